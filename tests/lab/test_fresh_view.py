"""``python -m accelmig.lab.fresh -- CMD``: CMD sees a machine without
libvirt's own directories; the machine itself stays as it was."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile

import pytest

from accelmig.lab import fresh

pytestmark = pytest.mark.root

LOOK = r"""
import json, os
print(json.dumps({p: os.path.lexists(p) for p in
                  ["/run/libvirt", "/var/lib/libvirt", "/var/cache/libvirt", "/var/log/libvirt",
                   "/var/lib/dpkg", "/run/lock", "/var/log"]}))
"""


def test_the_command_sees_no_libvirt_directories_and_the_machine_is_untouched():
    if os.geteuid() != 0:
        pytest.skip("needs root (mount namespaces)")
    before = {p: os.path.lexists(p) for p in fresh.HIDDEN}
    stashes = set(glob.glob(os.path.join(tempfile.gettempdir(), "accelmig-fresh-*")))
    ran = subprocess.run([sys.executable, "-m", "accelmig.lab.fresh", "--", sys.executable, "-c", LOOK],
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    seen = json.loads(ran.stdout)
    assert not any(seen[p] for p in fresh.HIDDEN)
    assert seen["/var/lib/dpkg"] == os.path.lexists("/var/lib/dpkg")     # the rest is all there
    assert seen["/run/lock"] == os.path.lexists("/run/lock") and seen["/var/log"]
    assert "hidden for this run" in ran.stderr
    assert {p: os.path.lexists(p) for p in fresh.HIDDEN} == before
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "accelmig-fresh-*"))) == stashes


def test_the_exit_status_is_the_commands():
    ran = subprocess.run([sys.executable, "-m", "accelmig.lab.fresh", "--", "sh", "-c", "exit 7"],
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 7, ran.stderr


def test_it_refuses_to_hide_anything_outside_a_namespace_of_its_own():
    with pytest.raises(SystemExit, match="refusing to hide anything"):
        fresh.hide()
