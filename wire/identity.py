"""The host identity: what a hypervisor host tells its guests about itself.

A guest's driver must find the pool from wherever the guest runs now.  The
host that runs it says where the pool is *from this host* (``pool_endpoint``),
which address and interface this host uses towards the pool, and — for a
host-bound accelerator fabric, where every host gives its guests their own
subnet — the address, prefix, gateway, MTU and routes the guest's fabric NIC
must take here.  Versioned: a guest agent can outlive host upgrades.

Standard library only.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re

from accelmig.wire.dataplane import parse_endpoint
from accelmig.wire.errors import BadRequest
from accelmig.wire.values import describe, field, is_int

IDENTITY_VERSION = 1
_MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")


#: field -> (its type, whether it is required); every field's type is
#: checked before any is used (a peer may send anything)
_NIC_FIELDS = {"address": (str, True), "prefixlen": (int, True), "gateway": (str, False), "mtu": (int, False),
               "mac": (str, False), "routes": (list, False)}
_IDENTITY_FIELDS = {"host_id": (str, True), "pool_endpoint": (str, True), "host_address": (str, False),
                    "interface": (str, False), "mtu": (int, False), "mac": (str, False),
                    "guest_nic": (dict, False)}


def _fields(data: dict, table: dict, what: str) -> dict:
    """``data``'s fields of ``table``, each checked (an optional one may be
    absent or null): a clear BadRequest, never a TypeError further on."""
    return {key: field(data, key, kind, what) if required else field(data, key, (kind, type(None)), what, None)
            for key, (kind, required) in table.items()}


def _check_ip(value, what: str, allow_none: bool = True):
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, int, float, list, tuple, dict)) or value is None:
        raise BadRequest(reason=f"identity: {what} must be an IP address string, not {describe(value)}")
    try:
        return str(ipaddress.ip_address(str(value)))
    except ValueError:
        raise BadRequest(reason=f"identity: {what} {value!r} is not an IP address") from None


def _check_mac(value, what: str):
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRequest(reason=f"identity: {what} must be a MAC address string, not {describe(value)}")
    text = value.lower()
    if not _MAC.match(text):
        raise BadRequest(reason=f"identity: {what} {value!r} is not a MAC address")
    return text


def _check_mtu(value, what: str):
    if value is None:
        return None
    # 68 is IPv4's minimum; loopback has 65536, jumbo-capable drivers allow more
    if not is_int(value, 68, 2**31 - 1):
        raise BadRequest(reason=f"identity: {what} {value!r} is not an MTU (68 or more)")
    return value


@dataclasses.dataclass(frozen=True)
class GuestNic:
    """How the guest's fabric NIC must be configured on this host."""

    address: str
    prefixlen: int
    gateway: str | None = None
    mtu: int | None = None
    mac: str | None = None                 # which guest NIC (None: the only/first one)
    routes: tuple[str, ...] = ()           # CIDRs to reach through ``gateway`` (e.g. the pool's)

    def __post_init__(self):
        object.__setattr__(self, "address", _check_ip(self.address, "guest address", False))
        if not is_int(self.prefixlen, 0, 32 if ":" not in self.address else 128):
            raise BadRequest(reason=f"identity: prefixlen {self.prefixlen!r} is out of range")
        object.__setattr__(self, "gateway", _check_ip(self.gateway, "gateway"))
        object.__setattr__(self, "mtu", _check_mtu(self.mtu, "guest MTU"))
        object.__setattr__(self, "mac", _check_mac(self.mac, "guest NIC MAC"))
        if self.routes is None:
            object.__setattr__(self, "routes", ())
        if not isinstance(self.routes, (list, tuple)):
            raise BadRequest(reason=f"identity: routes must be a list of CIDRs, not {describe(self.routes)}")
        routes = []
        for route in self.routes:
            if isinstance(route, (bool, int, float, list, tuple, dict)) or route is None:
                raise BadRequest(reason=f"identity: route {describe(route)} is not a CIDR string")
            try:
                routes.append(str(ipaddress.ip_network(str(route), strict=False)))
            except ValueError:
                raise BadRequest(reason=f"identity: route {route!r} is not a CIDR") from None
        object.__setattr__(self, "routes", tuple(routes))

    @property
    def cidr(self) -> str:
        return f"{self.address}/{self.prefixlen}"

    def to_wire(self) -> dict:
        return {"address": self.address, "prefixlen": self.prefixlen, "gateway": self.gateway,
                "mtu": self.mtu, "mac": self.mac, "routes": list(self.routes)}

    @classmethod
    def from_wire(cls, data) -> "GuestNic":
        if not isinstance(data, dict):
            raise BadRequest(reason=f"identity: guest_nic must be an object, not {describe(data)}")
        fields = _fields(data, _NIC_FIELDS, "identity: guest_nic")
        return cls(**dict(fields, routes=tuple(fields["routes"] or ())))


@dataclasses.dataclass(frozen=True)
class HostIdentity:
    """Where the pool is from this host, and how this host reaches it."""

    host_id: str
    pool_endpoint: str                     # data plane HOST:PORT, as guests here reach it
    host_address: str | None = None        # this host's source address towards the pool
    interface: str | None = None           # this host's interface towards the pool
    mtu: int | None = None                 # that interface's MTU
    mac: str | None = None                 # that interface's MAC
    guest_nic: GuestNic | None = None      # for host-bound fabrics
    version: int = IDENTITY_VERSION

    def __post_init__(self):
        if not isinstance(self.host_id, str) or not self.host_id:
            raise BadRequest(reason="identity: host_id must be a non-empty string")
        parse_endpoint(self.pool_endpoint)
        object.__setattr__(self, "host_address", _check_ip(self.host_address, "host address"))
        object.__setattr__(self, "mtu", _check_mtu(self.mtu, "MTU"))
        object.__setattr__(self, "mac", _check_mac(self.mac, "MAC"))
        if self.interface is not None and not isinstance(self.interface, str):
            raise BadRequest(reason="identity: interface must be a string")

    def to_wire(self) -> dict:
        return {"version": self.version, "host_id": self.host_id, "pool_endpoint": self.pool_endpoint,
                "host_address": self.host_address, "interface": self.interface, "mtu": self.mtu,
                "mac": self.mac,
                "guest_nic": self.guest_nic.to_wire() if self.guest_nic is not None else None}

    @classmethod
    def from_wire(cls, data) -> "HostIdentity":
        if not isinstance(data, dict):
            raise BadRequest(reason=f"identity must be an object, not {describe(data)}")
        version = data.get("version", IDENTITY_VERSION)
        if not is_int(version, 1):
            raise BadRequest(reason=f"identity: version must be an integer of 1 or more, not {describe(version)}")
        # A newer host may add fields: ignore the unknown, keep what we know.
        fields = _fields(data, _IDENTITY_FIELDS, "identity")
        nic = fields["guest_nic"]
        return cls(**dict(fields, guest_nic=GuestNic.from_wire(nic) if nic is not None else None),
                   version=min(version, IDENTITY_VERSION))
