"""Apply a host-bound fabric's addressing to the guest's fabric NIC.

When every host gives its guests their own subnet, a migrated guest must
take the address, prefix, gateway, MTU and routes its new host assigned
(``accelmig.wire.identity.GuestNic``) before its drivers reconnect.  This
is netlink from the agent's own process (``rtnetlink``, the standard
library's ``AF_NETLINK``), the one way: spawning processes is slow in a
guest that just migrated (the lab notes: 88-149 ms for three ``ip`` runs
under TCG), and this lies on the accelerator's blackout path.  (The
pyroute2 and ``ip`` ways are gone: nothing chose them, and each was a
second code path to keep right.)

Standard library only.
"""

from __future__ import annotations

import ipaddress

from accelmig.wire.errors import Unavailable
from accelmig.wire.identity import GuestNic


def choose_interface(links: list[tuple[str, str]], mac: str | None) -> str:
    """From (name, MAC) of the Ethernet links: the one with ``mac``, or
    without a MAC to go by, the only one."""
    if mac is not None:
        for name, address in links:
            if address.lower() == mac.lower():
                return name
        raise Unavailable(what=f"the fabric NIC {mac}", reason="no interface has that MAC")
    if len(links) != 1:
        raise Unavailable(what="the fabric NIC",
                          reason=f"{len(links)} Ethernet interfaces and no MAC to choose by")
    return links[0][0]


class NetworkConfigurator:
    """Re-addresses the fabric NIC over netlink (``apply``)."""

    #: how: netlink, the only way (said in the rehome's logs and tests)
    method = "netlink"

    def __init__(self, *removed, **removed_options):
        # The pyroute2 and ip ways were removed (issue 29): a caller that
        # still names one is told so, not silently given netlink.
        if removed or removed_options:
            named = ", ".join([repr(v) for v in removed] + sorted(removed_options))
            raise TypeError(f"NetworkConfigurator takes no arguments (given {named}): the guest's NIC "
                            f"is configured over netlink only (the pyroute2 and ip ways were removed)")

    def apply(self, nic: GuestNic) -> list[str]:
        """Make the NIC match ``nic``; return what changed (human-readable)."""
        from accelmig.agent.daemon.rtnetlink import ARPHRD_ETHER, IFF_UP, RtNetlink, family_of
        changes = []
        target = ipaddress.ip_interface(nic.cidr)
        with RtNetlink() as nl:
            links = [link for link in nl.links() if link["type"] == ARPHRD_ETHER]
            ifname = choose_interface([(link["name"], link["mac"]) for link in links], nic.mac)
            link = next(link for link in links if link["name"] == ifname)
            index = link["index"]
            have = False
            for current in nl.addresses(index, family_of(target)):
                if current == target:
                    have = True
                elif not current.ip.is_link_local:
                    nl.delete_address(index, current)
                    changes.append(f"{ifname}: removed {current}")
            if not have:
                nl.add_address(index, target)
                changes.append(f"{ifname}: added {target}")
            mtu = nic.mtu if nic.mtu and link["mtu"] != nic.mtu else None
            if mtu or not link["flags"] & IFF_UP:
                nl.set_link(index, up=True, mtu=mtu)
                if mtu:
                    changes.append(f"{ifname}: mtu {link['mtu']} -> {mtu}")
            if nic.gateway:
                gateway = ipaddress.ip_address(nic.gateway)
                default = "0.0.0.0/0" if gateway.version == 4 else "::/0"
                for dst in nic.routes or (default,):
                    net = ipaddress.ip_network(dst)
                    nl.replace_route(net, gateway, index)
                    changes.append(f"route {net} via {nic.gateway} dev {ifname}")
        return changes
