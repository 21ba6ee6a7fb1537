"""The pool's configuration: a TOML file plus command-line flags.

``pool.toml`` (every key optional; flags override)::

    [pool]
    listen = "0.0.0.0:7070"            # data plane (guest drivers)
    control_listen = "0.0.0.0:7071"    # control plane (hypervisor hosts)
    admin_socket = "/run/accelmig/pool.sock"
    metrics_listen = "127.0.0.1:9470"  # Prometheus HTTP; "" = off
    device = "auto"                    # or "opencl:N"
    tokens = "/etc/accelmig/tokens.toml"
    hosts = "/etc/accelmig/hosts.toml"
    grace = 30.0                       # s a detached session is kept
    park_retention = 86400.0           # s a parked (saved) session is kept
    lease_ttl = 30.0                   # s a migration record lives unrenewed
    ticket_ttl = 300.0                 # s a resume ticket is valid
    max_header = 65536
    max_payload = "1GiB"
    max_reply_bytes = "256MiB"         # per session, before execution waits for acks
    log_format = "json"                # or "text"

``tokens.toml``: one table per tenant::

    [tenants.alice]
    token = "s3cret"
    quota = "2GiB"

``hosts.toml``: one table per hypervisor host::

    [hosts.hostA]
    secret = "long random string"
    addresses = ["10.89.1.0/24"]      # optional: where its guests' connections come from
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import tomllib

from accelmig.wire.errors import ConfigInvalid

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(value, source: str = "config") -> int:
    """``1048576``, ``"64MiB"``, ``"2G"`` -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ConfigInvalid(source=source, reason=f"{value!r} is not a size (e.g. 512MiB)")
    unit = (match.group(2) or "").upper()[:1]
    return int(float(match.group(1)) * _UNITS[unit])


@dataclasses.dataclass
class TenantSpec:
    name: str
    token: str
    quota: int


@dataclasses.dataclass
class HostSpec:
    name: str
    secret: bytes
    addresses: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class PoolConfig:
    listen: str = "127.0.0.1:7070"
    control_listen: str = "127.0.0.1:7071"
    admin_socket: str = "/run/accelmig/pool.sock"
    metrics_listen: str = ""
    device: str = "auto"
    tokens: str = "/etc/accelmig/tokens.toml"
    hosts: str = ""
    grace: float = 30.0
    park_retention: float = 86400.0
    lease_ttl: float = 30.0
    ticket_ttl: float = 300.0
    max_header: int = 64 * 1024
    max_payload: int = 1 << 30
    max_reply_bytes: int = 256 << 20
    log_format: str = "json"
    log_level: str = "INFO"

    _FLOATS = ("grace", "park_retention", "lease_ttl", "ticket_ttl")
    _SIZES = ("max_header", "max_payload", "max_reply_bytes")

    @classmethod
    def load(cls, path: str | None, overrides: dict | None = None) -> "PoolConfig":
        values: dict = {}
        if path:
            data = _read_toml(path)
            section = data.get("pool", {})
            if not isinstance(section, dict):
                raise ConfigInvalid(source=path, reason="[pool] must be a table")
            values.update(section)
        values.update({k: v for k, v in (overrides or {}).items() if v is not None})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigInvalid(source=path or "flags", reason=f"unknown key(s) {', '.join(unknown)}")
        config = cls()
        for key, value in values.items():
            if key in cls._FLOATS:
                try:
                    value = float(value)
                except (TypeError, ValueError):
                    raise ConfigInvalid(source=path or "flags", reason=f"{key} must be seconds") from None
                if value <= 0:
                    raise ConfigInvalid(source=path or "flags", reason=f"{key} must be positive")
            elif key in cls._SIZES:
                value = parse_size(value, path or "flags")
            elif not isinstance(value, str):
                raise ConfigInvalid(source=path or "flags", reason=f"{key} must be a string")
            setattr(config, key, value)
        if config.log_format not in ("json", "text"):
            raise ConfigInvalid(source=path or "flags", reason="log_format is json or text")
        return config


def _read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigInvalid(source=path, reason="file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigInvalid(source=path, reason=f"not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigInvalid(source=path, reason=str(exc)) from None


def load_tenants(path: str) -> dict[str, TenantSpec]:
    data = _read_toml(path)
    tenants = data.get("tenants")
    if not isinstance(tenants, dict) or not tenants:
        raise ConfigInvalid(source=path, reason="no [tenants.NAME] table")
    out: dict[str, TenantSpec] = {}
    tokens: set[str] = set()
    for name, table in tenants.items():
        if not isinstance(table, dict):
            raise ConfigInvalid(source=path, reason=f"tenants.{name} must be a table")
        token = table.get("token")
        if not isinstance(token, str) or len(token) < 8:
            raise ConfigInvalid(source=path, reason=f"tenants.{name}.token must be a string of 8+ characters")
        if token in tokens:
            raise ConfigInvalid(source=path, reason=f"tenants.{name}.token is another tenant's token")
        tokens.add(token)
        if "quota" not in table:
            raise ConfigInvalid(source=path, reason=f"tenants.{name}.quota is missing")
        out[name] = TenantSpec(name, token, parse_size(table["quota"], f"{path}: tenants.{name}.quota"))
    return out


def parse_networks(values, source: str) -> list:
    nets = []
    for value in values or []:
        try:
            nets.append(ipaddress.ip_network(str(value), strict=False))
        except ValueError:
            raise ConfigInvalid(source=source, reason=f"{value!r} is not an address or CIDR") from None
    return nets


def load_hosts(path: str) -> dict[str, HostSpec]:
    if not path:
        return {}
    data = _read_toml(path)
    hosts = data.get("hosts", {})
    if not isinstance(hosts, dict):
        raise ConfigInvalid(source=path, reason="[hosts.NAME] tables expected")
    out = {}
    for name, table in hosts.items():
        if not isinstance(table, dict):
            raise ConfigInvalid(source=path, reason=f"hosts.{name} must be a table")
        secret = table.get("secret")
        if not isinstance(secret, str) or len(secret) < 16:
            raise ConfigInvalid(source=path, reason=f"hosts.{name}.secret must be 16+ characters")
        if name == "admin":
            raise ConfigInvalid(source=path, reason="'admin' is reserved for the admin socket")
        out[name] = HostSpec(name, secret.encode(), parse_networks(table.get("addresses"), path))
    return out
