"""``accelmig status`` and ``accelmig doctor``.

Most of these are **unit tests of the CLI's formatting and decisions**: hostd
is a real ``LocalServer`` (hostd's local API, over a real unix socket) that
serves canned answers, not a real hostd; the pool is a real pool
(``PoolThread``) where its control plane matters; libvirt is libvirt's own
``test:///default`` driver.  The last test runs doctor against a real lab
libvirt daemon with real accelmig domains (one booted guest whose agent
opened its channel, two started paused) for the channel checks.
"""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest
from click.testing import CliRunner

from accelmig.lab.poolthread import PoolThread
from accelmig.plugin.cli import main as cli
from accelmig.wire.errors import Unavailable
from tests.support.hostd import HostdStub
from tests.support.libvirt import FakeLibvirtd, start_paused
from tests.support.hostd import write_host_config as write_config
from tests.support.wait import wait_for

SECRET = "hostA-secret-0123456789"
UUID1 = "5e3b1f7c-9a41-4d2e-8c0a-3f6d2b9e1a77"
UUID2 = "0d6f3c1e-1111-4222-8333-444455556666"

FULL_STATUS = {
    "host": "hostA", "pid": 4242, "uptime": 61.2,
    "libvirt": {"uri": "qemu:///system", "connected": True, "reconnects": 0},
    "pool": {"control": "10.88.0.1:7071", "reachable": True, "instance": "7f3a9c01"},
    "identity": {"version": 1, "host_id": "hostA", "pool_endpoint": "10.88.0.1:7070",
                 "host_address": "10.88.1.2", "interface": "to-pool", "mtu": 1500,
                 "mac": "02:00:00:00:01:02",
                 "guest_nic": {"address": "10.89.1.10", "prefixlen": 24, "gateway": "10.89.1.1",
                               "mtu": None, "mac": None, "routes": ["10.88.0.1/32"]}},
    "domains": [
        {"uuid": UUID1, "name": "vm1", "state": "running",
         "channel": {"path": "/run/x/org.accelmig.agent.0", "connected": True, "synced": True},
         "sessions": ["s-aaa", "s-bbb"]},
        {"uuid": UUID2, "name": "vm2", "state": "incoming", "channel": None, "sessions": []},
    ],
    "records": [
        {"domain_uuid": UUID1, "migration_id": "m-0001", "source_host": "hostB", "dest_host": "hostA",
         "state": "completed", "policy": "none", "resumed": {"s-aaa": 0.2134, "s-bbb": 0.25}},
        {"domain_uuid": UUID2, "state": "open"},
    ],
    "counters": {"hook_migrate_begin": 1},
}


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture
def hostd(tmp_path):
    stub = HostdStub(tmp_path / "hostd.sock", {"status": FULL_STATUS,
                                               "ping": {"host": "hostA", "pid": 4242, "pool": True,
                                                        "libvirt": True}})
    try:
        yield stub
    finally:
        stub.close()


@pytest.fixture(scope="module")
def pool():
    with PoolThread(hosts={"hostA": SECRET}) as harness:
        yield harness


# ---------------------------------------------------------------- status


def test_status_formats_what_hostd_says(tmp_path, hostd):
    config = write_config(tmp_path, socket=hostd.path)
    result = invoke("status", "--config", str(config))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"hostd     running (pid 4242, host hostA, up 61 s, socket {hostd.path})" in out
    assert "libvirt   qemu:///system: connected" in out
    assert "pool      10.88.0.1:7071: reachable, instance 7f3a9c01" in out
    assert ("identity  10.88.1.2 on to-pool (mtu 1500, mac 02:00:00:00:01:02) -> pool 10.88.0.1:7070 "
            "; guest fabric 10.89.1.10/24 via 10.89.1.1 for 10.88.0.1/32") in out
    assert "domains   2 accelmig domain(s)" in out
    assert f"  vm1  {UUID1}  running  channel connected, synced  sessions 2: s-aaa, s-bbb" in out
    assert f"  vm2  {UUID2}  incoming  no agent channel  sessions 0" in out
    assert (f"  vm1 ({UUID1})  migration m-0001  hostB -> hostA  completed  pause policy none  "
            f"resumed s-aaa 0.213 s, s-bbb 0.250 s") in out
    assert f"  vm2 ({UUID2})  open" in out
    assert [m["type"] for m in hostd.requests] == ["status"]


