"""A console script run as if some libraries were not installed.

``blocked_env(tmp_path, "click")`` is the environment of a subprocess in
which importing ``click`` (or any ``click.*``) fails with the same
``ModuleNotFoundError`` an install without it gives (a dotted name
blocks that module and those below it): a ``sitecustomize`` on
``PYTHONPATH`` puts a finder first on ``sys.meta_path`` before anything else
is imported.  The console script itself is the real one of this virtualenv.
"""

from __future__ import annotations

import os

SITECUSTOMIZE = '''\
import os, sys

_BLOCKED = set(os.environ["ACCELMIG_TEST_BLOCKED"].split(","))


class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in _BLOCKED):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
'''


def blocked_env(tmp_path, *modules: str) -> dict:
    site = tmp_path / "blocked-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ, PYTHONPATH=str(site), ACCELMIG_TEST_BLOCKED=",".join(modules))
    return env
