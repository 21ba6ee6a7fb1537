"""The lab's network: a pool node and two hypervisor hosts, each a network
namespace, joined by veth pairs (built with the toolkit :mod:`accelmig.lab.netns`).

::

                      pool  (10.88.0.1/32 on lo: the pool's service address)
               to-hostA /  \\ to-hostB            routes: 10.89.1.0/24, 10.90.0.0/24 via 10.88.1.2
          10.88.1.1/30 /    \\ 10.88.2.1/30               10.89.2.0/24 via 10.88.2.2
                      /      \\
          10.88.1.2/30         10.88.2.2/30
             to-pool            to-pool
              hostA --to-hostB----to-hostA-- hostB
                  10.88.3.1/30   10.88.3.2/30       (migration link)
             fab0 10.89.1.1/24       fab0 10.89.2.1/24
             (guests on A)           (guests on B)
             ten0 10.90.0.1/24 --ten-hostB----ten-hostA-- ten0 (no address)
             (the tenant network's gateway: one L2 stretched over both hosts)

- Every address exists only inside the lab's namespaces: nothing touches the
  machine's own network, and several labs (distinct prefixes) can run at once
  with the same addresses.
- Each host routes its guests' subnet to the pool and the pool routes both
  guest subnets back through the right host, **without NAT**: the pool sees
  the guest's own source address (10.89.1.x from A, 10.89.2.x from B), which
  is what accelmig's host identity and the pool's per-host address checks
  are about.
- The **tenant network** is what a Neutron tenant network is to a VM: one
  subnet (10.90.0.0/24) on every host, so a guest's address never changes
  when it migrates.  A bridge ``ten0`` in each host, the two joined by a veth
  pair (each end a port of its host's ``ten0``): one L2 segment.  Its
  gateway 10.90.0.1 lives on hostA's ``ten0`` only (the "network node"):
  a guest on B reaches the pool through the L2 to A, and A routes it (IP
  forwarding is on in the hosts); the pool routes 10.90.0.0/24 back via A.
  Guests attach with ``<interface type='bridge'><source bridge='ten0'/>``
  and ``accelmig.net=10.90.0.N/24,10.90.0.1`` (:func:`tenant_net`).
- Each bridge (``fab0``, ``ten0``) gets an **explicit MAC**: a bridge with a random MAC
  takes its first port's MAC, which libvirt derives from the guest MAC, so
  both hosts' bridges ended up with the same MAC and a migrated guest's
  cached gateway entry still "worked" on B with its old address (docs/lab-notes.md).
- Veths are created inside the namespaces (the peer placed straight into the
  other namespace), never in the root namespace, so names cannot collide
  with anything outside the lab.

**A pool of two nodes** (``Topology(prefix, pool_nodes=2)``, off by default)
adds two namespaces; everything above stays as it is::

                      etcd  (cl0 10.88.8.1/24: a bridge, ports to-pool and to-pool2)
                     /     \\
     to-etcd 10.88.8.2/24   to-etcd 10.88.8.3/24          (the cluster network)
                   /         \\
     pool (10.88.0.1)         pool2 (10.88.0.2/32 on lo)
     (its host links:          to-hostA 10.88.4.1/30 ---- to-pool2 10.88.4.2/30 in hostA
      as above)                to-hostB 10.88.5.1/30 ---- to-pool2 10.88.5.2/30 in hostB

     pool2's routes: 10.89.1.0/24, 10.90.0.0/24 via 10.88.4.2; 10.89.2.0/24 via 10.88.5.2
     hostA: 10.88.0.2/32 via 10.88.4.1        hostB: 10.88.0.2/32 via 10.88.5.1

- ``pool2`` is a second pool node with its own service address on its own
  ``lo`` and its own links to both hosts, so each host (hostd, and its guests
  through ``fab0``/``ten0``) reaches either node directly and a node's death
  or restart touches no other node's links.
- ``etcd`` is a namespace of its own: etcd is neither node's process, so a
  node killed, or etcd restarted, leaves the other where it was.  The pool
  nodes reach it on the cluster network (``cl0``), which carries nothing
  else; no host, no guest is on it (they never talk to etcd).

Setup and teardown are idempotent: ``up()`` completes a half-built topology,
``down()`` removes whatever part of it exists, after killing any process
still inside (a process holding a namespace would keep its links alive
after the name is gone).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import time

from . import netns

LOG = logging.getLogger("accelmig.lab.topology")

POOL_ADDRESS = "10.88.0.1"
BRIDGE = "fab0"

#: A pool of two nodes (``pool_nodes=2``): the second node's service address,
#: the cluster network's bridge (in the etcd namespace) and etcd's address there.
POOL2_ADDRESS = "10.88.0.2"
CLUSTER_BRIDGE = "cl0"
CLUSTER_SUBNET = "10.88.8.0/24"
ETCD_ADDRESS = "10.88.8.1"
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380

#: The tenant network (a Neutron tenant network's stand-in): one L2 segment
#: over both hosts, the same subnet everywhere, its gateway on hostA.
TENANT_BRIDGE = "ten0"
TENANT_SUBNET = "10.90.0.0/24"
TENANT_GATEWAY = "10.90.0.1"
TENANT_GATEWAY_HOST = "hostA"


def tenant_link(host: str, other: str) -> str:
    """The name, in ``host``, of its end of the veth that joins both hosts'
    ``ten0`` (``ten-hostB`` in hostA, ``ten-hostA`` in hostB)."""
    return f"ten-{other}"


def tenant_address(n: int = 10) -> str:
    """The n-th address of the tenant subnet, CIDR (10.90.0.10/24): the same
    on every host."""
    net = ipaddress.ip_network(TENANT_SUBNET)
    if not 1 < n < net.num_addresses - 1:
        raise ValueError(f"tenant address {n}: 2..{net.num_addresses - 2} (1 is the gateway)")
    return f"{net.network_address + n}/{net.prefixlen}"


def tenant_net(n: int = 10) -> str:
    """The guest kernel's ``accelmig.net=`` value on the tenant network
    (``10.90.0.10/24,10.90.0.1``)."""
    return f"{tenant_address(n)},{TENANT_GATEWAY}"


def tenant_gateway_cidr() -> str:
    return f"{TENANT_GATEWAY}/{ipaddress.ip_network(TENANT_SUBNET).prefixlen}"


@dataclasses.dataclass(frozen=True)
class HostPlan:
    """One hypervisor host's addressing."""

    name: str                     # hostA / hostB
    index: int                    # 1 / 2
    uplink: str                   # this host's end of the pool link, CIDR
    pool_side: str                # the pool's end of that link, CIDR
    migration: str                # this host's end of the host<->host link, CIDR
    guest_subnet: str             # the subnet of this host's guests (fab0)
    bridge_mac: str
    tenant_bridge_mac: str        # this host's ten0 (the tenant network's bridge)

    @property
    def address(self) -> str:
        """The host's address on the migration link (what ``--migrateuri`` names)."""
        return self.migration.split("/")[0]

    @property
    def uplink_address(self) -> str:
        """The source address the pool sees for this host's own connections."""
        return self.uplink.split("/")[0]

    @property
    def gateway(self) -> str:
        """The guests' default gateway: fab0's address."""
        return str(next(ipaddress.ip_network(self.guest_subnet).hosts()))

    @property
    def gateway_cidr(self) -> str:
        return f"{self.gateway}/{ipaddress.ip_network(self.guest_subnet).prefixlen}"

    def guest_address(self, n: int = 10) -> str:
        """The n-th guest address of this host's subnet, CIDR (10.89.1.10/24)."""
        net = ipaddress.ip_network(self.guest_subnet)
        return f"{net.network_address + n}/{net.prefixlen}"

    def guest_net(self, n: int = 10) -> str:
        """The guest kernel's ``accelmig.net=`` value (address, gateway)."""
        return f"{self.guest_address(n)},{self.gateway}"