def test_status_tolerates_missing_keys(tmp_path):
    stub = HostdStub(tmp_path / "h.sock", {"status": {"host": "hostA",
                                                     "domains": [{"name": "odd", "channel": {}},
                                                                 "not-a-dict"],
                                                     "records": [{}], "identity": None}})
    try:
        config = write_config(tmp_path, socket=stub.path)
        result = invoke("status", "--config", str(config))
        assert result.exit_code == 0, result.output
        assert "hostd     running (pid ?, host hostA" in result.stdout
        assert "identity  not discovered yet" in result.stdout
        assert "  odd  ?  ?  channel state unknown  sessions 0" in result.stdout
        assert "records   1 migration record(s)" in result.stdout
    finally:
        stub.close()


def test_status_json_carries_hostds_answer(tmp_path, hostd):
    config = write_config(tmp_path, socket=hostd.path)
    data = json.loads(invoke("status", "--config", str(config), "--json").stdout)
    assert data["hostd"]["running"] and data["hostd"]["status"] == FULL_STATUS
    assert data["config"] == {"path": str(config), "ok": True, "host": "hostA", "error": None}
    assert "pool" not in data          # hostd said it


def test_status_hostd_down_still_asks_the_pool(tmp_path, pool):
    config = write_config(tmp_path, control=pool.control_endpoint, secret=SECRET)
    result = invoke("status", "--config", str(config))
    assert result.exit_code == 1
    assert f"config    {config} (host hostA" in result.stdout
    assert "hostd     NOT RUNNING (or not answering): hostd at" in result.stdout
    assert f"hint: start it with 'accelmig hostd --config {config}'" in result.stdout
    instance = pool.pool.instance
    assert f"pool      {pool.control_endpoint}: reachable, instance {instance} (asked directly)" in result.stdout
    assert result.stderr.startswith("accelmig: hostd at ") and "is unavailable" in result.stderr

    data = json.loads(invoke("status", "--config", str(config), "--json").stdout)
    assert data["hostd"]["running"] is False and data["pool"]["reachable"] is True

    wrong = write_config(tmp_path / "wrong", control=pool.control_endpoint, secret="not-the-secret-at-all")
    result = invoke("status", "--config", str(wrong))
    assert result.exit_code == 1
    assert "NOT reachable: authentication failed" in result.stdout


def test_status_hostd_answering_an_error(tmp_path):
    stub = HostdStub(tmp_path / "h.sock", {"status": Unavailable(what="the pool", reason="down")})
    try:
        config = write_config(tmp_path, socket=stub.path)
        result = invoke("status", "--config", str(config))
        assert result.exit_code == 1
        assert "hostd     answered with an error: the pool is unavailable: down" in result.stdout
    finally:
        stub.close()


def test_status_without_config(tmp_path):
    result = invoke("status", "--config", str(tmp_path / "none.toml"))
    assert result.exit_code == 1
    assert "config    invalid configuration in" in result.stdout and "file not found" in result.stdout
    assert "Traceback" not in result.output


# ---------------------------------------------------------------- doctor


def install(hooks, config, daemon=None):
    args = ["install", "--hooks-dir", str(hooks), "--config", str(config)]
    args += ["--libvirtd-pid-file", str(daemon.pid_file)] if daemon else ["--no-reload"]
    result = invoke(*args)
    assert result.exit_code == 0, result.output


def checks_of(result) -> dict:
    data = json.loads(result.stdout)
    return {c["name"]: c for c in data["checks"]}


