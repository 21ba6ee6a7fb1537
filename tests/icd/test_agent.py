"""The OpenCL driver and the guest agent (issue 30, milestone 2): an
unmodified OpenCL program's session registers with a real guest agent
(``accelmig.agent.daemon.Agent``: the agent's own code, on a thread, its
SMBIOS UUID read from a file that stands for ``/sys``), the hosts bind it
with the proof the driver alone can make (its session secret), and a real
migration record's ticket, handed over by the agent's rehome, moves it to
the other host: the program's results bit-identical to local PoCL's, each
session resumed once.  The pool serves TLS with client certificates on its
control plane, as a deployment's does; hostA's guests come from
127.0.0.0/8, hostB's from ::1.  Once more with the agent as a guest runs
it (its own process, reading SMBIOS) and the tickets brought as hostd's
guest-exec brings them."""

from __future__ import annotations

import json
import re
import shutil
import uuid

import pytest

from accelmig.lab.poolthread import PoolThread
from accelmig.plugin.channel import GuestChannel
from accelmig.wire import tls
from accelmig.wire.control import ControlClient
from tests.support import icd as icd_support
from tests.support.attest import register_token
from tests.support.processes import AgentProcess
from tests.support.tenants import run_cli
from tests.support.wait import wait_for

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="SKIPPED LOUDLY: the openssl command makes the test CA")

