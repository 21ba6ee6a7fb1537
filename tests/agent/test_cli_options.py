"""``accelmig-agent``'s command line (argparse, standard library only): its
version, option types that refuse a bad log level or endpoint with a usage
error (exit 2, no traceback), the exit codes in its help, and its log lines
with journald priorities when stderr is the journal — the real console
script in a subprocess."""

from __future__ import annotations

import importlib.metadata
import os
import signal
import subprocess
import sys

import pytest

from accelmig.agent.cli import main
from tests.conftest import run_cli
from tests.support.wait import wait_for

VERSION = importlib.metadata.version("accelmig")


def test_version():
    out = run_cli("accelmig-agent", "--version", timeout=60)
    assert (out.returncode, out.stdout) == (0, f"accelmig-agent {VERSION}\n")


@pytest.mark.parametrize("args, why", [
    (["--log-level", "LOUD"], "argument --log-level: log level 'LOUD' is not one of DEBUG, INFO, WARNING, ERROR"),
    (["--endpoint", "pool:99999"], "argument --endpoint: endpoint 'pool:99999': port 99999 is not in 1-65535"),
    (["--endpoint", "nonsense"], "argument --endpoint: endpoint 'nonsense' has no port (HOST:PORT)"),
])
def test_bad_option_values_are_usage_errors(args, why):
    out = run_cli("accelmig-agent", "run", *args, timeout=60)
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1] == f"accelmig-agent run: error: {why}"
    assert "Traceback" not in out.stderr


def test_help_documents_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "Exit status:" in text and "  0  success" in text and "  2  usage" in text
    assert "  3  run: another agent already serves the socket" in text


def run_agent(tmp_path, stderr_path, env_extra):
    with open(stderr_path, "w") as stderr:
        info = os.fstat(stderr.fileno())
        env = dict(os.environ, **{k: v.format(dev=info.st_dev, ino=info.st_ino) for k, v in env_extra.items()})
        exe = os.path.join(os.path.dirname(sys.executable), "accelmig-agent")
        return subprocess.Popen([exe, "run", "--port", str(tmp_path / "channel.sock"),
                                 "--socket", str(tmp_path / "agent.sock"), "--state-dir", str(tmp_path / "state"),
                                 "--log-format", "text", "--log-level", "info"],
                                stderr=stderr, stdout=subprocess.DEVNULL, env=env)


@pytest.mark.parametrize("journal", [True, False])
def test_log_lines_carry_journald_priorities_only_on_the_journal(tmp_path, journal):
    """systemd sets JOURNAL_STREAM=DEV:INODE of the stream it connects to
    journald: lines written there start with sd-daemon's <N>; the same
    variable inherited by a process whose stderr is elsewhere changes nothing."""
    log = tmp_path / "stderr.log"
    env = {"JOURNAL_STREAM": "{dev}:{ino}" if journal else "{dev}:1"}
    proc = run_agent(tmp_path, log, env)
    try:
        line = wait_for(lambda: next((l for l in log.read_text().splitlines() if "channel" in l), None),
                        30, "the agent's first log line")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    if journal:
        assert line.startswith("<6>") and " INFO " in line           # info -> priority 6
    else:
        assert not line.startswith("<") and " INFO " in line
