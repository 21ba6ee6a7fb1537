"""The lab's memory dirtier (``bench/blackout --dirty``): a guest process
that makes a live migration's pre-copy last.  Its script runs here for
real (the guest runs the same interpreter), its init script's shell logic
too, with the guest's helpers stubbed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from accelmig.lab.guest import DIRTIER_STARTED, dirty_cmdline, memory_dirtier_files

FILES = {f.path: f for f in memory_dirtier_files()}
DIRTIER = FILES["/usr/local/bin/accelmig-dirtier"]
INIT = FILES["/etc/accelmig/init.d/55-dirtier"]


def _vm_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:"))


def _nice(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[16])


def test_the_dirtier_fills_its_memory_first_then_says_so_niced(tmp_path):
    script = tmp_path / "dirtier"
    script.write_bytes(DIRTIER.data)
    mib = 24
    proc = subprocess.Popen([sys.executable, str(script), str(mib), "1000"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith(DIRTIER_STARTED) and f"{mib} MiB at 1000 MiB/s" in line
        # every page was written before the line (the first pre-copy round sends them all)
        assert _vm_rss_kib(proc.pid) >= mib * 1024
        assert _nice(proc.pid) == 19              # busy, but behind the agent and the application
        assert proc.poll() is None                # and it goes on rewriting
    finally:
        proc.kill()
        proc.wait()
    assert DIRTIER.mode == INIT.mode == 0o755


@pytest.mark.parametrize("interpreter", ["python3.9"])
def test_the_dirtier_runs_on_the_oldest_guest_python(tmp_path, interpreter):
    python = shutil.which(interpreter)
    if python is None:
        pytest.skip(f"SKIPPED LOUDLY: no {interpreter} here (pyenv versions)")
    script = tmp_path / "dirtier"
    script.write_bytes(DIRTIER.data)
    proc = subprocess.Popen([python, str(script), "4", "1000"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYENV_VERSION": "3.9.18"})
    try:
        assert proc.stdout.readline().startswith(DIRTIER_STARTED)
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def run_init(tmp_path):
    """The init script with the guest's helpers stubbed: what it would run."""
    (tmp_path / "lib.sh").write_text('log() { echo "LOG $*"; }\nload_settings() { :; }\n')
    (tmp_path / "fake-dirtier").write_text('echo "RUN $*"\n')
    text = INIT.data.decode().replace("/etc/accelmig/lib.sh", str(tmp_path / "lib.sh")) \
        .replace("python3 /usr/local/bin/accelmig-dirtier", f"sh {tmp_path / 'fake-dirtier'}") \
        .replace(">/dev/console", "").replace(") </dev/null 2>&1 &", ")")
    (tmp_path / "init").write_text(text)

    def run(value: str | None) -> str:
        env = {"PATH": os.environ["PATH"]}
        if value is not None:
            env["ACCELMIG_DIRTY"] = value
        out = subprocess.run(["sh", str(tmp_path / "init")], env=env, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()
    return run


def test_the_init_script_starts_it_only_when_the_command_line_says_so(run_init):
    assert run_init(None) == ""
    assert run_init("1024,64") == "RUN 1024 64"
    assert run_init("256,6.5") == "RUN 256 6.5"
    for bad in ("1024", "abc,1", "1,2,3", "1.5,3", ",3", "3,", "1;reboot,2"):
        assert run_init(bad).startswith("LOG dirtier: bad accelmig.dirty="), bad


def test_the_command_line_word_is_checked():
    assert dirty_cmdline(1024, 64) == "accelmig.dirty=1024,64"
    assert dirty_cmdline(256, 6.5) == "accelmig.dirty=256,6.5"
    for mib, rate in ((0, 64), (-1, 64), (256, 0), (1.5, 3)):
        with pytest.raises(ValueError, match="must be positive"):
            dirty_cmdline(mib, rate)
