"""One pool node, all its devices (issue 12, first part), on a real
``accelmig-pool serve`` process with PoCL's two different devices
(``POCL_DEVICES="pthread basic"``): ``devices --json``, placement by id, by
name, by type, by min_memory, the least loaded choice, a selector nothing
matches, hostile selectors, quotas across devices and per type, programs
that never cross devices, and a session that stays on its device across
cuts and resumes."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accelmig.agent.driver import connect
from accelmig.agent.driver.device import Program
from accelmig.lab.cutproxy import CutProxy
from accelmig.pool.config import PoolConfig, load_tenants
from accelmig.pool.devices.inventory import Placer
from accelmig.pool.session import Tenant
from accelmig.wire.control import ControlClient
from accelmig.wire.devices import ID_PATTERN, MAX_SELECTOR, DeviceSelector, parse_selector
from accelmig.wire.errors import (BadRequest, BuildFailed, ConfigInvalid, ErrorCode, LimitExceeded,
                                  NoSuchDevice, NoSuchObject, QuotaExceeded)
from tests.fuzz.peers import FrameConn, problems
from tests.fuzz.strategies import fuzz_settings
from tests.support.attest import bind
from tests.support.processes import PoolProcess
from tests.support.tenants import run_cli
from tests.support.twohosts import HOSTS, TwoHosts

TWO_DEVICES = {"POCL_DEVICES": "pthread basic"}
ALICE, BOB, CAROL = "devices-alice-0001", "devices-bob-00002", "devices-carol-0003"
TOKENS = (f'[tenants.alice]\ntoken = "{ALICE}"\nquota = "64MiB"\n'
          f'[tenants.bob]\ntoken = "{BOB}"\nquota = "2MiB"\n'                 # across the whole pool
          f'[tenants.carol]\ntoken = "{CAROL}"\nquota = "64MiB"\n'
          f'quota_by_type = {{ cpu = "1MiB", gpu = "1GiB" }}\n')                # on every cpu device
SOURCE = "__kernel void inc(__global uint *a) { a[get_global_id(0)] += 1u; }"


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """The pool, on IPv4 and IPv6 loopback: hostA's guests and hostB's
    (tests/support/twohosts.py), so that sessions can migrate."""
    directory = tmp_path_factory.mktemp("devices")
    hosts = "".join(f'[hosts.{name}]\nsecret = "{secret}"\naddresses = {json.dumps(addresses)}\n'
                    for name, (secret, addresses) in HOSTS.items())
    pool = PoolProcess(directory, TOKENS, hosts, env=TWO_DEVICES, extra=("--listen", "127.0.0.1:0,[::1]:0"))
    os.chmod(pool.hosts, 0o600)
    os.chmod(pool.tokens, 0o600)
    pool.admin = str(directory / "pool.sock")
    try:
        yield pool
        assert problems(pool) == []
    finally:
        pool.stop()


def admin(node, method: str, **args) -> dict:
    with ControlClient("unix:" + node.admin, "admin", None) as client:
        return client.call(method, **args)


def served(node) -> dict:
    """The pool's devices by name ("basic", "pthread"), as it lists them."""
    return {d["name"].split("-")[0]: d for d in admin(node, "list_devices")["devices"]}


def idle(node) -> dict:
    """The devices, after checking that every earlier test gave back what it held."""
    devices = served(node)
    assert [(d["sessions"], d["bytes_in_use"]) for d in devices.values()] == [(0, 0), (0, 0)]
    return devices


def opened(node, token=ALICE, device=None, endpoint=None):
    return connect(endpoint or node.endpoint, token, agent=False, domain=False, device=device)


# -- what the node has -----------------------------------------------------------------