HOSTS = (
    HostPlan("hostA", 1, uplink="10.88.1.2/30", pool_side="10.88.1.1/30", migration="10.88.3.1/30",
             guest_subnet="10.89.1.0/24", bridge_mac="02:ac:4d:00:01:01",
             tenant_bridge_mac="02:ac:4d:00:01:90"),
    HostPlan("hostB", 2, uplink="10.88.2.2/30", pool_side="10.88.2.1/30", migration="10.88.3.2/30",
             guest_subnet="10.89.2.0/24", bridge_mac="02:ac:4d:00:02:01",
             tenant_bridge_mac="02:ac:4d:00:02:90"),
)


@dataclasses.dataclass(frozen=True)
class PoolNodePlan:
    """One pool node's addressing (a pool of two nodes: ``pool`` and ``pool2``)."""

    name: str                     # pool / pool2: its namespace is <prefix>-<name>
    address: str                  # its service address (data and control plane), on its lo
    cluster: str                  # its address on the cluster network (etcd's), CIDR
    #: per host: (this node's end, the host's end) of their link, CIDR
    links: dict

    def host_link(self, host: str) -> str:
        """The name, in ``host``, of its link to this node."""
        return f"to-{self.name}"

    def host_end(self, host: str) -> str:
        """``host``'s address on its link to this node: the source address
        this node sees for that host's own connections."""
        return self.links[host][1].split("/")[0]

    def node_end(self, host: str) -> str:
        return self.links[host][0].split("/")[0]


