"""A rehome that moves two real sessions to a new host whose subnet is in
another network namespace.  The agent runs in the guest namespace and does
the guest's part itself: it re-addresses the fabric NIC (netlink from the
standard library, the default; pyroute2; or the ``ip`` tool) and tells
both drivers to resume from their new address."""

from __future__ import annotations

import threading

import pytest

from accelmig.agent.daemon import Agent
from accelmig.agent.daemon.netconfig import NetworkConfigurator
from accelmig.agent.driver import connect
from accelmig.lab.poolthread import PoolThread
from accelmig.plugin.channel import GuestChannel
from accelmig.wire.control import ControlClient
from tests.conftest import ALICE, TENANTS
from tests.support.attest import bind
from tests.support.twohosts import SECRETS
from tests.support.topology import GATEWAYS, GUEST_ADDRESSES, GUEST_MAC, POOL_ADDRESS, SUBNETS, MovingGuest
from tests.support.wait import wait_for

pytestmark = pytest.mark.root


@pytest.mark.parametrize("method", ["netlink", "pyroute2", "ip"])
def test_rehome_two_sessions_into_another_namespace(netns_factory, tmp_path, method):
    net = MovingGuest.build(netns_factory)
    hosts = {name: (SECRETS[name], [SUBNETS[name]]) for name in ("hostA", "hostB")}
    pool = PoolThread(TENANTS, hosts, listen="0.0.0.0:0", control_listen="0.0.0.0:0")
    with net.pool.entered():
        pool.start()
    agent = Agent(str(tmp_path / "channel.sock"), str(tmp_path / "agent.sock"),
                  state_dir=str(tmp_path / "state"), network=NetworkConfigurator(method=method))
    agent.open()
    try:
        endpoint = f"{POOL_ADDRESS}:{pool.endpoint.rsplit(':', 1)[1]}"
        control_port = pool.control_endpoint.rsplit(":", 1)[1]
        clients = {}
        for name in ("hostA", "hostB"):
            clients[name] = ControlClient(f"{POOL_ADDRESS}:{control_port}", name, SECRETS[name].encode())
            with net.hosts[name].entered():
                clients[name].call("ping")
        with net.guest.entered():          # the agent and the drivers live in the guest
            threading.Thread(target=agent.run, daemon=True).start()
            devs = [connect(endpoint, ALICE, agent=agent.socket_path, timeout=20) for _ in range(2)]
        bufs = [dev.upload(b"weights-%d" % i) for i, dev in enumerate(devs)]
        wait_for(lambda: len(agent.sessions()) >= 2, 5, "the agent to register both sessions", interval=0.02)
        for dev in devs:
            assert pool.session(dev.sid)["bound_host"] == "hostA"
            bind(clients["hostA"], dev, "dom-agent")
        record = clients["hostB"].call("open_migration", domain_uuid="dom-agent")
        clients["hostA"].call("switchover", domain_uuid="dom-agent")
        done = clients["hostB"].call("complete", domain_uuid="dom-agent", migration_id=record["migration_id"])
        net.move_wire("hostB")             # the VM now sits on B; its address is A's
        identity = {"host_id": "hostB", "pool_endpoint": endpoint, "guest_nic": {
            "address": GUEST_ADDRESSES["hostB"], "prefixlen": 24, "gateway": GATEWAYS["hostB"],
            "mac": GUEST_MAC, "mtu": 1400, "routes": [f"{POOL_ADDRESS}/32"]}}
        with GuestChannel(agent.port_path) as host:
            host.connect()
            result = host.request("rehome", migration_id=record["migration_id"], identity=identity,
                                  tickets=done["tickets"], timeout=60)
        assert result["ok"], result
        assert any("added 10.89.2.10/24" in c for c in result["network"])
        assert any("removed 10.89.1.10/24" in c for c in result["network"])
        for dev, buf, i in zip(devs, bufs, range(2)):
            outcome = result["sessions"][dev.sid]
            assert outcome["ok"] and outcome["ticket"] and outcome["seconds"] > 0
            assert dev.read(buf) == b"weights-%d" % i
            state = pool.session(dev.sid)
            assert state["bound_host"] == "hostB" and state["counters"]["bytes_uploaded"] == 9
        with net.guest.ipr() as ipr:
            index = ipr.link_lookup(ifname=net.guest_nic)[0]
            addresses = {f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}" for a in ipr.get_addr(index=index, family=2)}
            assert addresses == {"10.89.2.10/24"}
            assert ipr.get_links(index)[0].get_attr("IFLA_MTU") == 1400
            routes = ipr.route("get", dst=POOL_ADDRESS)
            assert routes[0].get_attr("RTA_GATEWAY") == GATEWAYS["hostB"]
        for dev in devs:
            dev.close()
    finally:
        agent.stop()
        pool.stop()
