"""Many pool nodes on a real etcd (Debian's etcd-server on loopback): nodes
under a lease, a dead node's lease running out, a node that comes back as a
new instance, tenant quotas that hold across nodes, and a store that lies.
Real ``accelmig-pool serve`` processes, no mock."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading

import pytest

pytest.importorskip("etcd3gw", reason="the cluster extra (pip install 'accelmig[cluster]')")

from accelmig.agent.driver import connect  # noqa: E402
from accelmig.pool.cluster.quotas import QuotaLedger, tenant_prefix  # noqa: E402
from accelmig.pool.cluster.registry import NODES, live_nodes, node_key  # noqa: E402
from accelmig.pool.cluster.store import ClusterStore  # noqa: E402
from accelmig.agent.driver.session import LinkState  # noqa: E402
from accelmig.wire.errors import QuotaExceeded, SessionLost, Unavailable  # noqa: E402
from tests.support.etcd import etcd_server  # noqa: E402,F401  (the fixture)
from tests.support.processes import PoolProcess, tenants_toml  # noqa: E402
from tests.support.tenants import run_cli  # noqa: E402
from tests.support.wait import wait_for  # noqa: E402

MiB = 1 << 20


def store_of(etcd) -> ClusterStore:
    return ClusterStore([("127.0.0.1", etcd.client_port)])


def node(tmp_path, etcd, name: str, *extra, env: dict | None = None) -> PoolProcess:
    directory = tmp_path / f"{name}-{len(list(tmp_path.glob(name + '-*')))}"
    directory.mkdir()
    return PoolProcess(directory, tenants_toml(alice="alice-token-0001"),
                       extra=("--cluster", etcd.url, "--node-name", name, "--cluster-ttl", "2",
                              "--device-isolation", "none", *extra), env=env)


class PrefixWatch:
    """What etcd's watch reports under a prefix from now on: ``(kind, key,
    value)``, kind PUT or DELETE, the value parsed from JSON (None when
    deleted)."""

    def __init__(self, store: ClusterStore, prefix: str):
        self.seen: queue.Queue = queue.Queue()
        _, revision = store.range(prefix)
        self.events, self.cancel = store.watch_prefix(prefix, start_revision=revision + 1)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for event in self.events:
            self.seen.put((event.get("type", "PUT"), event["kv"]["key"].decode(), event["kv"].get("value", b"")))

    def wait(self, predicate, timeout: float = 30.0, what: str = "such an etcd event") -> None:
        while True:
            try:
                kind, key, value = self.seen.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no {what} within {timeout} s") from None
            if predicate(kind, key, json.loads(value) if kind != "DELETE" and value else None):
                return

    def wait_deleted(self, key: str, timeout: float = 30.0) -> None:
        self.wait(lambda kind, seen, _value: kind == "DELETE" and seen == key, timeout,
                  f"deletion of {key} by etcd")


def test_a_node_registers_endpoints_devices_and_instance_under_a_lease_and_leaves_on_stop(tmp_path, etcd_server):
    store = store_of(etcd_server)
    pool = node(tmp_path, etcd_server, "n1")
    try:
        assert pool.ready["node"] == "n1"
        nodes = live_nodes(store)
        assert set(nodes) == {"n1"}
        view = nodes["n1"]
        assert view.instance == pool.ready["instance"]
        assert view.data == pool.endpoint and view.control == pool.control_endpoint
        assert view.devices and view.devices[0]["name"] and view.devices[0]["global_mem_size"] > 0
        assert view.lease != 0
        assert store.keepalive(view.lease) > 0           # a live lease, its key under it
        pool.wait_log(lambda e: e["msg"].startswith("node n1 (instance"))
    finally:
        assert pool.stop() == 0
    assert live_nodes(store) == {}                       # revoked at a clean stop, not left to expire
    assert store.keepalive(view.lease) == -1


def test_a_killed_node_leaves_when_its_lease_runs_out_and_returns_as_a_new_instance(tmp_path, etcd_server):
    store = store_of(etcd_server)
    first = node(tmp_path, etcd_server, "n1")
    other = node(tmp_path, etcd_server, "n2")
    try:
        dev = connect(first.endpoint, "alice-token-0001", agent=False, timeout=5, auto_reconnect=False)
        dev.upload(b"device memory that dies with its node")
        dev.finish()
        old_instance = first.ready["instance"]
        deletions = PrefixWatch(store, NODES)
        first.signal(signal.SIGKILL)                     # no deregistration: only the TTL removes it
        first.proc.wait(10)
        deletions.wait_deleted(node_key("n1"))
        deletions.cancel()
        assert set(live_nodes(store)) == {"n2"}          # the other node is untouched

        again = node(tmp_path, etcd_server, "n1")        # same name, new process
        try:
            nodes = live_nodes(store)
            assert nodes["n1"].instance == again.ready["instance"] != old_instance
            # the old instance's session is not the new one's: lost, never re-created
            with pytest.raises(SessionLost, match="no live node of the pool is instance " + old_instance):
                dev.resume(again.endpoint)
        finally:
            again.stop()
    finally:
        first.stop()
        other.stop()


def test_a_second_node_with_a_live_nodes_name_is_refused(tmp_path, etcd_server):
    pool = node(tmp_path, etcd_server, "n1")
    try:
        out = run_cli("accelmig-pool", "serve", "--listen", "127.0.0.1:0", "--control-listen", "",
                      "--admin-socket", "", "--insecure", "--tokens", pool.tokens, "--cluster", etcd_server.url,
                      "--node-name", "n1", "--cluster-ttl", "2", "--device-isolation", "none",
                      "--log-format", "text", timeout=60)
        assert out.returncode == 2
        assert "node name n1 is held in etcd by instance " + pool.ready["instance"] in out.stderr
        assert live_nodes(store_of(etcd_server))["n1"].instance == pool.ready["instance"]
    finally:
        pool.stop()


def test_two_nodes_racing_for_a_tenants_quota_never_exceed_it_together(etcd_server):
    """Each node tries 12 reservations of 1 MiB at once against a 10 MiB quota."""
    quota, attempts = 10 * MiB, 12
    ledgers = []
    for name in ("n1", "n2"):
        store = store_of(etcd_server)
        ledgers.append(QuotaLedger(store, name, store.grant(30)))
    start = threading.Barrier(2)
    granted = {"n1": 0, "n2": 0}
    refused = {"n1": 0, "n2": 0}

    def race(ledger):
        start.wait()
        for i in range(attempts):
            try:
                ledger.reserve("alice", f"s-{i}", MiB, quota)
                granted[ledger.node] += 1
            except QuotaExceeded:
                refused[ledger.node] += 1

    threads = [threading.Thread(target=race, args=(ledger,)) for ledger in ledgers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert granted["n1"] + granted["n2"] == 10, (granted, refused)
    assert refused["n1"] + refused["n2"] == 2 * attempts - 10
    used, _ = ledgers[0].used("alice")
    assert used == quota
    # a tenant name that is no plain key part (TOML allows any) has keys of its own
    odd = "alice/../bob twin"
    assert tenant_prefix(odd).startswith("/accelmig/v1/quota/~") and tenant_prefix(odd) != tenant_prefix("alice")
    ledgers[0].take(odd, MiB, quota)
    assert ledgers[1].used(odd)[0] == MiB and ledgers[1].used("alice")[0] == quota
    # node 1 dies: its reservations go with its lease, node 2's stay
    ledgers[0].store.revoke(ledgers[0].lease)
    assert ledgers[1].used("alice")[0] == granted["n2"] * MiB
    ledgers[1].reserve("alice", "after", granted["n1"] * MiB, quota)     # the freed bytes are usable
    with pytest.raises(QuotaExceeded, match="would use 10485760 of its 10485760-byte"):
        ledgers[1].reserve("alice", "one-too-many", 1, quota)
    ledgers[1].release("alice", "after")
    assert ledgers[1].used("alice")[0] == granted["n2"] * MiB


def test_what_a_hostile_store_holds_costs_bounded_memory_and_a_clear_error(etcd_server):
    store = store_of(etcd_server)
    raw = store.client
    good = {"name": "ok", "instance": "abcd1234", "data": "127.0.0.1:7070", "control": None,
            "devices": [{"name": "cpu", "global_mem_size": 1}], "sessions": 0}
    store.put(node_key("ok"), good)
    raw.put(NODES + "not-json", b"\xff{not json")
    raw.put(NODES + "a-list", b"[1, 2, 3]")
    store.put(node_key("other-name"), dict(good))                       # key and name disagree
    store.put(node_key("bad-endpoint"), dict(good, name="bad-endpoint", data="no port"))
    store.put(node_key("many-devices"), dict(good, name="many-devices", devices=[{}] * 65))
    store.put(node_key("bad-load"), dict(good, name="bad-load", sessions=True))
    assert set(live_nodes(store)) == {"ok"}
    # a reservation without a byte count counts as nothing, never as a crash
    raw.put(tenant_prefix("alice") + "x/evil", b'{"bytes": "lots"}')
    assert QuotaLedger(store, "n1").used("alice")[0] == 0
    # an answer past the bound (8 MiB) is refused before it is held: values of
    # 1 MiB each (etcd takes up to 1.5 MiB a request), 8 of them
    for i in range(8):
        raw.put(NODES + f"huge-{i}", b"x" * MiB)
    with pytest.raises(Unavailable, match="an answer of more than"):
        live_nodes(store)


def test_no_etcd_answering_is_a_clear_error_at_start(tmp_path):
    (tmp_path / "tokens.toml").write_text(tenants_toml(alice="alice-token-0001"))
    out = run_cli("accelmig-pool", "serve", "--listen", "127.0.0.1:0", "--control-listen", "",
                  "--admin-socket", "", "--insecure", "--tokens", tmp_path / "tokens.toml",
                  "--cluster", "etcd://127.0.0.1:1", "--device-isolation", "none", "--log-format", "text",
                  timeout=60)
    assert out.returncode == 2
    assert "cannot join the cluster at etcd://127.0.0.1:1" in out.stderr
    assert "no endpoint answered" in out.stderr


@pytest.mark.parametrize("value, reason", [
    ("http://127.0.0.1:2379", "write etcds://HOST:PORT for TLS to etcd, etcd://HOST:PORT for plain"),
    ("etcdx://127.0.0.1:2379", "cluster must be etcd://HOST:PORT"),
    ("etcd://", "cluster: ''"),
    ("etcd://127.0.0.1:99999", "cluster: '127.0.0.1:99999'"),
])
def test_a_bad_cluster_url_is_refused_before_anything_starts(tmp_path, value, reason):
    out = run_cli("accelmig-pool", "serve", "--insecure", "--cluster", value, "--tokens", tmp_path / "none")
    assert out.returncode == 2
    assert reason in out.stderr


def test_a_single_node_never_imports_the_etcd_client():
    code = ("import sys\n"
            "from accelmig.pool.config import PoolConfig\n"
            "import accelmig.pool.cli, accelmig.pool.listeners, accelmig.pool.state\n"
            "PoolConfig.load(None, {'insecure': True})\n"
            "assert 'etcd3gw' not in sys.modules and 'accelmig.pool.cluster.store' not in sys.modules\n"
            "PoolConfig.load(None, {'insecure': True, 'cluster': 'etcd://127.0.0.1:2379'})\n"
            "assert 'etcd3gw' not in sys.modules, 'checking the config imported the client'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def raw_open(endpoint: str, op: str = "open", **fields) -> dict:
    """hello + open (or another first frame) on a bare socket: the pool's
    first answer after welcome."""
    import socket as _socket

    from accelmig.wire.errors import AccelmigError

    from accelmig.agent.driver.link import read_answer
    from accelmig.wire.dataplane import parse_endpoint
    from accelmig.wire.frames import FrameReader, Limits, encode_frame
    sock = _socket.create_connection(parse_endpoint(endpoint), timeout=10)
    try:
        sock.sendall(encode_frame({"op": "hello", "versions": [1]})
                     + encode_frame({"op": op, **({"token": "alice-token-0001", "secret": "ab" * 16} if op == "open" else {}),
                                      **fields}))
        reader = FrameReader(Limits(max_header=65536, max_payload=0))
        welcome, rest = read_answer(sock, reader)
        assert welcome["op"] == "welcome"
        if rest:
            return rest[0].header
        try:
            return read_answer(sock, reader)[0]
        except AccelmigError as exc:        # an error frame: read_answer raises it
            return {"op": "error", "error": exc.to_wire()}
    finally:
        sock.close()


def test_an_open_at_any_node_is_placed_on_the_least_loaded_live_node_and_redirected_once(tmp_path, etcd_server):
    n1 = node(tmp_path, etcd_server, "n1")
    n2 = node(tmp_path, etcd_server, "n2")
    try:
        here = connect(n1.endpoint, "alice-token-0001", agent=False, timeout=10, auto_reconnect=False)
        assert here.endpoint == n1.endpoint                 # both idle: the node reached keeps it
        placed = connect(n1.endpoint, "alice-token-0001", agent=False, timeout=10, auto_reconnect=False)
        assert placed.endpoint == n2.endpoint               # n1 holds one, n2 none: placed on n2
        assert placed.pool_instance == n2.ready["instance"]
        entry = n1.wait_log(lambda e: "redirected to" in e["msg"])
        assert entry["node"] == "n2" and entry["instance"] == n2.ready["instance"]
        buf = placed.upload(b"computed where it was placed")
        assert placed.read(buf) == b"computed where it was placed"
        assert [e for e in n2.entries() if "redirected" in e["msg"]] == []   # placed once, never again
        here.close()
        placed.close()
    finally:
        n1.stop()
        n2.stop()


def test_a_placed_open_opens_only_at_the_node_and_instance_it_was_placed_on(tmp_path, etcd_server):
    n1 = node(tmp_path, etcd_server, "n1")
    try:
        stale = raw_open(n1.endpoint, placed={"node": "n1", "instance": "0000aaaa"})
        assert stale["op"] == "error" and stale["error"]["code"] == "UNAVAILABLE"
        assert "the node the session was placed on restarted" in stale["error"]["message"]
        elsewhere = raw_open(n1.endpoint, placed={"node": "n9", "instance": n1.ready["instance"]})
        assert elsewhere["error"]["code"] == "UNAVAILABLE" and "is not here" in elsewhere["error"]["message"]
        bad = raw_open(n1.endpoint, placed={"node": "n1/../x", "instance": "zz"})
        assert bad["error"]["code"] == "BAD_REQUEST"
        right = raw_open(n1.endpoint, placed={"node": "n1", "instance": n1.ready["instance"]})
        assert right["op"] == "opened"
        stranger = raw_open(n1.endpoint, token="not-a-tenant-token")
        assert stranger["error"]["code"] == "AUTH_FAILED"      # before any etcd read
    finally:
        n1.stop()


class FakePool:
    """A listener that answers every open with the redirects given, in turn:
    a hostile or broken node, seen from the driver."""

    def __init__(self, answers: list[dict]):
        import socket as _socket
        self.answers = list(answers)
        self.received: list[bytes] = []       # what each connection sent (hello and open)
        self.listener = _socket.create_server(("127.0.0.1", 0))
        self.endpoint = "127.0.0.1:%d" % self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        from accelmig.wire.frames import encode_frame
        while self.answers:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                self.received.append(conn.recv(65536))   # hello and open (small: one segment on loopback)
                conn.sendall(encode_frame({"op": "welcome", "version": 1, "instance": "feed", "challenge": "c"})
                             + encode_frame(self.answers.pop(0)))

    def close(self):
        self.listener.close()


@pytest.mark.parametrize("redirect, error", [
    ({"endpoint": "no port here", "node": "n2", "instance": "abcd"}, "BAD_REQUEST"),
    ({"endpoint": "127.0.0.1:1", "node": "n2/x", "instance": "abcd"}, "BAD_REQUEST"),
    ({"endpoint": "127.0.0.1:1", "node": "n2", "instance": "not hex"}, "BAD_REQUEST"),
    ({"endpoint": ["127.0.0.1:1"], "node": "n2", "instance": "abcd"}, "BAD_REQUEST"),
])
def test_the_driver_checks_a_redirect_before_it_dials_anything(redirect, error):
    from accelmig.wire.errors import AccelmigError
    fake = FakePool([{"op": "redirect", **redirect}])
    try:
        with pytest.raises(AccelmigError) as raised:
            connect(fake.endpoint, "alice-token-0001", agent=False, timeout=5, auto_reconnect=False)
        assert raised.value.code.value == error
    finally:
        fake.close()


def test_the_driver_follows_a_redirect_once_never_twice():
    from accelmig.wire.errors import ProtocolError
    second = FakePool([{"op": "redirect", "endpoint": "127.0.0.1:1", "node": "n3", "instance": "abcd"}])
    first = FakePool([{"op": "redirect", "endpoint": second.endpoint, "node": "n2", "instance": "abcd"}])
    try:
        with pytest.raises(ProtocolError, match="redirected again by " + second.endpoint):
            connect(first.endpoint, "alice-token-0001", agent=False, timeout=5, auto_reconnect=False)
    finally:
        first.close()
        second.close()


def test_an_open_sent_to_a_node_that_just_died_is_placed_again_without_it(tmp_path, etcd_server):
    """A node killed less than its lease's TTL ago is still listed live: the
    driver that cannot open there asks the node that placed it once more,
    which leaves that node out."""
    store = store_of(etcd_server)
    n1 = node(tmp_path, etcd_server, "n1", "--cluster-ttl", "60")
    n2 = node(tmp_path, etcd_server, "n2", "--cluster-ttl", "60")
    try:
        keeper = connect(n1.endpoint, "alice-token-0001", agent=False, timeout=10, auto_reconnect=False)
        n2.signal(signal.SIGKILL)
        n2.proc.wait(10)
        assert live_nodes(store)["n2"].instance == n2.ready["instance"]     # etcd still lists it
        dev = connect(n1.endpoint, "alice-token-0001", agent=False, timeout=10, auto_reconnect=False)
        assert dev.endpoint == n1.endpoint                                  # placed again: here
        assert dev.read(dev.upload(b"opened on the node that answered")) == b"opened on the node that answered"
        n1.wait_log(lambda e: "redirected to" in e["msg"] and e.get("node") == "n2")
        again = n1.wait_log(lambda e: "placed again without it" in e["msg"])
        assert again["node"] == "n2"
        dev.close()
        keeper.close()
    finally:
        n1.stop()
        n2.stop()


def test_an_unreachable_claim_is_checked_and_places_again_only_once():
    from accelmig.wire.errors import Unavailable
    dead = "127.0.0.1:1"                        # nothing listens: the dial is refused
    placer = FakePool([{"op": "redirect", "endpoint": dead, "node": "n2", "instance": "abcd"},
                       {"op": "redirect", "endpoint": dead, "node": "n3", "instance": "bcde"}])
    try:
        with pytest.raises(Unavailable):        # n2 unreachable, placed again on n3, unreachable too: stop
            connect(placer.endpoint, "alice-token-0001", agent=False, timeout=5, auto_reconnect=False)
        assert len(placer.received) == 2
        assert b'"unreachable"' not in placer.received[0]
        opened_again = placer.received[1].replace(b" ", b"")
        assert b'"unreachable":{"node":"n2","instance":"abcd"}' in opened_again
    finally:
        placer.close()


def test_a_malformed_unreachable_claim_is_refused(tmp_path, etcd_server):
    n1 = node(tmp_path, etcd_server, "n1")
    try:
        bad = raw_open(n1.endpoint, unreachable={"node": "n2", "instance": "not hex"})
        assert bad["error"]["code"] == "BAD_REQUEST" and "unreachable" in bad["error"]["message"]
        itself = raw_open(n1.endpoint, unreachable={"node": "n1", "instance": n1.ready["instance"]})
        assert itself["op"] == "opened"          # a claim about the node answering changes nothing
    finally:
        n1.stop()


def test_a_session_whose_node_died_is_lost_clearly_never_recreated_elsewhere(tmp_path, etcd_server):
    store = store_of(etcd_server)
    n1 = node(tmp_path, etcd_server, "n1")
    n2 = node(tmp_path, etcd_server, "n2")
    try:
        keeper = connect(n1.endpoint, "alice-token-0001", agent=False, timeout=10, auto_reconnect=False)
        dev = connect(n1.endpoint, "alice-token-0001", agent=False, timeout=10)      # reconnects on its own
        assert dev.endpoint == n2.endpoint
        buf = dev.upload(b"held in n2's device memory")
        dev.finish()
        # n2 live: a resume of its session at n1 is told where it lives, not that it is lost
        there = raw_open(n1.endpoint, "resume", sid=dev.sid, epoch=0, last_seen=0, proof="x")
        assert there["error"]["code"] == "UNAVAILABLE"
        assert f"it lives on node n2 at {n2.endpoint}" in there["error"]["message"]

        deletions = PrefixWatch(store, NODES)
        n2.signal(signal.SIGKILL)
        n2.proc.wait(10)
        deletions.wait_deleted(node_key("n2"))
        deletions.cancel()
        wait_for(lambda: dev.state is LinkState.FAILED, 30, "the driver to learn its session is lost")
        with pytest.raises(SessionLost, match="no live node of the pool is instance " + n2.ready["instance"]):
            dev.read(buf)
        listing = run_cli("accelmig-pool", "sessions", "--admin-socket", n1.tokens.parent / "pool.sock", "--json")
        sids = [row["sid"] for row in json.loads(listing.stdout)["sessions"]]
        assert sids == [keeper.sid]               # nothing re-created on n1: only its own session
        keeper.close()
    finally:
        n1.stop()
        n2.stop()


def test_an_etcd_restart_loses_no_node_and_placement_goes_on(tmp_path, etcd_server):
    n1 = node(tmp_path, etcd_server, "n1")
    n2 = node(tmp_path, etcd_server, "n2")
    try:
        before = live_nodes(store_of(etcd_server))
        etcd_server.restart()                           # same data, same ports
        after = live_nodes(store_of(etcd_server))
        assert {n: v.instance for n, v in after.items()} == {n: v.instance for n, v in before.items()}
        keeper = connect(n1.endpoint, "alice-token-0001", agent=False, timeout=10, auto_reconnect=False)
        placed = connect(n1.endpoint, "alice-token-0001", agent=False, timeout=10, auto_reconnect=False)
        assert {keeper.endpoint, placed.endpoint} == {n1.endpoint, n2.endpoint}
        keeper.close()
        placed.close()
    finally:
        n1.stop()
        n2.stop()


def test_a_node_whose_lease_etcd_expired_registers_again_as_the_same_instance(tmp_path, etcd_server):
    """What a node cut off from etcd past its TTL finds when it comes back:
    its lease gone (revoked here, as etcd's expiry would), its key with it."""
    store = store_of(etcd_server)
    pool = node(tmp_path, etcd_server, "n1")
    try:
        first = live_nodes(store)["n1"]
        store.revoke(first.lease)
        pool.wait_log(lambda e: "etcd expired its lease" in e["msg"])
        pool.wait_log(lambda e: e["msg"].startswith("node n1 (instance"))
        again = live_nodes(store)["n1"]
        assert again.instance == first.instance == pool.ready["instance"]    # the process did not restart
        assert again.lease != first.lease and store.keepalive(again.lease) > 0
    finally:
        pool.stop()


def test_a_tenants_device_memory_quota_holds_across_two_pool_nodes(tmp_path, etcd_server):
    """alice's quota is 64 MiB for the whole pool, not per node."""
    store = store_of(etcd_server)
    n1 = node(tmp_path, etcd_server, "n1")
    n2 = node(tmp_path, etcd_server, "n2")
    held = tenant_prefix("alice")
    try:
        on_n1 = connect(n1.endpoint, "alice-token-0001", agent=False, timeout=10, auto_reconnect=False)
        on_n2 = connect(n1.endpoint, "alice-token-0001", agent=False, timeout=10, auto_reconnect=False)
        assert (on_n1.endpoint, on_n2.endpoint) == (n1.endpoint, n2.endpoint)
        first = on_n1.alloc(40 * MiB)
        on_n1.finish()
        on_n2.alloc(30 * MiB)        # 70 MiB > 64 MiB, on two nodes: refused pool-wide
        with pytest.raises(QuotaExceeded, match="would use 41943040 of its 67108864-byte") as refused:
            on_n2.finish()
        assert refused.value.details.get("pool_wide") is True
        puts = PrefixWatch(store, held)
        first.free()
        on_n1.finish()
        puts.wait(lambda kind, key, value: key == held + "n1/held" and value == {"bytes": 0})
        puts.cancel()
        on_n2.alloc(30 * MiB)        # given back on n1: now it fits
        on_n2.finish()
        assert QuotaLedger(store, "reader").used("alice")[0] == 30 * MiB
        # n2 dies: its bytes leave the ledger with its lease
        gone = PrefixWatch(store, held)
        n2.signal(signal.SIGKILL)
        n2.proc.wait(10)
        gone.wait_deleted(held + "n2/held")
        gone.cancel()
        assert QuotaLedger(store, "reader").used("alice")[0] == 0
        on_n1.alloc(60 * MiB)
        on_n1.finish()
        on_n1.close()
    finally:
        n1.stop()
        n2.stop()


def test_an_open_asking_for_a_device_only_another_node_has_is_placed_there(tmp_path, etcd_server):
    """Two nodes with different devices (PoCL's pthread on one, basic on the
    other): a selector only n2's device fits is redirected to n2 and lands on
    that device; one that no node fits names every node's devices."""
    n1 = node(tmp_path, etcd_server, "n1", env={"POCL_DEVICES": "pthread"})
    n2 = node(tmp_path, etcd_server, "n2", env={"POCL_DEVICES": "basic"})
    try:
        registered = {v.name: v for v in live_nodes(store_of(etcd_server)).values()}
        basic = registered["n2"].devices[0]
        assert basic["name"].startswith("basic") and registered["n1"].devices[0]["id"] != basic["id"]
        dev = connect(n1.endpoint, "alice-token-0001", agent=False, timeout=10, auto_reconnect=False,
                      device=basic["id"])
        assert dev.endpoint == n2.endpoint and dev.info()["id"] == basic["id"]
        buf = dev.upload(b"on the device it asked for")
        assert dev.read(buf) == b"on the device it asked for"
        dev.close()
        answer = raw_open(n1.endpoint, device="name=no-such-device")
        assert answer["op"] == "error" and answer["error"]["code"] == "NO_SUCH_DEVICE", answer
        assert "node n1:" in answer["error"]["message"] and "node n2:" in answer["error"]["message"]
        assert basic["id"] in answer["error"]["message"]
    finally:
        n1.stop()
        n2.stop()
