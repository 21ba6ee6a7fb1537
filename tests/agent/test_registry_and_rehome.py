"""The agent's driver registry (real driver processes, one of which dies),
rehome of real sessions (idempotent per migration id), and the --stdin path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from accelmig.agent.driver import connect
from accelmig.plugin.channel import GuestChannel
from tests.conftest import ALICE, run_cli
from tests.support.attest import bind
from tests.support.twohosts import TwoHosts, make_pool
from tests.support.wait import wait_for

DRIVER = textwrap.dedent("""
    import sys, time, json
    from accelmig.agent.driver import connect
    dev = connect(sys.argv[1], sys.argv[2], agent=sys.argv[3], timeout=20)
    buf = dev.upload(b"x" * 64)
    print(json.dumps({"sid": dev.sid}), flush=True)
    for line in sys.stdin:         # each line: do one read, report the state
        dev.read(buf)
        print(json.dumps(dev.describe()), flush=True)
""")


def test_registry_with_driver_processes_one_of_which_dies(agent, shared_pool):
    procs = [subprocess.Popen([sys.executable, "-c", DRIVER, shared_pool.endpoint, ALICE, agent.socket_path],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        sids = [json.loads(p.stdout.readline())["sid"] for p in procs]
        with GuestChannel(agent.port_path) as host:
            hello = host.connect()
            listed = wait_for(lambda: len(agent.sessions()) == 3 and agent.sessions())
            assert {s["sid"] for s in listed} == set(sids)
            assert {s["pid"] for s in listed} == {p.pid for p in procs}
            assert {s["sid"] for s in hello["sessions"]} <= set(sids)
            procs[1].send_signal(signal.SIGKILL)            # a driver dies
            procs[1].wait(5)
            closed = host.events.get(timeout=5)
            while closed.get("type") != "session_closed":
                closed = host.events.get(timeout=5)
            assert closed["sid"] == sids[1] and closed["reason"] == "driver gone"
            assert {s["sid"] for s in agent.sessions()} == {sids[0], sids[2]}
            # the survivors are unaffected
            for p in (procs[0], procs[2]):
                p.stdin.write("go\n")
                p.stdin.flush()
                assert json.loads(p.stdout.readline())["state"] == "connected"
    finally:
        for p in procs:
            p.kill()
            p.wait(5)


def test_a_new_session_is_reported_to_the_host(agent, shared_pool):
    with GuestChannel(agent.port_path) as host:
        host.connect()
        with connect(shared_pool.endpoint, ALICE, agent=agent.socket_path) as dev:
            opened = host.events.get(timeout=5)
            while opened.get("type") != "session_opened":
                opened = host.events.get(timeout=5)
            assert opened["sid"] == dev.sid and opened["pid"] == os.getpid()
        closed = host.events.get(timeout=5)
        assert closed["type"] == "session_closed" and closed["reason"] == "closed"


def _migrate_two_sessions(hosts, agent, domain):
    """Two sessions on hostA, registered with the agent; their tickets for B."""
    devs = [connect(hosts.a.endpoint, ALICE, agent=agent.socket_path, timeout=15) for _ in range(2)]
    wait_for(lambda: len(agent.sessions()) == 2)
    for dev in devs:
        bind(hosts.a, dev, domain)
    done = hosts.migrate(domain, hosts.a, hosts.b)
    return devs, done


def test_rehome_moves_every_session_and_is_idempotent_per_migration(agent):
    with make_pool() as pool:
        hosts = TwoHosts(pool)
        devs, done = _migrate_two_sessions(hosts, agent, "dom-rehome")
        bufs = [dev.upload(b"state-%d" % i) for i, dev in enumerate(devs)]
        identity = {"host_id": "hostB", "pool_endpoint": hosts.b.endpoint}
        message = {"migration_id": done["record"]["migration_id"], "identity": identity,
                   "tickets": done["tickets"]}
        with GuestChannel(agent.port_path) as host:
            host.connect()
            first = host.request("rehome", **message)
            second = host.request("rehome", **message)      # delivered again
        assert first["ok"] and set(first["sessions"]) == {d.sid for d in devs}
        assert all(s["ok"] and s["ticket"] for s in first["sessions"].values())
        # the same outcome; only the answer's own clock is this round trip's
        first_clock, second_clock = first.pop("clock"), second.pop("clock")
        assert second == first
        assert first_clock["received"] <= first_clock["answered"] <= second_clock["received"]
        assert set(first["times"]) == {"agent_received", "driver_connected"}     # no guest NIC here
        assert first["times"]["agent_received"] <= first["times"]["driver_connected"]
        assert all("times" not in s for s in first["sessions"].values())   # one aggregate, not per session
        assert agent.stats["rehome_repeated"] == 1
        for dev, buf, i in zip(devs, bufs, range(2)):
            assert dev.stats["resumes"] == 1                  # applied once
            assert dev.read(buf) == b"state-%d" % i
            assert pool.session(dev.sid)["bound_host"] == "hostB"
            dev.close()
        hosts.close()


def test_rehome_reports_sessions_it_cannot_move(agent):
    with make_pool() as pool:
        hosts = TwoHosts(pool)
        devs, done = _migrate_two_sessions(hosts, agent, "dom-partial")
        tickets = dict(done["tickets"])
        tickets["s-not-here"] = "v1.x.y"
        del tickets[devs[1].sid]                      # one session gets no ticket
        with GuestChannel(agent.port_path) as host:
            host.connect()
            result = host.request("rehome", migration_id="m-partial", tickets=tickets,
                                  identity={"host_id": "hostB", "pool_endpoint": hosts.b.endpoint})
        assert result["ok"] is False
        assert result["sessions"][devs[0].sid]["ok"]
        assert result["sessions"][devs[1].sid]["error"]["code"] == "TICKET_REQUIRED"
        assert result["sessions"]["s-not-here"]["error"]["code"] == "NO_SUCH_OBJECT"
        for dev in devs:
            dev.close()
        hosts.close()


def test_two_concurrent_rehomes_of_one_migration_resume_each_session_once(agent):
    """The channel and guest-exec (or two hostds) deliver the same migration
    at once, each with the tickets of its own ``complete``: every session
    resumes exactly once and both deliveries hear success (issue 9)."""
    with make_pool() as pool:
        hosts = TwoHosts(pool)
        devs, first = _migrate_two_sessions(hosts, agent, "dom-race")
        mid = first["record"]["migration_id"]
        second = hosts.b.call("complete", domain_uuid="dom-race", migration_id=mid)
        identity = {"host_id": "hostB", "pool_endpoint": hosts.b.endpoint}
        stdin = subprocess.Popen(
            [os.path.join(os.path.dirname(sys.executable), "accelmig-agent"), "rehome", "--stdin",
             "--socket", agent.socket_path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        with GuestChannel(agent.port_path) as host:
            host.connect()
            stdin.stdin.write(json.dumps({"migration_id": mid, "identity": identity,
                                          "tickets": second["tickets"]}))
            stdin.stdin.close()
            by_channel = host.request("rehome", migration_id=mid, identity=identity,
                                      tickets=first["tickets"])
        out, err = stdin.stdout.read(), stdin.stderr.read()
        assert stdin.wait(60) == 0, err
        by_exec = json.loads(out)
        assert by_channel["ok"] and by_exec["ok"], (by_channel, by_exec)
        assert by_channel["sessions"] == by_exec["sessions"]
        for dev in devs:
            assert dev.stats["resumes"] == 1
            dev.finish()
            assert pool.session(dev.sid)["bound_host"] == "hostB"
            dev.close()
        hosts.close()


def test_a_rehome_delivered_again_retries_only_what_failed(agent):
    """A first delivery whose ticket was refused leaves the session where it
    was; delivering the same migration again with a good ticket resumes it,
    and the session that had already moved is not moved twice."""
    with make_pool() as pool:
        hosts = TwoHosts(pool)
        devs, done = _migrate_two_sessions(hosts, agent, "dom-retry")
        mid = done["record"]["migration_id"]
        identity = {"host_id": "hostB", "pool_endpoint": hosts.b.endpoint}
        broken = dict(done["tickets"], **{devs[1].sid: done["tickets"][devs[0].sid]})   # not its ticket
        with GuestChannel(agent.port_path) as host:
            host.connect()
            first = host.request("rehome", migration_id=mid, identity=identity, tickets=broken)
            assert not first["ok"] and first["sessions"][devs[0].sid]["ok"]
            assert first["sessions"][devs[1].sid]["error"]["code"] == "TICKET_INVALID"
            again = hosts.b.call("complete", domain_uuid="dom-retry", migration_id=mid)["tickets"]
            assert set(again) == {devs[1].sid}         # only the session still moving
            second = host.request("rehome", migration_id=mid, identity=identity, tickets=again)
        assert second["ok"] and second["attempts"] == 2, second
        assert second["sessions"][devs[0].sid] == first["sessions"][devs[0].sid]
        assert agent.stats["rehome_retried"] == 1
        assert [dev.stats["resumes"] for dev in devs] == [1, 1]
        for dev in devs:
            dev.finish()
            assert pool.session(dev.sid)["bound_host"] == "hostB"
            dev.close()
        hosts.close()


def test_rehome_from_stdin(agent):
    with make_pool() as pool:
        hosts = TwoHosts(pool)
        devs, done = _migrate_two_sessions(hosts, agent, "dom-stdin")
        document = {"migration_id": done["record"]["migration_id"], "tickets": done["tickets"],
                    "identity": {"host_id": "hostB", "pool_endpoint": hosts.b.endpoint}}
        out = run_cli("accelmig-agent", "rehome", "--stdin", "--socket", agent.socket_path,
                      input=json.dumps(document), timeout=60)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["ok"] and len(result["sessions"]) == 2
        for dev in devs:
            dev.finish()
            assert pool.session(dev.sid)["bound_host"] == "hostB"
            dev.close()
        hosts.close()


@pytest.mark.parametrize("document, words", [
    ("{not json", "is not JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"migration_id": "m", "identity": {"host_id": "B"}}', "identity lacks 'pool_endpoint'"),
    ('{"identity": {"host_id": "B", "pool_endpoint": "h:1"}}', "migration_id must be a non-empty"),
    ('{"migration_id": "m", "identity": {"host_id": "B", "pool_endpoint": "h:1"}, "tickets": [1]}',
     "tickets must map"),
])
def test_a_broken_rehome_document_is_a_clear_error(agent, document, words):
    out = run_cli("accelmig-agent", "rehome", "--stdin", "--socket", agent.socket_path, input=document)
    assert out.returncode == 2 and words in out.stderr


def test_rehome_without_a_running_agent(tmp_path):
    out = run_cli("accelmig-agent", "rehome", "--stdin", "--socket", str(tmp_path / "none.sock"),
                  input='{"migration_id": "m", "identity": {"host_id": "B", "pool_endpoint": "h:1"}}')
    assert out.returncode == 3 and "no agent answers" in out.stderr


def test_cli_help_explains(tmp_path):
    out = run_cli("accelmig-agent", "--help")
    assert out.returncode == 0 and "virtio-serial" in out.stdout
    out = run_cli("accelmig-agent", "run", "--help")
    assert "--port" in out.stdout and "unix socket" in out.stdout


def test_a_driver_started_before_the_agent_is_registered_once_it_runs(tmp_path, shared_pool, monkeypatch):
    """At boot the application and the agent start together; the agent may
    come second.  The driver must still be registered (else no host can ever
    hand it a ticket)."""
    from accelmig.agent.driver.registry import AgentRegistration
    from tests.support.processes import LoggedProcess
    socket_path = tmp_path / "agent.sock"
    monkeypatch.setenv("ACCELMIG_AGENT_SOCKET", str(socket_path))
    monkeypatch.setattr(AgentRegistration, "ABSENT_BACKOFF", (0.05, 0.2))
    with connect(shared_pool.endpoint, ALICE) as dev:          # agent=None: the environment's socket
        assert not socket_path.exists()
        proc = LoggedProcess(["accelmig-agent", "run", "--port", tmp_path / "channel.sock",
                              "--socket", socket_path, "--state-dir", tmp_path / "state",
                              "--log-format", "json"])
        try:
            entry = proc.wait_log(lambda e: e["msg"].startswith(f"session {dev.sid} opened"))
            assert f"by pid {os.getpid()}" in entry["msg"]
        finally:
            proc.stop()
