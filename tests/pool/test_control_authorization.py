"""Hypervisor hosts authenticated on the control plane may still not touch
what is another host's (issue 14, item 6, the parts about bindings, saved
domains and networks): a real pool, real drivers, real control clients.

hostA owns 127.0.0.1 (the drivers below connect from there), hostB is
another authenticated host that tries its luck.
"""

from __future__ import annotations

import pytest

from accelmig.agent.driver import connect
from accelmig.pool.testing import PoolThread
from accelmig.wire.control import ControlClient
from accelmig.wire.errors import BadRequest, Conflict, Forbidden
from tests.support.tenants import ALICE, TENANTS

SECRETS = {"hostA": "secret-of-host-a-0001", "hostB": "secret-of-host-b-0001"}
DOMAIN = "5f0c1f4e-0000-4000-8000-00000000000a"


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


def test_a_session_is_bound_to_the_host_its_connection_comes_from(pool, hosts):
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        assert pool.session(dev.sid)["bound_host"] == "hostA"
        with pytest.raises(Conflict, match="bound to host hostA, not hostB"):
            hosts["hostB"].call("bind_session", sid=dev.sid, domain_uuid=DOMAIN)
        assert pool.session(dev.sid)["domain_uuid"] is None


def test_only_the_bound_host_unbinds(pool, hosts):
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        hosts["hostA"].call("bind_session", sid=dev.sid, domain_uuid=DOMAIN)
        with pytest.raises(Forbidden, match="bound to host hostA"):
            hosts["hostB"].call("unbind_session", sid=dev.sid)
        assert pool.session(dev.sid)["domain_uuid"] == DOMAIN
        hosts["hostA"].call("unbind_session", sid=dev.sid)
        assert pool.session(dev.sid)["domain_uuid"] is None


@pytest.mark.parametrize("retention", [0.001, -5, 1e300, "60", True])
def test_a_retention_out_of_range_is_refused(pool, hosts, retention):
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        hosts["hostA"].call("bind_session", sid=dev.sid, domain_uuid=DOMAIN)
        with pytest.raises(BadRequest, match="retention must be seconds from 1 to"):
            hosts["hostA"].call("park", domain_uuid=DOMAIN, retention=retention)
        assert pool.session(dev.sid)["state"] == "attached"


def test_only_the_host_of_a_domain_parks_it(pool, hosts):
    with connect(pool.endpoint, ALICE, agent=False) as dev:
        hosts["hostA"].call("bind_session", sid=dev.sid, domain_uuid=DOMAIN)
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
        assert hosts["hostA"].call("bind_session", sid=dev.sid, domain_uuid=DOMAIN)["bound_host"] == "hostA"
