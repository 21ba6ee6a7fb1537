"""Hypervisor hosts authenticated on the control plane may still not touch
what is another host's (issue 14, item 6): bindings, saved domains,
networks, migration records and the arguments of every call.  A real pool,
real drivers, real control clients.

hostA owns 127.0.0.1 (the drivers below connect from there), hostB is the
destination hostA names or the one that tries its luck, hostC a third
authenticated host that takes no part.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from accelmig.agent.driver import connect
from accelmig.lab.poolthread import PoolThread
from accelmig.pool.controlconn import MAX_WAITS
from accelmig.pool.ledger.parties import INTENT_TTL, MAX_INTENTS
from accelmig.wire import attestation as att
from accelmig.wire.control import AsyncControlClient, ControlClient
from accelmig.wire.errors import BadRequest, Conflict, Forbidden, RecordState
from accelmig.wire.records import RecordView
from tests.support.attest import bind, register_token
from tests.support.tenants import ALICE, BOB, TENANTS
from tests.support.wait import wait_for

SECRETS = {"hostA": "secret-of-host-a-0001", "hostB": "secret-of-host-b-0001",
           "hostC": "secret-of-host-c-0001"}
DOMAIN = "5f0c1f4e-0000-4000-8000-00000000000a"
OTHER = "5f0c1f4e-0000-4000-8000-00000000000b"


@pytest.fixture
def pool():
    with PoolThread(TENANTS, hosts={"hostA": (SECRETS["hostA"], ["127.0.0.1/32"]),
                                    "hostB": (SECRETS["hostB"], ["10.99.0.0/24"]),
                                    "hostC": (SECRETS["hostC"], ["10.98.0.0/24"])}) as harness:
        yield harness


@pytest.fixture
def hosts(pool):
    clients = {name: ControlClient(pool.control_endpoint, name, secret.encode())
               for name, secret in SECRETS.items()}
    yield clients
    for client in clients.values():
        client.close()


def test_a_session_is_bound_to_the_host_its_connection_comes_from(pool, hosts):
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        assert pool.session(dev.sid)["bound_host"] == "hostA"
        with pytest.raises(Conflict, match="bound to host hostA, not hostB"):
            bind(hosts["hostB"], dev, DOMAIN)
        assert pool.session(dev.sid)["domain_uuid"] is None


def test_only_the_bound_host_unbinds(pool, hosts):
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        bind(hosts["hostA"], dev, DOMAIN)
        with pytest.raises(Forbidden, match="bound to host hostA"):
            hosts["hostB"].call("unbind_session", sid=dev.sid, domain_uuid=DOMAIN)
        assert pool.session(dev.sid)["domain_uuid"] == DOMAIN
        hosts["hostA"].call("unbind_session", sid=dev.sid, domain_uuid=DOMAIN)
        assert pool.session(dev.sid)["domain_uuid"] is None


@pytest.mark.parametrize("retention", [0.001, -5, 1e300, "60", True])
def test_a_retention_out_of_range_is_refused(pool, hosts, retention):
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        bind(hosts["hostA"], dev, DOMAIN)
        with pytest.raises(BadRequest, match="retention must be seconds from 1 to"):
            hosts["hostA"].call("park", domain_uuid=DOMAIN, retention=retention)
        assert pool.session(dev.sid)["state"] == "attached"


def test_only_the_host_of_a_domain_parks_it(pool, hosts):
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        bind(hosts["hostA"], dev, DOMAIN)
        with pytest.raises(Forbidden, match="bound to hostA"):
            hosts["hostB"].call("park", domain_uuid=DOMAIN, retention=60)
        assert pool.session(dev.sid)["state"] == "attached"
        parked = hosts["hostA"].call("park", domain_uuid=DOMAIN, retention=60)
        assert parked == {"parked": [dev.sid], "retention": 60.0}


def test_a_host_cannot_register_a_network_inside_another_hosts(pool, hosts):
    answer = hosts["hostB"].call("register_host", addresses=["127.0.0.0/8", "10.99.1.0/24"])
    assert answer["refused"] == [{"network": "127.0.0.0/8", "overlaps": "127.0.0.1/32 of host hostA"}]
    assert "127.0.0.0/8" not in answer["networks"] and "10.99.1.0/24" in answer["networks"]
    # hostA's guests are still hostA's
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        assert bind(hosts["hostA"], dev, DOMAIN)["bound"] == [dev.sid]
        assert pool.session(dev.sid)["bound_host"] == "hostA"


@pytest.fixture
def admin(pool):
    with ControlClient(pool.admin_endpoint, "admin", None) as client:
        yield client


# -- who opens a migration -----------------------------------------------------------
def test_only_the_destination_the_domains_host_named_opens_its_migration(pool, hosts):
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        bind(hosts["hostA"], dev, DOMAIN)
        hosts["hostA"].call("register_intent", domain_uuid=DOMAIN, dest_host="hostB")
        with pytest.raises(Forbidden, match="host hostC may not open a migration of domain .*: it goes "
                                            "to host hostB .named by its host hostA"):
            hosts["hostC"].call("open_migration", domain_uuid=DOMAIN)
        record = hosts["hostB"].call("open_migration", domain_uuid=DOMAIN)
        assert record["vouched"] and record["source_host"] == "hostA"
        # nor may it supersede the migration under way (that would abort it)
        with pytest.raises(Forbidden, match="may not open a migration"):
            hosts["hostC"].call("open_migration", domain_uuid=DOMAIN)
        with pytest.raises(Forbidden, match="may not complete"):
            hosts["hostC"].call("complete", domain_uuid=DOMAIN, migration_id=record["migration_id"])
        hosts["hostA"].call("switchover", domain_uuid=DOMAIN)
        done = hosts["hostB"].call("complete", domain_uuid=DOMAIN, migration_id=record["migration_id"])
        assert set(done["tickets"]) == {dev.sid} and done["record"]["state"] == "completed"


def test_a_host_names_the_destination_only_of_its_own_domains(pool, hosts, admin):
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        bind(hosts["hostA"], dev, DOMAIN)
        with pytest.raises(Forbidden, match="host hostB may not register an intent for domain .*: "
                                            "it runs on host hostA"):
            hosts["hostB"].call("register_intent", domain_uuid=DOMAIN, dest_host="hostB")
        # the admin socket may name one for any domain
        admin.call("register_intent", domain_uuid=DOMAIN, dest_host="hostB")
        with pytest.raises(Forbidden, match="it goes to host hostB"):
            hosts["hostC"].call("open_migration", domain_uuid=DOMAIN)


def test_a_stale_intent_names_no_destination(pool, hosts):
    """``accelmig migrate`` that failed before the destination's hook ran
    leaves its intent behind: after INTENT_TTL it keeps nobody out."""
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        bind(hosts["hostA"], dev, DOMAIN)
        hosts["hostA"].call("register_intent", domain_uuid=DOMAIN, dest_host="hostB", policy="start")
        later = time.time() + INTENT_TTL + 1      # the ledger's clock, moved past the intent's life
        pool.call(lambda: setattr(pool.pool.ledger, "clock", lambda: later))
        record = hosts["hostC"].call("open_migration", domain_uuid=DOMAIN)
        assert record["policy"] == "none" and not record["vouched"]


# -- who acts on a record --------------------------------------------------------------
@pytest.mark.parametrize("method", ["switchover", "close", "commit", "complete", "abort"])
def test_a_host_that_takes_no_part_in_a_migration_cannot_act_on_it(pool, hosts, method):
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        bind(hosts["hostA"], dev, DOMAIN)
        record = hosts["hostB"].call("open_migration", domain_uuid=DOMAIN)
        with pytest.raises(Forbidden, match=f"host hostC may not .* {DOMAIN}/{record['migration_id']}"):
            hosts["hostC"].call(method, domain_uuid=DOMAIN, migration_id=record["migration_id"])
        assert hosts["hostA"].call("list_records")["records"][0]["state"] == "open"


def test_a_record_opened_before_the_pool_knew_the_domain_is_its_sessions_hosts(pool, hosts):
    """A record opened for a domain the pool did not know has no source yet:
    once the domain's sessions are bound, it is theirs, not anyone's."""
    record = hosts["hostB"].call("open_migration", domain_uuid=DOMAIN)
    assert record["source_host"] is None
    mid = record["migration_id"]
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        bind(hosts["hostA"], dev, DOMAIN)     # during pre-copy
        with pytest.raises(Forbidden, match="may not switch over .*: it comes from host hostA"):
            hosts["hostC"].call("switchover", domain_uuid=DOMAIN, migration_id=mid)
        with pytest.raises(Forbidden, match="may not close .*: it comes from host hostA"):
            hosts["hostC"].call("close", domain_uuid=DOMAIN, migration_id=mid)
        with pytest.raises(Conflict, match="host hostB is the destination"):
            hosts["hostB"].call("close", domain_uuid=DOMAIN, migration_id=mid)
        assert hosts["hostA"].call("switchover", domain_uuid=DOMAIN)["source_host"] == "hostA"
        done = hosts["hostB"].call("complete", domain_uuid=DOMAIN, migration_id=mid)
        assert set(done["tickets"]) == {dev.sid}
        assert hosts["hostA"].call("close", domain_uuid=DOMAIN, migration_id=mid)["state"] == "closed"


def test_only_the_host_of_a_domain_unparks_it(pool, hosts, admin):
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        bind(hosts["hostA"], dev, DOMAIN)
        hosts["hostA"].call("park", domain_uuid=DOMAIN, retention=3600)
        with pytest.raises(Forbidden, match="host hostB may not unpark domain .*: its sessions are "
                                            "bound to hostA"):
            hosts["hostB"].call("unpark", domain_uuid=DOMAIN)
        assert pool.session(dev.sid)["parked"]
        assert hosts["hostA"].call("unpark", domain_uuid=DOMAIN) == {"unparked": [dev.sid]}
        hosts["hostA"].call("park", domain_uuid=DOMAIN, retention=3600)
        assert admin.call("unpark", domain_uuid=DOMAIN) == {"unparked": [dev.sid]}


# -- who attests a session ---------------------------------------------------------------
def test_a_destination_attests_another_hosts_session_only_once_that_host_switched_over(pool, hosts):
    """A VM without the accelmig channel reports its sessions only at the
    destination (guest-exec), so the pool knows neither them nor the domain
    before: a record any host can open.  Its destination takes the sessions
    of the domain's host only after that host switched the migration over."""
    with connect(pool.endpoint, ALICE, agent=False) as dev, \
            connect(pool.endpoint, BOB, agent=False) as neighbour:
        # hostC opens a migration of a domain it made up, and reaches for
        # hostA's unattested sessions
        invented = hosts["hostC"].call("open_migration", domain_uuid=OTHER)
        with pytest.raises(RecordState, match="cannot attest session .* before its source switched"):
            bind(hosts["hostC"], neighbour, OTHER)
        assert pool.session(neighbour.sid)["domain_uuid"] is None
        hosts["hostC"].call("abort", domain_uuid=OTHER, migration_id=invented["migration_id"])
        # the real migration of the guest-exec VM from hostA to hostB
        record = hosts["hostB"].call("open_migration", domain_uuid=DOMAIN)
        with pytest.raises(RecordState, match="before its source switched"):
            bind(hosts["hostB"], dev, DOMAIN)
        hosts["hostA"].call("switchover", domain_uuid=DOMAIN)
        assert bind(hosts["hostB"], dev, DOMAIN)["bound"] == [dev.sid]
        assert pool.session(dev.sid)["bound_host"] == "hostA"
        with pytest.raises(Conflict, match="bound to host hostA, not hostC"):
            bind(hosts["hostC"], neighbour, DOMAIN)
        done = hosts["hostB"].call("complete", domain_uuid=DOMAIN, migration_id=record["migration_id"])
        assert set(done["tickets"]) == {dev.sid}
        assert pool.session(neighbour.sid)["domain_uuid"] is None


