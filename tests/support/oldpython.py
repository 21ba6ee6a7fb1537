"""The oldest Python a guest image may bring (3.9), for the tests that prove
the guest side on it: ``$ACCELMIG_GUEST_PYTHON``, ``python3.9`` on the
PATH, or pyenv's 3.9.  ``None`` where this machine has none: those tests
are skipped with ``SKIP_REASON``, loudly."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

OLDEST = (3, 9)
SKIP_REASON = "SKIPPED LOUDLY: no Python 3.9 here (set ACCELMIG_GUEST_PYTHON, or 'pyenv install 3.9')"


def oldest_python() -> str | None:
    pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = [os.environ.get("ACCELMIG_GUEST_PYTHON"), shutil.which("python3.9"),
                  *sorted(glob.glob(os.path.join(pyenv, "versions", "3.9*", "bin", "python3.9")))]
    for candidate in filter(None, candidates):
        try:
            out = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == str(OLDEST):
            return candidate
    return None
