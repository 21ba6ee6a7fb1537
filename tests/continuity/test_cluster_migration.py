"""A migration whose VM holds sessions on two pool nodes, without a VM: a
real etcd, two real ``accelmig-pool serve --cluster`` processes (PoCL's
two devices, ``POCL_DEVICES="pthread basic"``), real drivers with sessions
on both nodes (one of them placed there by a redirect), and hostd's own
routing (``PoolNodes``: the coordinator, a client per node, per-session
calls to their node, the union of every node's tickets) under hostd's
migration steps (``MigrationSteps``).  Each host's guest is the drivers
themselves: what the agent does with a rehome is ``resume(endpoint, ticket)``.

Hosts here register no networks: their guests' sessions are bound by
attestation alone (``bind_sessions`` with each session's proof, as for a Nova instance) and a ticket
moves a session whatever address it resumes from, so both "hosts" may share
loopback."""

from __future__ import annotations

import asyncio
import signal
import types
import uuid

import pytest

pytest.importorskip("etcd3gw", reason="the cluster extra (pip install 'accelmig[cluster]')")

from accelmig.agent.driver import connect  # noqa: E402
from accelmig.plugin.hostd.migration import MigrationSteps  # noqa: E402
from accelmig.plugin.hostd.nodes import PoolNodes  # noqa: E402
from accelmig.pool.cluster.records import EtcdRecords  # noqa: E402
from accelmig.pool.cluster.registry import NODES, live_nodes, node_key  # noqa: E402
from accelmig.pool.cluster.store import ClusterStore  # noqa: E402
from accelmig.wire.control import AsyncControlClient  # noqa: E402
from accelmig.wire.errors import Conflict, RecordState, SessionLost  # noqa: E402
from accelmig.wire.records import RecordStateName as S  # noqa: E402
from tests.pool.test_cluster import PrefixWatch  # noqa: E402
from tests.support.attest import bind_async
from tests.support.etcd import etcd_server  # noqa: E402,F401  (the fixture)
from tests.support.processes import PoolProcess, hosts_toml, tenants_toml  # noqa: E402
from tests.support.twohosts import SECRETS  # noqa: E402
from tests.support.wait import wait_for  # noqa: E402

TOKEN = "alice-token-0001"


@pytest.fixture
def two_nodes(tmp_path, etcd_server, request):
    """n1 and n2 of one pool on etcd, both knowing hostA and hostB (more
    options for both: the test's ``pool_options`` mark)."""
    mark = request.node.get_closest_marker("pool_options")
    store = ClusterStore([("127.0.0.1", etcd_server.client_port)])
    nodes = {}
    try:
        for name in ("n1", "n2"):
            directory = tmp_path / name
            directory.mkdir()
            nodes[name] = PoolProcess(directory, tenants_toml(alice=TOKEN), hosts_toml(**SECRETS), extra=(
                "--cluster", etcd_server.url, "--node-name", name, "--cluster-ttl", "2",
                "--device-isolation", "none", *(mark.args if mark else ())), env={"POCL_DEVICES": "pthread basic"})
        yield store, nodes
    finally:
        for pool in nodes.values():
            pool.stop()


def load_is(store, **loads):
    return lambda: all(getattr(live_nodes(store).get(n), "sessions", None) == k for n, k in loads.items())


def open_sessions(store, nodes):
    """Four sessions, two per node: one opened at each node directly, one
    more at n1 (a tie: kept), and one at n1 placed on n2 (redirected)."""
    n1, n2 = nodes["n1"].endpoint, nodes["n2"].endpoint
    devs = [connect(n1, TOKEN, agent=False, timeout=10, auto_reconnect=False, device="name=pthread")]
    devs.append(connect(n2, TOKEN, agent=False, timeout=10, auto_reconnect=False, device="name=basic"))
    wait_for(load_is(store, n1=1, n2=1), 20, "etcd showing one session on each node")
    devs.append(connect(n1, TOKEN, agent=False, timeout=10, auto_reconnect=False, device="name=basic"))
    wait_for(load_is(store, n1=2, n2=1), 20, "etcd showing n1's second session")
    devs.append(connect(n1, TOKEN, agent=False, timeout=10, auto_reconnect=False))
    assert [d.endpoint for d in devs] == [n1, n2, n1, n2]     # the last one redirected to n2
    return devs