def test_a_session_is_moved_to_another_domain_by_nobody(pool, hosts):
    """Rebinding is refused even to the session's own host: it unbinds first
    (the session then belongs to no domain, and no migration takes it)."""
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        bind(hosts["hostA"], dev, DOMAIN)
        hosts["hostB"].call("open_migration", domain_uuid=DOMAIN)
        for host in ("hostA", "hostB"):
            with pytest.raises(Conflict):
                bind(hosts[host], dev, OTHER)
        assert pool.session(dev.sid)["domain_uuid"] == DOMAIN


# -- arguments ------------------------------------------------------------------------------
@pytest.mark.parametrize("method, args, message", [
    ("open_migration", {"domain_uuid": DOMAIN, "migration_id": 5}, "migration_id must be a string"),
    ("open_migration", {"domain_uuid": ["x"]}, "domain_uuid must be a string"),
    ("open_migration", {"domain_uuid": DOMAIN, "migration_id": "m" * 300}, "of 1 to 256 characters"),
    ("open_migration", {"domain_uuid": DOMAIN, "postcopy": "no"}, "postcopy must be true or false"),
    ("register_intent", {"domain_uuid": None}, "domain_uuid must be a string"),
    ("bind_sessions", {"sessions": {"s": None}, "domain_uuid": 7}, "domain_uuid must be a string"),
    ("bind_sessions", {"sessions": ["s"], "domain_uuid": DOMAIN}, "sessions must be an object of 1 to 1024"),
    ("bind_sessions", {"sessions": {}, "domain_uuid": DOMAIN}, "sessions must be an object of 1 to 1024"),
    ("bind_sessions", {"sessions": {"s": 7}, "domain_uuid": DOMAIN}, "a proof .a hex string. or null"),
    ("unbind_session", {"sid": "s"}, "missing 1 required positional argument: 'domain_uuid'"),
    ("register_token", {"domain_uuid": DOMAIN, "digest": "xyz"}, "digest must be 16 to 128 lower-case hex"),
    ("open_migration", {"domain_uuid": DOMAIN, "token": 5}, "token must be 16 to 128 lower-case hex"),
    ("abort", {"domain_uuid": DOMAIN, "reason": {"why": 1}}, "reason must be a string"),
    ("list_records", {"open_only": 1}, "open_only must be true or false"),
    ("renew", {"records": [[DOMAIN, 5]]}, "records are .domain_uuid, migration_id. pairs"),
    ("register_host", {"addresses": "10.99.0.0/24"}, "addresses must be a list"),
    ("register_host", {"addresses": [f"10.99.{n}.0/24" for n in range(257)]}, "at most 256 networks"),
    ("register_host", {"addresses": [], "identity": ["x"]}, "identity must be an object"),
])
def test_arguments_of_the_wrong_type_or_size_are_refused(pool, hosts, method, args, message):
    with pytest.raises(BadRequest, match=message):
        hosts["hostB"].call(method, **args)
    # nothing was made of them: every host still reads every record
    for record in hosts["hostA"].call("list_records")["records"]:
        RecordView.from_wire(record)