POOL_NODES = (
    PoolNodePlan("pool", POOL_ADDRESS, cluster="10.88.8.2/24",
                 links={"hostA": ("10.88.1.1/30", "10.88.1.2/30"), "hostB": ("10.88.2.1/30", "10.88.2.2/30")}),
    PoolNodePlan("pool2", POOL2_ADDRESS, cluster="10.88.8.3/24",
                 links={"hostA": ("10.88.4.1/30", "10.88.4.2/30"), "hostB": ("10.88.5.1/30", "10.88.5.2/30")}),
)
#: its MAC, explicit (a bridge without one takes a port's)
CLUSTER_BRIDGE_MAC = "02:ac:4d:00:08:01"


class Topology:
    """The lab's namespaces and links, named ``<prefix>-pool``,
    ``<prefix>-hostA``, ``<prefix>-hostB`` (and, with ``pool_nodes=2``,
    ``<prefix>-pool2`` and ``<prefix>-etcd``)."""

    def __init__(self, prefix: str, pool_nodes: int = 1):
        if not prefix or len(prefix) > 40 or not all(c.isalnum() or c in "-_." for c in prefix):
            raise ValueError(f"lab prefix {prefix!r}: 1-40 characters of [A-Za-z0-9._-]")
        if pool_nodes not in (1, 2):
            raise ValueError(f"pool nodes {pool_nodes!r}: 1 or 2")
        self.prefix = prefix
        self.pool_nodes = pool_nodes
        self.pool_ns = f"{prefix}-pool"
        self.hosts = {h.name: h for h in HOSTS}
        self.host_ns = {h.name: f"{prefix}-{h.name}" for h in HOSTS}
        #: the pool nodes' plans and namespaces (``pool`` first), etcd's namespace
        self.pool_plans = {n.name: n for n in POOL_NODES[:pool_nodes]}
        self.node_ns = {n: f"{prefix}-{n}" for n in self.pool_plans}
        self.etcd_ns = f"{prefix}-etcd" if pool_nodes > 1 else None

    #: Every interface the topology makes (inside its namespaces only).
    LINKS = ("to-pool", "to-hostA", "to-hostB", BRIDGE, TENANT_BRIDGE,
             tenant_link("hostA", "hostB"), tenant_link("hostB", "hostA"),
             "to-pool2", "to-etcd", CLUSTER_BRIDGE)

    @property
    def namespaces(self) -> list[str]:
        extra = [self.node_ns["pool2"], self.etcd_ns] if self.pool_nodes > 1 else []
        return [self.pool_ns, *self.host_ns.values(), *extra]

    def pool_addresses(self) -> list[str]:
        """Every pool node's service address (``pool`` first)."""
        return [plan.address for plan in self.pool_plans.values()]

    def host(self, name: str) -> HostPlan:
        return self.hosts[name]

    def up(self):
        """Create (or complete) the topology."""
        t0 = time.monotonic()
        existing = set(netns.names())
        for name in self.namespaces:
            if name not in existing:
                netns.create(name)
            netns.sysctl(name, {
                "net.ipv6.conf.all.disable_ipv6": "1",      # no DAD/RS noise on lab links
                "net.ipv6.conf.default.disable_ipv6": "1",
                # only the hosts route (their guests' traffic); pool nodes and etcd never
                "net.ipv4.ip_forward": "1" if name in self.host_ns.values() else "0",
            })
        a, b = self.hosts["hostA"], self.hosts["hostB"]
        netns.veth(self.pool_ns, "to-hostA", self.host_ns["hostA"], "to-pool")
        netns.veth(self.pool_ns, "to-hostB", self.host_ns["hostB"], "to-pool")
        netns.veth(self.host_ns["hostA"], "to-hostB", self.host_ns["hostB"], "to-hostA")
        netns.veth(self.host_ns["hostA"], tenant_link("hostA", "hostB"),
                   self.host_ns["hostB"], tenant_link("hostB", "hostA"))
        gateway_host = self.hosts[TENANT_GATEWAY_HOST]
        with netns.ipr(self.pool_ns) as ipr:
            netns.address(ipr, "lo", f"{POOL_ADDRESS}/32")
            for host in (a, b):
                netns.address(ipr, f"to-{host.name}", host.pool_side)
                netns.set_link(ipr, f"to-{host.name}")
                netns.route(ipr, host.guest_subnet, host.uplink_address)
            netns.route(ipr, TENANT_SUBNET, gateway_host.uplink_address)
        for host in (a, b):
            other = b if host is a else a
            tenant_port = tenant_link(host.name, other.name)
            with netns.ipr(self.host_ns[host.name]) as ipr:
                netns.bridge(ipr, BRIDGE, mac=host.bridge_mac)
                netns.bridge(ipr, TENANT_BRIDGE, mac=host.tenant_bridge_mac, ports=[tenant_port])
                netns.address(ipr, "to-pool", host.uplink)
                netns.address(ipr, f"to-{other.name}", host.migration)
                netns.address(ipr, BRIDGE, host.gateway_cidr)
                if host is gateway_host:
                    netns.address(ipr, TENANT_BRIDGE, tenant_gateway_cidr())
                for link in ("to-pool", f"to-{other.name}", BRIDGE, tenant_port, TENANT_BRIDGE):
                    netns.set_link(ipr, link)
                netns.route(ipr, f"{POOL_ADDRESS}/32", host.pool_side.split("/")[0])
        if self.pool_nodes > 1:
            self._second_node_up(gateway_host)
        LOG.info("topology %s up in %.2f s", self.prefix, time.monotonic() - t0)

    def _second_node_up(self, gateway_host: HostPlan):
        """``pool2`` linked to both hosts, and the cluster network: etcd's
        bridge with a port for each pool node (the module docstring's picture)."""
        second = self.pool_plans["pool2"]
        pool2_ns = self.node_ns["pool2"]
        for host in self.hosts.values():
            netns.veth(pool2_ns, f"to-{host.name}", self.host_ns[host.name], second.host_link(host.name))
        for plan in self.pool_plans.values():
            netns.veth(self.etcd_ns, f"to-{plan.name}", self.node_ns[plan.name], "to-etcd")
        with netns.ipr(self.etcd_ns) as ipr:
            ports = [f"to-{name}" for name in self.pool_plans]
            netns.bridge(ipr, CLUSTER_BRIDGE, mac=CLUSTER_BRIDGE_MAC, ports=ports)
            prefixlen = ipaddress.ip_network(CLUSTER_SUBNET).prefixlen
            netns.address(ipr, CLUSTER_BRIDGE, f"{ETCD_ADDRESS}/{prefixlen}")
            for link in (*ports, CLUSTER_BRIDGE):
                netns.set_link(ipr, link)
        for plan in self.pool_plans.values():
            with netns.ipr(self.node_ns[plan.name]) as ipr:
                netns.address(ipr, "to-etcd", plan.cluster)
                netns.set_link(ipr, "to-etcd")
        with netns.ipr(pool2_ns) as ipr:
            netns.address(ipr, "lo", f"{second.address}/32")
            for host in self.hosts.values():
                netns.address(ipr, f"to-{host.name}", second.links[host.name][0])
                netns.set_link(ipr, f"to-{host.name}")
                netns.route(ipr, host.guest_subnet, second.host_end(host.name))
            netns.route(ipr, TENANT_SUBNET, second.host_end(gateway_host.name))
        for host in self.hosts.values():
            with netns.ipr(self.host_ns[host.name]) as ipr:
                netns.address(ipr, second.host_link(host.name), second.links[host.name][1])
                netns.set_link(ipr, second.host_link(host.name))
                netns.route(ipr, f"{second.address}/32", second.node_end(host.name))

    def exists(self) -> list[str]:
        """Which of this lab's namespaces exist now."""
        present = set(netns.names())
        return [n for n in self.namespaces if n in present]

    def pids(self) -> dict[str, list[int]]:
        """PIDs of the processes inside each of this lab's namespaces."""
        return {n: netns.pids_inside([n]) for n in self.namespaces}

    def down(self, kill_timeout: float = 5.0):
        """Remove the topology: processes still inside first, then the
        namespaces (their links and bridges go with them)."""
        t0 = time.monotonic()
        netns.stop_processes_inside(self.exists(), term_timeout=kill_timeout)
        for name in self.exists():
            netns.remove(name)
        LOG.info("topology %s down in %.2f s", self.prefix, time.monotonic() - t0)

    def etc_hosts(self) -> str:
        """An /etc/hosts for the host namespaces: the other lab nodes by name
        (the plain names and the prefixed ones)."""
        lines = ["127.0.0.1\tlocalhost", f"{POOL_ADDRESS}\tpool {self.pool_ns}"]
        if self.pool_nodes > 1:
            lines.append(f"{POOL2_ADDRESS}\tpool2 {self.node_ns['pool2']}")
        for host in self.hosts.values():
            lines.append(f"{host.address}\t{host.name} {self.host_ns[host.name]}")
        return "\n".join(lines) + "\n"
