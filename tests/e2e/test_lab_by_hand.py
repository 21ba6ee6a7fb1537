"""The README's "lab by hand" path, as a new user follows it (issue 9):
``accelmig lab up``, ``accelmig lab boot``, ``accelmig lab up`` again — one
hostd per host, however often it is run — then plain ``virsh migrate``
twelve times back and forth while the solver computes: every migration
resumes every session, nothing is re-sent or rebuilt, and the result is
bit-identical to a run that never migrated."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from accelmig.lab.accel import AccelLab
from accelmig.lab.cli import VM
from tests.conftest import run_cli

pytestmark = [pytest.mark.root, pytest.mark.libvirt, pytest.mark.vm, pytest.mark.slow]

STEPS = 2400          # ~60 s of solver (a progress line every 20 steps, 0.5 s apart): outlives 12 moves
MOVES = 12


def hostd_processes(config: Path) -> list[int]:
    """Every ``accelmig hostd`` on this machine serving ``config`` (by cmdline,
    so a second one started behind the lab's back is counted too)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"/accelmig") for a in argv) and b"hostd" in argv and str(config).encode() in argv:
            pids.append(int(entry))
    return pids


def test_lab_up_boot_up_then_twelve_virsh_migrations(tmp_path):
    name = f"hand{os.getpid() % 10000}"
    lab = AccelLab(name)
    try:
        for argv in (["up"], ["boot", "--steps", str(STEPS)], ["up"]):
            out = run_cli("accelmig", "lab", *argv, "--name", name, timeout=300)
            assert out.returncode == 0, f"accelmig lab {argv[0]}: {out.stderr[-3000:]}"
        lab = AccelLab(name)              # what a new shell sees: the state file
        for host in lab.lab.HOSTS:
            running = hostd_processes(lab.config_path(host))
            assert running == [lab.hostd_pid(host)], f"{host}: hostd processes {running}"
        reference = lab.reference(steps=STEPS)
        where = lab.where(VM)
        assert where == "hostA"
        for move in range(MOVES):
            dst = "hostB" if where == "hostA" else "hostA"
            result = lab.migrate_virsh(VM, where, dst)
            assert result["ok"], f"move {move + 1} {where}->{dst}: {result}\n{lab.hostd_log(dst)[-3000:]}"
            assert result["resumed"] == result["sessions"] == 1, f"move {move + 1}: {result}"
            assert result["bytes_resent"] == 0 and result["rebuilds"] == 0, result
            where = dst
        done = lab.demo_done(VM, timeout=300)
        assert done["sha256"] == reference["sha256"], "the result differs from a run that never migrated"
        assert done["resumes"] == MOVES
        for host in lab.lab.HOSTS:     # still one each, and never a revoked ticket
            assert hostd_processes(lab.config_path(host)) == [lab.hostd_pid(host)]
            assert "ticket revoked" not in lab.hostd_log(host)
    finally:
        out = run_cli("accelmig", "lab", "down", "--name", name, timeout=300)
        assert out.returncode == 0, out.stderr
