"""Test support for libvirt: a stand-in libvirtd and a real lab.

``FakeLibvirtd``: a process named ``libvirtd`` that records each SIGHUP;
``lab_for_module``: the body of a module-scoped ``lab`` fixture (two real
libvirt daemons in namespaces, and the guest image), skipping loudly where
this machine cannot run one; ``start_paused``: a real domain on it, paused."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from accelmig.plugin.commands import install as inst
from tests.support.wait import wait_for

LAB_TOOLS = ["ip", "unshare", "/usr/sbin/libvirtd", "qemu-system-x86_64", "busybox"]


class FakeLibvirtd:
    """A process whose comm is ``libvirtd`` (a script of that name) that
    appends a line to ``hups`` on every SIGHUP, with a pid file."""

    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.exe = directory / "libvirtd"
        self.hups = directory / "hups.log"
        self.pid_file = directory / "libvirtd.pid"
        self.exe.write_text(f"#!/bin/sh\ntrap 'echo hup >> {self.hups}' HUP\n"
                            "while :; do sleep 0.05; done\n")
        self.exe.chmod(0o755)
        self.proc = subprocess.Popen([str(self.exe)], start_new_session=True)
        self.pid = self.proc.pid
        self.pid_file.write_text(f"{self.pid}\n")
        wait_for(lambda: inst.daemon_name(self.pid) == "libvirtd", 5, "the stand-in libvirtd to start",
                 interval=0.01)
        self.starttime = inst.proc_stat(self.pid)[1]

    def hup_count(self, settle: float = 0.3) -> int:
        time.sleep(settle)            # the trap runs once the current sleep ends
        return len(self.hups.read_text().splitlines()) if self.hups.exists() else 0

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()     # our own child, by its Popen
            self.proc.wait(5)


def lab_for_module(module_name: str):
    """Yield one lab (``lab.image`` the guest image) and take it down after."""
    if os.geteuid() != 0:
        pytest.skip("SKIPPED LOUDLY: the lab needs root")
    missing = [t for t in LAB_TOOLS if shutil.which(t) is None and not os.path.exists(t)]
    if missing:
        pytest.skip(f"SKIPPED LOUDLY: not installed: {missing}")
    pytest.importorskip("libvirt")
    from accelmig.lab.image import build_image
    from accelmig.lab.rig import Lab
    tag = module_name.rsplit("_", 1)[-1][:6]          # install / doctor
    lab = Lab(f"cli{tag}{os.getpid() % 100000}")
    try:
        lab.up()
        lab.image = build_image()
        yield lab
    finally:
        lab.down()


def start_paused(lab, name: str, host: str = "hostA", **values):
    """A real accelmig domain, started paused: every start hook runs, the guest never does."""
    import libvirt
    xml = lab.domain_xml(name, lab.image, host, **values)
    return lab.connect(host).createXML(xml, libvirt.VIR_DOMAIN_START_PAUSED)
