"""The lab on a fresh machine: a lab libvirt daemon starts where libvirt's
own directories (/run/libvirt, /var/lib/libvirt, /var/cache/libvirt,
/var/log/libvirt) do not exist, as on Debian with libvirt-daemon but not
libvirt-daemon-system.

The machine is made fresh without touching it: the test body runs in a
child ``unshare --mount --net --propagation private`` that mounts empty
tmpfs over /run, /var/lib, /var/cache and /var/log (its own network
namespace, so the daemon's TCP port is private and /run/netns is not
needed).  Whatever the lab creates lands on those tmpfs and vanishes with
the child; the test checks that the real paths are as they were.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.root, pytest.mark.libvirt]

#: What a fresh machine lacks (the lab binds over /etc/libvirt too, which
#: every libvirt install has: the client package ships its files).
FRESH = ("/run/libvirt", "/var/lib/libvirt", "/var/cache/libvirt", "/var/log/libvirt")
HIDDEN = ("/run", "/var/lib", "/var/cache", "/var/log")
REPO = Path(__file__).resolve().parents[2]


def child(workdir: str) -> int:
    """The test body inside the private mount namespace: make the machine
    fresh, start one lab libvirtd, report what it saw as JSON on stdout."""
    from accelmig.lab.libvirtd import LibvirtNode

    for path in HIDDEN:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "accelmig-test-fresh", path],
                       check=True)
    report = {"absent_before": [p for p in FRESH if not os.path.lexists(p)]}
    node = LibvirtNode(name="fresh", root=Path(workdir) / "node", netns=None, hostname="fresh-host")
    try:
        node.start()
        node.wait_ready(60)
        conn = node.connect()
        try:
            report["hostname"] = conn.getHostname()
            report["domains"] = len(conn.listAllDomains())
        finally:
            conn.close()
        report["modes"] = {p: oct(stat.S_IMODE(os.stat(p).st_mode)) for p in FRESH
                           if os.path.isdir(p)}
        # what the daemon wrote went to the node's own directories
        report["socket"] = node.socket.exists()
        report["log"] = node.log_file.exists()
        report["qemu_state"] = (node.dir("/var/lib/libvirt") / "qemu").is_dir()
    finally:
        node.stop()
    report["stderr"] = node.stderr_file.read_text(errors="replace")
    print(json.dumps(report))
    return 0


def test_a_lab_libvirtd_starts_where_libvirts_directories_are_absent(tmp_path):
    missing = [t for t in ("unshare", "mount", "/usr/sbin/libvirtd") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"SKIPPED LOUDLY: not installed: {missing}")
    pytest.importorskip("libvirt")
    real_before = {p: os.path.lexists(p) for p in FRESH}
    proc = subprocess.run(
        ["unshare", "--mount", "--net", "--propagation", "private", sys.executable, "-c",
         "import sys; from tests.lab.test_fresh_machine import child; sys.exit(child(sys.argv[1]))",
         str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["absent_before"] == list(FRESH)              # the machine really was fresh
    assert report["hostname"] == "fresh-host"                  # the daemon answers, in its own UTS ns
    assert report["domains"] == 0
    # Under a parent the node makes its own (/run, /var/lib: lab/machine.py)
    # the mount point is the node's, in its tmpfs: nothing even outside it;
    # elsewhere it is created, 0755, on the machine (here the child's tmpfs).
    from accelmig.lab.machine import PRIVATE_PARENTS
    outside = [p for p in FRESH if os.path.dirname(p) not in PRIVATE_PARENTS]
    assert outside and report["modes"] == {p: "0o755" for p in outside}
    assert report["socket"] and report["log"] and report["qemu_state"]
    for path in FRESH:                                         # ... and said so
        assert f"created the mount point {path} (it was absent)" in report["stderr"]
    # the real machine is untouched: the child's mount points lived on its tmpfs
    assert {p: os.path.lexists(p) for p in FRESH} == real_before