@pytest.mark.parametrize("timeout", [-1, 601, 1e300, "5", True, None])
def test_a_wait_out_of_range_is_refused(pool, hosts, timeout):
    with pytest.raises(BadRequest, match="timeout must be 0 to 600 seconds"):
        hosts["hostA"].call("wait_record", domain_uuid=DOMAIN, timeout=timeout)


def test_a_connection_holds_only_so_many_waits_and_finished_ones_do_not_count(pool):
    async def run():
        client = AsyncControlClient(pool.control_endpoint, "hostA", SECRETS["hostA"].encode())
        try:
            for _ in range(MAX_WAITS + 10):          # each answered at once
                answer = await client.call("wait_record", domain_uuid=DOMAIN, timeout=0)
                assert answer == {"record": None, "reached": False}
            # pipelined on the one connection, in this order
            pending = [asyncio.ensure_future(client.call_within(600, "wait_record", domain_uuid=DOMAIN,
                                                                timeout=600)) for _ in range(MAX_WAITS)]
            one_more = asyncio.ensure_future(client.call_within(10, "wait_record", domain_uuid=DOMAIN,
                                                                timeout=600))
            with pytest.raises(BadRequest, match=f"{MAX_WAITS} waits already pending on this connection"):
                await one_more
            assert not any(task.done() for task in pending)
            for task in pending:        # (a call failed by a closed connection is sent again)
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        finally:
            await client.close()
    asyncio.run(run())


