"""A real ``accelmig hostd`` process and a real pool process: SIGHUP reloads
what hostd can (the secret, ``strict``) and names what needs a restart; a
broken config changes nothing; the pool-down warning is said once, and
again when the pool is back."""

from __future__ import annotations

import os
import signal
import socket

import pytest

from accelmig.wire.errors import AuthFailed
from accelmig.wire.localapi import LocalClient
from tests.support.hostd import SECRET, write_config
from tests.support.processes import LoggedProcess, PoolProcess, hosts_toml, tenants_toml
from tests.support.wait import wait_for

NEW_SECRET = "hostA-rotated-secret-0123"


def hostd(config: str) -> LoggedProcess:
    return LoggedProcess(["accelmig", "hostd", "--config", config, "--log-format", "json"])


def reload_line(proc: LoggedProcess) -> dict:
    proc.signal(signal.SIGHUP)
    return proc.wait_log(lambda e: e["msg"].startswith("reload"))


def test_sighup_reloads_hostd_and_a_secret_rotates_with_the_pool(tmp_path):
    pool = PoolProcess(tmp_path, tenants_toml(t="tenant-token-01"), hosts_toml(hostA=SECRET))
    config = write_config(tmp_path, pool)
    daemon = hostd(config)
    try:
        daemon.wait_log(lambda e: e["msg"].startswith("registered at pool"))
        client = LocalClient(str(tmp_path / "hostd.sock"))
        entry = reload_line(daemon)
        assert entry["level"] == "info"
        assert entry["msg"].endswith("nothing to reload (host.toml and the secret are unchanged)")

        text = open(config).read()
        with open(config, "w") as handle:
            handle.write(text.replace("strict = true", "strict = false")
                         .replace("hook_timeout = 2.0", "hook_timeout = 5.0")
                         .replace(f'state_dir = "{tmp_path}/state"', f'state_dir = "{tmp_path}/other"'))
        entry = reload_line(daemon)
        assert entry["level"] == "warning", entry
        assert "applied hostd.strict = False, hostd.hook_timeout = 5.0" in entry["msg"]
        assert "needs a restart of hostd (running with the old values): hostd.state_dir" in entry["msg"]

        with open(config, "w") as handle:
            handle.write("[host\n")                              # a half-written file
        entry = reload_line(daemon)
        assert entry["level"] == "error" and "not valid TOML" in entry["msg"]
        assert "reload refused, running on as before" in entry["msg"]
        assert client.call("ping")["host"] == "hostA"           # alive, and the same process
        with open(config, "w") as handle:
            handle.write(text)

        # rotate the host's secret: the pool first (calls are refused), then hostd
        pool.hosts.write_text(hosts_toml(hostA=NEW_SECRET))
        assert pool.hup()["hosts_changed"] == "hostA"
        with pytest.raises(AuthFailed, match="does not verify"):
            client.call("intent", uuid="dom-1", policy="none")
        secret_file = tmp_path / "host.secret"
        secret_file.write_text(NEW_SECRET + "\n")
        os.chmod(secret_file, 0o600)
        entry = reload_line(daemon)
        assert f"a new control-plane secret from {secret_file}" in entry["msg"]
        assert client.call("intent", uuid="dom-1", policy="none")["source_host"] == "hostA"
        assert daemon.stop() == 0
    finally:
        daemon.stop()
        pool.stop()


def test_sighup_takes_renewed_tls_files_at_the_same_paths(tmp_path):
    """A host certificate is renewed in place: hostd used the files it read
    at start until a restart; now SIGHUP takes them for the next connection.
    hostd starts with a certificate of a CA the pool does not trust (refused
    before any call), gets the right one at the same paths, and registers."""
    import shutil
    from accelmig.lab.certs import issue, make_ca, make_pki
    pki = make_pki(tmp_path / "pki", hosts=("hostA",))
    other_ca, other_key = make_ca(tmp_path / "other", name="a CA the pool does not trust")
    wrong = issue(tmp_path / "other", other_ca, other_key, "hostA", client=True)
    cert, key = tmp_path / "host.crt", tmp_path / "host.key"
    shutil.copy(wrong.cert, cert)
    shutil.copy(wrong.key, key)
    pool = PoolProcess(tmp_path, tenants_toml(t="tenant-token-01"), hosts_toml(hostA=SECRET), tls=pki)
    config = write_config(tmp_path, pool)
    text = open(config).read().replace(
        "insecure = true", f'ca_file = "{pki.ca}"\ncert_file = "{cert}"\nkey_file = "{key}"')
    with open(config, "w") as handle:
        handle.write(text)
    daemon = hostd(config)
    try:
        refused = daemon.wait_log(lambda e: e["msg"].startswith("pool registration"))
        assert refused["level"] == "warning", refused
        shutil.copy(pki.hosts["hostA"].cert, cert)          # renewed, same paths
        shutil.copy(pki.hosts["hostA"].key, key)
        entry = reload_line(daemon)
        assert "new TLS files (ca_file, cert_file, key_file)" in entry["msg"], entry
        daemon.wait_log(lambda e: e["msg"].startswith("registered at pool"), timeout=30)
        assert reload_line(daemon)["msg"].endswith("nothing to reload (host.toml and the secret are unchanged)")
        assert daemon.stop() == 0
    finally:
        daemon.stop()
        pool.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_pool_down_warning_is_said_once_and_its_end_too(tmp_path):
    """hostd retries every 2 s; before, each attempt logged the same warning."""
    control = f"127.0.0.1:{free_port()}"
    (tmp_path / "pool").mkdir()

    class NoPoolYet:                                  # what write_config reads of a pool
        endpoint, control_endpoint = "127.0.0.1:7070", control

    daemon = hostd(write_config(tmp_path, NoPoolYet()))
    pool = None
    try:
        first = daemon.wait_log(lambda e: e["msg"].startswith("pool registration"))
        assert first["level"] == "warning" and "unavailable" in first["msg"]
        client = LocalClient(str(tmp_path / "hostd.sock"))
        wait_for(lambda: client.call("status")["pool"]["registration_failures"] >= 3, 30,
                 "three failed registrations")
        pool = PoolProcess(tmp_path / "pool", tenants_toml(t="tenant-token-01"), hosts_toml(hostA=SECRET),
                           control_listen=control)
        back = daemon.wait_log(lambda e: e["msg"].startswith("pool registration works again"))
        assert back["level"] == "info" and back["failures"] >= 3
        # between the two: no repeated warning, however many attempts failed
        said = [e for e in daemon.seen if e["msg"].startswith("pool registration")]
        assert said == [first, back], [e["msg"] for e in said]
        assert any(e["msg"].startswith("registered at pool") for e in daemon.seen)
        assert client.call("status")["pool"]["registration_failures"] == 0
    finally:
        daemon.stop()
        if pool is not None:
            pool.stop()
