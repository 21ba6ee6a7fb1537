"""The lab's tenant network (lab/topology.py): one L2 segment, ``ten0``,
stretched over both hosts by a veth pair, one subnet everywhere, its gateway
on hostA only — a Neutron tenant network's stand-in, where a guest keeps its
address when it migrates.

- fast tier: the plan (addresses, names, MACs, what ``Lab.env()`` says);
- root: real packets.  A namespace standing in for a guest, plugged into
  hostB's ``ten0`` like a tap, pings and connects to the pool's address
  through the L2 to hostA's gateway; the pool sees the guest's own address;
  then the "guest" is plugged into hostA's ``ten0`` instead (its migration)
  and reaches the pool again from the same address.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import threading

import pytest

from accelmig.lab import netns
from accelmig.lab.topology import (BRIDGE, HOSTS, POOL_ADDRESS, TENANT_BRIDGE, TENANT_GATEWAY, TENANT_GATEWAY_HOST,
                                   TENANT_SUBNET, Topology, tenant_address, tenant_link, tenant_net)

GUEST_MAC = "fa:16:3e:77:00:2a"
GUEST_INDEX = 42
PORT = 7070


# ---------------------------------------------------------------- the plan

def test_tenant_plan():
    assert (TENANT_BRIDGE, TENANT_SUBNET, TENANT_GATEWAY, TENANT_GATEWAY_HOST) == (
        "ten0", "10.90.0.0/24", "10.90.0.1", "hostA")
    assert tenant_address(10) == "10.90.0.10/24" and tenant_net(10) == "10.90.0.10/24,10.90.0.1"
    for bad in (0, 1, 255, 300):
        with pytest.raises(ValueError):
            tenant_address(bad)
    # explicit, distinct bridge MACs (fab0 and ten0, both hosts), unicast and locally administered
    macs = [h.bridge_mac for h in HOSTS] + [h.tenant_bridge_mac for h in HOSTS]
    assert len(set(macs)) == 4
    assert all(int(m.split(":")[0], 16) & 0b11 == 0b10 for m in macs)
    # the tenant subnet is neither host's guest subnet nor on a host link
    tenant = ipaddress.ip_network(TENANT_SUBNET)
    assert not any(tenant.overlaps(ipaddress.ip_network(h.guest_subnet)) for h in HOSTS)
    names = [tenant_link("hostA", "hostB"), tenant_link("hostB", "hostA")]
    assert names == ["ten-hostB", "ten-hostA"] and all(len(n) <= netns.IFNAMSIZ for n in names)
    assert {TENANT_BRIDGE, BRIDGE, *names} <= set(Topology.LINKS)


def test_env_names_the_tenant_network(tmp_path):
    from accelmig.lab.rig import Lab
    env = Lab("tenant-env", base_dir=tmp_path).env()
    assert env["tenant"] == {"bridge": "ten0", "subnet": "10.90.0.0/24", "gateway": "10.90.0.1",
                             "gateway_host": "hostA"}
    assert env["hosts"]["hostA"]["tenant_bridge_mac"] != env["hosts"]["hostB"]["tenant_bridge_mac"]
    assert env["hosts"]["hostB"]["tenant_bridge"] == "ten0"


# ---------------------------------------------------------------- real packets

def in_ns(ns: str, *argv, timeout: float = 10) -> subprocess.CompletedProcess:
    return subprocess.run(netns.exec_argv(ns, argv), capture_output=True, text=True, timeout=timeout)


def plug_guest(topo: Topology, host: str, guest_ns: str, tap: str = "tap-g42") -> None:
    """The guest's NIC (eth0 in ``guest_ns``) plugged into ``host``'s ten0
    as a tap would be: same MAC and address wherever it is plugged."""
    netns.veth(topo.host_ns[host], tap, guest_ns, "eth0")
    with netns.ipr(topo.host_ns[host]) as ip:
        netns.bridge(ip, TENANT_BRIDGE, ports=[tap])
        netns.set_link(ip, tap)
    with netns.ipr(guest_ns) as ip:
        netns.set_link(ip, "eth0", mac=GUEST_MAC)
        netns.address(ip, "eth0", tenant_address(GUEST_INDEX))
        netns.route(ip, "default", TENANT_GATEWAY)


def unplug_guest(topo: Topology, host: str, tap: str = "tap-g42") -> None:
    with netns.ipr(topo.host_ns[host]) as ip:
        ip.link("del", index=netns.index(ip, tap))          # its peer, the guest's eth0, goes with it


class PoolListener:
    """A TCP listener on the pool's address, inside the pool namespace,
    that records each peer's address."""

    def __init__(self, pool_ns: str):
        with netns.entered(pool_ns):
            self.sock = socket.create_server((POOL_ADDRESS, PORT))
        self.sock.settimeout(10)
        self.peers: list[str] = []

    def accept_one(self) -> str:
        conn, (peer, _port) = self.sock.accept()
        with conn:
            conn.sendall(b"pool\n")
        self.peers.append(peer)
        return peer

    def close(self):
        self.sock.close()