# -- migration tokens (issue 28, item 2) --------------------------------------------------------
def test_only_the_domains_host_registers_its_token_and_a_token_vouches_for_one_destination(pool, hosts):
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        digest = att.token_digest(att.new_token())
        # a domain with no session here: nothing to vouch for, nothing registered
        assert hosts["hostC"].call("register_token", domain_uuid=OTHER, digest=digest)["registered"] is False
        bind(hosts["hostA"], dev, DOMAIN)
        with pytest.raises(Forbidden, match="host hostB may not register the migration token of domain .*: "
                                            "it runs on host hostA"):
            hosts["hostB"].call("register_token", domain_uuid=DOMAIN, digest=digest)
        token = register_token(hosts["hostA"], DOMAIN)
        # the same token again from its host: unchanged
        assert hosts["hostA"].call("register_token", domain_uuid=DOMAIN,
                                   digest=att.token_digest(token))["state"] == "fresh"
        first = hosts["hostB"].call("open_migration", domain_uuid=DOMAIN, token=token)
        assert first["vouched"]
        assert hosts["hostA"].call("register_token", domain_uuid=DOMAIN,
                                   digest=att.token_digest(token))["state"] == "in_use"
        hosts["hostB"].call("abort", domain_uuid=DOMAIN, migration_id=first["migration_id"])
        # the retry of an aborted migration to the same destination: the same token vouches
        retry = hosts["hostB"].call("open_migration", domain_uuid=DOMAIN, token=token)
        assert retry["vouched"] and retry["migration_id"] != first["migration_id"]
        hosts["hostB"].call("abort", domain_uuid=DOMAIN, migration_id=retry["migration_id"])
        # another host that saw it (or made it up) is vouched for by nobody
        elsewhere = hosts["hostC"].call("open_migration", domain_uuid=DOMAIN, token=token)
        assert not elsewhere["vouched"]
        with pytest.raises(Forbidden, match="nobody vouched for it"):
            hosts["hostC"].call("complete", domain_uuid=DOMAIN, migration_id=elsewhere["migration_id"])