TOKEN = "alice-icd-agent-token-0001"
TENANTS = {"alice": (TOKEN, "256MiB")}
SECRETS = {"hostA": "hostA-icd-agent-secret-01", "hostB": "hostB-icd-agent-secret-02"}
DOMAIN, OTHER = str(uuid.uuid4()), str(uuid.uuid4())
SCRIPT = ["step 20", "sum", "step 30", "sum"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    from accelmig.lab.certs import make_pki
    return make_pki(tmp_path_factory.mktemp("pki") / "ca", hosts=tuple(SECRETS))


@pytest.fixture
def pool(pki):
    with PoolThread(TENANTS, {"hostA": (SECRETS["hostA"], ["127.0.0.0/8"]), "hostB": (SECRETS["hostB"], ["::1/128"])},
                    listen="127.0.0.1:0,[::1]:0", tls_cert=str(pki.pool.cert), tls_key=str(pki.pool.key),
                    tls_client_ca=str(pki.ca)) as harness:
        yield harness


@pytest.fixture
def hosts(pool, pki):
    """Each host's control-plane client: its secret, and its client certificate."""
    clients = {host: ControlClient(pool.control_endpoint, host, secret.encode(),
                                   tls=tls.client_context(str(pki.ca), str(pki.hosts[host].cert),
                                                          str(pki.hosts[host].key)))
               for host, secret in SECRETS.items()}
    yield clients
    for client in clients.values():
        client.close()


@pytest.fixture(scope="module")
def reference(icd, tmp_path_factory):
    return icd_support.solver_reference(icd, tmp_path_factory.mktemp("local"), SCRIPT)


def endpoint(pool, host: str) -> str:
    port = pool.endpoint.rsplit(":", 1)[1]
    return f"127.0.0.1:{port}" if host == "hostA" else f"[::1]:{port}"


def solver_env(icd, pool, pki, agent, host: str = "hostA", **extra) -> dict:
    return icd_support.driver_env(icd, endpoint(pool, host), TOKEN, cafile=str(pki.ca),
                                  ACCELMIG_AGENT_SOCKET=agent.socket_path, ACCELMIG_ICD_LOG="info", **extra)


def registered(agent, solver) -> dict:
    """The session the agent holds for the solver's process (the kernel's pid, not the message's)."""
    return wait_for(lambda: next((s for s in agent.sessions() if s["pid"] == solver.pid), None), 10,
                    "the driver's session registered with the agent")


def prove(agent, host: str, challenges: dict, sids=None) -> dict:
    """What hostd does: ask the guest (its channel) for its drivers' proofs."""
    with GuestChannel(agent.port_path) as channel:
        channel.connect()
        return channel.request("prove", host=host, challenges=challenges,
                               **({"sids": sids} if sids is not None else {}))


def bind(client, agent, host: str, domain: str, sid: str) -> dict:
    challenge = client.call("bind_challenge")
    answer = prove(agent, host, {challenge["instance"]: challenge["challenge"]}, [sid])
    assert set(answer["proofs"]) == {sid}, answer
    return client.call("bind_sessions", domain_uuid=domain, challenge=challenge["challenge"],
                       sessions=answer["proofs"])


def test_a_migration_rehomes_the_drivers_session_with_its_ticket(icd, pool, hosts, pki, guest_agent, reference):
    agent = guest_agent(DOMAIN)
    with icd_support.Solver(icd, solver_env(icd, pool, pki, agent)) as solver:
        out = [solver.ask(command) for command in SCRIPT[:2]]
        session = registered(agent, solver)
        sid = session["sid"]
        assert session["name"] == "cl-moves" and session["endpoint"] == endpoint(pool, "hostA")
        assert pool.session(sid)["claimed_domain"] == DOMAIN            # told at open, as the agent read it
        assert bind(hosts["hostA"], agent, "hostA", DOMAIN, sid)["bound"] == [sid]
        # the migration to hostB: hostA's token, hostB's hook opens, switchover, complete
        token = register_token(hosts["hostA"], DOMAIN)
        record = hosts["hostB"].call("open_migration", domain_uuid=DOMAIN, token=token)
        hosts["hostA"].call("switchover", domain_uuid=DOMAIN, migration_id=record["migration_id"])
        done = hosts["hostB"].call("complete", domain_uuid=DOMAIN, migration_id=record["migration_id"])
        assert set(done["tickets"]) == {sid}
        rehome = {"migration_id": record["migration_id"], "tickets": done["tickets"],
                  "identity": {"host_id": "hostB", "pool_endpoint": endpoint(pool, "hostB")}}
        with GuestChannel(agent.port_path) as channel:
            channel.connect()
            first = channel.request("rehome", **rehome)
            again = channel.request("rehome", **rehome)          # delivered twice: moved once
        hosts["hostA"].call("close", domain_uuid=DOMAIN, migration_id=record["migration_id"])
        assert first["ok"], first
        moved = first["sessions"][sid]
        assert moved["ok"] and moved["ticket"] and moved["epoch"] == 2 and moved["endpoint"] == endpoint(pool, "hostB")
        assert "driver_connected" in first["times"]              # the driver's word for the timeline
        assert again["sessions"] == first["sessions"]
        state = pool.session(sid)
        assert state["bound_host"] == "hostB" and state["epoch"] == 2
        out += [solver.ask(command) for command in SCRIPT[2:]]
        log = solver.finish()
    assert out == reference                     # nothing lost, nothing run twice
    assert "resuming at " + endpoint(pool, "hostB") + " with a migration's ticket, as the guest agent asks" in log
    assert log.count("resumed at") == 1, log    # once: the second delivery moved nothing


def test_the_binding_proof_binds_the_session_to_its_own_domain_only(icd, pool, hosts, pki, guest_agent):
    """The driver proves its session for the domain it reads (the agent's
    word for the SMBIOS UUID), for the challenge of its own node, and for
    the host that asked: a host presenting it for another domain, another
    host presenting it, or a node it does not live on asking, get nothing."""
    agent = guest_agent(DOMAIN)
    with icd_support.Solver(icd, solver_env(icd, pool, pki, agent)) as solver:
        solver.ask("step 2")
        sid = registered(agent, solver)["sid"]
        a, b = hosts["hostA"], hosts["hostB"]
        challenge = a.call("bind_challenge")
        by_instance = {challenge["instance"]: challenge["challenge"]}
        answer = prove(agent, "hostA", by_instance, [sid, "s-nobody-1"])
        assert set(answer["proofs"]) == {sid}
        assert answer["refused"] == {"s-nobody-1": "no driver in this guest holds that session"}
        proof = answer["proofs"][sid]
        # another domain, with the driver's own proof: refused, nothing bound
        other = a.call("bind_sessions", domain_uuid=OTHER, challenge=challenge["challenge"], sessions={sid: proof})
        assert other["bound"] == [] and "proof does not verify" in other["refused"][sid]["message"]
        # hostB presenting hostA's proof with its own challenge: refused
        theirs = b.call("bind_challenge")
        stolen = b.call("bind_sessions", domain_uuid=DOMAIN, challenge=theirs["challenge"], sessions={sid: proof})
        assert stolen["bound"] == []
        # a node it does not live on: no proof at all
        elsewhere = prove(agent, "hostA", {"0badc0de": "ab" * 16}, [sid])
        assert elsewhere["proofs"] == {} and "no challenge of its pool instance" in elsewhere["refused"][sid]
        # its own domain, its own host: bound
        bound = a.call("bind_sessions", domain_uuid=DOMAIN, challenge=challenge["challenge"], sessions={sid: proof})
        assert bound["bound"] == [sid] and pool.session(sid)["domain_uuid"] == DOMAIN
        assert solver.ask("step 1").endswith(" 0 0")
        log = solver.finish()
    assert f"binding proof made for host hostA, domain {DOMAIN}" in log


def test_a_guest_whose_domain_nobody_can_read_proves_nothing(icd, pool, hosts, pki, guest_agent):
    agent = guest_agent(None)
    with icd_support.Solver(icd, solver_env(icd, pool, pki, agent)) as solver:
        sid = registered(agent, solver)["sid"]
        challenge = hosts["hostA"].call("bind_challenge")
        answer = prove(agent, "hostA", {challenge["instance"]: challenge["challenge"]}, [sid])
        assert answer["proofs"] == {} and "no SMBIOS system UUID" in answer["refused"][sid]
        assert pool.session(sid)["claimed_domain"] is None
        solver.finish()


def test_a_restarted_agent_gets_the_session_registered_again(icd, pool, pki, guest_agent):
    first = guest_agent(DOMAIN, name="first")
    with icd_support.Solver(icd, solver_env(icd, pool, pki, first)) as solver:
        sid = registered(first, solver)["sid"]
        guest_agent.stop(first)                          # the agent goes (restarted, say)
        second = guest_agent(DOMAIN, name="first")       # the same socket, a new agent
        assert registered(second, solver)["sid"] == sid
        assert solver.ask("step 1").endswith(" 0 0")
        log = solver.finish()
    assert "the guest agent went away; registering again" in log


def test_a_refused_rehome_is_said_and_the_same_migration_delivered_again_moves_it(icd, pool, hosts, pki, guest_agent):
    """A ticket the pool refuses (not this session's) is the rehome's
    outcome for the session, which stays usable; the same migration
    delivered again with its own ticket moves it, once."""
    agent = guest_agent(DOMAIN)
    with icd_support.Solver(icd, solver_env(icd, pool, pki, agent)) as solver:
        first_step = solver.ask("step 3")
        sid = registered(agent, solver)["sid"]
        assert bind(hosts["hostA"], agent, "hostA", DOMAIN, sid)["bound"] == [sid]
        token = register_token(hosts["hostA"], DOMAIN)
        record = hosts["hostB"].call("open_migration", domain_uuid=DOMAIN, token=token)
        hosts["hostA"].call("switchover", domain_uuid=DOMAIN, migration_id=record["migration_id"])
        tickets = hosts["hostB"].call("complete", domain_uuid=DOMAIN, migration_id=record["migration_id"])["tickets"]
        identity = {"host_id": "hostB", "pool_endpoint": endpoint(pool, "hostB")}
        with GuestChannel(agent.port_path) as channel:
            channel.connect()
            refused = channel.request("rehome", migration_id=record["migration_id"], identity=identity,
                                      tickets={sid: tickets[sid][:-4] + "AAAA"})
            assert not refused["ok"] and refused["sessions"][sid]["error"]["code"] == "TICKET_INVALID", refused
            moved = channel.request("rehome", migration_id=record["migration_id"], identity=identity,
                                    tickets=tickets)
        assert moved["ok"] and moved["attempts"] == 2 and moved["sessions"][sid]["ticket"], moved
        hosts["hostA"].call("close", domain_uuid=DOMAIN, migration_id=record["migration_id"])
        assert pool.session(sid)["bound_host"] == "hostB"
        assert solver.ask("step 3") == "step: 6 0 0" and first_step == "step: 3 0 0"
        log = solver.finish()
    assert log.count("resumed at") == 1, log


# The agent as a guest runs it: its own process (``accelmig-agent run``), in
# a mount namespace of its own where /sys/class/dmi/id/product_uuid is the
# domain's (this machine has no SMBIOS table; the agent reads its path).
SMBIOS = ("mount -t tmpfs accelmig-test-dmi /sys/class && mkdir -p /sys/class/dmi/id && "
          "printf '%s\\n' \"$ACCELMIG_TEST_DOMAIN\" > /sys/class/dmi/id/product_uuid && exec \"$@\"")


@pytest.fixture
def agent_process(tmp_path):
    directory = tmp_path / "agent-process"
    directory.mkdir()
    agent = AgentProcess(directory, env={"ACCELMIG_TEST_DOMAIN": DOMAIN.upper()},
                         wrapper=["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", SMBIOS, "sh"])
    try:
        yield agent
    finally:
        agent.stop()
        assert agent.raw == [], "\n".join(agent.raw)      # no traceback of a dying thread


@pytest.mark.root
def test_a_real_agent_process_rehomes_the_session_through_guest_exec(icd, pool, hosts, pki, agent_process,
                                                                     reference):
    """The whole guest side as processes: the driver registers with a
    running ``accelmig-agent``, proves its binding for the domain that
    agent reads from SMBIOS, and a real migration's tickets reach it the
    way hostd's guest-exec brings them (``accelmig-agent rehome --stdin``,
    root's call on the agent's socket): results bit-identical to local
    PoCL's, resumed once, at hostB."""
    agent = agent_process
    env = icd_support.driver_env(icd, endpoint(pool, "hostA"), TOKEN, cafile=str(pki.ca),
                                 ACCELMIG_AGENT_SOCKET=str(agent.socket), ACCELMIG_ICD_LOG="info")
    with icd_support.Solver(icd, env) as solver:
        out = [solver.ask(command) for command in SCRIPT[:2]]
        opened = agent.wait_log(lambda e: re.match(r"session \S+ opened by pid %d " % solver.pid, e["msg"]))
        sid = opened["msg"].split()[1]
        assert pool.session(sid)["claimed_domain"] == DOMAIN          # what the agent's process read
        with GuestChannel(str(agent.channel)) as channel:
            channel.connect()
            challenge = hosts["hostA"].call("bind_challenge")
            answer = channel.request("prove", host="hostA", challenges={challenge["instance"]: challenge["challenge"]},
                                     sids=[sid])
        bound = hosts["hostA"].call("bind_sessions", domain_uuid=DOMAIN, challenge=challenge["challenge"],
                                    sessions=answer["proofs"])
        assert bound["bound"] == [sid], bound
        token = register_token(hosts["hostA"], DOMAIN)
        record = hosts["hostB"].call("open_migration", domain_uuid=DOMAIN, token=token)
        hosts["hostA"].call("switchover", domain_uuid=DOMAIN, migration_id=record["migration_id"])
        done = hosts["hostB"].call("complete", domain_uuid=DOMAIN, migration_id=record["migration_id"])
        document = {"migration_id": record["migration_id"], "tickets": done["tickets"],
                    "identity": {"host_id": "hostB", "pool_endpoint": endpoint(pool, "hostB")}}
        rehome = run_cli("accelmig-agent", "rehome", "--stdin", "--socket", str(agent.socket),
                         input=json.dumps(document), timeout=60)
        hosts["hostA"].call("close", domain_uuid=DOMAIN, migration_id=record["migration_id"])
        assert rehome.returncode == 0, rehome.stderr
        moved = json.loads(rehome.stdout)
        assert moved["ok"] and moved["sessions"][sid]["ok"] and moved["sessions"][sid]["epoch"] == 2, moved
        assert pool.session(sid)["bound_host"] == "hostB"
        out += [solver.ask(command) for command in SCRIPT[2:]]
        log = solver.finish()
    assert out == reference                     # nothing lost, nothing run twice
    assert log.count("resumed at " + endpoint(pool, "hostB")) == 1, log