def fill(devs):
    """Each session's device memory: 64 KiB of its own bytes (sent once)."""
    data = [bytes((i * 7 + j) % 251 for j in range(64 << 10)) for i in range(len(devs))]
    bufs = [dev.upload(blob) for dev, blob in zip(devs, data)]
    for dev in devs:
        dev.finish()
    return data, bufs


def hostd(nodes, host: str):
    """hostd's routing and steps for ``host``, its coordinator n1."""
    coordinator = AsyncControlClient(nodes["n1"].control_endpoint, host, SECRETS[host].encode())
    routing = PoolNodes(coordinator, lambda endpoint: AsyncControlClient(endpoint, host, SECRETS[host].encode()))
    steps = MigrationSteps(types.SimpleNamespace(pool_call=routing.call, pool_call_all=routing.call_all),
                           retry_first=1, retry_max=1)
    return routing, steps


async def attest(routing, domain, devs):
    """What hostd does with the proofs the guest's drivers give: each
    session bound at its own node."""
    for dev in devs:
        assert (await bind_async(await routing.node_for_sid(dev.sid), dev, domain))["bound"] == [dev.sid]


async def opened_and_switched_over(a, b, domain, devs) -> str:
    """hostA's and hostB's hostd list the nodes; ``devs`` attested to
    ``domain`` on hostA, its migration to hostB opened and switched over:
    the migration's id."""
    for routing, _ in (a, b):
        await routing.refresh()
    await attest(a[0], domain, devs)
    mid = (await b[1].pool("open_migration", domain_uuid=domain))["migration_id"]
    await a[1].pool("switchover", domain_uuid=domain, migration_id=mid)
    return mid


async def migrate(src, dst, domain, devs, coordinator_endpoint, *, between=None):
    """open (destination), switchover (source), complete (destination),
    each driver resumed with its ticket at the destination's coordinator,
    close (source): what hostd's steps and the agent do."""
    (_, src_steps), (_, dst_steps) = src, dst
    record = await dst_steps.pool("open_migration", domain_uuid=domain)
    mid = record["migration_id"]
    assert record["cluster"]["nodes"].keys() == {"n1", "n2"}
    await src_steps.pool("switchover", domain_uuid=domain, migration_id=mid)
    if between is not None:
        await asyncio.to_thread(between)
    done = await dst_steps.pool_all("complete", domain_uuid=domain, migration_id=mid)
    tickets = done["tickets"]
    assert sorted(tickets) == sorted(d.sid for d in devs)        # the union of both nodes' tickets
    outcomes = [await asyncio.to_thread(dev.resume, coordinator_endpoint, tickets[dev.sid]) for dev in devs]
    await src_steps.pool("close", domain_uuid=domain, migration_id=mid)
    return mid, outcomes


