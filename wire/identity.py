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

IDENTITY_VERSION = 1
_MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")


def _type_name(value) -> str:
    """How a wrong value is named in an error: its JSON type, and the value when it is short."""
    kind = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            tuple: "a list", dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
    if isinstance(value, (list, tuple, dict)) or value is None:
        return kind                 # never the repr of a container (it may be nested deeply)
    text = repr(value)
    return f"{kind} ({text})" if len(text) <= 40 else kind


def _wire_check(data: dict, key: str, types: tuple, what: str, optional: bool = True) -> None:
    """``data[key]`` (what the peer sent) is one of ``types`` (or absent or
    null where ``optional``): a clear BadRequest, never a TypeError further on."""
    value = data.get(key)
    if value is None and optional:
        return
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = {str: "a string", int: "an integer", list: "a list", dict: "an object", bool: "a boolean"}
        wanted = " or ".join(names.get(t, t.__name__) for t in types) + (" or null" if optional else "")
        raise BadRequest(reason=f"identity: {what} must be {wanted}, not {_type_name(value)}")


def _check_ip(value, what: str, allow_none: bool = True):
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, int, float, list, tuple, dict)) or value is None:
        raise BadRequest(reason=f"identity: {what} must be an IP address string, not {_type_name(value)}")
    try:
        return str(ipaddress.ip_address(str(value)))
    except ValueError:
        raise BadRequest(reason=f"identity: {what} {value!r} is not an IP address") from None


def _check_mac(value, what: str):
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRequest(reason=f"identity: {what} must be a MAC address string, not {_type_name(value)}")
    text = value.lower()
    if not _MAC.match(text):
        raise BadRequest(reason=f"identity: {what} {value!r} is not a MAC address")
    return text


def _check_mtu(value, what: str):
    if value is None:
        return None
    # 68 is IPv4's minimum; loopback has 65536, jumbo-capable drivers allow more
    if not isinstance(value, int) or isinstance(value, bool) or not 68 <= value <= 2**31 - 1:
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
        if not isinstance(self.prefixlen, int) or isinstance(self.prefixlen, bool) or \
                not 0 <= self.prefixlen <= (32 if ":" not in self.address else 128):
            raise BadRequest(reason=f"identity: prefixlen {self.prefixlen!r} is out of range")
        object.__setattr__(self, "gateway", _check_ip(self.gateway, "gateway"))
        object.__setattr__(self, "mtu", _check_mtu(self.mtu, "guest MTU"))
        object.__setattr__(self, "mac", _check_mac(self.mac, "guest NIC MAC"))
        if self.routes is None:
            object.__setattr__(self, "routes", ())
        if not isinstance(self.routes, (list, tuple)):
            raise BadRequest(reason=f"identity: routes must be a list of CIDRs, not {_type_name(self.routes)}")
        routes = []
        for route in self.routes:
            if isinstance(route, (bool, int, float, list, tuple, dict)) or route is None:
                raise BadRequest(reason=f"identity: route {_type_name(route)} is not a CIDR string")
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
            raise BadRequest(reason=f"identity: guest_nic must be an object, not {_type_name(data)}")
        for key in ("address", "prefixlen"):
            if key not in data:
                raise BadRequest(reason=f"identity: guest_nic lacks {key!r}")
        # every field's type, before any is used (a peer may send anything)
        _wire_check(data, "address", (str,), "guest_nic address", optional=False)
        _wire_check(data, "prefixlen", (int,), "guest_nic prefixlen", optional=False)
        _wire_check(data, "gateway", (str,), "guest_nic gateway")
        _wire_check(data, "mtu", (int,), "guest_nic mtu")
        _wire_check(data, "mac", (str,), "guest_nic mac")
        _wire_check(data, "routes", (list,), "guest_nic routes")
        return cls(address=data["address"], prefixlen=data["prefixlen"],
                   gateway=data.get("gateway"), mtu=data.get("mtu"), mac=data.get("mac"),
                   routes=tuple(data.get("routes") or ()))


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
            raise BadRequest(reason=f"identity must be an object, not {_type_name(data)}")
        version = data.get("version", IDENTITY_VERSION)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise BadRequest(reason=f"identity: version must be an integer of 1 or more, not {_type_name(version)}")
        for key in ("host_id", "pool_endpoint"):
            if key not in data:
                raise BadRequest(reason=f"identity lacks {key!r}")
        # every field's type, before any is used (a peer may send anything)
        _wire_check(data, "host_id", (str,), "host_id", optional=False)
        _wire_check(data, "pool_endpoint", (str,), "pool_endpoint", optional=False)
        _wire_check(data, "host_address", (str,), "host_address")
        _wire_check(data, "interface", (str,), "interface")
        _wire_check(data, "mtu", (int,), "mtu")
        _wire_check(data, "mac", (str,), "mac")
        _wire_check(data, "guest_nic", (dict,), "guest_nic")
        # A newer host may add fields: ignore the unknown, keep what we know.
        nic = data.get("guest_nic")
        return cls(host_id=data["host_id"], pool_endpoint=data["pool_endpoint"],
                   host_address=data.get("host_address"), interface=data.get("interface"),
                   mtu=data.get("mtu"), mac=data.get("mac"),
                   guest_nic=GuestNic.from_wire(nic) if nic is not None else None,
                   version=min(version, IDENTITY_VERSION))
