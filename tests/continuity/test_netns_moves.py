"""Moves between hosts whose addresses live in separate network namespaces.

The pool runs in its own namespace, the driver in a "guest" namespace whose
NIC moves from hostA's subnet to hostB's and back, as a VM's does; each move
goes through the control plane (record, switchover, complete, tickets) and
the driver resumes with its ticket from its new address.  Meanwhile its
connection is cut at random moments (its socket killed from inside the
guest, ``ss -K``).  The dependent workload ends bit-identical to a run that
never moved, with zero program rebuilds and zero re-uploads.
"""

from __future__ import annotations

import random
import subprocess
import threading
import time

import pytest

from accelmig.agent.driver import connect
from accelmig.lab.poolthread import PoolThread
from accelmig.wire.errors import TicketInvalid, WrongHost
from tests.conftest import ALICE, TENANTS
from tests.support.attest import bind
from tests.support.topology import POOL_ADDRESS, SUBNETS, MovingGuest
from tests.support.twohosts import SECRETS
from tests.support.workload import PROGRAMS, WEIGHT_BYTES, Workload

pytestmark = pytest.mark.root

MOVES = 10
CUTS = 50
LAUNCHES = 2000


@pytest.fixture
def world(netns_factory):
    net = MovingGuest.build(netns_factory)
    hosts = {name: (SECRETS[name], [SUBNETS[name]]) for name in ("hostA", "hostB")}
    pool = PoolThread(TENANTS, hosts, listen="0.0.0.0:0", control_listen="0.0.0.0:0")
    with net.pool.entered():          # the pool's threads and sockets live in its namespace
        pool.start()
    try:
        yield net, pool
    finally:
        pool.stop()


def control(pool, net, host):
    """A host's control-plane client, its socket made inside that host."""
    from accelmig.wire.control import ControlClient
    port = pool.control_endpoint.rsplit(":", 1)[1]
    client = ControlClient(f"{POOL_ADDRESS}:{port}", host, SECRETS[host].encode())
    with net.hosts[host].entered():
        client.call("ping")
    return client


def test_ten_moves_between_namespaced_hosts_bit_identical(world):
    net, pool = world
    port = pool.endpoint.rsplit(":", 1)[1]
    endpoint = f"{POOL_ADDRESS}:{port}"
    clients = {h: control(pool, net, h) for h in ("hostA", "hostB")}
    domain = "dom-netns"
    with net.guest.entered():
        reference = Workload(connect(endpoint, ALICE, agent=False)).run(LAUNCHES)
        dev = connect(endpoint, ALICE, agent=False, timeout=60)   # its threads stay in the guest
    assert pool.session(dev.sid)["bound_host"] == "hostA"
    bind(clients["hostA"], dev, domain)
    workload = Workload(dev)
    moves = []
    rng = random.Random(20261202)
    cut_steps = set(rng.sample(range(20, LAUNCHES - 20), CUTS))
    cuts, cutters = [], []

    def cut():
        time.sleep(rng.random() * 0.004)        # land anywhere in the pipeline
        out = subprocess.run(["ip", "netns", "exec", net.guest.name, "ss", "-K", "dst", POOL_ADDRESS],
                             capture_output=True, text=True)
        cuts.append(out.returncode)

    def move(step):
        src = net.at
        dst = "hostB" if src == "hostA" else "hostA"
        back_to_back = len(moves) in (4, 5) and len(moves) % 2 == 0
        rec = clients[dst].call("open_migration", domain_uuid=domain)
        clients[src].call("switchover", domain_uuid=domain)
        tickets = clients[dst].call("complete", domain_uuid=domain, migration_id=rec["migration_id"])
        clients[src].call("close", domain_uuid=domain, migration_id=rec["migration_id"])
        ticket = tickets["tickets"][dev.sid]
        if back_to_back:      # and straight back, before the first ticket was used
            rec2 = clients[src].call("open_migration", domain_uuid=domain)
            clients[dst].call("switchover", domain_uuid=domain)
            second = clients[src].call("complete", domain_uuid=domain, migration_id=rec2["migration_id"])
            clients[dst].call("close", domain_uuid=domain, migration_id=rec2["migration_id"])
            moves.append((step, src, dst))
            dst, ticket = src, second["tickets"][dev.sid]
        net.move(dst)
        with net.guest.entered():
            result = dev.resume(endpoint, ticket)
        assert result["epoch"] == pool.session(dev.sid)["epoch"]
        moves.append((step, src, dst))

    def on_step(step):
        if step in cut_steps:
            cutters.append(threading.Thread(target=cut))
            cutters[-1].start()
        if step % 180 == 90 and len(moves) < MOVES:
            move(step)

    digest = workload.run(LAUNCHES, on_step=on_step, check_every=50)
    for thread in cutters:
        thread.join(30)
    session = pool.session(dev.sid)
    dev.close()
    assert len(moves) == MOVES
    assert len(cuts) == CUTS and set(cuts) == {0}
    # the cuts landed: the driver reconnected by itself (cuts that fall into a
    # reconnect already under way merge with it)
    assert dev.stats["reconnect_attempts"] >= 5, dev.stats
    assert dev.stats["resumes"] >= MOVES - 1 + 5, dev.stats
    assert digest == reference
    counters = session["counters"]
    assert counters["builds"] == len(PROGRAMS)
    assert counters["bytes_uploaded"] == WEIGHT_BYTES
    assert counters["duplicates"] == 0
    assert session["bound_host"] == net.at


def test_the_old_hosts_address_cannot_resume_a_moved_session(world):
    net, pool = world
    port = pool.endpoint.rsplit(":", 1)[1]
    endpoint = f"{POOL_ADDRESS}:{port}"
    a, b = control(pool, net, "hostA"), control(pool, net, "hostB")
    with net.guest.entered():
        dev = connect(endpoint, ALICE, agent=False, timeout=10, auto_reconnect=False)
    bind(a, dev, "dom-2")
    rec = b.call("open_migration", domain_uuid="dom-2")
    a.call("switchover", domain_uuid="dom-2")
    ticket = b.call("complete", domain_uuid="dom-2", migration_id=rec["migration_id"])["tickets"][dev.sid]
    # still on A's subnet: the ticket is for B
    with net.guest.entered():
        with pytest.raises(TicketInvalid, match="for host hostB, the resume comes from host hostA"):
            dev.resume(endpoint, ticket)
    net.move("hostB")
    with net.guest.entered():
        dev.resume(endpoint, ticket)
        dev.finish()
    # back on A's subnet without a migration: the session is bound to B
    net.move("hostA")
    with net.guest.entered():
        with pytest.raises(WrongHost, match="bound to host hostB"):
            dev.resume(endpoint)
    dev.close()