def test_a_migration_there_and_back_rehomes_every_session_on_its_own_node(two_nodes, etcd_server):
    store, nodes = two_nodes
    devs = open_sessions(store, nodes)
    home = {dev.sid: dev.endpoint for dev in devs}
    placed = {dev.sid: (dev.device_id, dev.info()["name"]) for dev in devs}
    assert placed[devs[0].sid][1] != placed[devs[1].sid][1]      # PoCL's two devices, one per selector
    try:
        data, bufs = fill(devs)
        domain = str(uuid.uuid4())

        async def scenario():
            a, b = hostd(nodes, "hostA"), hostd(nodes, "hostB")
            try:
                for routing, _ in (a, b):
                    assert await routing.refresh() is True and set(routing.nodes) == {"n2"}
                await attest(a[0], domain, devs)
                listed = await a[0].call_all("list_sessions", domain_uuid=domain)   # (what reconciliation reads)
                assert sorted(s["sid"] for s in listed["sessions"]) == sorted(d.sid for d in devs)
                # A -> B, etcd restarted between the switchover and the completion
                there, outcomes = await migrate(a, b, domain, devs, nodes["n1"].endpoint,
                                                between=etcd_server.restart)
                for dev, outcome in zip(devs, outcomes):
                    assert dev.endpoint == home[dev.sid]            # resumed on its own node
                    assert outcome["ticket"] and outcome["resent"] == 0
                # what ``accelmig migrate`` waits on: every node's sessions resumed
                waited = await b[0].call_within(15, "wait_record", domain_uuid=domain, migration_id=there,
                                                until="rehomed", timeout=10)
                assert waited["reached"] and waited["record"]["session_count"] == 4
                assert waited["record"]["resumed_count"] == 4 and waited["record"]["rehomed"] is True
                # B -> A
                back, outcomes = await migrate(b, a, domain, devs, nodes["n1"].endpoint)
                for dev, outcome in zip(devs, outcomes):
                    assert dev.endpoint == home[dev.sid] and outcome["resent"] == 0
                return there, back
            finally:
                for routing, _ in (a, b):
                    await routing.close()
                    await routing.coordinator.close()

        there, back = asyncio.run(scenario())
        # bit-identical: each session's device memory as it was, on its own device
        for dev, blob, buf in zip(devs, data, bufs):
            assert dev.read(buf, len(blob)) == blob
        assert {d.sid: (d.device_id, d.info()["name"]) for d in devs} == placed     # never re-placed
        # etcd holds both migrations, closed, a part per node each; no ticket there
        ledger = EtcdRecords(store, "n1")
        for mid in (there, back):
            stored = ledger.read(domain, mid)
            assert stored.state is S.CLOSED and set(stored.parts) == {"n1", "n2"} and stored.lost == ()
            assert {p.state for p in stored.parts.values()} == {S.CLOSED}
        assert "v1." not in repr(store.range("/accelmig/v1/records/")[0])
    finally:
        for dev in devs:
            dev.close()


def test_an_abort_releases_both_nodes_parts_and_the_sessions_go_on_at_the_source(two_nodes):
    store, nodes = two_nodes
    devs = open_sessions(store, nodes)
    try:
        data, bufs = fill(devs)
        domain = str(uuid.uuid4())

        async def scenario():
            a, b = hostd(nodes, "hostA"), hostd(nodes, "hostB")
            try:
                mid = await opened_and_switched_over(a, b, domain, devs)
                watch = types.SimpleNamespace(name="vm", uuid=domain,
                                              record=types.SimpleNamespace(migration_id=mid))
                await a[1].abort(watch, "the migration failed; the guest resumed on the source")
                # a saved domain: every node parks its own sessions of it
                parked = await a[0].call("park", domain_uuid=domain, retention=60)
                assert len(parked["parked"]) == 2
                listed = await a[0].call_all("list_sessions", domain_uuid=domain)
                assert [s["parked"] for s in listed["sessions"]] == [True] * 4
                await a[0].call("unpark", domain_uuid=domain)
                listed = await a[0].call_all("list_sessions", domain_uuid=domain)
                assert [s["parked"] for s in listed["sessions"]] == [False] * 4
                # every node's record is aborted: neither completes it
                for name in ("n1", "n2"):
                    client = AsyncControlClient(nodes[name].control_endpoint, "hostB", SECRETS["hostB"].encode())
                    try:
                        with pytest.raises(RecordState):
                            await client.call("complete", domain_uuid=domain, migration_id=mid)
                        listed = await client.call("list_records", domain_uuid=domain)
                        assert [r["state"] for r in listed["records"]] == ["aborted"]
                    finally:
                        await client.close()
                return mid
            finally:
                for routing, _ in (a, b):
                    await routing.close()
                    await routing.coordinator.close()

        mid = asyncio.run(scenario())
        stored = EtcdRecords(store, "n1").read(domain, mid)
        assert stored.state is S.ABORTED and set(stored.parts) == {"n1", "n2"}
        assert {p.state for p in stored.parts.values()} == {S.ABORTED}
        assert "the guest resumed on the source" in stored.abort_reason
        # the sessions never stopped: still on their nodes, memory as it was
        for dev, blob, buf in zip(devs, data, bufs):
            assert dev.read(buf, len(blob)) == blob
    finally:
        for dev in devs:
            dev.close()


