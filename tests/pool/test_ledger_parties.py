"""The ledger's memory of parties is bounded, against a real pool (TLS-less
control plane with host MACs, real drivers' sessions): a host cannot grow
the intents it holds without end, and a domain whose last session is gone
has no host any more (its old host neither keeps other hosts out of it nor
costs the pool memory for ever).  Both failed on main before issue 29."""

from __future__ import annotations

import pytest

from accelmig.agent.driver import connect
from accelmig.lab.poolthread import PoolThread
from accelmig.pool.ledger.parties import MAX_INTENTS
from accelmig.wire.control import ControlClient
from accelmig.wire.errors import BadRequest
from tests.support.attest import bind
from tests.support.tenants import ALICE, TENANTS
from tests.support.wait import wait_for

SECRETS = {"hostA": "secret-of-host-a-0001", "hostB": "secret-of-host-b-0001"}
DOMAIN = "5f0c1f4e-0000-4000-8000-0000000000d1"


@pytest.fixture
def pool():
    with PoolThread(TENANTS, hosts={"hostA": (SECRETS["hostA"], ["127.0.0.1/32"]),
                                    "hostB": (SECRETS["hostB"], ["10.99.0.0/24"])}) as harness:
        yield harness


@pytest.fixture
def hosts(pool):
    clients = {name: ControlClient(pool.control_endpoint, name, secret.encode())
               for name, secret in SECRETS.items()}
    yield clients
    for client in clients.values():
        client.close()


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
        bind(hosts["hostA"], dev, DOMAIN)
    wait_for(lambda: pool.call(lambda: sid not in pool.pool.sessions), what="the released session gone")
    record = hosts["hostB"].call("open_migration", domain_uuid=DOMAIN)
    assert record["source_host"] is None and not record["vouched"]
    assert pool.call(lambda: DOMAIN not in pool.pool.ledger.parties.domain_hosts)