def devices_json(*args, env=TWO_DEVICES) -> dict:
    out = run_cli("accelmig-pool", "devices", "--json", *args, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_devices_json_lists_both_devices_with_ids_that_do_not_follow_the_order(tmp_path):
    listed = devices_json("--admin-socket", str(tmp_path / "no-pool.sock"))
    assert listed["source"].startswith("this node")
    devices = listed["devices"]
    assert [d["spec"] for d in devices] == ["opencl:0", "opencl:1"]
    assert {d["type"] for d in devices} == {"cpu"}
    assert len({d["id"] for d in devices}) == 2 and all(ID_PATTERN.match(d["id"]) for d in devices)
    for dev in devices:
        assert dev["vendor"] and dev["name"] and dev["global_mem_size"] > 0
        assert dev["sessions"] is None and dev["bytes_in_use"] is None       # nothing served here
    # a stale admin socket (a pool that died): said, and this node's devices listed
    (tmp_path / "stale.sock").write_text("")
    out = run_cli("accelmig-pool", "devices", "--admin-socket", str(tmp_path / "stale.sock"),
                  env={**os.environ, **TWO_DEVICES})
    assert out.returncode == 0 and "no pool answered at" in out.stderr
    assert [line.split()[1] for line in out.stdout.splitlines()] == [d["id"] for d in devices]
    # pthread alone: it is opencl:0 now, and keeps its id (the order is not the id)
    pthread = [d for d in devices if d["name"].startswith("pthread")][0]
    assert pthread["spec"] == "opencl:1"
    alone = devices_json("--admin-socket", str(tmp_path / "no-pool.sock"),
                         env={"POCL_DEVICES": "pthread"})["devices"]
    assert [(d["spec"], d["id"], d["name"]) for d in alone] == [("opencl:0", pthread["id"], pthread["name"])]


def test_the_pool_serves_every_device_and_devices_json_shows_what_is_in_use(node):
    devices = idle(node)
    local = {d["id"] for d in devices_json("--admin-socket", "/nonexistent/pool.sock")["devices"]}
    assert {d["id"] for d in devices.values()} == local        # the same ids, pool or not
    with opened(node, device=devices["basic"]["id"]) as dev:
        dev.alloc(3 << 20)
        dev.finish()
        listed = devices_json("--admin-socket", node.admin)
        assert listed["source"].startswith("pool instance")
        by_id = {d["id"]: d for d in listed["devices"]}
        assert (by_id[devices["basic"]["id"]]["sessions"], by_id[devices["basic"]["id"]]["bytes_in_use"]) \
            == (1, 3 << 20)
        assert (by_id[devices["pthread"]["id"]]["sessions"], by_id[devices["pthread"]["id"]]["bytes_in_use"]) \
            == (0, 0)
        text = run_cli("accelmig-pool", "devices", "--admin-socket", node.admin).stdout
        assert f"{devices['basic']['id']}" in text and "1 sessions, 3 MiB in use" in text
        metrics = dict(line.rsplit(" ", 1) for line in admin(node, "metrics")["text"].splitlines()
                       if line and not line.startswith("#"))
        label = f'{{device="{devices["basic"]["id"]}",type="cpu"}}'
        assert float(metrics["accelmig_device_sessions" + label]) == 1
        assert float(metrics["accelmig_device_memory_in_use_bytes" + label]) == 3 << 20
    idle(node)


# -- placement -------------------------------------------------------------------------


@pytest.mark.parametrize("selector, expected", [
    ("ID:basic", "basic"), ("ID:pthread", "pthread"), ("id=ID:pthread", "pthread"),
    ("name=basic", "basic"), ("name=PTHREAD,type=cpu", "pthread"),
    ("type=cpu,vendor=VENDOR,name=basic", "basic"), ("min_memory=1GiB,name=basic", "basic"),
])
def test_a_session_gets_the_device_it_asks_for(node, selector, expected):
    devices = idle(node)
    for name, dev in devices.items():
        selector = selector.replace(f"ID:{name}", dev["id"])
    selector = selector.replace("VENDOR", devices["basic"]["vendor"])
    with opened(node, device=selector) as dev:
        info = dev.info()
        assert dev.device_id == info["id"] == devices[expected]["id"]
        assert info["name"] == devices[expected]["name"] and info["type"] == "cpu"
        sessions = admin(node, "list_sessions")["sessions"]
        assert [s["device"] for s in sessions if s["sid"] == dev.sid] == [devices[expected]["id"]]
    idle(node)


@pytest.mark.parametrize("selector", ["type=gpu", "type=fpga", "min_memory=1024TiB", "vendor=nvidia",
                                      "name=basic,type=accelerator",
                                      "cpu-00000000-0"])
def test_a_selector_nothing_matches_is_a_clear_error_naming_what_exists(node, selector):
    devices = idle(node)
    with pytest.raises(NoSuchDevice) as caught:
        opened(node, device=selector)
    message = str(caught.value)
    assert caught.value.code is ErrorCode.NO_SUCH_DEVICE
    assert str(parse_selector(selector)) in message
    for dev in devices.values():
        assert dev["id"] in message and dev["name"] in message
    idle(node)


def test_without_a_selector_the_least_loaded_device_gets_the_session(node):
    devices = idle(node)
    basic, pthread = devices["basic"]["id"], devices["pthread"]["id"]
    held = opened(node, device=basic)
    try:
        with opened(node) as free:                      # one session on basic, none on pthread
            assert free.device_id == pthread
        # one session each; basic holds memory, pthread none: pthread is less loaded
        other = opened(node, device=pthread)
        try:
            held.alloc(8 << 20)
            held.finish()
            with opened(node) as chosen:
                assert chosen.device_id == pthread
            other.alloc(16 << 20)
            other.finish()
            with opened(node) as chosen:
                assert chosen.device_id == basic
        finally:
            other.close()
    finally:
        held.close()
    idle(node)


def test_the_placer_ranks_sessions_then_memory_share_then_id():
    views = [{"id": "gpu-aaaaaaaa-0", "type": "gpu", "name": "big", "vendor": "v", "global_mem_size": 16 << 30,
              "sessions": 1, "bytes_in_use": 1 << 30},
             {"id": "gpu-bbbbbbbb-0", "type": "gpu", "name": "small", "vendor": "v", "global_mem_size": 4 << 30,
              "sessions": 1, "bytes_in_use": 1 << 30},
             {"id": "cpu-cccccccc-0", "type": "cpu", "name": "host", "vendor": "w", "global_mem_size": 8 << 30,
              "sessions": 0, "bytes_in_use": 0}]
    placer = Placer()
    assert placer.choose(views, None)["id"] == "cpu-cccccccc-0"                      # fewest sessions
    assert placer.choose(views, parse_selector("type=gpu"))["id"] == "gpu-aaaaaaaa-0"  # smaller share
    assert placer.choose(views, parse_selector("min_memory=8GiB,type=gpu"))["id"] == "gpu-aaaaaaaa-0"
    views[1]["bytes_in_use"] = views[0]["bytes_in_use"] = 0
    assert placer.choose(views, parse_selector("type=gpu"))["id"] == "gpu-aaaaaaaa-0"  # then the id
    with pytest.raises(NoSuchDevice, match="gpu-aaaaaaaa-0 .*gpu-bbbbbbbb-0 .*cpu-cccccccc-0"):
        placer.choose(views, parse_selector("min_memory=17GiB"))


# -- hostile selectors -----------------------------------------------------------------


@fuzz_settings(300)
@given(st.one_of(st.text(max_size=80), st.lists(st.sampled_from(
    ["id=", "type=", "vendor=", "name=", "min_memory=", "gpu", "fpga", "8GiB", "99999999999999999TiB",
     ",", "=", " ", "cpu-0123abcd-0", "\x00", "é", "a" * 70]), max_size=12).map("".join)))
def test_any_selector_text_is_a_selector_or_bad_request(text):
    try:
        selector = parse_selector(text)
    except BadRequest as exc:
        assert exc.code is ErrorCode.BAD_REQUEST and exc.message
        return
    assert isinstance(selector, DeviceSelector) and len(text) <= MAX_SELECTOR
    assert parse_selector(str(selector)) == selector          # its canonical text says the same
    assert selector.min_memory is None or 0 <= selector.min_memory <= 1 << 50


@pytest.mark.parametrize("text, words", [
    ("", "1 to 256 characters"), ("type=gpu," * 40, "1 to 256 characters"),
    ("type=gpu,type=cpu", "names type twice"), ("a=1,b=2,c=3,d=4,e=5,f=6", "at most 5"),
    ("type=tpu", "device type 'tpu'"), ("min_memory=8 GiB", "not a size"),
    ("min_memory=2PiB", "not a size"), ("min_memory=99999999999999TiB", "over 1 PiB"),
    ("vendor=" + "x" * 65, "1 to 64"), ("name=a;rm", "letters, digits"), ("type=gpu\n", "printable"),
    ("gpu", "neither a device id"), (42, "must be a string"),
])
def test_bad_selectors_are_refused_with_their_reason(text, words):
    with pytest.raises(BadRequest, match=words.replace("(", r"\(")):
        parse_selector(text)


def test_a_hostile_selector_sent_past_the_driver_is_refused_and_the_pool_serves_on(node):
    for selector in ["type=gpu," * 100, {"type": "gpu"}, ["gpu"], 7, "x" * 3000, "min_memory=1e99",
                     "type=gpu\x00", "name=\u00e9"]:
        conn = FrameConn(node.endpoint)
        try:
            conn.send({"op": "hello", "versions": [1]})
            assert conn.next()["op"] == "welcome"
            conn.send({"op": "open", "token": ALICE, "secret": "ab" * 16, "device": selector})
            answer = conn.next()
            assert answer["op"] == "error" and answer["error"]["code"] == "BAD_REQUEST", answer
        finally:
            conn.close()
    with pytest.raises(BadRequest):                     # the driver refuses it before it leaves
        opened(node, device="type=gpu," * 100)
    with opened(node) as dev:
        assert dev.info()["id"]
    idle(node)


# -- quotas ------------------------------------------------------------------------------


def test_a_tenant_quota_counts_every_device_of_the_pool(node):
    devices = idle(node)
    with opened(node, BOB, devices["basic"]["id"]) as on_basic, \
            opened(node, BOB, devices["pthread"]["id"]) as on_pthread:
        kept = on_basic.alloc(1536 << 10)
        on_basic.finish()
        on_pthread.alloc(1 << 20)
        with pytest.raises(QuotaExceeded, match=r"tenant bob: allocating 1048576 bytes would use 1572864"):
            on_pthread.finish()
        kept.free()
        on_basic.finish()
        on_pthread.alloc(1 << 20)
        on_pthread.finish()                            # the bytes came back: it fits now
    idle(node)


def test_a_quota_by_type_counts_every_device_of_that_type(node):
    devices = idle(node)
    with opened(node, CAROL, devices["basic"]["id"]) as on_basic, \
            opened(node, CAROL, devices["pthread"]["id"]) as on_pthread:
        kept = on_basic.alloc(768 << 10)
        on_basic.finish()
        on_pthread.alloc(512 << 10)
        with pytest.raises(QuotaExceeded, match=r"1310720 bytes on cpu devices, over its "
                                                r"quota_by_type.cpu of 1048576"):
            on_pthread.finish()
        on_pthread.alloc(256 << 10)
        on_pthread.finish()                            # exactly the type's quota
        kept.free()
        on_basic.finish()
        on_pthread.alloc(768 << 10)
        on_pthread.finish()
    idle(node)


def test_quota_by_type_keeps_types_apart_within_the_tenant_quota():
    tenant = Tenant("t", "token-xxxxxxxx", 3 << 20, quota_by_type={"gpu": 1 << 20})
    tenant.reserve(1 << 20, "gpu")
    with pytest.raises(LimitExceeded, match="on gpu devices"):
        tenant.reserve(1, "gpu")
    tenant.reserve(2 << 20, "cpu")                     # no cpu limit: the tenant's quota holds
    with pytest.raises(QuotaExceeded):
        tenant.reserve(1, "accelerator")
    tenant.give_back(1 << 20, "gpu")
    assert (tenant.used, tenant.used_by_type) == (2 << 20, {"gpu": 0, "cpu": 2 << 20})
    tenant.reserve(1 << 20, "gpu")


# -- a session never changes device ----------------------------------------------------


def test_a_program_built_on_one_device_is_never_used_on_the_other(node):
    devices = idle(node)
    with opened(node, device=devices["basic"]["id"]) as on_basic, \
            opened(node, device=devices["pthread"]["id"]) as on_pthread:
        program = on_basic.build(SOURCE)
        # its handle means nothing in a session on the other device ...
        stranger = Program(on_pthread, program.handle, program.kernels)
        buf = on_pthread.alloc(16)
        with pytest.raises(NoSuchObject):
            stranger.launch("inc", (4,), None, buf)
            on_pthread.finish()
        # ... and its binary, built for basic, is refused by the other device's runtime
        with pytest.raises(BuildFailed, match="device binary refused"):
            on_pthread.build_binary(program.binary())
    idle(node)


def test_a_session_stays_on_its_device_across_cuts_and_resumes(node):
    devices = idle(node)
    proxy = CutProxy(node.endpoint)
    try:
        with opened(node, device="name=pthread", endpoint=proxy.endpoint) as dev:
            program = dev.build(SOURCE)
            data = dev.upload(bytes(64))
            for round_ in range(1, 4):
                proxy.cut()
                program.launch("inc", (16,), None, data)
                assert dev.read(data) == (round_).to_bytes(4, "little") * 16
                assert dev.info()["id"] == dev.device_id == devices["pthread"]["id"]
            assert dev.epoch >= 2                      # it did resume
            listed = [s for s in admin(node, "list_sessions")["sessions"] if s["sid"] == dev.sid]
            assert listed[0]["device"] == devices["pthread"]["id"]
            assert listed[0]["counters"]["builds"] == 1 and listed[0]["counters"]["resumes"] >= 1
    finally:
        proxy.close()
    idle(node)


# -- configuration ---------------------------------------------------------------------


@pytest.mark.parametrize("table, words", [
    ('quota_by_type = { tpu = "1GiB" }', "'tpu' is no device type"),
    ('quota_by_type = "1GiB"', "must be a table of sizes"),
    ('quota_by_type = { gpu = "lots" }', "is not a size"),
    ('quota_by_type = { fpga = "1GiB", accelerator = "2GiB" }', "accelerator is given twice"),
])
def test_bad_quota_by_type_is_a_clear_error(tmp_path, table, words):
    path = tmp_path / "tokens.toml"
    path.write_text(f'[tenants.a]\ntoken = "long-enough-token"\nquota = "1GiB"\n{table}\n')
    with pytest.raises(ConfigInvalid, match=words):
        load_tenants(str(path))


def test_fpga_is_the_accelerator_type_in_quotas(tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text('[tenants.a]\ntoken = "long-enough-token"\nquota = "1GiB"\n'
                    'quota_by_type = { fpga = "512MiB", gpu = 1024 }\n')
    assert load_tenants(str(path))["a"].quota_by_type == {"accelerator": 512 << 20, "gpu": 1024}


def test_device_and_devices_together_are_refused():
    with pytest.raises(ConfigInvalid, match="choose one"):
        PoolConfig.load(None, {"device": "opencl:0", "devices": "opencl:1"})


def test_serve_devices_picks_some_and_an_unknown_one_names_what_exists(tmp_path):
    ids = {d["name"].split("-")[0]: d["id"] for d in devices_json("--admin-socket", "/nonexistent")["devices"]}
    pool = PoolProcess(tmp_path, TOKENS, env=TWO_DEVICES, extra=("--devices", ids["pthread"]))
    try:
        with ControlClient("unix:" + str(tmp_path / "pool.sock"), "admin", None) as client:
            assert [d["id"] for d in client.call("list_devices")["devices"]] == [ids["pthread"]]
        with connect(pool.endpoint, ALICE, agent=False, domain=False, device="name=basic") as dev:
            pytest.fail(f"placed on {dev.device_id}, a device the pool does not serve")
    except NoSuchDevice as exc:
        assert ids["pthread"] in str(exc) and ids["basic"] not in str(exc)
    finally:
        pool.stop()
    out = run_cli("accelmig-pool", "serve", "--listen", "127.0.0.1:0", "--control-listen", "", "--insecure",
                  "--tokens", str(tmp_path / "tokens.toml"), "--admin-socket", str(tmp_path / "again.sock"),
                  "--devices", "cpu-00000000-0", env={**os.environ, **TWO_DEVICES}, timeout=60)
    assert out.returncode == 2
    assert "device 'cpu-00000000-0' (--devices)" in out.stderr
    assert ids["basic"] in out.stderr and ids["pthread"] in out.stderr


def test_a_session_stays_on_its_device_across_migrations_between_hosts(node):
    devices = idle(node)
    hosts = TwoHosts(node)
    try:
        with opened(node, device=devices["basic"]["id"], endpoint=hosts.a.endpoint) as dev, \
                opened(node, device=devices["pthread"]["id"], endpoint=hosts.a.endpoint) as beside:
            program = dev.build(SOURCE)
            data = dev.upload(bytes(16))
            bind(hosts.a, [dev, beside], "dom-devices")
            here = hosts.a
            for round_ in range(1, 5):                  # A -> B -> A -> B -> A
                there = hosts.other(here)
                tickets = hosts.migrate("dom-devices", here, there)["tickets"]
                dev.resume(there.endpoint, tickets[dev.sid])
                beside.resume(there.endpoint, tickets[beside.sid])
                program.launch("inc", (4,), None, data)
                assert dev.read(data) == round_.to_bytes(4, "little") * 4
                assert dev.info()["id"] == dev.device_id == devices["basic"]["id"]
                assert beside.info()["id"] == beside.device_id == devices["pthread"]["id"]
                here = there
            listed = {s["sid"]: s for s in admin(node, "list_sessions")["sessions"]}
            assert listed[dev.sid]["device"] == devices["basic"]["id"] and listed[dev.sid]["epoch"] == 5
            assert listed[dev.sid]["counters"]["builds"] == 1          # nothing rebuilt, nothing re-placed
            assert listed[beside.sid]["device"] == devices["pthread"]["id"]
    finally:
        hosts.close()
    idle(node)


def test_a_reload_changes_quota_by_type_and_keeps_what_is_held(node):
    devices = idle(node)
    with opened(node, CAROL, devices["basic"]["id"]) as dev:
        dev.alloc(768 << 10)
        dev.finish()
        node.tokens.write_text(TOKENS.replace('cpu = "1MiB"', 'cpu = "512KiB"'))
        try:
            assert node.hup()["tenants_changed"] == "carol"
            dev.alloc(1)                            # held is kept, more is refused
            with pytest.raises(QuotaExceeded, match="over its quota_by_type.cpu of 524288"):
                dev.finish()
        finally:
            node.tokens.write_text(TOKENS)
            assert node.hup()["tenants_changed"] == "carol"
        dev.alloc(1)
        dev.finish()
    idle(node)