def test_a_node_killed_mid_migration_loses_its_sessions_the_other_nodes_resume(two_nodes):
    store, nodes = two_nodes
    devs = open_sessions(store, nodes)
    on_n1 = [d for d in devs if d.endpoint == nodes["n1"].endpoint]
    on_n2 = [d for d in devs if d.endpoint == nodes["n2"].endpoint]
    try:
        data, bufs = fill(devs)
        domain = str(uuid.uuid4())

        async def scenario():
            a, b = hostd(nodes, "hostA"), hostd(nodes, "hostB")
            try:
                mid = await opened_and_switched_over(a, b, domain, devs)
                gone = PrefixWatch(store, NODES)
                nodes["n2"].signal(signal.SIGKILL)            # no deregistration: its lease runs out
                nodes["n2"].proc.wait(10)
                gone.wait_deleted(node_key("n2"))
                gone.cancel()
                done = await b[1].pool_all("complete", domain_uuid=domain, migration_id=mid)
                assert sorted(done["tickets"]) == sorted(d.sid for d in on_n1)     # n1's only
                assert done["cluster"]["lost"] == ["n2"]          # etcd says whose sessions are gone
                assert "n2" not in b[0].nodes                    # hostd learned it left
                return mid, done["tickets"]
            finally:
                for routing, _ in (a, b):
                    await routing.close()
                    await routing.coordinator.close()

        mid, tickets = asyncio.run(scenario())
        for dev in on_n1:
            assert dev.resume(nodes["n1"].endpoint, tickets[dev.sid])["resent"] == 0
        for dev, blob, buf in zip(devs, data, bufs):
            if dev in on_n1:
                assert dev.read(buf, len(blob)) == blob
        for dev in on_n2:           # reported lost, never re-created on n1
            with pytest.raises(SessionLost, match="no live node of the pool is instance"):
                dev.resume(nodes["n1"].endpoint)
        stored = EtcdRecords(store, "n1").read(domain, mid)
        assert stored.state is S.COMPLETED and stored.lost == ("n2",) and set(stored.parts) == {"n1"}
    finally:
        for dev in devs:
            dev.close()


def test_a_node_catches_up_from_etcd_and_refuses_a_step_etcds_record_did_not_take(two_nodes):
    store, nodes = two_nodes
    devs = open_sessions(store, nodes)
    on_n1 = sorted(d.sid for d in devs if d.endpoint == nodes["n1"].endpoint)
    on_n2 = sorted(d.sid for d in devs if d.endpoint == nodes["n2"].endpoint)
    domain, other = str(uuid.uuid4()), str(uuid.uuid4())

    async def scenario():
        a, b = hostd(nodes, "hostA"), hostd(nodes, "hostB")
        n2 = AsyncControlClient(nodes["n2"].control_endpoint, "hostB", SECRETS["hostB"].encode())
        try:
            for routing, _ in (a, b):
                await routing.refresh()
            await attest(a[0], domain, devs)
            # the open and the switchover reach the coordinator only (n2 was out of reach)
            mid = (await b[0].coordinator.call("open_migration", domain_uuid=domain))["migration_id"]
            assert (await n2.call("list_records", domain_uuid=domain))["records"] == []
            # a source whose coordinator is n2 switches over without naming the migration
            # (as hostd does): n2 takes the domain's open record from etcd
            n2_source = AsyncControlClient(nodes["n2"].control_endpoint, "hostA", SECRETS["hostA"].encode())
            try:
                switched = await n2_source.call("switchover", domain_uuid=domain)
            finally:
                await n2_source.close()
            assert switched["migration_id"] == mid and switched["state"] == "switched_over"
            assert switched["cluster"]["state"] == "switched_over"
            # n1 missed the switchover: its record is still open until its next call follows etcd's
            listed = (await b[0].coordinator.call("list_records", domain_uuid=domain))["records"]
            assert [r["state"] for r in listed] == ["open"]
            done = await b[0].coordinator.call_all("complete", domain_uuid=domain, migration_id=mid)
            assert done["record"]["state"] == "completed" and "switchover" in done["record"]["times"]
            assert sorted(done["tickets"]) == on_n1                     # each node mints its own
            done = await n2.call_all("complete", domain_uuid=domain, migration_id=mid)
            assert sorted(done["tickets"]) == on_n2
            # etcd's record aborted by another node alone (its lease ran out there): n2 refuses
            # to complete, and its own record follows to aborted
            mid2 = (await b[0].coordinator.call("open_migration", domain_uuid=other))["migration_id"]
            # another host cannot open that migration under the same id at a node that has
            # not heard of it yet: etcd says where it goes
            c = AsyncControlClient(nodes["n2"].control_endpoint, "hostA", SECRETS["hostA"].encode())
            try:
                with pytest.raises(Conflict, match="goes to host hostB"):
                    await c.call("open_migration", domain_uuid=other, migration_id=mid2)
            finally:
                await c.close()
            await asyncio.to_thread(EtcdRecords(store, "n1").advance, other, mid2, "abort",
                                    abort_reason="lease expired at n1")
            with pytest.raises(RecordState, match="aborted"):
                await n2.call("complete", domain_uuid=other, migration_id=mid2)
            listed = (await n2.call("list_records", domain_uuid=other))["records"]
            assert [r["state"] for r in listed] == ["aborted"] and "lease expired at n1" in listed[0]["abort_reason"]
        finally:
            await n2.close()
            for routing, _ in (a, b):
                await routing.close()
                await routing.coordinator.close()

    try:
        asyncio.run(scenario())
    finally:
        for dev in devs:
            dev.close()


