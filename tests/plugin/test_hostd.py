"""hostd's event handling and reconciliation against libvirt's in-process
test:///default driver (real libvirt events and domain states; it has no
migration, so migrations are in tests/e2e), and a real pool."""

from __future__ import annotations

import asyncio
import os
import uuid as uuid_module
from pathlib import Path

import libvirt
import pytest

from accelmig.agent.driver import connect
from accelmig.lab.poolthread import PoolThread
from accelmig.wire import attestation as att
from accelmig.wire.control import ControlClient
from accelmig.wire.errors import Unavailable
from accelmig.wire.localapi import LocalClient
from tests.conftest import ALICE, TENANTS, run_cli
from tests.support.attest import bind
from tests.support.hostd import SECRET, HostdThread, write_config
from tests.support.wait import wait_for

GOLDEN = Path(__file__).parent / "golden" / "rewrite"
SECRET_B = "hostB-secret-9876543210"


def accel_domain_xml(name: str, uuid: str, channel: str | None = None, token: str | None = None) -> str:
    """A test-driver domain carrying accelmig's metadata (test:///default runs
    no QEMU: a ``channel`` path is a unix socket the test's own agent serves)
    and, with ``token``, the migration token its former host wrote into it."""
    devices = (f"<devices><channel type='unix'><source mode='bind' path='{channel}'/>"
               f"<target type='virtio' name='org.accelmig.agent.0'/></channel></devices>") if channel else ""
    vouch = (f'<accelmig-migration:token xmlns:accelmig-migration="{att.MIGRATION_NS}" value="{token}"/>'
             if token else "")
    return f"""<domain type='test'>
  <name>{name}</name><uuid>{uuid}</uuid><memory>65536</memory><vcpu>1</vcpu>
  <metadata><accelmig:domain xmlns:accelmig="http://accelmig.dev/xmlns/domain/1">
    <accelmig:interfaces owner="accelmig"/></accelmig:domain>{vouch}</metadata>
  <os><type arch='x86_64'>hvm</type></os>
  {devices}
</domain>"""


@pytest.fixture
def world(tmp_path):
    hosts = {"hostA": (SECRET, ["127.0.0.0/8"]), "hostB": (SECRET_B, ["::1/128"])}
    with PoolThread(TENANTS, hosts, listen="127.0.0.1:0,[::1]:0") as pool:
        config = write_config(tmp_path, pool)
        conn = libvirt.open("test:///default")
        created = []
        try:
            yield pool, config, conn, created
        finally:
            for dom in created:
                try:
                    dom.destroy()
                except libvirt.libvirtError:
                    pass
                try:
                    dom.undefine()
                except libvirt.libvirtError:
                    pass
            conn.close()


def control(pool, host="hostA"):
    return ControlClient(pool.control_endpoint, host, (SECRET if host == "hostA" else SECRET_B).encode())


def test_save_parks_and_restore_unparks_the_domains_sessions(world, tmp_path):
    pool, config, conn, created = world
    uuid = str(uuid_module.uuid4())
    dom = conn.defineXML(accel_domain_xml("accel-save", uuid))
    created.append(dom)
    dom.create()
    hostd = HostdThread(config).start()
    try:
        # its events are registered once it says libvirt is connected: a save
        # before that is never seen (a race a loaded machine lost)
        wait_for(lambda: LocalClient(str(tmp_path / "hostd.sock")).call("ping")["libvirt"], 10,
                 "hostd to watch libvirt's events")
        dev = connect(pool.endpoint, ALICE, agent=False, timeout=5, auto_reconnect=False)
        with control(pool) as a:
            bind(a, dev, uuid)
        image = str(tmp_path / "accel-save.img")
        dom.save(image)
        wait_for(lambda: pool.session(dev.sid)["parked"], what="the session parked")
        conn.restore(image)
        wait_for(lambda: not pool.session(dev.sid)["parked"], what="the session unparked")
        status = LocalClient(str(tmp_path / "hostd.sock")).call("status")
        watched = {d["uuid"]: d for d in status["domains"]}
        assert [h["trigger"] for h in watched[uuid]["history"]][-2:] == ["saved", "restored"]
        dev.close()
    finally:
        hostd.stop()


