"""The OpenCL driver in a pool of two nodes on a real etcd (issue 30,
milestone 2): two real ``accelmig-pool serve --cluster`` processes (PoCL's
two devices each), an unmodified OpenCL program whose open at n1 is placed
on n2 (a redirect), registered with a real guest agent; hostd's own
routing and migration steps move its domain to another host, and the
agent's rehome names the coordinator n1: n1 says the session lives on n2,
where the driver resumes with the migration's ticket.  The program's
results are local PoCL's, byte for byte."""

from __future__ import annotations

import asyncio
import uuid

import pytest

pytest.importorskip("etcd3gw", reason="the cluster extra (pip install 'accelmig[cluster]')")

from accelmig.agent.driver import connect  # noqa: E402
from accelmig.plugin.channel import GuestChannel  # noqa: E402
from tests.continuity.test_cluster_migration import hostd, load_is, two_nodes  # noqa: E402,F401  (the fixture)
from tests.support import icd as icd_support  # noqa: E402
from tests.support.etcd import etcd_server  # noqa: E402,F401  (the fixture)
from tests.support.wait import wait_for  # noqa: E402

TOKEN = "alice-token-0001"           # (the two nodes' tenant)
DOMAIN = str(uuid.uuid4())
SCRIPT = ["step 12", "sum", "step 9", "sum"]


@pytest.fixture(scope="module")
def reference(icd, tmp_path_factory):
    return icd_support.solver_reference(icd, tmp_path_factory.mktemp("local"), SCRIPT)


def prove_and_bind(agent, client, sid: str, host: str) -> list:
    """hostd's attestation of one session at the node it lives on: that
    node's challenge, the guest's proof (its driver's), the binding."""
    async def challenge():
        return await client.call("bind_challenge")
    issued = asyncio.run(challenge())
    with GuestChannel(agent.port_path) as channel:
        channel.connect()
        answer = channel.request("prove", host=host, challenges={issued["instance"]: issued["challenge"]},
                                 sids=[sid])
    assert set(answer["proofs"]) == {sid}, answer

    async def bind():
        return await client.call("bind_sessions", domain_uuid=DOMAIN, challenge=issued["challenge"],
                                 sessions=answer["proofs"])
    return asyncio.run(bind())["bound"]


# (the nodes run device work in their own process: a tenant's builds there must be allowed)
@pytest.mark.pool_options("--allow-unconfined-builds")
def test_a_redirected_session_migrates_and_resumes_on_its_own_node(icd, two_nodes, guest_agent, reference):
    store, nodes = two_nodes
    n1, n2 = nodes["n1"].endpoint, nodes["n2"].endpoint
    # a session at n1 first: the driver's open there is placed on n2, the less loaded
    loader = connect(n1, TOKEN, agent=False, timeout=10, auto_reconnect=False, device="name=pthread")
    agent = guest_agent(DOMAIN)
    try:
        wait_for(load_is(store, n1=1, n2=0), 20, "etcd showing the first session on n1")
        env = icd_support.driver_env(icd, n1, TOKEN, ACCELMIG_AGENT_SOCKET=agent.socket_path,
                                     ACCELMIG_ICD_LOG="info")
        with icd_support.Solver(icd, env) as solver:
            out = [solver.ask(command) for command in SCRIPT[:2]]
            session = wait_for(lambda: next(iter(agent.sessions()), None), 10, "the driver's session registered")
            sid = session["sid"]
            assert session["endpoint"] == n2                           # where it was placed
            wait_for(load_is(store, n1=1, n2=1), 20, "etcd showing the driver's session on n2")
            a, b = hostd(nodes, "hostA"), hostd(nodes, "hostB")

            async def routes():
                for routing, _ in (a, b):
                    await routing.refresh()
                return await a[0].node_for_sid(sid)
            home = asyncio.run(routes())
            assert prove_and_bind(agent, home, sid, "hostA") == [sid]

            async def moved():
                (_, src), (_, dst) = a, b
                record = await dst.pool("open_migration", domain_uuid=DOMAIN)
                await src.pool("switchover", domain_uuid=DOMAIN, migration_id=record["migration_id"])
                done = await dst.pool_all("complete", domain_uuid=DOMAIN, migration_id=record["migration_id"])
                return record["migration_id"], done["tickets"]
            mid, tickets = asyncio.run(moved())
            assert set(tickets) == {sid}
            # the rehome names the coordinator, n1; the session lives on n2
            with GuestChannel(agent.port_path) as channel:
                channel.connect()
                rehomed = channel.request("rehome", migration_id=mid, tickets=tickets,
                                          identity={"host_id": "hostB", "pool_endpoint": n1})
            assert rehomed["ok"], rehomed
            outcome = rehomed["sessions"][sid]
            assert outcome["ticket"] and outcome["endpoint"] == n2 and outcome["resent"] == 0

            async def closed():
                await a[1].pool("close", domain_uuid=DOMAIN, migration_id=mid)
                for routing, _ in (a, b):
                    await routing.close()
                    await routing.coordinator.close()
            asyncio.run(closed())
            out += [solver.ask(command) for command in SCRIPT[2:]]
            log = solver.finish()
    finally:
        loader.close()
    assert out == reference
    assert "was placed on node n2" in log and f"opening at {n2}" in log, log
    assert f"lives on another node, at {n2}: resuming there" in log, log