def test_hostd_with_a_single_node_talks_to_it_alone(tmp_path):
    """No etcd: ``list_nodes`` says so, and every call goes to the one node."""
    pool = PoolProcess(tmp_path, tenants_toml(alice=TOKEN), hosts_toml(**SECRETS),
                       extra=("--device-isolation", "none"))
    try:
        async def scenario():
            routing, _ = hostd({"n1": pool}, "hostA")
            try:
                assert await routing.refresh() is False
                assert not routing.clustered and routing.nodes == {} and routing.clients() == []
                assert (await routing.call("list_nodes"))["cluster"] is False
            finally:
                await routing.close()
                await routing.coordinator.close()
        asyncio.run(scenario())
    finally:
        pool.stop()


@pytest.mark.pool_options("--lease-ttl", "1")
def test_a_record_no_host_renews_is_aborted_on_every_node_and_in_etcd(two_nodes):
    store, nodes = two_nodes
    domain = str(uuid.uuid4())
    aborted = PrefixWatch(store, "/accelmig/v1/records/")

    async def scenario():
        b = hostd(nodes, "hostB")
        try:
            await b[0].refresh()
            return (await b[1].pool("open_migration", domain_uuid=domain))["migration_id"]
        finally:
            await b[0].close()
            await b[0].coordinator.close()

    mid = asyncio.run(scenario())                  # and nobody renews it
    aborted.wait(lambda kind, key, value: key.endswith(f"/{mid}") and value and value["state"] == "aborted",
                 what="the record aborted in etcd")
    aborted.cancel()
    stored = EtcdRecords(store, "n1").read(domain, mid)
    assert stored.state is S.ABORTED and "lease expired" in stored.abort_reason
    assert {p.state for p in stored.parts.values()} == {S.ABORTED} and set(stored.parts) == {"n1", "n2"}
    for name in ("n1", "n2"):
        client = nodes[name]
        wait_for(lambda: _local_state(client, domain) == "aborted", 20, f"node {name}'s record aborted")


def _local_state(pool, domain):
    from accelmig.wire.control import ControlClient
    client = ControlClient(pool.control_endpoint, "hostB", SECRETS["hostB"].encode())
    try:
        records = client.call("list_records", domain_uuid=domain)["records"]
    finally:
        client.close()
    return records[0]["state"] if records else None


