"""The addresses this host gives its guests' fabric NICs (a host-bound
fabric: every host its own subnet).

``GuestAddressAllocator`` leases one address of ``fabric.guest_subnet`` to
each domain UUID and keeps the leases in one JSON file (written to a
temporary file and renamed, under an ``flock``), so a restarted hostd, the
hook and the CLI all see the same leases and a domain keeps its address.
``guest_nic`` is what the guest's fabric NIC must take here: that address,
the subnet's prefix, the gateway, MTU and routes.  A domain's lease is
released when the domain is undefined on this host.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import json
import logging
import os
import uuid as uuid_module
from pathlib import Path
from typing import TYPE_CHECKING

from accelmig.runtime.files import atomic_write
from accelmig.wire.errors import BadRequest, ConfigInvalid, Unavailable
from accelmig.wire.identity import GuestNic

if TYPE_CHECKING:  # pragma: no cover
    from accelmig.plugin.config import FabricConfig, HostConfig

__all__ = ["GuestAddressAllocator", "LEASES_FILE", "guest_nic", "spare_key"]

log = logging.getLogger(__name__)

#: The allocator's file under ``hostd.state_dir``.
LEASES_FILE = "guest-leases.json"
_LEASES_VERSION = 1


def guest_nic(fabric: "FabricConfig", address: str, mac: str | None = None) -> GuestNic:
    """The fabric NIC's settings on this host for a guest given ``address``."""
    if fabric.guest_subnet is None:
        raise BadRequest(reason="guest NIC: this host's fabric is not host-bound (no fabric.guest_subnet)")
    return GuestNic(address=str(address), prefixlen=fabric.guest_subnet.prefixlen,
                    gateway=str(fabric.gateway) if fabric.gateway is not None else None,
                    mtu=fabric.mtu, mac=mac, routes=tuple(fabric.routes))


#: the namespace of the spare addresses' keys (``spare_key``)
_SPARE_NAMESPACE = uuid_module.UUID("6d1f3f0e-52a4-4f0e-9a8e-7a1c2b0f5e11")


def spare_key(domain_uuid: str) -> str:
    """The lease key of a domain's second address (hostd's ``rehome_here``
    moves the NIC between the two): a UUID of its own, derived from the
    domain's, so the spare is leased like any address and never given to
    another guest; released with the domain's own lease."""
    return str(uuid_module.uuid5(_SPARE_NAMESPACE, _domain_key(domain_uuid)))


def _domain_key(domain_uuid: str) -> str:
    try:
        return str(uuid_module.UUID(str(domain_uuid)))
    except ValueError:
        raise BadRequest(reason=f"guest address lease: {domain_uuid!r} is not a domain UUID") from None


