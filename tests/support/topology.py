"""A guest that moves between two hosts, without a VM: network namespaces.

::

    pool ns  (10.77.0.1 on lo: the pool's service address)
      |-- 10.77.1.1/30 ---- 10.77.1.2/30 -- hostA ns (forwarding) -- 10.89.1.1/24 --+
      |-- 10.77.2.1/30 ---- 10.77.2.2/30 -- hostB ns (forwarding)                     |
                                                                   guest ns: gnic 10.89.1.10/24

The guest has one NIC.  Its far end (the "host side" of the wire, like a
VM's tap on a bridge) lives in the host the guest runs on.  ``move_wire(B)``
moves that far end into hostB and gives it B's gateway address: the guest's
NIC keeps its name and MAC but now sits on B's subnet, where its old address
means nothing — its old TCP connections fail silently, as docs/lab-notes.md measured
for a real VM.  Re-addressing the guest (``readdress_guest``) is what the
guest agent does; tests that are not about the agent call it themselves.

The pool reaches each guest subnet through that subnet's host, with no NAT,
so it sees the guest's own addresses: 10.89.1.0/24 means hostA.
"""

from __future__ import annotations

import dataclasses

from accelmig.lab import netns
from tests.support.netns import NS, NetnsFactory

POOL_ADDRESS = "10.77.0.1"
SUBNETS = {"hostA": "10.89.1.0/24", "hostB": "10.89.2.0/24"}
GATEWAYS = {"hostA": "10.89.1.1", "hostB": "10.89.2.1"}
GUEST_ADDRESSES = {"hostA": "10.89.1.10", "hostB": "10.89.2.10"}
GUEST_MAC = "52:54:00:89:00:10"


@dataclasses.dataclass
class MovingGuest:
    factory: NetnsFactory
    pool: NS
    hosts: dict
    guest: NS
    guest_nic: str
    wire: str          # the far end of the guest's NIC, in the current host
    at: str = "hostA"

    @classmethod
    def build(cls, factory: NetnsFactory) -> "MovingGuest":
        pool = factory.add("pool")
        factory.address(pool, "lo", f"{POOL_ADDRESS}/32")
        hosts = {}
        for index, name in enumerate(("hostA", "hostB"), start=1):
            host = factory.add(name)
            factory.link(pool, host, f"10.77.{index}.1/30", f"10.77.{index}.2/30")
            factory.route(host, f"{POOL_ADDRESS}/32", f"10.77.{index}.1")
            factory.route(pool, SUBNETS[name], f"10.77.{index}.2")
            factory.forwarding(host)
            hosts[name] = host
        guest = factory.add("guest")
        link = factory.link(guest, hosts["hostA"], f"{GUEST_ADDRESSES['hostA']}/24",
                            f"{GATEWAYS['hostA']}/24", mac_a=GUEST_MAC)
        factory.route(guest, "default", GATEWAYS["hostA"])
        return cls(factory, pool, hosts, guest, link.a.ifname, link.b.ifname)

    def move_wire(self, dest: str) -> None:
        """Plug the guest's NIC into ``dest``: its far end moves there."""
        if dest == self.at:
            return
        src_ns, dst_ns = self.hosts[self.at], self.hosts[dest]
        with src_ns.ipr() as ipr:
            ipr.link("set", index=netns.index(ipr, self.wire), net_ns_fd=dst_ns.name)
        with dst_ns.ipr() as ipr:
            netns.address(ipr, self.wire, f"{GATEWAYS[dest]}/24")
            netns.set_link(ipr, self.wire)
        self.at = dest

    def readdress_guest(self, dest: str) -> None:
        """What the guest agent does for a host-bound fabric: new address and route."""
        with self.guest.ipr() as ipr:
            ipr.flush_addr(index=netns.index(ipr, self.guest_nic))
            netns.address(ipr, self.guest_nic, f"{GUEST_ADDRESSES[dest]}/24")
            netns.route(ipr, "default", GATEWAYS[dest])

    def move(self, dest: str) -> None:
        self.move_wire(dest)
        self.readdress_guest(dest)