def test_a_token_that_moved_its_domain_is_spent(pool, hosts):
    """The domain's XML still carries its former host's token when it
    arrives: its new host registers it and is told to write its own."""
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        bind(hosts["hostA"], dev, DOMAIN)
        token = register_token(hosts["hostA"], DOMAIN)
        record = hosts["hostB"].call("open_migration", domain_uuid=DOMAIN, token=token)
        hosts["hostA"].call("switchover", domain_uuid=DOMAIN)
        hosts["hostB"].call("complete", domain_uuid=DOMAIN, migration_id=record["migration_id"])
        assert hosts["hostB"].call("register_token", domain_uuid=DOMAIN,
                                   digest=att.token_digest(token))["state"] == "spent"
        # hostA, no longer its host, may not register one
        with pytest.raises(Forbidden, match="it runs on host hostB"):
            hosts["hostA"].call("register_token", domain_uuid=DOMAIN, digest=att.token_digest(token))
        assert register_token(hosts["hostB"], DOMAIN)


def test_a_challenge_is_its_hosts_and_expires(pool, hosts):
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        issued = hosts["hostA"].call("bind_challenge")
        proof = att.bind_proof(dev._session.secret, challenge=issued["challenge"], instance=issued["instance"],
                               host="hostB", domain=DOMAIN, sid=dev.sid)
        with pytest.raises(Forbidden, match="the pool did not issue it to this host, or it expired"):
            hosts["hostB"].call("bind_sessions", domain_uuid=DOMAIN, challenge=issued["challenge"],
                                sessions={dev.sid: proof})
        pool.call(lambda: setattr(pool.pool.ledger.parties.challenges, "ttl", 0.0))
        expired = hosts["hostA"].call("bind_challenge")
        proof = att.bind_proof(dev._session.secret, challenge=expired["challenge"], instance=expired["instance"],
                               host="hostA", domain=DOMAIN, sid=dev.sid)
        with pytest.raises(Forbidden, match="or it expired"):
            hosts["hostA"].call("bind_sessions", domain_uuid=DOMAIN, challenge=expired["challenge"],
                                sessions={dev.sid: proof})
        assert pool.session(dev.sid)["domain_uuid"] is None


# -- what a host reads (issue 28, item 3) --------------------------------------------------------
def test_a_host_reads_only_its_own_sessions_and_the_records_it_takes_part_in(pool, hosts, admin):
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        bind(hosts["hostA"], dev, DOMAIN)
        record = hosts["hostB"].call("open_migration", domain_uuid=DOMAIN)
        mid = record["migration_id"]
        assert [s["sid"] for s in hosts["hostA"].call("list_sessions")["sessions"]] == [dev.sid]
        for host in ("hostB", "hostC"):
            listed = hosts[host].call("list_sessions", domain_uuid=DOMAIN)
            assert listed["sessions"] == [] and listed["elsewhere"] == 1
        assert [s["sid"] for s in admin.call("list_sessions")["sessions"]] == [dev.sid]
        assert hosts["hostC"].call("list_records")["records"] == []
        for host in ("hostA", "hostB"):
            assert [r["migration_id"] for r in hosts[host].call("list_records")["records"]] == [mid]
        with pytest.raises(Forbidden, match="host hostC may not list the sessions of .*: it takes no part"):
            hosts["hostC"].call("record_sessions", domain_uuid=DOMAIN, migration_id=mid)
        with pytest.raises(Forbidden, match="host hostC may not wait for .*: it takes no part"):
            hosts["hostC"].call("wait_record", domain_uuid=DOMAIN, migration_id=mid, timeout=0)
        assert hosts["hostB"].call("wait_record", domain_uuid=DOMAIN, migration_id=mid, timeout=0)["record"]
        # which domains hold sessions, and how many wait to be attested: never an id
        assert hosts["hostC"].call("accel_domains")["domains"] == {DOMAIN: 0}