def connect_from(guest_ns: str) -> tuple[str, bytes]:
    """(the guest's source address, what the pool said), from inside the guest namespace."""
    def connect():
        with socket.create_connection((POOL_ADDRESS, PORT), timeout=5) as s:
            return s.getsockname()[0], s.recv(16)
    return netns.in_thread(guest_ns, connect)


def reach_pool(topo: Topology, listener: PoolListener, guest_ns: str) -> str:
    ping = in_ns(guest_ns, "busybox", "ping", "-c", "1", "-W", "3", POOL_ADDRESS)
    assert ping.returncode == 0, ping.stdout + ping.stderr
    result: dict = {}
    server = threading.Thread(target=lambda: result.update(peer=listener.accept_one()))
    server.start()
    try:
        source, said = connect_from(guest_ns)
    finally:
        server.join(15)
    assert said == b"pool\n"
    assert source == result["peer"] == tenant_address(GUEST_INDEX).split("/")[0]     # no NAT
    return result["peer"]


@pytest.mark.root
@pytest.mark.timeout(90)
def test_a_guest_on_B_reaches_the_pool_through_the_stretched_L2_and_keeps_its_address(netns_factory):
    if subprocess.run(["sh", "-c", "command -v busybox"], capture_output=True).returncode != 0:
        pytest.skip("SKIPPED LOUDLY: busybox is not installed (its ping is used)")
    topo = Topology(f"ten{os.getpid() % 100000}")
    dir_state = netns.netns_dir_state()
    guest = netns_factory.add("guest")
    listener = None
    try:
        topo.up()
        topo.up()                                           # idempotent
        a, b = topo.host_ns["hostA"], topo.host_ns["hostB"]
        # the plan, as built: explicit MACs, the veth ends enslaved, the gateway on A only
        for ns, plan, other in ((a, topo.host("hostA"), "hostB"), (b, topo.host("hostB"), "hostA")):
            with netns.ipr(ns) as ip:
                ten = ip.get_links(ifname=TENANT_BRIDGE)[0]
                assert ten.get("address") == plan.tenant_bridge_mac
                port = ip.get_links(ifname=tenant_link(plan.name, other))[0]
                assert port.get("master") == ten["index"]
                addresses = [x.get_attr("IFA_ADDRESS") for x in ip.get_addr(index=ten["index"], family=socket.AF_INET)]
                assert addresses == ([TENANT_GATEWAY] if plan.name == TENANT_GATEWAY_HOST else [])
        route = in_ns(topo.pool_ns, "ip", "route", "get", "10.90.0.77")
        assert "via 10.88.1.2 dev to-hostA" in route.stdout, route.stdout

        listener = PoolListener(topo.pool_ns)
        plug_guest(topo, "hostB", guest.name)
        assert reach_pool(topo, listener, guest.name) == "10.90.0.42"
        # B's own stack has no tenant address: the packets crossed the L2 to A's gateway
        assert "10.90.0." not in in_ns(b, "ip", "-4", "addr").stdout
        neigh = in_ns(guest.name, "ip", "neigh", "show", TENANT_GATEWAY).stdout
        assert topo.host("hostA").tenant_bridge_mac in neigh, neigh

        # "migrate": the same NIC (MAC, address) now plugged into A's ten0
        unplug_guest(topo, "hostB")
        plug_guest(topo, "hostA", guest.name)
        assert reach_pool(topo, listener, guest.name) == "10.90.0.42"
        assert listener.peers == ["10.90.0.42", "10.90.0.42"]
    finally:
        if listener is not None:
            listener.close()
        topo.down()
        topo.down()                                         # idempotent
        netns.restore_netns_dir(dir_state)
    assert topo.exists() == []