def test_hostd_learns_the_domains_holding_sessions_on_every_node(two_nodes):
    """A Nova instance carries nothing of accelmig: hostd learns it from the
    pool's ``accel_domains``, which in a cluster is every node's, united."""
    store, nodes = two_nodes
    n1, n2 = nodes["n1"].endpoint, nodes["n2"].endpoint
    only_n2 = "7c1f0d7e-0000-4000-8000-00000000000a"          # all its sessions on n2, not the coordinator
    both = "7c1f0d7e-0000-4000-8000-00000000000b"
    devs = [connect(n2, TOKEN, agent=False, timeout=10, auto_reconnect=False, domain=only_n2),
            connect(n1, TOKEN, agent=False, timeout=10, auto_reconnect=False, domain=both)]
    wait_for(load_is(store, n1=1, n2=1), 20, "etcd showing one session on each node")   # a tie: kept where opened
    devs.append(connect(n2, TOKEN, agent=False, timeout=10, auto_reconnect=False, domain=both))
    assert [d.endpoint for d in devs] == [n2, n1, n2]
    routing, _ = hostd(nodes, "hostA")

    async def scenario():
        await routing.refresh()
        first = await routing.call_all("accel_domains")
        again = await routing.call_all("accel_domains", since=first["version"])
        await asyncio.to_thread(devs[2].close)                 # n2's picture changes
        changed = await routing.call_all("accel_domains", since=first["version"])
        return first, again, changed
    try:
        first, again, changed = asyncio.run(scenario())
        # each domain and how many of its sessions wait to be attested, never their ids
        assert first["domains"] == {only_n2: 1, both: 2}
        assert again == {"version": first["version"], "unchanged": True}     # nothing new: a few bytes
        assert changed["version"] != first["version"]
        assert changed["domains"] == {only_n2: 1, both: 1}
    finally:
        for dev in devs:
            dev.close()


def test_hostd_registers_at_every_node_its_coordinator_lists(two_nodes, tmp_path):
    """The real ``HostDaemon`` (libvirt's test driver): its registration
    round lists the nodes at its ``[pool] control`` and registers there and
    at each other node, which attributes this host's guests' connections."""
    from accelmig.wire.control import ControlClient
    from tests.support.hostd import HostdThread, write_host_config
    _, nodes = two_nodes
    config = write_host_config(tmp_path / "hostA", control=nodes["n1"].control_endpoint, secret=SECRETS["hostA"])
    hostd_thread = HostdThread(str(config)).start()
    try:
        wait_for(lambda: set(hostd_thread.daemon.nodes.nodes) == {"n2"}, 20, "hostd listing n2")

        def registered(name):
            client = ControlClient(nodes[name].control_endpoint, "hostA", SECRETS["hostA"].encode())
            try:
                return {h["host"]: h["registered_at"] for h in client.call("list_hosts")["hosts"]}.get("hostA")
            finally:
                client.close()
        wait_for(lambda: registered("n1") and registered("n2"), 20, "hostA registered at both nodes")
    finally:
        hostd_thread.stop()


def test_a_cluster_nodes_steps_answer_hostile_arguments_clearly_and_write_nothing(two_nodes):
    from accelmig.wire.control import ControlClient
    from accelmig.wire.errors import AccelmigError, ErrorCode
    store, nodes = two_nodes
    client = ControlClient(nodes["n2"].control_endpoint, "hostB", SECRETS["hostB"].encode())
    hostile = [{"domain_uuid": 7}, {"domain_uuid": "d", "migration_id": ["x"]}, {"domain_uuid": "d", "bogus": 1},
               {"domain_uuid": "x" * 300}, {"domain_uuid": "d", "postcopy": "yes"}, {},
               {"domain_uuid": "d", "reason": {"a": 1}}, {"domain_uuid": "d", "migration_id": "../../nodes/n1"}]
    try:
        for method in ("open_migration", "switchover", "commit", "complete", "close", "abort", "list_nodes"):
            for args in hostile:
                try:
                    client.call(method, **args)
                except AccelmigError as exc:
                    assert exc.code in (ErrorCode.BAD_REQUEST, ErrorCode.NO_SUCH_RECORD, ErrorCode.FORBIDDEN,
                                        ErrorCode.CONFLICT, ErrorCode.RECORD_STATE), (method, args, exc)
        # the one open that checked (domain "d", id "../../nodes/n1") has keys of its own; nodes untouched
        assert set(live_nodes(store)) == {"n1", "n2"}
        kvs, _ = store.range("/accelmig/v1/records/")
        assert all(key.startswith("/accelmig/v1/records/d/") for key, _, _ in kvs)
    finally:
        client.close()