def test_reconciliation_finishes_what_hostd_missed(world):
    """Records left open while hostd was away: hostd's start settles them."""
    pool, config, conn, created = world
    running, absent_in, absent_out = (str(uuid_module.uuid4()) for _ in range(3))
    dom = conn.defineXML(accel_domain_xml("accel-here", running))
    created.append(dom)
    dom.create()
    with control(pool, "hostA") as a, control(pool, "hostB") as b:
        # 1. an incoming migration to this host that completed while hostd was down
        a.call("register_intent", domain_uuid=running, policy="none", source_host="hostB")
        arrived = a.call("open_migration", domain_uuid=running)
        # 2. an incoming migration whose domain never arrived
        lost = a.call("open_migration", domain_uuid=absent_in)
        # 3. an outgoing migration of a domain that is no longer here
        b.call("register_intent", domain_uuid=absent_out, source_host="hostA")
        gone = b.call("open_migration", domain_uuid=absent_out)
        a.call("switchover", domain_uuid=absent_out)
        b.call("complete", domain_uuid=absent_out, migration_id=gone["migration_id"])
    hostd = HostdThread(config, rehome_timeout=2.0).start()
    try:
        def state_of(uuid, mid):
            with control(pool) as a:
                return next(r for r in a.call("list_records", domain_uuid=uuid)["records"]
                            if r["migration_id"] == mid)["state"]
        wait_for(lambda: state_of(absent_in, lost["migration_id"]) == "aborted", what="abort")
        wait_for(lambda: state_of(absent_out, gone["migration_id"]) == "closed", what="close")
        # the domain that did arrive: completed (its rehome has no channel to go through here)
        wait_for(lambda: state_of(running, arrived["migration_id"]) == "completed", what="complete")
    finally:
        hostd.stop()


def test_the_source_aborts_a_migration_whose_guest_still_runs_here(world):
    pool, config, conn, created = world
    uuid = str(uuid_module.uuid4())
    dom = conn.defineXML(accel_domain_xml("accel-stayed", uuid))
    created.append(dom)
    dom.create()
    with control(pool, "hostB") as b:
        b.call("register_intent", domain_uuid=uuid, source_host="hostA")
        record = b.call("open_migration", domain_uuid=uuid)
    hostd = HostdThread(config).start()
    try:
        def state():
            with control(pool) as a:
                return a.call("list_records", domain_uuid=uuid)["records"][0]
        final = wait_for(lambda: state()["state"] == "aborted" and state(), what="abort")
        assert "runs on the source" in final["abort_reason"]
        assert final["migration_id"] == record["migration_id"]
    finally:
        hostd.stop()


def test_a_rehome_whose_first_delivery_fails_is_retried_until_the_session_resumes(world, tmp_path):
    """The guest is not reachable when the domain arrives (its agent is not up
    yet): hostd keeps retrying, status says it waits and why, and the session
    resumes on a later attempt without anyone stepping in (issue 9)."""
    import threading

    from accelmig.agent.daemon import Agent
    pool, config, conn, created = world
    uuid = str(uuid_module.uuid4())
    channel, agent_socket = tmp_path / "channel.sock", tmp_path / "agent.sock"
    port = pool.endpoint.rsplit(":", 1)[1]
    dev = connect(f"[::1]:{port}", ALICE, agent=str(agent_socket), timeout=20)   # on hostB
    agent = None
    try:
        buf = dev.upload(b"kept on the pool" * 4)
        token = att.new_token()
        with control(pool, "hostB") as b:
            bind(b, dev, uuid)
            b.call("register_token", domain_uuid=uuid, digest=att.token_digest(token))
        with control(pool, "hostA") as a:
            # the domain comes to hostA with the token hostB wrote into it (as its hook opens)
            record = a.call("open_migration", domain_uuid=uuid, token=token)
            assert record["vouched"]
        dom = conn.defineXML(accel_domain_xml("accel-retry", uuid, channel=str(channel), token=token))
        created.append(dom)
        dom.create()
        hostd = HostdThread(config, rehome_timeout=1.0, retry_first=0.2, retry_max=0.5).start()
        try:
            client = LocalClient(str(tmp_path / "hostd.sock"))

            def waiting():
                domains = {d["uuid"]: d for d in client.call("status")["domains"]}
                return (domains.get(uuid) or {}).get("rehome_retry")
            retry = wait_for(waiting, timeout=20, what="hostd to report a rehome waiting for a retry")
            assert "channel" in retry["why"] and retry["attempts"] >= 1
            assert pool.session(dev.sid)["bound_host"] == "hostB"      # nothing moved yet
            agent = Agent(str(channel), str(agent_socket), state_dir=str(tmp_path / "agent-state"),
                          rehome_timeout=5)
            agent.open()
            threading.Thread(target=agent.run, daemon=True).start()
            wait_for(lambda: pool.session(dev.sid)["bound_host"] == "hostA", timeout=30,
                     what="the session to resume on hostA")
            assert dev.read(buf) == b"kept on the pool" * 4
            status = {d["uuid"]: d for d in client.call("status")["domains"]}[uuid]
            assert status["rehome_retry"] is None and status["phase"] == "running"
            assert status["last_rehome"]["ok"] and status["last_rehome"]["migration_id"] == record["migration_id"]
            with control(pool) as a:
                final = a.call("list_records", domain_uuid=uuid)["records"][0]
            assert dev.sid in final["resumed"]
        finally:
            hostd.stop()
    finally:
        dev.close()
        if agent is not None:
            agent.stop()


