"""This host's network identity towards the pool, from its routing table.

``host_identity(config)`` asks the kernel (rtnetlink, through pyroute2) how
this host reaches the pool's data plane: the route towards the pool's
address gives the preferred source address and the output interface, whose
MTU and MAC come from the link.  Given a namespace name it asks inside that
network namespace instead (tests; a host whose fabric lives in one).  The
address a guest's fabric NIC takes here is ``accelmig.plugin.addresses``'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import socket
from typing import TYPE_CHECKING

from accelmig.wire.errors import BadRequest, Unavailable
from accelmig.wire.identity import HostIdentity

if TYPE_CHECKING:  # pragma: no cover
    from accelmig.plugin.config import HostConfig

__all__ = ["RouteChanges", "RouteInfo", "host_identity", "resolve_address", "route_towards"]


@dataclasses.dataclass(frozen=True)
class RouteInfo:
    """How this host (or namespace) reaches one destination."""

    destination: str
    source: str                 # preferred source address
    interface: str              # output interface name
    ifindex: int
    mtu: int | None
    mac: str | None             # None for links without one (tun, ip tunnels)
    gateway: str | None         # next hop; None when the destination is on-link


def resolve_address(host: str) -> str:
    """An IP literal as it is; a name through the system resolver (first answer)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise Unavailable(what=f"the pool's address {host!r}", reason=f"cannot resolve it: {exc}") from None
    return infos[0][4][0]


@contextlib.contextmanager
def _rtnl(netns: str | None):
    # pyroute2 takes ~0.2 s to import: only what asks the kernel pays for it.
    from pyroute2 import IPRoute, NetNS
    if netns is None:
        with IPRoute() as ip:
            yield ip
        return
    # flags=0: never create a namespace that is not there (NetNS's default would).
    try:
        ns = NetNS(netns, flags=0)
    except FileNotFoundError:
        raise Unavailable(what=f"network namespace {netns!r}", reason="it does not exist") from None
    except OSError as exc:
        raise Unavailable(what=f"network namespace {netns!r}", reason=exc.strerror or str(exc)) from None
    with ns:
        yield ns


def route_towards(destination: str, *, netns: str | None = None) -> RouteInfo:
    """Ask the kernel's routing table how ``destination`` (an IP address) is reached."""
    from pyroute2.netlink.exceptions import NetlinkError
    try:
        dst = str(ipaddress.ip_address(destination))
    except ValueError:
        raise BadRequest(reason=f"route lookup: {destination!r} is not an IP address") from None
    where = f" in network namespace {netns!r}" if netns else ""
    with _rtnl(netns) as ip:
        try:
            answers = ip.route("get", dst=dst)
        except NetlinkError as exc:
            reason = os.strerror(exc.code) if exc.code else str(exc)
            raise Unavailable(what=f"a route to the pool at {dst}{where}",
                              reason=f"{reason} (errno {exc.code}): this host has no route there") from None
        if not answers:
            raise Unavailable(what=f"a route to the pool at {dst}{where}", reason="the kernel gave no answer")
        route = answers[0]
        oif = route.get("RTA_OIF")
        if oif is None:
            raise Unavailable(what=f"a route to the pool at {dst}{where}",
                              reason="the route has no output interface")
        links = ip.link("get", index=oif)
        link = links[0]
        source = route.get("RTA_PREFSRC")
        if source is None:
            family = socket.AF_INET6 if ":" in dst else socket.AF_INET
            addresses = [a.get("IFA_ADDRESS") for a in ip.addr("dump", index=oif, family=family)]
            addresses = [a for a in addresses if a]
            if not addresses:
                raise Unavailable(what=f"a source address towards {dst}{where}",
                                  reason=f"interface {link.get('IFLA_IFNAME')} has no address")
            source = addresses[0]
    mac = link.get("IFLA_ADDRESS")
    return RouteInfo(destination=dst, source=str(source), interface=str(link.get("IFLA_IFNAME")),
                     ifindex=int(oif), mtu=link.get("IFLA_MTU"),
                     mac=mac.lower() if isinstance(mac, str) and len(mac) == 17 else None,
                     gateway=route.get("RTA_GATEWAY"))


def host_identity(config: "HostConfig", *, netns: str | None = None) -> HostIdentity:
    """This host's identity towards the pool (no guest NIC: see
    ``accelmig.plugin.addresses.guest_nic``)."""
    route = route_towards(resolve_address(config.pool.address), netns=netns)
    return HostIdentity(host_id=config.host_id, pool_endpoint=config.pool.endpoint,
                        host_address=route.source, interface=route.interface, mtu=route.mtu,
                        mac=route.mac)


#: rtnetlink's multicast groups (rtnetlink.h) of what can change the route
#: towards the pool: links, IPv4/IPv6 addresses and routes
RTMGRP_LINK, RTMGRP_IPV4_IFADDR, RTMGRP_IPV4_ROUTE = 0x1, 0x10, 0x40
RTMGRP_IPV6_IFADDR, RTMGRP_IPV6_ROUTE = 0x100, 0x400


class RouteChanges:
    """The kernel's word that a link, an address or a route changed, on a
    netlink socket of this network namespace (the standard library's
    ``AF_NETLINK``): hostd keeps its identity cached and refreshes it when
    one comes (and still every few seconds), so no rehome ever discovers
    routes on its path and a changed route is known at once.  Its
    ``fileno`` is readable when something changed; ``drain`` reads it all."""

    GROUPS = RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_IFADDR | RTMGRP_IPV6_ROUTE

    def __init__(self):
        try:
            self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK,
                                      socket.NETLINK_ROUTE)
            self.sock.bind((0, self.GROUPS))
        except (AttributeError, OSError) as exc:
            raise Unavailable(what="route change notifications", reason=str(exc)) from None

    def fileno(self) -> int:
        return self.sock.fileno()

    def drain(self) -> int:
        """Read what the kernel said (never blocks): how many messages, at
        least 1 when its buffer overflowed (something changed, we missed what)."""
        count = 0
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except BlockingIOError:
                return count
            except OSError:               # ENOBUFS: more changes than the buffer held
                return count + 1
            if not data:
                return count
            count += 1

    def close(self) -> None:
        self.sock.close()
