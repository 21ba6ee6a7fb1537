"""A real ``accelmig-agent run`` process: SIGHUP does not kill it (it says
there is nothing to reload); one agent per socket and per channel port; a
file that is not a socket is never replaced."""

from __future__ import annotations

import json
import os
import signal

from tests.conftest import run_cli
from tests.support.processes import LoggedProcess


def agent(tmp_path, port: str = "channel.sock", sock: str = "agent.sock") -> LoggedProcess:
    return LoggedProcess(["accelmig-agent", "run", "--port", tmp_path / port, "--socket", tmp_path / sock,
                          "--state-dir", tmp_path / "state", "--log-format", "json"])


def test_sighup_is_answered_and_the_agent_keeps_serving(tmp_path):
    proc = agent(tmp_path)
    try:
        proc.wait_log(lambda e: e["msg"].startswith("agent "))
        proc.signal(signal.SIGHUP)
        entry = proc.wait_log(lambda e: e["msg"].startswith("reload"))
        assert entry["msg"].startswith("reload: nothing to reload") and entry["level"] == "info"
        out = run_cli("accelmig-agent", "status", "--socket", str(tmp_path / "agent.sock"), timeout=60)
        assert out.returncode == 0 and json.loads(out.stdout)["agent_version"]
        assert proc.proc.poll() is None
        assert proc.stop() == 0
        assert not (tmp_path / "agent.sock").exists() and not (tmp_path / "channel.sock").exists()
    finally:
        proc.stop()


def test_a_second_agent_on_either_socket_exits_and_the_first_keeps_serving(tmp_path):
    first = agent(tmp_path)
    try:
        first.wait_log(lambda e: e["msg"].startswith("agent "))
        inodes = {name: os.stat(tmp_path / name).st_ino for name in ("agent.sock", "channel.sock")}
        for port, sock, path in (("other-channel.sock", "agent.sock", "agent.sock"),
                                 ("channel.sock", "other-agent.sock", "channel.sock")):
            second = run_cli("accelmig-agent", "run", "--port", str(tmp_path / port), "--socket",
                             str(tmp_path / sock), "--state-dir", str(tmp_path / "state2"), timeout=60)
            assert second.returncode == 3, second.stderr
            assert f"already runs on {tmp_path / path} (pid {first.pid})" in second.stderr
            assert not (tmp_path / "other-agent.sock").exists()        # gave back what it had claimed
        assert {name: os.stat(tmp_path / name).st_ino for name in inodes} == inodes
        out = run_cli("accelmig-agent", "status", "--socket", str(tmp_path / "agent.sock"), timeout=60)
        assert out.returncode == 0, out.stderr
    finally:
        first.stop()


def test_a_file_at_a_socket_path_is_never_replaced(tmp_path):
    for port, sock in (("precious", "agent.sock"), ("channel.sock", "precious")):
        (tmp_path / "precious").write_text("keep me")
        out = run_cli("accelmig-agent", "run", "--port", str(tmp_path / port), "--socket", str(tmp_path / sock),
                      "--state-dir", str(tmp_path / "state"), timeout=60)
        assert out.returncode == 2 and "not a socket" in out.stderr, out.stderr
        assert (tmp_path / "precious").read_text() == "keep me"
