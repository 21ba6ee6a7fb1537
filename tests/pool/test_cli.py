"""``accelmig-pool`` as an operator runs it: a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from accelmig.agent.driver import connect
from accelmig.wire.control import ControlClient
from tests.conftest import run_cli

TOKEN = "cli-tenant-token-01"


def serve(tmp_path, *extra, tokens_text=None):
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(tokens_text or f'[tenants.cli]\ntoken = "{TOKEN}"\nquota = "512MiB"\n')
    exe = os.path.join(os.path.dirname(sys.executable), "accelmig-pool")
    return subprocess.Popen([exe, "serve", "--listen", "127.0.0.1:0", "--control-listen", "",
                             "--tokens", str(tokens), "--admin-socket", str(tmp_path / "pool.sock"),
                             "--log-format", "json", "--insecure", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_serve_then_sessions_migrations_metrics_and_a_clean_sigterm(tmp_path):
    proc = serve(tmp_path)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["ready"] and ready["data"].startswith("127.0.0.1:")
        with connect(ready["data"], TOKEN, agent=False) as dev:
            dev.upload(b"x" * 1000)
            dev.finish()
            out = run_cli("accelmig-pool", "sessions", "--admin-socket", str(tmp_path / "pool.sock"))
            assert out.returncode == 0 and dev.sid in out.stdout and "attached" in out.stdout
            listed = json.loads(run_cli("accelmig-pool", "sessions", "--json", "--admin-socket",
                                        str(tmp_path / "pool.sock")).stdout)
            assert listed["sessions"][0]["counters"]["bytes_uploaded"] == 1000
            with ControlClient("unix:" + str(tmp_path / "pool.sock"), "admin", None) as admin:
                metrics = admin.call("metrics")["text"]
            assert 'accelmig_bytes_total{direction="up"} 1000.0' in metrics
            assert 'accelmig_sessions{state="attached"}' in metrics
        out = run_cli("accelmig-pool", "migrations", "--admin-socket", str(tmp_path / "pool.sock"))
        assert out.returncode == 0 and "0 record(s)" in out.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        log = [json.loads(line) for line in proc.stderr.read().splitlines() if line.startswith("{")]
        assert any(entry["msg"].startswith("signal received") for entry in log)
        assert any("stopped" in entry["msg"] for entry in log)
        assert not (tmp_path / "pool.sock").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


@pytest.mark.parametrize("tokens_text, words", [
    ("not toml at all [", "not valid TOML"),
    ("[tenants.a]\ntoken = \"short\"\nquota = \"1GiB\"\n", "token must be a string of 8+ characters"),
    ("[tenants.a]\ntoken = \"long-enough-token\"\n", "quota is missing"),
    ("[tenants.a]\ntoken = \"long-enough-token\"\nquota = \"lots\"\n", "is not a size"),
    ("[other]\n", "no [tenants.NAME] table"),
])
def test_bad_tokens_files_are_clear_errors(tmp_path, tokens_text, words):
    proc = serve(tmp_path, tokens_text=tokens_text)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and words in err and "tokens.toml" in err


def test_bad_flags_and_config(tmp_path):
    (tmp_path / "pool.toml").write_text('[pool]\nlisten = "127.0.0.1:0"\nnonsense = 1\n')
    proc = serve(tmp_path, "--config", str(tmp_path / "pool.toml"))
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "unknown key(s) nonsense" in err
    proc = serve(tmp_path, "--devices", "cuda:7")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "device 'cuda:7' (--devices) is unavailable: this node has opencl:0" in err
    out = run_cli("accelmig-pool", "sessions", "--admin-socket", str(tmp_path / "absent.sock"))
    assert out.returncode == 2 and "is unavailable" in out.stderr


@pytest.mark.parametrize("how, value, words", [
    ("flag", "opencl:1", "invalid configuration in flags: --device was removed: give --devices opencl:1 "
                         "(one device is a list of one)"),
    ("flag", "auto", "--device was removed: give --devices opencl:0"),
    ("config", "opencl:1", 'pool.toml: `device` was removed: write `devices = "opencl:1"` '
                           '(one device is a list of one)'),
    ("config", "auto", 'write `devices = "opencl:0"`'),
])
def test_the_removed_device_setting_fails_naming_devices(tmp_path, how, value, words):
    """``device`` (one device) was replaced by ``devices``: a config or a
    command line that still says it stops with exit 2 and the line to write
    instead, before any device is opened; neither is taken for an unknown key."""
    if how == "flag":
        proc = serve(tmp_path, "--device", value)
    else:
        (tmp_path / "pool.toml").write_text(f'[pool]\ndevice = "{value}"\n')
        proc = serve(tmp_path, "--config", str(tmp_path / "pool.toml"))
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and words in err and "unknown key" not in err, err
    assert "ready" not in out


def test_help_documents_every_option():
    out = run_cli("accelmig-pool", "serve", "--help")
    for option in ("--listen", "--control-listen", "--tokens", "--hosts", "--config", "--devices",
                   "--admin-socket", "--metrics-listen", "--grace", "--park-retention", "--lease-ttl",
                   "--ticket-ttl", "--log-format"):
        assert option in out.stdout, option
    assert "--device " not in out.stdout            # removed: hidden, kept only to fail naming --devices
    assert run_cli("accelmig-pool", "devices").stdout.startswith("opencl:0")


def test_a_second_pool_on_the_same_admin_socket_exits_and_touches_nothing(tmp_path):
    proc = serve(tmp_path)
    try:
        ready = json.loads(proc.stdout.readline())
        inode = os.stat(tmp_path / "pool.sock").st_ino
        second = serve(tmp_path)
        assert second.wait(30) == 3
        assert f"already runs on {tmp_path / 'pool.sock'} (pid {proc.pid})" in second.stderr.read()
        assert os.stat(tmp_path / "pool.sock").st_ino == inode
        out = run_cli("accelmig-pool", "sessions", "--admin-socket", str(tmp_path / "pool.sock"))
        assert out.returncode == 0, out.stderr          # the first one still answers
        with connect(ready["data"], TOKEN, agent=False) as dev:
            dev.finish()
    finally:
        proc.kill()
        proc.wait(5)


def test_a_file_at_the_admin_socket_path_is_never_replaced(tmp_path):
    (tmp_path / "pool.sock").write_text("not a socket")
    proc = serve(tmp_path)
    assert proc.wait(30) == 2
    assert "not a socket" in proc.stderr.read()
    assert (tmp_path / "pool.sock").read_text() == "not a socket"
