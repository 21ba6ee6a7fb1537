"""A session's binding proof, as the guest makes it (issue 28, items 3 and
4; ``accelmig.wire.attestation``): the host asks the agent — on its channel,
or through ``accelmig-agent prove --stdin`` as qemu-guest-agent's guest-exec
runs it — the agent asks each driver that registered one of the sessions,
and the driver answers with an HMAC of its own session secret for the
domain it reads itself.  A real agent, real drivers, a real pool that
checks the proofs."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

from accelmig.agent.driver import connect
from accelmig.lab.poolthread import PoolThread
from accelmig.plugin.channel import GuestChannel
from accelmig.wire import attestation as att
from accelmig.wire.control import ControlClient
from accelmig.wire.errors import BadRequest
from tests.conftest import ALICE, TENANTS
from tests.support.wait import wait_for

SECRET = "hostA-proofs-secret-0001"
DOMAIN, OTHER = str(uuid.uuid4()), str(uuid.uuid4())


@pytest.fixture
def pool():
    with PoolThread(TENANTS, {"hostA": (SECRET, ["127.0.0.0/8"])}) as harness:
        yield harness


@pytest.fixture
def host_a(pool):
    with ControlClient(pool.control_endpoint, "hostA", SECRET.encode()) as client:
        yield client


def challenges(client) -> tuple[str, dict]:
    answer = client.call("bind_challenge")
    return answer["challenge"], {answer["instance"]: answer["challenge"]}


def test_each_driver_proves_its_own_session_for_its_own_domain_and_the_pool_checks_it(agent, pool, host_a):
    """Two applications of one guest: one says it is DOMAIN, the other
    (an application that gave another domain at open) OTHER.  Each proof
    binds its session to its own domain only, on the host that asked only,
    once."""
    with connect(pool.endpoint, ALICE, agent=agent.socket_path, domain=DOMAIN) as mine, \
            connect(pool.endpoint, ALICE, agent=agent.socket_path, domain=OTHER) as elsewhere:
        wait_for(lambda: len(agent.sessions()) == 2, what="both sessions registered")
        challenge, by_instance = challenges(host_a)
        with GuestChannel(agent.port_path) as host:
            host.connect()
            answer = host.request("prove", host="hostA", challenges=by_instance,
                                  sids=[mine.sid, elsewhere.sid, "s-nobody-1"])
        assert set(answer["proofs"]) == {mine.sid, elsewhere.sid}
        assert answer["refused"] == {"s-nobody-1": "no driver in this guest holds that session"}
        assert answer["next"] is None
        bound = host_a.call("bind_sessions", domain_uuid=DOMAIN, challenge=challenge, sessions=answer["proofs"])
        assert bound["bound"] == [mine.sid]
        assert "proof does not verify" in bound["refused"][elsewhere.sid]["message"]
        assert pool.session(mine.sid)["domain_uuid"] == DOMAIN
        assert pool.session(elsewhere.sid)["domain_uuid"] is None
        # the same proof again, or for another domain: nothing
        again = host_a.call("bind_sessions", domain_uuid=OTHER, challenge=challenge,
                            sessions={mine.sid: answer["proofs"][mine.sid]})
        assert again["bound"] == [] and mine.sid in again["refused"]
        # a session bound here already needs no proof to be acknowledged
        assert host_a.call("bind_sessions", domain_uuid=DOMAIN, sessions={mine.sid: None, elsewhere.sid: None}) \
            == {"domain_uuid": DOMAIN, "bound": [mine.sid], "prove": [elsewhere.sid], "refused": {}}


def test_a_driver_proves_nothing_for_a_node_it_does_not_live_on_and_a_bad_request_is_refused(agent, pool):
    with connect(pool.endpoint, ALICE, agent=agent.socket_path, domain=DOMAIN) as dev:
        wait_for(lambda: len(agent.sessions()) == 1, what="the session registered")
        with GuestChannel(agent.port_path) as host:
            host.connect()
            answer = host.request("prove", host="hostA", challenges={"0badc0de": "ab" * 16})
            assert answer["proofs"] == {}
            assert "no challenge of its pool instance" in answer["refused"][dev.sid]
            for bad in ({"challenges": {"0badc0de": "ab" * 16}},                    # no host
                        {"host": "hostA", "challenges": {}},
                        {"host": "hostA", "challenges": {"0badc0de": "not hex"}},
                        {"host": "hostA", "challenges": {"0badc0de": "ab" * 16}, "sids": "s-1"},
                        {"host": "hostA", "challenges": {"0badc0de": "ab" * 16},
                         "sids": ["s"] * (att.MAX_PROVE + 1)}):
                with pytest.raises(BadRequest):
                    host.request("prove", **bad)


def test_every_session_a_page_at_a_time(agent_on_thread, pool, host_a, monkeypatch):
    """With no sessions named the agent proves every one it holds, at most
    MAX_PROVE an answer, and says where the next page starts."""
    agent = agent_on_thread()
    devs = [connect(pool.endpoint, ALICE, agent=agent.socket_path, domain=DOMAIN) for _ in range(3)]
    try:
        wait_for(lambda: len(agent.sessions()) == 3, what="three sessions registered")
        challenge, by_instance = challenges(host_a)
        monkeypatch.setattr(att, "MAX_PROVE", 2)          # (the agent reads it at each prove)
        with GuestChannel(agent.port_path) as host:
            host.connect()
            first = host.request("prove", host="hostA", challenges=by_instance)
            second = host.request("prove", host="hostA", challenges=by_instance, after=first["next"])
        assert len(first["proofs"]) == 2 and first["next"] == sorted(first["proofs"])[-1]
        assert len(second["proofs"]) == 1 and second["next"] is None
        proofs = {**first["proofs"], **second["proofs"]}
        assert sorted(host_a.call("bind_sessions", domain_uuid=DOMAIN, challenge=challenge,
                                  sessions=proofs)["bound"]) == sorted(d.sid for d in devs)
    finally:
        for dev in devs:
            dev.close()


def test_accelmig_agent_prove_from_stdin_as_guest_exec_runs_it(agent, pool, host_a):
    with connect(pool.endpoint, ALICE, agent=agent.socket_path, domain=DOMAIN) as dev:
        wait_for(lambda: len(agent.sessions()) == 1, what="the session registered")
        challenge, by_instance = challenges(host_a)
        command = [sys.executable, "-m", "accelmig.agent", "prove", "--stdin", "--socket", agent.socket_path]
        done = subprocess.run(command, input=json.dumps({"host": "hostA", "challenges": by_instance}),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        assert set(answer["proofs"]) == {dev.sid}
        assert host_a.call("bind_sessions", domain_uuid=DOMAIN, challenge=challenge,
                           sessions=answer["proofs"])["bound"] == [dev.sid]
        bad = subprocess.run(command, input='{"host": 5}', capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "bad prove document" in bad.stderr
        gone = subprocess.run(command[:-1] + [agent.socket_path + ".nobody"], input=json.dumps(
            {"host": "hostA", "challenges": by_instance}), capture_output=True, text=True, timeout=60)
        assert gone.returncode == 3 and "no agent answers" in gone.stderr
