"""The guest side of accelmig: the user-space driver (``accelmig.agent.driver``)
and the guest agent daemon (``accelmig.agent.daemon``, run as ``accelmig-agent``).
Standard library only, and Python 3.9 or later (guest images are old)."""

import logging as _logging

# A library stays quiet unless the application configures logging.
_logging.getLogger("accelmig").addHandler(_logging.NullHandler())
