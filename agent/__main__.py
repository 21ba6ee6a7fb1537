"""``python3 -m accelmig.agent``: the same as ``accelmig-agent`` (for guest
images that carry the packages without installing console scripts)."""

import sys

from accelmig.agent.cli import main

sys.exit(main())