def test_doctor_all_ok(tmp_path, hostd, pool):
    daemon = FakeLibvirtd(tmp_path / "daemon")
    try:
        config = write_config(tmp_path / "etc", socket=hostd.path, control=pool.control_endpoint, secret=SECRET)
        install(tmp_path / "hooks", config, daemon)
        result = invoke("doctor", "--config", str(config))
        assert result.exit_code == 0, result.output
        assert all(line.startswith(("ok    ", "      ")) for line in result.stdout.splitlines()[:-1])
        assert result.stdout.strip().endswith("9 ok, 0 warn, 0 FAIL")
        data = checks_of(invoke("doctor", "--config", str(config), "--json"))
        assert {n: c["status"] for n, c in data.items()} == {
            "config": "ok", "secret": "ok", "hook": "ok", "hook runs": "ok", "hook seen": "ok",
            "hostd": "ok", "pool": "ok", "libvirt": "ok", "channels": "ok"}
        assert "reloaded (SIGHUP) by accelmig install" in data["hook seen"]["reason"]
        assert f"pid {daemon.pid}" in data["hook seen"]["reason"]
        assert "pid 4242" in data["hostd"]["reason"]
        assert pool.pool.instance in data["pool"]["reason"]
        assert "test:///default" in data["libvirt"]["reason"]
        assert data["channels"]["reason"] == "no accelmig domain is running"   # the test driver's "test"
    finally:
        daemon.stop()


def test_doctor_finds_the_problems(tmp_path, pool):
    daemon = FakeLibvirtd(tmp_path / "daemon")
    try:
        config = write_config(tmp_path / "etc", control=pool.control_endpoint, secret="wrong-secret-0123456789")
        (tmp_path / "etc" / "host.secret").chmod(0o644)
        # no hook yet
        data = checks_of(invoke("doctor", "--config", str(config), "--json",
                                "--hooks-dir", str(tmp_path / "hooks")))
        assert data["hook"]["status"] == "FAIL" and "is not installed" in data["hook"]["reason"]
        assert data["hook"]["hint"] == f"run 'accelmig install --config {config}'"
        assert data["secret"]["status"] == "FAIL" and data["secret"]["hint"].startswith("chmod 600")
        assert data["hostd"]["status"] == "FAIL" and "accelmig hostd" in data["hostd"]["hint"]

        (tmp_path / "etc" / "host.secret").chmod(0o600)
        install(tmp_path / "hooks", config)                        # --no-reload
        result = invoke("doctor", "--config", str(config), "--libvirtd-pid-file", str(daemon.pid_file))
        assert result.exit_code == 1
        text = result.stdout
        assert "warn  hook seen" in text and "no reload of it since is recorded" in text
        assert "hint: reload libvirtd (kill -HUP" in text and "or run accelmig install" in text
        assert "FAIL  pool" in text and "authentication failed" in text
        assert "must match host hostA in the pool's hosts.toml" in text
        assert "FAIL  hostd" in text
        assert "ok    secret" in text

        # a daemon that started after the hook was written has seen it
        hook = tmp_path / "hooks" / "qemu.d" / "50-accelmig"
        past = time.time() - 600
        os.utime(hook, (past, past))
        data = checks_of(invoke("doctor", "--config", str(config), "--json",
                                "--libvirtd-pid-file", str(daemon.pid_file)))
        assert data["hook seen"]["status"] == "ok" and "after the hook was written" in data["hook seen"]["reason"]

        # a hook whose interpreter is gone
        text = hook.read_text().replace("\nexec /", "\nexec /nonexistent/", 1)
        hook.write_text(text)
        data = checks_of(invoke("doctor", "--config", str(config), "--json"))
        assert data["hook"]["status"] == "FAIL" and "interpreter /nonexistent/" in data["hook"]["reason"]
    finally:
        daemon.stop()


def test_doctor_notices_a_hook_reading_another_config(tmp_path):
    config = write_config(tmp_path / "etc")
    other = write_config(tmp_path / "other")
    install(tmp_path / "hooks", other)
    data = checks_of(invoke("doctor", "--config", str(config), "--json",
                            "--hooks-dir", str(tmp_path / "hooks")))
    assert data["hook"]["status"] == "warn"
    assert f"reads {other}, these checks read {config}" in data["hook"]["reason"]


