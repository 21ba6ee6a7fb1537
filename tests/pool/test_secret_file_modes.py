"""The tenants file and the hosts file hold secrets: a real ``accelmig-pool
serve`` still loads them when other users may read them (refusing would turn
a deploy slip into an outage), but says so, naming the mode and the fix
(issue 14, low items)."""

from __future__ import annotations

import os

from tests.support.processes import PoolProcess, hosts_toml, tenants_toml


def _mode_warnings(entries) -> list[str]:
    return [e["msg"] for e in entries if e["level"] == "warning" and "other users may read it" in e["msg"]]


def test_secret_files_readable_by_others_are_named_with_their_mode_and_the_fix(tmp_path):
    old = os.umask(0o022)                  # files as a careless `cat > tokens.toml` leaves them
    try:
        proc = PoolProcess(tmp_path, tenants_toml(alice="alice-token-0001"),
                           hosts_toml(hostA="hostA-secret-0123456789"))
    finally:
        os.umask(old)
    try:
        proc.wait_log(lambda e: "hosts file" in e["msg"] and "other users" in e["msg"])
        warned = _mode_warnings(proc.seen)
        assert warned == [
            f"tenants file (it holds their tokens) {proc.tokens} is mode 0644: other users may read "
            f"it; run: chmod 0640 {proc.tokens} (or 0600)",
            f"hosts file (it holds their control-plane secrets) {proc.hosts} is mode 0644: other "
            f"users may read it; run: chmod 0640 {proc.hosts} (or 0600)"], proc.drain()
        # loaded all the same: the pool serves
        assert proc.endpoint.startswith("127.0.0.1:")
        # fixed as told: the next reload says nothing about modes
        os.chmod(proc.tokens, 0o640)
        os.chmod(proc.hosts, 0o600)
        seen = len(proc.seen)
        assert "nothing changed" in proc.hup()["msg"]
        assert _mode_warnings(proc.seen[seen:]) == []
        # a group-readable file is fine; one that others may write is not
        os.chmod(proc.tokens, 0o602)
        seen = len(proc.seen)
        proc.hup()
        assert _mode_warnings(proc.seen[seen:]) == [
            f"tenants file (it holds their tokens) {proc.tokens} is mode 0602: other users may read "
            f"it; run: chmod 0640 {proc.tokens} (or 0600)"]
    finally:
        assert proc.stop() == 0
