"""The hypervisor hosts the pool knows: their secrets, the networks their
guests' connections come from, what they registered."""

from __future__ import annotations

import ipaddress
import logging
import time

from accelmig.pool.config import HostSpec, parse_networks
from accelmig.wire.errors import BadRequest
from accelmig.wire.values import describe

LOG = logging.getLogger("accelmig.pool")
#: Networks one host may register (each data-plane connection is matched
#: against all of them).
MAX_ADDRESSES = 256


class HostState:
    def __init__(self, spec: HostSpec):
        self.name = spec.name
        self.secret = spec.secret
        self.static_networks = list(spec.addresses)
        self.networks = list(spec.addresses)
        self.identity: dict = {}
        self.registered_at: float | None = None
        self.last_seen: float | None = None

    def update(self, spec: HostSpec) -> bool:
        """A reloaded hosts file's entry for this host (SIGHUP): the secret and
        the static networks change in place, so that the host's open control
        connections verify their next call with the new secret; the networks
        it registered stay.  Whether anything changed."""
        changed = spec.secret != self.secret or list(spec.addresses) != self.static_networks
        # ``networks`` is always ``static_networks`` + what the host registered
        registered = self.networks[len(self.static_networks):]
        self.secret = spec.secret
        self.static_networks = list(spec.addresses)
        self.networks = self.static_networks + registered
        return changed

    def describe(self) -> dict:
        return {"host": self.name, "networks": [str(n) for n in self.networks],
                "identity": self.identity, "registered_at": self.registered_at,
                "last_seen": self.last_seen}


class HostTable(dict):
    """name -> ``HostState``: the hosts of the pool's hosts file (a reload
    makes a new table that keeps the hosts it still names)."""

    @classmethod
    def of(cls, specs: dict[str, HostSpec]) -> "HostTable":
        return cls({name: HostState(spec) for name, spec in specs.items()})

    def register(self, name: str, addresses=(), identity=None) -> dict:
        """Host ``name`` (authenticated) registers the networks its guests'
        connections come from and its identity.  The longest prefix
        attributes a guest's connection to a host: a network that overlaps
        another host's would take its guests, and is refused (the others
        are kept)."""
        host = self[name]
        if not isinstance(addresses, (list, tuple)) or len(addresses) > MAX_ADDRESSES:
            raise BadRequest(reason=f"register_host: addresses must be a list of at most "
                                    f"{MAX_ADDRESSES} networks, not {describe(addresses)}")
        if identity is not None and not isinstance(identity, dict):
            raise BadRequest(reason=f"register_host: identity must be an object, not {describe(identity)}")
        wanted = parse_networks(addresses, f"register_host({name})")
        taken = {net: other.name for other in self.values() if other is not host for net in other.networks}
        kept, refused = [], []
        for net in wanted:
            clash = next((f"{n} of host {owner}" for n, owner in taken.items()
                          if n.version == net.version and n.overlaps(net)), None)
            if clash is None:
                kept.append(net)
            else:
                refused.append({"network": str(net), "overlaps": clash})
                LOG.warning("host %s: registration of %s refused: it overlaps %s", name, net,
                            clash, extra={"host": name})
        host.networks = host.static_networks + kept
        host.identity = dict(identity or {})
        host.registered_at = time.time()
        LOG.info("host %s registered: %s", name, ", ".join(str(n) for n in host.networks), extra={"host": name})
        return dict(host.describe(), refused=refused)

    def for_address(self, address: str) -> str | None:
        return host_for_address(self.values(), address)


def host_for_address(hosts, address: str) -> str | None:
    """The host whose networks hold ``address`` (the longest prefix wins)."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return None
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped      # a dual-stack socket reports IPv4 peers this way
    best, best_len = None, -1
    for host in hosts:
        for net in host.networks:
            if ip.version == net.version and ip in net and net.prefixlen > best_len:
                best, best_len = host.name, net.prefixlen
    return best
