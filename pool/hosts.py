"""The hypervisor hosts the pool knows: their secrets, the networks their
guests' connections come from, what they registered."""

from __future__ import annotations

import ipaddress

from accelmig.pool.config import HostSpec


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