class GuestAddressAllocator:
    """Stable guest addresses per domain UUID from one subnet, kept on disk.

    A domain's first address is chosen from a hash of its UUID (probing on
    from there past taken ones), so it is the same even if the lease file
    were lost and nothing collided.  Never the network, broadcast or gateway
    address.  Every call re-reads the file under an exclusive ``flock`` and
    writes it back atomically (temporary file, fsync, rename, fsync of the
    directory): concurrent processes and restarts keep consistent leases.
    """

    def __init__(self, state_path: str | os.PathLike, subnet, gateway=None):
        self.path = Path(state_path)
        try:
            self.subnet = ipaddress.ip_network(str(subnet), strict=True)
        except ValueError as exc:
            raise ConfigInvalid(source=str(self.path), reason=f"guest subnet {subnet!r}: {exc}") from None
        if self.subnet.num_addresses < 4:
            raise ConfigInvalid(source=str(self.path), reason=f"guest subnet {self.subnet} is too small")
        if gateway is None:
            self.gateway = self.subnet.network_address + 1
        else:
            self.gateway = ipaddress.ip_address(str(gateway))
            if self.gateway not in self.subnet:
                raise ConfigInvalid(source=str(self.path),
                                    reason=f"gateway {self.gateway} is not in guest subnet {self.subnet}")
        # Usable offsets from the network address: 1 .. last (v4 keeps broadcast out).
        self._last = self.subnet.num_addresses - (2 if self.subnet.version == 4 else 1)

    @classmethod
    def for_config(cls, config: "HostConfig") -> "GuestAddressAllocator":
        fabric = config.fabric
        if fabric.guest_subnet is None:
            raise BadRequest(reason="guest addresses: this host's fabric has no guest_subnet")
        return cls(Path(config.hostd.state_dir) / LEASES_FILE, fabric.guest_subnet, fabric.gateway)

    @property
    def capacity(self) -> int:
        """How many guests the subnet holds (the gateway excluded)."""
        return self._last - (1 if self._usable(self.gateway) else 0)

    def _usable(self, address) -> bool:
        offset = int(address) - int(self.subnet.network_address)
        return 1 <= offset <= self._last

    # -- public ------------------------------------------------------------

    def allocate(self, domain_uuid: str) -> str:
        """The domain's address: its existing lease, or a new one."""
        key = _domain_key(domain_uuid)
        with self._locked() as leases:
            if key in leases:
                return leases[key]
            taken = set(leases.values())
            if len(taken) >= self.capacity:
                raise Unavailable(what=f"a guest address in {self.subnet}",
                                  reason=f"all {self.capacity} addresses are leased (leases in {self.path})")
            for candidate in self._candidates(key):
                text = str(candidate)
                if candidate != self.gateway and text not in taken:
                    leases[key] = text
                    return text
            raise Unavailable(what=f"a guest address in {self.subnet}",  # pragma: no cover
                              reason=f"all {self.capacity} addresses are leased (leases in {self.path})")

    def lookup(self, domain_uuid: str) -> str | None:
        key = _domain_key(domain_uuid)
        return self._read()[0].get(key)

    def release(self, domain_uuid: str) -> str | None:
        """Free the domain's lease; returns the address it had (None: it had none)."""
        key = _domain_key(domain_uuid)
        with self._locked() as leases:
            return leases.pop(key, None)

    def leases(self) -> dict[str, str]:
        """Every lease, domain UUID -> address."""
        return self._read()[0]

    # -- internals ---------------------------------------------------------

    def _candidates(self, key: str):
        count = self._last
        start = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % count
        base = int(self.subnet.network_address) + 1
        for i in range(count):
            yield ipaddress.ip_address(base + (start + i) % count)

    @contextlib.contextmanager
    def _locked(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock_path = self.path.with_name(self.path.name + ".lock")
        with open(lock_path, "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            leases, dirty = self._read()
            before = dict(leases)
            yield leases
            if dirty or leases != before:
                self._write(leases)

    def _read(self) -> tuple[dict[str, str], bool]:
        """The valid leases, and whether the file holds others (to drop on the next write)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}, False
        except OSError as exc:
            raise ConfigInvalid(source=str(self.path),
                                reason=f"cannot read the guest address leases: {exc.strerror}") from None
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or not isinstance(data.get("leases"), dict):
                raise ValueError("no 'leases' object")
        except ValueError as exc:
            raise ConfigInvalid(source=str(self.path),
                                reason=f"the guest address leases are corrupt ({exc}); move the file "
                                       f"away to start afresh (running guests may then get "
                                       f"addresses that others hold)") from None
        out: dict[str, str] = {}
        seen: set[str] = set()
        dirty = False
        for key, value in data["leases"].items():
            try:
                domain = _domain_key(key)
                address = ipaddress.ip_address(str(value))
            except (BadRequest, ValueError):
                log.warning("guest leases %s: dropping malformed lease %r -> %r", self.path, key, value)
                dirty = True
                continue
            if address not in self.subnet or not self._usable(address) or address == self.gateway \
                    or str(address) in seen:
                # The subnet or gateway changed since, or a duplicate: not a valid lease now.
                log.warning("guest leases %s: dropping lease %s -> %s (not usable in %s, gateway %s)",
                            self.path, domain, address, self.subnet, self.gateway)
                dirty = True
                continue
            out[domain] = str(address)
            seen.add(str(address))
        return out, dirty

    def _write(self, leases: dict[str, str]) -> None:
        data = {"version": _LEASES_VERSION, "subnet": str(self.subnet), "gateway": str(self.gateway),
                "leases": dict(sorted(leases.items()))}
        atomic_write(self.path, json.dumps(data, indent=2) + "\n", 0o644)
