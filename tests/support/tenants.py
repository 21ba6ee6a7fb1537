"""The pool's tenants in tests, and running this virtualenv's console scripts."""

from __future__ import annotations

import os
import subprocess
import sys

TENANTS = {
    "alice": ("alice-token-0001", "256MiB"),
    "bob": ("bob-token-000002", "64MiB"),
}

ALICE = TENANTS["alice"][0]
BOB = TENANTS["bob"][0]


def run_cli(*args, **kwargs):
    """Run a console script of this virtualenv."""
    exe = os.path.join(os.path.dirname(sys.executable), args[0])
    return subprocess.run([exe, *args[1:]], capture_output=True, text=True, **kwargs)