def test_the_guest_agent_rehomes_every_session_to_its_own_node_from_one_rehome(two_nodes, tmp_path):
    """The whole delivery: hostd's ``ChannelDelivery`` hands the real
    guest agent one rehome (the destination's identity, naming its
    coordinator, and the union of both nodes' tickets); the agent tells each
    registered driver to resume, and each does so on its own node."""
    import threading
    from accelmig.agent.daemon import Agent
    from accelmig.plugin.hostd.delivery import ChannelDelivery
    store, nodes = two_nodes
    agent = Agent(str(tmp_path / "channel.sock"), str(tmp_path / "agent.sock"), state_dir=str(tmp_path / "state"),
                  rehome_timeout=15)
    agent.open()
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    n1, n2 = nodes["n1"].endpoint, nodes["n2"].endpoint
    devs = []
    try:
        devs.append(connect(n1, TOKEN, agent=agent.socket_path, timeout=15))
        devs.append(connect(n2, TOKEN, agent=agent.socket_path, timeout=15))
        wait_for(lambda: len(agent.sessions()) == 2, what="both drivers registered with the agent")
        data, bufs = fill(devs)
        domain = str(uuid.uuid4())

        async def scenario():
            a, b = hostd(nodes, "hostA"), hostd(nodes, "hostB")
            delivery = ChannelDelivery(inspect=_nothing, on_event=lambda w, m: None, timeout=15)
            watch = types.SimpleNamespace(name="vm", uuid=domain, channel_path=str(tmp_path / "channel.sock"))
            try:
                mid = await opened_and_switched_over(a, b, domain, devs)
                done = await b[1].pool_all("complete", domain_uuid=domain, migration_id=mid)
                identity = {"host_id": "hostB", "pool_endpoint": n1}       # hostB's view: its coordinator
                return await delivery.rehome(None, watch, {"migration_id": mid, "identity": identity,
                                                           "tickets": done["tickets"]})
            finally:
                await delivery.close(watch)
                for routing, _ in (a, b):
                    await routing.close()
                    await routing.coordinator.close()

        outcome = asyncio.run(scenario())
        assert outcome["ok"] and outcome["resumed_count"] == 2, outcome
        assert [d.endpoint for d in devs] == [n1, n2]
        for dev, blob, buf in zip(devs, data, bufs):
            assert dev.read(buf, len(blob)) == blob
    finally:
        for dev in devs:
            dev.close()
        agent.stop()
        thread.join(5)


async def _nothing(dom, watch):
    return None


def test_the_domains_token_vouches_on_every_node_and_no_source_need_switch_over(two_nodes):
    """The domain's sessions on both nodes, its host's token registered at
    each: the destination's open with it is vouched for on every node (and
    in etcd), so the destination completes both nodes' parts though the
    source's hostd never switched over (it died); a made-up token vouches
    for nothing anywhere."""
    from accelmig.wire import attestation as att
    store, nodes = two_nodes
    devs = open_sessions(store, nodes)
    domain = str(uuid.uuid4())

    async def scenario():
        a, b = hostd(nodes, "hostA"), hostd(nodes, "hostB")
        try:
            for routing, _ in (a, b):
                await routing.refresh()
            await attest(a[0], domain, devs)
            token = att.new_token()
            states = [(await client.call("register_token", domain_uuid=domain,
                                         digest=att.token_digest(token)))["state"] for client in a[0].every()]
            assert states == ["fresh", "fresh"]
            made_up = await b[1].pool("open_migration", domain_uuid=domain, token=att.new_token())
            assert not made_up["vouched"]
            await b[1].pool("abort", domain_uuid=domain, migration_id=made_up["migration_id"])
            record = await b[1].pool("open_migration", domain_uuid=domain, token=token)
            assert record["vouched"]
            stored = await asyncio.to_thread(EtcdRecords(store, "n1").read, domain, record["migration_id"])
            assert stored.vouched
            done = await b[1].pool_all("complete", domain_uuid=domain, migration_id=record["migration_id"])
            assert sorted(done["tickets"]) == sorted(d.sid for d in devs)     # both nodes' parts
        finally:
            for routing, _ in (a, b):
                await routing.close()
                await routing.coordinator.close()
    try:
        asyncio.run(scenario())
    finally:
        for dev in devs:
            dev.close()