def test_status_and_ping_and_intent_through_the_local_api(world, tmp_path):
    pool, config, conn, created = world
    hostd = HostdThread(config).start()
    try:
        client = LocalClient(str(tmp_path / "hostd.sock"))
        wait_for(lambda: client.call("ping")["pool"], what="hostd reached the pool")
        ping = client.call("ping")
        assert ping["host"] == "hostA" and ping["libvirt"] is True
        intent = client.call("intent", uuid="dom-x", policy="switchover", dest_host="hostB")
        assert intent["policy"] == "switchover" and intent["migration_id"]
        status = client.call("status")
        assert status["libvirt"]["connected"] and status["pool"]["reachable"]
        metrics = client.call("metrics")["text"]
        assert "accelmig_host_libvirt_connected 1.0" in metrics
        assert "accelmig_host_pool_reachable 1.0" in metrics
        assert status["identity"]["host_id"] == "hostA"
        assert status["identity"]["pool_endpoint"].startswith("127.0.0.1:")
        # the pool knows this host's addresses now
        with control(pool) as a:
            hosts = {h["host"]: h for h in a.call("list_hosts")["hosts"]}
        assert "127.0.0.1/32" in hosts["hostA"]["networks"]
    finally:
        hostd.stop()
    with pytest.raises(Unavailable, match="hostd at"):
        LocalClient(str(tmp_path / "hostd.sock")).call("ping")


def test_one_hostd_per_socket_a_second_one_exits_and_touches_nothing(world, tmp_path):
    pool, config, conn, created = world
    hostd = HostdThread(config).start()
    try:
        socket_path = tmp_path / "hostd.sock"
        inode = socket_path.stat().st_ino
        second = run_cli("accelmig", "hostd", "--config", config, "--log-format", "text", timeout=60)
        assert second.returncode == 3
        assert f"accelmig hostd already runs on {socket_path} (pid {os.getpid()})" in second.stderr
        assert socket_path.stat().st_ino == inode
        assert LocalClient(str(socket_path)).call("ping")["host"] == "hostA"
    finally:
        hostd.stop()
    assert not (tmp_path / "hostd.sock").exists()       # the first one removes its own socket


def test_hostd_refuses_a_socket_path_that_is_not_a_socket(world, tmp_path):
    pool, config, conn, created = world
    (tmp_path / "hostd.sock").write_text("precious")
    out = run_cli("accelmig", "hostd", "--config", config, "--log-format", "text", timeout=60)
    assert out.returncode == 2 and "not a socket" in out.stderr
    assert (tmp_path / "hostd.sock").read_text() == "precious"


def foreign_domain_xml(name: str, uuid: str) -> str:
    """A domain nothing of accelmig's is in (Nova's or anyone's)."""
    return f"""<domain type='test'><name>{name}</name><uuid>{uuid}</uuid><memory>65536</memory>
  <vcpu>1</vcpu><os><type arch='x86_64'>hvm</type></os></domain>"""


def hostd_status(tmp_path) -> dict:
    return LocalClient(str(tmp_path / "hostd.sock")).call("status")


