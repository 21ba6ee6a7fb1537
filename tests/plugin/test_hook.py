"""The libvirt hook, run as libvirt runs it (a process, XML on stdin), against
a real hostd and a real pool — and with hostd down, strict and lenient."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from accelmig.wire.control import ControlClient
from tests.support.hostd import SECRET, HostdThread, write_config

GOLDEN = Path(__file__).parent / "golden" / "rewrite"
ACCEL_XML = (GOLDEN / "bridge-rewrite.in.xml").read_bytes()
REWRITTEN = (GOLDEN / "bridge-rewrite.out.xml").read_text()
FOREIGN_XML = (GOLDEN / "foreign-domain.in.xml").read_bytes()
UUID = "7c2f6a4e-1d3b-4c8e-9a5f-0b1c2d3e4f51"
FABRIC_B = '[fabric]\nmode = "bridge"\nbridge = "fab-b"\n'
OPERATIONS = [("prepare", "begin"), ("start", "begin"), ("started", "begin"), ("stopped", "end"),
              ("release", "end"), ("reconnect", "begin"), ("attach", "begin"), ("migrate", "begin"),
              ("restore", "begin")]


def run_hook(config: str | None, *args, xml: bytes = ACCEL_XML, timeout: float = 20):
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C", "HOME": "/root"}     # all libvirt passes on
    if config:
        env["ACCELMIG_CONFIG"] = config
    code = "import sys; from accelmig.plugin.hook import main; sys.exit(main())"
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code, *args], input=xml, env=env, capture_output=True,
                         timeout=timeout)
    return out.returncode, out.stdout.decode(), out.stderr.decode(), time.monotonic() - started


@pytest.fixture
def hostd_up(tmp_path, pool_a):
    config = write_config(tmp_path, pool_a, fabric=FABRIC_B)
    hostd = HostdThread(config).start()
    yield config, pool_a
    hostd.stop()


@pytest.mark.parametrize("op, sub", OPERATIONS)
def test_foreign_domains_are_left_alone_silently(tmp_path, op, sub):
    code, out, err, took = run_hook(str(tmp_path / "no-config.toml"), "some-vm", op, sub, "-", xml=FOREIGN_XML)
    assert (code, out, err) == (0, "", "")


def test_migrate_begin_opens_the_record_and_rewrites_the_host_bound_part(hostd_up):
    config, pool = hostd_up
    code, out, err, took = run_hook(config, "accel-vm1", "migrate", "begin", "-")
    assert code == 0, err
    assert out == REWRITTEN                   # the bridge is this host's now, nothing else changed
    with ControlClient(pool.control_endpoint, "hostA", SECRET.encode()) as client:
        records = client.call("list_records", domain_uuid=UUID)["records"]
    assert len(records) == 1 and records[0]["dest_host"] == "hostA" and records[0]["state"] == "open"
    assert records[0]["domain_name"] == "accel-vm1"


def test_a_note_for_every_other_operation_and_exit_zero(hostd_up):
    config, _ = hostd_up
    for op, sub in OPERATIONS:
        if (op, sub) in (("migrate", "begin"), ("restore", "begin")):
            continue
        code, out, err, took = run_hook(config, "accel-vm1", op, sub, "-")
        assert (code, out) == (0, ""), (op, sub, err)


@pytest.mark.parametrize("op", ["migrate", "restore"])
def test_strict_mode_refuses_when_hostd_is_down(tmp_path, pool_a, op):
    config = write_config(tmp_path, pool_a, fabric=FABRIC_B, strict=True)
    code, out, err, took = run_hook(config, "accel-vm1", op, "begin", "-")
    assert code == 1 and out == ""
    assert f"refusing {op} of accel-vm1 to host hostA" in err and "hostd" in err
    assert "strict mode" in err


def test_lenient_mode_lets_the_migration_through_with_the_xml_adapted(tmp_path, pool_a):
    config = write_config(tmp_path, pool_a, fabric=FABRIC_B, strict=False)
    code, out, err, took = run_hook(config, "accel-vm1", "migrate", "begin", "-")
    assert code == 0 and out == REWRITTEN
    assert "goes ahead without accelmig (lenient mode)" in err


@pytest.mark.parametrize("op, sub", [o for o in OPERATIONS if o[0] not in ("migrate", "restore")])
def test_hostd_down_never_fails_other_operations(tmp_path, pool_a, op, sub):
    config = write_config(tmp_path, pool_a)
    code, out, err, took = run_hook(config, "accel-vm1", op, sub, "-")
    assert (code, out) == (0, "")


def test_strict_refuses_when_the_pool_is_unreachable(tmp_path, pool_a):
    config = write_config(tmp_path, pool_a, fabric=FABRIC_B)
    hostd = HostdThread(config).start()
    try:
        pool_a.stop()                         # hostd is up, the pool is gone
        code, out, err, took = run_hook(config, "accel-vm1", "migrate", "begin", "-")
        assert code == 1 and "pool's control plane" in err
    finally:
        hostd.stop()


def test_the_hook_keeps_its_time_budget_when_hostd_hangs(tmp_path, pool_a):
    config = write_config(tmp_path, pool_a, fabric=FABRIC_B)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "hostd.sock"))     # accepts, never answers
    listener.listen(8)
    held = []
    threading.Thread(target=lambda: held.extend(listener.accept() for _ in range(3)), daemon=True).start()
    try:
        code, out, err, took = run_hook(config, "accel-vm1", "migrate", "begin", "-")
        assert code == 1 and "did not complete within" in err
        assert took < 2.0 + 3.0              # hook_timeout 2 s, plus interpreter start
        code, out, err, took = run_hook(config, "accel-vm1", "prepare", "begin", "-")
        assert code == 0 and took < 0.5 + 3.0
    finally:
        listener.close()


def test_bad_xml_and_bad_arguments(tmp_path, pool_a):
    config = write_config(tmp_path, pool_a)
    broken = b"<domain><name>accelmig-broken</name><devices>"
    code, out, err, _ = run_hook(config, "accelmig-broken", "migrate", "begin", "-", xml=broken)
    assert code == 1 and "its XML cannot be read" in err
    code, out, err, _ = run_hook(config, "accelmig-broken", "prepare", "begin", "-", xml=broken)
    assert (code, out) == (0, "")
    code, out, err, _ = run_hook(config, "only-one-arg")
    assert code == 0 and "expected DOMAIN OPERATION SUB-OPERATION" in err


def test_a_missing_config_refuses_gated_operations_only(tmp_path):
    missing = str(tmp_path / "nowhere.toml")
    code, out, err, _ = run_hook(missing, "accel-vm1", "migrate", "begin", "-")
    assert code == 1 and "nowhere.toml" in err
    code, out, err, _ = run_hook(missing, "accel-vm1", "start", "begin", "-")
    assert (code, out, err) == (0, "", "")