def test_a_host_unbinds_a_session_only_from_the_domain_it_is_in(pool, hosts):
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        bind(hosts["hostA"], dev, DOMAIN)
        with pytest.raises(Forbidden, match=f"unbind session {dev.sid} from domain {OTHER}: it is not in"):
            hosts["hostA"].call("unbind_session", sid=dev.sid, domain_uuid=OTHER)
        assert pool.session(dev.sid)["domain_uuid"] == DOMAIN


def test_the_source_of_a_migration_still_reads_the_sessions_it_moved(pool, hosts):
    """``accelmig migrate`` on the source counts what the domain's sessions
    sent meanwhile, after they are the destination's."""
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        bind(hosts["hostA"], dev, DOMAIN)
        hosts["hostA"].call("register_intent", domain_uuid=DOMAIN, dest_host="hostB")
        record = hosts["hostB"].call("open_migration", domain_uuid=DOMAIN)
        hosts["hostA"].call("switchover", domain_uuid=DOMAIN)
        hosts["hostB"].call("complete", domain_uuid=DOMAIN, migration_id=record["migration_id"])
        moved = hosts["hostA"].call("list_sessions", domain_uuid=DOMAIN)["sessions"]
        assert [(s["sid"], s["pending_move"]) for s in moved] == [(dev.sid, [DOMAIN, record["migration_id"]])]
        assert hosts["hostC"].call("list_sessions", domain_uuid=DOMAIN)["sessions"] == []


def test_a_post_copy_switchover_by_the_source_vouches_for_the_destination_and_commits(pool, hosts):
    """No token reached the destination (none registered): its own commit
    waits, the source's SUSPENDED_POSTCOPY switchover vouches and commits."""
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        bind(hosts["hostA"], dev, DOMAIN)
        record = hosts["hostB"].call("open_migration", domain_uuid=DOMAIN, postcopy=True)
        with pytest.raises(Forbidden, match="nobody vouched for it"):
            hosts["hostB"].call("commit", domain_uuid=DOMAIN, migration_id=record["migration_id"])
        switched = hosts["hostA"].call("switchover", domain_uuid=DOMAIN, postcopy=True)
        assert (switched["vouched"], switched["state"]) == (True, "committed")
        done = hosts["hostB"].call("complete", domain_uuid=DOMAIN, migration_id=record["migration_id"])
        assert set(done["tickets"]) == {dev.sid}


# -- the ledger's memory of parties is bounded (issue 29; both failed on main before) --------
def domain(n: int) -> str:
    return f"5f0c1f4e-0000-4000-8000-{n:012x}"


def test_a_host_cannot_hold_more_intents_than_the_bound(pool, hosts):
    """Anyone may name the destination of a domain that holds no sessions
    here; before the bound, a host could fill the pool's memory with
    intents for INTENT_TTL."""
    for n in range(MAX_INTENTS):
        hosts["hostB"].call("register_intent", domain_uuid=domain(n), dest_host="hostA")
    with pytest.raises(BadRequest, match=f"hostB holds {MAX_INTENTS} fresh intents already"):
        hosts["hostB"].call("register_intent", domain_uuid=domain(MAX_INTENTS), dest_host="hostA")
    # re-registering one it holds replaces it; another host is not counted against it
    hosts["hostB"].call("register_intent", domain_uuid=domain(0), dest_host="hostA", policy="start")
    hosts["hostA"].call("register_intent", domain_uuid=domain(MAX_INTENTS), dest_host="hostB")


def test_a_domain_whose_last_session_ended_has_no_host(pool, hosts):
    """The host a domain's sessions were bound to stops being its host when
    the last of them ends: it is not the source of the domain's next
    migration (a stale source would be the one host allowed to switch it
    over), and the pool does not keep one entry per domain it ever saw."""
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        sid = dev.sid
        bind(hosts["hostA"], dev, OTHER)
    wait_for(lambda: pool.call(lambda: sid not in pool.pool.sessions), what="the released session gone")
    record = hosts["hostB"].call("open_migration", domain_uuid=OTHER)
    assert record["source_host"] is None and not record["vouched"]
    assert pool.call(lambda: OTHER not in pool.pool.ledger.parties.domain_hosts)