def test_foreign_domains_cost_one_look_and_no_watch(world, tmp_path):
    """A compute host with 50 other domains: each is read once (one XMLDesc),
    remembered by UUID, and never watched, however many events they make."""
    pool, config, conn, created = world
    hostd = HostdThread(config).start()
    try:
        existing = len(conn.listAllDomains(0))        # test:///default's own domain(s)
        wait_for(lambda: hostd_status(tmp_path)["foreign_domains"] == existing, what="hostd reconciled")
        start_calls = hostd_status(tmp_path)["libvirt"]["calls"].get("XMLDesc", 0)
        doms = []
        for n in range(50):
            dom = conn.defineXML(foreign_domain_xml(f"nova-{n}", str(uuid_module.uuid4())))
            created.append(dom)
            doms.append(dom)
        for _ in range(3):
            for dom in doms:
                dom.create()
                dom.suspend()
                dom.resume()
                dom.destroy()
        # a sentinel: hostd handles events in order, so once it has this
        # accelmig domain running, every foreign event before it was handled
        sentinel = str(uuid_module.uuid4())
        dom = conn.defineXML(accel_domain_xml("accel-sentinel", sentinel))
        created.append(dom)
        dom.create()
        wait_for(lambda: any(d["uuid"] == sentinel and d["phase"] == "running"
                             for d in hostd_status(tmp_path)["domains"]), what="the sentinel watched")
        status = hostd_status(tmp_path)
        assert status["foreign_domains"] == existing + 50
        assert [d["uuid"] for d in status["domains"]] == [sentinel]
        assert hostd.call(lambda: asyncio.sleep(0, len(hostd.daemon.watches))) == 1
        # 50 foreign looks plus the sentinel's (its first look and its start)
        assert status["libvirt"]["calls"]["XMLDesc"] - start_calls <= 50 + 3
    finally:
        hostd.stop()


def test_a_gone_domain_is_forgotten_and_its_guest_address_released(world, tmp_path):
    pool, config, conn, created = world
    fabric = '[fabric]\nmode = "bridge"\nbridge = "fab0"\nguest_subnet = "10.89.1.0/24"\n'
    config = write_config(tmp_path, pool, fabric=fabric)
    from accelmig.plugin.addresses import GuestAddressAllocator
    from accelmig.plugin.config import HostConfig
    leases = GuestAddressAllocator.for_config(HostConfig.load(config))
    hostd = HostdThread(config).start()
    try:
        uuid = str(uuid_module.uuid4())
        dom = conn.createXML(accel_domain_xml("accel-transient", uuid), 0)    # transient
        wait_for(lambda: leases.lookup(uuid), what="a guest address leased at first contact")
        kept = conn.defineXML(accel_domain_xml("accel-kept", str(uuid_module.uuid4())))
        created.append(kept)
        kept.create()
        wait_for(lambda: leases.lookup(kept.UUIDString()), what="the persistent domain's lease")
        dom.destroy()                                   # a transient domain: gone for good
        wait_for(lambda: leases.lookup(uuid) is None, what="the lease released")
        wait_for(lambda: hostd.call(lambda: asyncio.sleep(0, hostd.daemon.watches.get(uuid))) is None,
                 what="its watch forgotten")
        kept.destroy()                                  # stopped but still defined: keeps its address
        wait_for(lambda: all(d["uuid"] != kept.UUIDString() for d in hostd_status(tmp_path)["domains"]),
                 what="the stopped domain no longer shown")
        assert leases.lookup(kept.UUIDString()) is not None
        kept.undefine()
        created.remove(kept)
        wait_for(lambda: leases.lookup(kept.UUIDString()) is None, what="the lease released at undefine")
    finally:
        hostd.stop()


def test_a_refused_hook_leaves_no_open_record_behind(world, tmp_path):
    """The pool answers the hook's open_migration only after the hook gave up
    (strict mode refuses the migration): the record it opened late is aborted."""
    from accelmig.lab.cutproxy import CutProxy
    pool, config, conn, created = world
    relay = CutProxy(pool.control_endpoint)
    config = write_config(tmp_path, pool, control=relay.endpoint)
    hostd = HostdThread(config).start()
    try:
        client = LocalClient(str(tmp_path / "hostd.sock"))
        wait_for(lambda: client.call("ping")["pool"], what="hostd reached the pool")
        uuid = str(uuid_module.uuid4())
        relay.hold()                                    # the pool becomes slow
        with pytest.raises(Unavailable, match="no answer within the hook's 0.3 s"):
            client.call("hook", timeout=5, op="migrate", sub="begin", uuid=uuid, name="late-vm", budget=0.3)
        relay.release()
        with control(pool) as a:
            def record():
                records = a.call("list_records", domain_uuid=uuid)["records"]
                return records[0] if records and records[0]["state"] == "aborted" else None
            late = wait_for(record, what="the late record aborted")
        assert "the hook refused the migration" in late["abort_reason"]
    finally:
        hostd.stop()
        relay.close()


