"""Apply a host-bound fabric's addressing to the guest's fabric NIC.

When every host gives its guests their own subnet, a migrated guest must
take the address, prefix, gateway, MTU and routes its new host assigned
(``accelmig.wire.identity.GuestNic``) before its drivers reconnect.  This
is netlink from the agent's own process (``rtnetlink``, the standard
library's ``AF_NETLINK``): spawning processes is slow in a guest that just
migrated (the lab notes: 88-149 ms for three ``ip`` runs under TCG), and
this lies on the accelerator's blackout path.  ``method="pyroute2"`` uses
pyroute2 where a guest has it, ``method="ip"`` the ``ip`` tool (iproute2
or busybox) with the fewest commands.

Standard library only (pyroute2 is optional).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import shutil
import subprocess

from accelmig.wire.errors import Unavailable
from accelmig.wire.identity import GuestNic

LOG = logging.getLogger(__name__)


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


METHODS = ("netlink", "pyroute2", "ip")


class NetworkConfigurator:
    def __init__(self, use_pyroute2: bool | None = None, ip_tool: str | None = None, method: str | None = None):
        """``method``: netlink (the default), pyroute2 or ip; ``use_pyroute2``
        True or False is the older way to say pyroute2 or ip."""
        if method is None:
            method = "netlink" if use_pyroute2 is None else ("pyroute2" if use_pyroute2 else "ip")
        if method not in METHODS:
            raise ValueError(f"network method {method!r} ({', '.join(METHODS)})")
        self.method = method
        self.ip_tool = ip_tool or shutil.which("ip") or "/sbin/ip"

    def apply(self, nic: GuestNic) -> list[str]:
        """Make the NIC match ``nic``; return what changed (human-readable)."""
        if self.method == "netlink":
            return self._apply_netlink(nic)
        if self.method == "pyroute2":
            return self._apply_pyroute2(nic)
        return self._apply_ip(nic)

    # -- netlink (standard library) ----------------------------------------------------
    def _apply_netlink(self, nic: GuestNic) -> list[str]:
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

    # -- pyroute2 --------------------------------------------------------------------
    def _apply_pyroute2(self, nic: GuestNic) -> list[str]:
        from pyroute2 import IPRoute
        changes = []
        target = ipaddress.ip_interface(nic.cidr)
        with IPRoute() as ip:
            links = [(link.get_attr("IFLA_IFNAME"), link.get_attr("IFLA_ADDRESS") or "")
                     for link in ip.get_links() if link["ifi_type"] == 1]      # ARPHRD_ETHER
            ifname = choose_interface(links, nic.mac)
            index = ip.link_lookup(ifname=ifname)[0]
            link = ip.get_links(index)[0]
            if nic.mtu and link.get_attr("IFLA_MTU") != nic.mtu:
                ip.link("set", index=index, mtu=nic.mtu)
                changes.append(f"{ifname}: mtu {link.get_attr('IFLA_MTU')} -> {nic.mtu}")
            have = False
            for addr in ip.get_addr(index=index, family=target.version == 4 and 2 or 10):
                current = ipaddress.ip_interface(f"{addr.get_attr('IFA_ADDRESS')}/{addr['prefixlen']}")
                if current == target:
                    have = True
                elif not current.ip.is_link_local:
                    ip.addr("del", index=index, address=str(current.ip), prefixlen=current.network.prefixlen)
                    changes.append(f"{ifname}: removed {current}")
            if not have:
                ip.addr("add", index=index, address=str(target.ip), prefixlen=target.network.prefixlen)
                changes.append(f"{ifname}: added {target}")
            if link.get_attr("IFLA_OPERSTATE") != "UP":
                ip.link("set", index=index, state="up")
            if nic.gateway:
                for dst in nic.routes or ("0.0.0.0/0",):
                    net = ipaddress.ip_network(dst)
                    ip.route("replace", dst=str(net.network_address), dst_len=net.prefixlen,
                             gateway=nic.gateway, oif=index)
                    changes.append(f"route {net} via {nic.gateway} dev {ifname}")
        return changes

    # -- the ip tool ------------------------------------------------------------------
    def _ip(self, *args) -> str:
        out = subprocess.run([self.ip_tool, *args], capture_output=True, text=True, timeout=10)
        if out.returncode != 0:
            raise Unavailable(what=f"ip {' '.join(args)}", reason=out.stderr.strip() or f"exit {out.returncode}")
        return out.stdout

    def _current_addresses(self, ifname: str) -> list:
        out = self._ip("-o", "-4", "addr", "show", "dev", ifname)
        found = []
        for line in out.splitlines():
            words = line.split()
            if "inet" in words:
                found.append(ipaddress.ip_interface(words[words.index("inet") + 1]))
        return found

    def _links(self) -> list[tuple[str, str]]:
        links = []
        for line in self._ip("-o", "link", "show").splitlines():
            words = line.split()
            if "link/ether" in words and len(words) > 1:
                links.append((words[1].rstrip(":").split("@")[0], words[words.index("link/ether") + 1]))
        return links

    def _apply_ip(self, nic: GuestNic) -> list[str]:
        ifname = choose_interface(self._links(), nic.mac)
        changes = []
        target = ipaddress.ip_interface(nic.cidr)
        current = self._current_addresses(ifname)
        if target not in current or len(current) > 1:
            # One flush removes the old host's address, whatever it was.
            self._ip("addr", "flush", "dev", ifname)
            self._ip("addr", "add", nic.cidr, "dev", ifname)
            changes += [f"{ifname}: removed {c}" for c in current if c != target]
            changes.append(f"{ifname}: added {target}")
        # Up in any case: a guest that booted without an address has it down.
        self._ip("link", "set", "dev", ifname, *(("mtu", str(nic.mtu)) if nic.mtu else ()), "up")
        if nic.mtu:
            changes.append(f"{ifname}: mtu {nic.mtu}")
        if nic.gateway:
            for dst in nic.routes or ("default",):
                self._ip("route", "replace", dst, "via", nic.gateway, "dev", ifname)
                changes.append(f"route {dst} via {nic.gateway} dev {ifname}")
        return changes


def describe(nic: GuestNic | None) -> str:
    return json.dumps(nic.to_wire()) if nic else "none"