def test_doctor_without_config(tmp_path):
    result = invoke("doctor", "--config", str(tmp_path / "none.toml"), "--hooks-dir", str(tmp_path))
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith("FAIL  config") and "file not found" in lines[0]
    assert any(line.startswith("skip  secret") for line in lines)
    assert "Traceback" not in result.output


def test_doctor_help():
    result = invoke("doctor", "--help")
    assert result.exit_code == 0 and "state='connected'" in result.stdout


# ---------------------------------------------------------------- a real libvirt daemon


@pytest.mark.root
@pytest.mark.libvirt
@pytest.mark.vm
@pytest.mark.timeout(150)
def test_doctor_against_a_real_daemon_and_real_domains(lab, tmp_path, hostd, pool):
    import libvirt
    from accelmig.lab.guest import channel_state
    node = lab.node("hostA")
    conn = lab.connect("hostA")
    config = write_config(tmp_path / "etc", socket=hostd.path, control=pool.control_endpoint,
                          secret=SECRET, libvirt_uri=node.uri)
    hooks_dir = node.hooks_dir.parent
    tag = uuid.uuid4().hex[:5]
    names = {"up": f"doc-up-{tag}", "paused": f"doc-paused-{tag}", "bare": f"doc-bare-{tag}"}
    domains = []
    try:
        proc = invoke("install", "--hooks-dir", str(hooks_dir), "--config", str(config),
                      "--libvirtd-pid-file", str(node.pid_file))
        assert proc.exit_code == 0, proc.output
        time.sleep(0.3)
        # a booted guest whose agent opens the channel, one paused, one without any channel
        domains.append(conn.createXML(lab.domain_xml(names["up"], lab.image, "hostA", guest_index=21), 0))
        domains.append(start_paused(lab, names["paused"], guest_index=22))
        domains.append(start_paused(lab, names["bare"], guest_index=23, agent_channel=False))
        up = domains[0]
        t0 = time.monotonic()
        wait_for(lambda: channel_state(up.XMLDesc(0)) == "connected", timeout=90, interval=0.2,
                 what=f"the guest's agent to open its channel (console: {lab.console_log('hostA', names['up'])})")

        print(f"\nchannel connected after {time.monotonic() - t0:.1f} s")
        t0 = time.monotonic()
        result = invoke("doctor", "--config", str(config), "--json")
        print(f"doctor took {time.monotonic() - t0:.2f} s")
        data = checks_of(result)
        assert data["hook"]["status"] == "ok" and data["hook runs"]["status"] == "ok"
        assert data["hook seen"]["status"] == "ok", data["hook seen"]
        assert f"pid {node.pid}" in data["hook seen"]["reason"]
        assert data["libvirt"]["status"] == "ok" and "3 of them accelmig's" in data["libvirt"]["reason"]
        assert data[f"channel {names['up']}"]["status"] == "ok"
        assert "agent channel connected at /var/lib/libvirt/qemu/channel/target/domain-" \
            in data[f"channel {names['up']}"]["reason"]
        paused = data[f"channel {names['paused']}"]
        assert paused["status"] == "warn" and "disconnected" in paused["reason"]
        assert "the domain is paused" in paused["reason"]
        assert paused["hint"] == f"resume it (virsh resume {names['paused']})"
        bare = data[f"channel {names['bare']}"]
        assert bare["status"] == "FAIL" and "neither the accelmig agent channel" in bare["reason"]
        assert json.loads(result.stdout)["ok"] is False and result.exit_code == 1

        # the plain text names each domain; once the bare one is gone nothing FAILs
        text = invoke("doctor", "--config", str(config)).stdout
        assert f"ok    channel {names['up']}" in text and f"FAIL  channel {names['bare']}" in text
        domains.pop().destroy()
        result = invoke("doctor", "--config", str(config))
        assert result.exit_code == 0, result.stdout
        assert conn.lookupByName(names["up"]).state()[0] == libvirt.VIR_DOMAIN_RUNNING
    finally:
        for dom in domains:
            try:
                dom.destroy()
            except libvirt.libvirtError:
                pass
        invoke("uninstall", "--hooks-dir", str(hooks_dir), "--config", str(config), "--no-reload")