def test_the_hook_opens_the_record_with_the_token_that_came_with_the_domain(world, tmp_path):
    """hostB (the domain's host) wrote and registered a migration token; its
    domain's XML reaches this host's hook with it, and hostd opens the
    record vouched for.  A made-up token vouches for nothing."""
    from tests.plugin.test_hook import run_hook
    pool, config, conn, created = world
    uuid = str(uuid_module.uuid4())
    port = pool.endpoint.rsplit(":", 1)[1]
    hostd = HostdThread(config).start()
    try:
        with connect(f"[::1]:{port}", ALICE, agent=False, timeout=10) as dev, control(pool, "hostB") as b, \
                control(pool) as a:
            bind(b, dev, uuid)
            token = att.new_token()
            b.call("register_token", domain_uuid=uuid, digest=att.token_digest(token))
            for given, vouched in ((att.new_token(), False), (token, True)):
                code, out, err, _ = run_hook(config, "accel-incoming", "migrate", "begin", "-",
                                             xml=accel_domain_xml("accel-incoming", uuid, token=given).encode())
                assert code == 0, err
                records = a.call("list_records", domain_uuid=uuid)["records"]
                latest = max(records, key=lambda r: r["times"]["opened"])
                assert (latest["dest_host"], latest["vouched"]) == ("hostA", vouched), records
    finally:
        hostd.stop()


def test_a_domain_that_arrived_while_hostd_was_away_is_rehomed_with_the_token_it_carries(world, tmp_path):
    """No record (the destination's hostd was down at the hook, lenient
    mode): at its start hostd finds the domain running here with its
    sessions bound elsewhere, opens the record with the token in its live
    XML (vouched: no source needs to switch over), rehomes the session and
    writes a token of its own into the domain."""
    import threading

    from accelmig.agent.daemon import Agent
    from accelmig.plugin.domain.model import DomainXML
    pool, config, conn, created = world
    uuid = str(uuid_module.uuid4())
    channel, agent_socket = tmp_path / "channel.sock", tmp_path / "agent.sock"
    port = pool.endpoint.rsplit(":", 1)[1]
    agent = Agent(str(channel), str(agent_socket), state_dir=str(tmp_path / "agent-state"), rehome_timeout=5)
    agent.open()
    threading.Thread(target=agent.run, daemon=True).start()
    dev = connect(f"[::1]:{port}", ALICE, agent=str(agent_socket), timeout=20, domain=uuid)   # on hostB
    hostd = None
    try:
        buf = dev.upload(b"kept on the pool" * 4)
        token = att.new_token()
        with control(pool, "hostB") as b:
            bind(b, dev, uuid)
            b.call("register_token", domain_uuid=uuid, digest=att.token_digest(token))
        dom = conn.defineXML(accel_domain_xml("accel-away", uuid, channel=str(channel), token=token))
        created.append(dom)
        dom.create()
        hostd = HostdThread(config, rehome_timeout=5.0).start()
        wait_for(lambda: pool.session(dev.sid)["bound_host"] == "hostA", 30, "the session rehomed on hostA")
        assert dev.read(buf) == b"kept on the pool" * 4
        with control(pool) as a:
            record = a.call("list_records", domain_uuid=uuid)["records"][0]
        assert record["vouched"] and record["dest_host"] == "hostA" and "switchover" not in record["times"]
        watch = hostd.daemon.watches.get(uuid)
        wait_for(lambda: watch.token_registered and watch.token != token, 20, "hostA's own token")
        assert DomainXML.parse(dom.XMLDesc(0)).migration_token() == watch.token
    finally:
        if hostd is not None:
            hostd.stop()
        dev.close()
        agent.stop()
