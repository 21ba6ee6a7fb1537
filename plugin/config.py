"""A hypervisor host's accelmig configuration: one TOML file.

``/etc/accelmig/host.toml`` (``HostConfig.load()``); every key but
``pool.endpoint`` has a default::

    [host]
    id = "hostA"                       # the name the pool knows this host by [default: hostname]
    [pool]
    endpoint = "10.88.0.1:7070"        # data plane, as guests on this host reach it (required)
    control = "10.88.0.1:7071"         # control plane [default: endpoint's host, port 7071]
    secret_file = "/etc/accelmig/host.secret"   # per-host HMAC secret (file mode 0600)
    ca_file = "/etc/accelmig/pool-ca.crt"   # verifies the pool's certificate [default: system store]
    cert_file = "/etc/accelmig/host.crt"    # this host's client certificate (mutual TLS)
    key_file = "/etc/accelmig/host.key"
    # insecure = true                  # plain TCP to a pool run --insecure (a warning)
    [fabric]
    mode = "bridge"                    # bridge | direct | none [default: none]
    bridge = "fab0"                    # mode = bridge: the host bridge of the fabric NIC
    device = "eth1"                    # mode = direct: the macvtap source device
    guest_subnet = "10.89.1.0/24"      # host-bound fabric: guests here get addresses from it
    gateway = "10.89.1.1"              # [default: the subnet's first address]
    mtu = 1500                         # [default: leave the guest's MTU as it is]
    routes = ["10.88.0.0/16"]          # what guests reach through the gateway (the pool)
                                       # [default: the pool's data-plane address, /32 or /128]
    interfaces_owner = "accelmig"      # "external" when Nova/Neutron own the interface XML
    [hostd]
    socket = "/run/accelmig/hostd.sock"   # local API for the hook and the CLI
    state_dir = "/var/lib/accelmig"
    strict = true                      # the hook refuses migrations when hostd/pool are unreachable
    hook_timeout = 3.0                 # seconds
    metrics_listen = ""                # HOST:PORT for Prometheus; "" = off
    libvirt_uri = "qemu:///system"

Unknown sections and keys are errors (a typo must not silently become a
default).  Every error is a ``ConfigInvalid`` naming the file, the key and why.
Every key with its type, default and meaning: docs/config-reference.md,
generated from the fields' metadata below (``python docs/configref.py``).

The secret file holds the string the pool's ``hosts.toml`` has for this host
(16+ characters; surrounding whitespace is ignored) and must not be
accessible to others: ``read_secret()`` refuses it otherwise.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket
import stat

from accelmig.runtime.files import load_toml, parse_toml
from accelmig.wire.dataplane import parse_endpoint
from accelmig.wire.errors import BadRequest, ConfigInvalid
from accelmig.wire.localapi import DEFAULT_HOSTD_SOCKET
from accelmig.wire.values import is_number

__all__ = [
    "DEFAULT_PATH", "FABRIC_MODES", "FabricConfig", "HostConfig", "HostdConfig",
    "INTERFACES_OWNERS", "MIN_SECRET_BYTES", "PoolEndpoints",
]

DEFAULT_PATH = "/etc/accelmig/host.toml"
DEFAULT_CONTROL_PORT = 7071
FABRIC_MODES = ("bridge", "direct", "none")
INTERFACES_OWNERS = ("accelmig", "external")
MIN_SECRET_BYTES = 16          # what the pool's hosts.toml requires of a host secret

_HOST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_IFNAME_MAX = 15               # IFNAMSIZ - 1


# Every key's meaning sits next to its field, in ``metadata``: docs/configref.py
# writes docs/config-reference.md from it ("doc": the meaning; "key": the TOML
# key when it is not the field's name; "type"/"default": what to show when the
# annotation or the literal default would mislead; "example": a valid value
# where there is no literal default; "toml": False for a field that is no key).
@dataclasses.dataclass(frozen=True)
class PoolEndpoints:
    endpoint: str = dataclasses.field(metadata={
        "doc": "The pool's data plane, HOST:PORT, as guests on this host reach it (an IPv6 "
               "address in brackets). hostd tells it to every guest here; it is also where "
               "the default fabric routes point.",
        "example": "10.88.0.1:7070"})
    control: str = dataclasses.field(metadata={
        "doc": "The pool's control plane, HOST:PORT, which hostd calls with this host's secret. "
               "In a pool of several nodes (etcd) this node is hostd's coordinator: hostd asks "
               "it for the live nodes (`list_nodes`) and calls each of them at the control "
               "endpoint it advertises, with the same secret and TLS files (every node is "
               "given the same hosts file; each node's certificate must name its own "
               "address). Nothing else to configure.",
        "default": "the endpoint's host, port 7071", "example": "10.88.0.1:7071"})
    secret_file: str = dataclasses.field(default="/etc/accelmig/host.secret", metadata={
        "doc": "File holding this host's control-plane secret: the `secret` the pool's "
               "hosts file has for `[host] id` (16+ characters; surrounding whitespace "
               "ignored). Refused when others can read or write it (`chmod 600`)."})
    ca_file: str = dataclasses.field(default="", metadata={
        "doc": "CA certificate(s) (PEM) that verify the pool's certificate on the control "
               "plane (it must name the `control` host: an IP needs an IP subjectAltName). "
               "`\"\"`: the system's trust store.", "example": "/etc/accelmig/pool-ca.crt"})
    cert_file: str = dataclasses.field(default="", metadata={
        "doc": "This host's client certificate (PEM), signed by the CA of the pool's "
               "`tls_client_ca` (mutual TLS); it must name this host's `[host] id` (its "
               "subject's CommonName, or a DNS subjectAltName): the pool lets a host act only "
               "as the name its certificate gives. A pool refuses a host without one unless both say `insecure`.",
        "example": "/etc/accelmig/host.crt"})
    key_file: str = dataclasses.field(default="", metadata={
        "doc": "The client certificate's private key (PEM; `chmod 600`); `\"\"`: in "
               "`cert_file`.", "example": "/etc/accelmig/host.key"})
    insecure: bool = dataclasses.field(default=False, metadata={
        "doc": "Plain TCP to the pool's control plane (a pool run with `--insecure`): "
               "tickets and calls cross the network in clear. Logged as a warning; no TLS "
               "key may be set with it.", "type": "boolean"})

    @property
    def address(self) -> str:
        """The data plane's host part (an address or a name)."""
        return parse_endpoint(self.endpoint)[0]


@dataclasses.dataclass(frozen=True)
class FabricConfig:
    mode: str = dataclasses.field(default="none", metadata={
        "doc": "How the fabric NIC of an accelmig domain is bound to this host: `bridge` "
               "(a host bridge), `direct` (macvtap on a host device), `none` (accelmig "
               "rewrites no interface XML). The migrate-begin hook gives the NIC this "
               "host's bridge or device.", "type": "string: " + " | ".join(FABRIC_MODES),
        "example": "bridge"})
    bridge: str | None = dataclasses.field(default=None, metadata={
        "doc": "The host bridge of the fabric NIC; required when `mode = \"bridge\"`.",
        "type": "string (an interface name)", "example": "fab0"})
    device: str | None = dataclasses.field(default=None, metadata={
        "doc": "The macvtap source device of the fabric NIC; required when `mode = \"direct\"`.",
        "type": "string (an interface name)", "example": "eth1"})
    guest_subnet: ipaddress.IPv4Network | ipaddress.IPv6Network | None = dataclasses.field(
        default=None, metadata={
            "doc": "A host-bound fabric: guests on this host get their fabric address from this "
                   "subnet (one stable lease per domain, kept in `[hostd] state_dir`), and "
                   "hostd registers it at the pool, which tells by a connection's source "
                   "address which host a guest is on. Unset: guests keep their addresses.",
            "type": "string (a CIDR)", "default": "unset (not host-bound)",
            "example": "10.89.1.0/24"})
    gateway: ipaddress.IPv4Address | ipaddress.IPv6Address | None = dataclasses.field(
        default=None, metadata={
            "doc": "The guests' gateway in `guest_subnet` (this host's address on the fabric "
                   "bridge). Only with `guest_subnet`.",
            "type": "string (an IP address)", "default": "the subnet's first address",
            "example": "10.89.1.1"})
    mtu: int | None = dataclasses.field(default=None, metadata={
        "doc": "The MTU the guest's fabric NIC takes on this host (68-65535).",
        "type": "integer", "default": "leave the guest's MTU as it is", "example": 1500})
    routes: tuple[str, ...] = dataclasses.field(default=(), metadata={
        "doc": "What guests reach through `gateway` (CIDRs, the pool's network). Only with "
               "`guest_subnet`.",
        "type": "array of strings (CIDRs)",
        "default": "the pool's data-plane address as a /32 or /128 (when it is an address "
                   "outside `guest_subnet`)",
        "example": ["10.88.0.0/16"]})
    interfaces_owner: str = dataclasses.field(default="accelmig", metadata={
        "doc": "`external` where another system (Nova/Neutron) owns the domains' interface "
               "XML: the hook then never rewrites it.",
        "type": "string: " + " | ".join(INTERFACES_OWNERS)})

    @property
    def host_bound(self) -> bool:
        """Guests on this host get their fabric address from this host's subnet."""
        return self.guest_subnet is not None

    @property
    def external(self) -> bool:
        return self.interfaces_owner == "external"

    @classmethod
    def from_table(cls, table: dict, source: str = "<fabric>",
                   pool_address: str | None = None) -> "FabricConfig":
        """``[fabric]`` as a dict (``pool_address``: for the default routes)."""
        return _fabric(_Table(table, "fabric", source), pool_address)


@dataclasses.dataclass(frozen=True)
class HostdConfig:
    socket: str = dataclasses.field(default=DEFAULT_HOSTD_SOCKET, metadata={
        "doc": "hostd's local API (a unix socket, owned by one hostd): the hook and the CLI "
               "reach hostd here."})
    state_dir: str = dataclasses.field(default="/var/lib/accelmig", metadata={
        "doc": "Where hostd keeps its state: the guest address leases and what `accelmig "
               "install` did (read by `accelmig doctor`)."})
    strict: bool = dataclasses.field(default=True, metadata={
        "doc": "The hook refuses a migration to this host when hostd or the pool cannot be "
               "reached; `false` lets it through, and hostd reconciles and rehomes later."})
    hook_timeout: float = dataclasses.field(default=3.0, metadata={
        "doc": "Seconds the migrate-begin hook may spend with hostd (more than 0, at most 600).",
        "type": "number (seconds)"})
    metrics_listen: str = dataclasses.field(default="", metadata={
        "doc": "HOST:PORT where hostd serves Prometheus metrics over HTTP; `\"\"` = off.",
        "type": "string (HOST:PORT)", "example": "127.0.0.1:9471"})
    libvirt_uri: str = dataclasses.field(default="qemu:///system", metadata={
        "doc": "The libvirt daemon hostd follows (and `accelmig migrate` starts from)."})
    guest_exec_command: tuple[str, ...] = dataclasses.field(
        default=("/usr/bin/python3", "-m", "accelmig.agent"), metadata={
            "doc": "How qemu-guest-agent's `guest-exec` runs the accelmig agent in a guest without "
                   "the accelmig channel (a Nova instance): an absolute program and its first "
                   "arguments; `rehome --stdin` or `status` follow. A guest bundle: "
                   "`[\"/usr/bin/python3\", \"/opt/accelmig/accelmig-agent.pyz\"]`.",
            "type": "array of strings (absolute program first)",
            "example": ["/usr/bin/python3", "/opt/accelmig/accelmig-agent.pyz"]})
    accel_domains_interval: float = dataclasses.field(default=2.0, metadata={
        "doc": "Seconds between hostd's looks at which domains hold accelerator sessions (the "
               "pool's `accel_domains`): how soon a VM that nobody marked (Nova's) is attested "
               "after its first session opens, and how soon the hook's cache of such domains "
               "(`accel-domains.json` in `state_dir`) learns it (0.1-600).",
        "type": "number (seconds)"})

    @property
    def accel_domains_file(self) -> str:
        """The cache of domains that hold sessions: the hook is strict for
        them when it cannot ask hostd."""
        return os.path.join(self.state_dir, "accel-domains.json")


@dataclasses.dataclass(frozen=True)
class HostConfig:
    host_id: str = dataclasses.field(metadata={
        "section": "host", "key": "id",
        "doc": "The name the pool knows this host by: its `[hosts.NAME]` in the pool's hosts "
               "file (letters, digits, `.`, `_`, `-`; at most 64; not `admin`).",
        "default": "this machine's hostname", "example": "hostA"})
    pool: PoolEndpoints = dataclasses.field(metadata={
        "doc": "Where the pool is and how this host authenticates to it."})
    fabric: FabricConfig = dataclasses.field(default=FabricConfig(), metadata={
        "doc": "The accelerator fabric: how guests here reach the pool."})
    hostd: HostdConfig = dataclasses.field(default=HostdConfig(), metadata={
        "doc": "The host daemon and the hook."})
    source: str = dataclasses.field(default="<defaults>", metadata={"toml": False})  # for messages

    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> "HostConfig":
        path = os.fspath(path) if path is not None else DEFAULT_PATH
        return cls.from_dict(load_toml(path), source=path)

    @classmethod
    def from_toml(cls, text: str, source: str = "<string>") -> "HostConfig":
        return cls.from_dict(parse_toml(text, source), source=source)

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>") -> "HostConfig":
        sections = {"host", "pool", "fabric", "hostd"}
        unknown = sorted(set(data) - sections)
        if unknown:
            raise ConfigInvalid(source=source, reason=f"unknown section(s) {', '.join(unknown)} "
                                                      f"(known: {', '.join(sorted(sections))})")
        host = _Table(data.get("host", {}), "host", source)
        host_id = host.string("id", default=None) or socket.gethostname()
        if not _HOST_ID.match(host_id):
            raise host.error("id", f"{host_id!r} is not a host name (letters, digits, '.', '_', '-'; "
                                   f"at most 64)")
        if host_id == "admin":
            raise host.error("id", "'admin' is reserved for the pool's admin socket")
        host.done()

        pool = _pool(_Table(data.get("pool", {}), "pool", source))
        fabric = _fabric(_Table(data.get("fabric", {}), "fabric", source), pool.address)
        hostd = _hostd(_Table(data.get("hostd", {}), "hostd", source))
        return cls(host_id=host_id, pool=pool, fabric=fabric, hostd=hostd, source=source)

    def control_tls(self):
        """The control plane's ``ssl.SSLContext`` (the pool verified with
        ``ca_file``; this host's ``cert_file`` presented), or None where
        ``insecure = true`` says plain TCP (hostd logs a warning)."""
        from accelmig.wire import tls
        pool = self.pool
        if pool.insecure:
            return None
        try:
            return tls.client_context(pool.ca_file or None, pool.cert_file or None,
                                      pool.key_file or None)
        except (OSError, ValueError) as exc:     # ssl.SSLError is an OSError
            raise ConfigInvalid(source=self.source, reason=f"pool TLS files (ca_file, cert_file, "
                                                           f"key_file): {exc}") from None

    def read_secret(self) -> bytes:
        """This host's control-plane secret.  Refuses a file others may read
        or write, one that is not a regular file, and one too short."""
        path = self.pool.secret_file
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
        except FileNotFoundError:
            raise ConfigInvalid(source=path, reason=f"secret file not found (pool.secret_file "
                                                    f"in {self.source})") from None
        except OSError as exc:
            raise ConfigInvalid(source=path, reason=f"cannot read the secret file: "
                                                    f"{exc.strerror or exc}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ConfigInvalid(source=path, reason="the secret file is not a regular file")
            mode = stat.S_IMODE(info.st_mode)
            if mode & 0o007:
                raise ConfigInvalid(source=path, reason=f"the secret file is accessible to everyone "
                                                        f"(mode {mode:04o}); run: chmod 600 {path}")
            with os.fdopen(fd, "rb", closefd=False) as handle:
                secret = handle.read(64 * 1024 + 1)
        finally:
            os.close(fd)
        secret = secret.strip()
        if len(secret) > 64 * 1024:
            raise ConfigInvalid(source=path, reason="the secret file is larger than 64 KiB")
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigInvalid(source=path, reason=f"the secret is {len(secret)} bytes; the pool "
                                                    f"needs {MIN_SECRET_BYTES} or more")
        return secret


# ---------------------------------------------------------------------------


class _Table:
    """One section being read: typed getters that name file and key in errors."""

    def __init__(self, table, name: str, source: str):
        if not isinstance(table, dict):
            raise ConfigInvalid(source=source, reason=f"[{name}] must be a table")
        self.table, self.name, self.source = table, name, source
        self.seen: set[str] = set()

    def error(self, key: str, why: str) -> ConfigInvalid:
        return ConfigInvalid(source=self.source, reason=f"{self.name}.{key}: {why}")

    def _get(self, key, default):
        self.seen.add(key)
        return self.table.get(key, default)

    def string(self, key: str, default=None, required: bool = False):
        if required and key not in self.table:
            raise self.error(key, "is required")
        value = self._get(key, default)
        if value is not None and not isinstance(value, str):
            raise self.error(key, f"must be a string, not {_kind(value)}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, not {_kind(value)}")
        return value

    def number(self, key: str, default):
        value = self._get(key, default)
        if value is None:
            return None
        if not is_number(value):
            raise self.error(key, f"must be a number, not {_kind(value)}")
        return value

    def strings(self, key: str):
        value = self._get(key, None)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(key, "must be a list of strings")
        return value

    def path(self, key: str, default: str) -> str:
        value = self.string(key, default)
        if not value or not os.path.isabs(value):
            raise self.error(key, f"{value!r} must be an absolute path")
        return value

    def endpoint(self, key: str, value: str) -> str:
        try:
            parse_endpoint(value)
        except BadRequest as exc:
            raise self.error(key, exc.kwargs.get("reason", exc.message)) from None
        return value

    def ifname(self, key: str, value: str | None, needed_for: str | None) -> str | None:
        if value is None:
            if needed_for:
                raise self.error(key, f"is required when {needed_for}")
            return None
        if not 0 < len(value) <= _IFNAME_MAX or any(c in value for c in "/ \t\n:") \
                or value in (".", ".."):
            raise self.error(key, f"{value!r} is not an interface name (1-{_IFNAME_MAX} "
                                  f"characters, no '/', ':' or blanks)")
        return value

    def done(self) -> None:
        unknown = sorted(set(self.table) - self.seen)
        if unknown:
            raise ConfigInvalid(source=self.source,
                                reason=f"unknown key(s) in [{self.name}]: {', '.join(unknown)} "
                                       f"(known: {', '.join(sorted(self.seen))})")


def _kind(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(value), type(value).__name__)


def _pool(t: _Table) -> PoolEndpoints:
    endpoint = t.endpoint("endpoint", t.string("endpoint", required=True))
    control = t.string("control", None)
    if control is None:
        host = parse_endpoint(endpoint)[0]
        control = f"[{host}]:{DEFAULT_CONTROL_PORT}" if ":" in host else f"{host}:{DEFAULT_CONTROL_PORT}"
    t.endpoint("control", control)
    secret_file = t.path("secret_file", PoolEndpoints.secret_file)
    insecure = t.boolean("insecure", False)
    files = {}
    for key in ("ca_file", "cert_file", "key_file"):
        files[key] = t.path(key, "/") if t.table.get(key) else t.string(key, "") or ""
        if insecure and files[key]:
            raise t.error(key, "is a TLS setting and insecure = true: choose one")
    if files["key_file"] and not files["cert_file"]:
        raise t.error("key_file", "needs pool.cert_file")
    t.done()
    return PoolEndpoints(endpoint=endpoint, control=control, secret_file=secret_file,
                         insecure=insecure, **files)


def _fabric(t: _Table, pool_address: str | None) -> FabricConfig:
    mode = t.string("mode", "none")
    if mode not in FABRIC_MODES:
        raise t.error("mode", f"{mode!r} is not one of {', '.join(FABRIC_MODES)}")
    bridge = t.ifname("bridge", t.string("bridge"), "mode = \"bridge\"" if mode == "bridge" else None)
    device = t.ifname("device", t.string("device"), "mode = \"direct\"" if mode == "direct" else None)
    owner = t.string("interfaces_owner", "accelmig")
    if owner not in INTERFACES_OWNERS:
        raise t.error("interfaces_owner", f"{owner!r} is not one of {', '.join(INTERFACES_OWNERS)}")

    mtu = t.number("mtu", None)
    if mtu is not None and (not isinstance(mtu, int) or not 68 <= mtu <= 65535):
        raise t.error("mtu", f"{mtu!r} is not an MTU (an integer, 68-65535)")

    subnet_text = t.string("guest_subnet")
    gateway_text = t.string("gateway")
    routes_list = t.strings("routes")
    subnet = gateway = None
    routes: tuple[str, ...] = ()
    if subnet_text is None:
        for key, value in (("gateway", gateway_text), ("routes", routes_list)):
            if value is not None:
                raise t.error(key, "needs fabric.guest_subnet (a host-bound fabric)")
    else:
        try:
            subnet = ipaddress.ip_network(subnet_text, strict=True)
        except ValueError as exc:
            raise t.error("guest_subnet", f"{subnet_text!r} is not a network ({exc})") from None
        if subnet.num_addresses < 4:
            raise t.error("guest_subnet", f"{subnet} is too small for a gateway and guests "
                                          f"(at most /{subnet.max_prefixlen - 2})")
        if gateway_text is None:
            gateway = subnet.network_address + 1
        else:
            try:
                gateway = ipaddress.ip_address(gateway_text)
            except ValueError:
                raise t.error("gateway", f"{gateway_text!r} is not an IP address") from None
            if gateway not in subnet:
                raise t.error("gateway", f"{gateway} is not in guest_subnet {subnet}")
            if gateway == subnet.network_address or (
                    subnet.version == 4 and gateway == subnet.broadcast_address):
                raise t.error("gateway", f"{gateway} is the network or broadcast address of {subnet}")
        if routes_list is None:
            routes = _default_routes(pool_address, subnet)
        else:
            out = []
            for text in routes_list:
                try:
                    net = ipaddress.ip_network(text, strict=False)
                except ValueError:
                    raise t.error("routes", f"{text!r} is not a CIDR") from None
                if net.version != subnet.version:
                    raise t.error("routes", f"{net} is IPv{net.version}, guest_subnet is "
                                            f"IPv{subnet.version}")
                out.append(str(net))
            routes = tuple(out)
    t.done()
    return FabricConfig(mode=mode, bridge=bridge, device=device, guest_subnet=subnet,
                        gateway=gateway, mtu=mtu, routes=routes, interfaces_owner=owner)


def _default_routes(pool_address: str | None, subnet) -> tuple[str, ...]:
    """The pool's own address, when it is an address outside the guest subnet."""
    if pool_address is None:
        return ()
    try:
        address = ipaddress.ip_address(pool_address)
    except ValueError:
        return ()                   # a name: the operator lists routes explicitly
    if address.version != subnet.version or address in subnet:
        return ()
    return (str(ipaddress.ip_network(address)),)


def _hostd(t: _Table) -> HostdConfig:
    defaults = HostdConfig()
    sock = t.path("socket", defaults.socket)
    state_dir = t.path("state_dir", defaults.state_dir)
    strict = t.boolean("strict", defaults.strict)
    timeout = t.number("hook_timeout", defaults.hook_timeout)
    if timeout is None or not 0 < timeout <= 600:
        raise t.error("hook_timeout", f"{timeout!r} must be seconds, more than 0 and at most 600")
    metrics = t.string("metrics_listen", defaults.metrics_listen)
    if metrics:
        t.endpoint("metrics_listen", metrics)
    uri = t.string("libvirt_uri", defaults.libvirt_uri)
    if not uri or "://" not in uri:
        raise t.error("libvirt_uri", f"{uri!r} is not a libvirt URI (e.g. qemu:///system)")
    command = t.strings("guest_exec_command")
    if command is None:
        command = defaults.guest_exec_command
    elif not command or not os.path.isabs(command[0]) or not all(command):
        raise t.error("guest_exec_command", f"{command!r} must start with an absolute program "
                                            f"(qemu-ga's PATH is its service manager's) and hold no "
                                            f"empty argument")
    interval = t.number("accel_domains_interval", defaults.accel_domains_interval)
    if interval is None or not 0.1 <= interval <= 600:
        raise t.error("accel_domains_interval", f"{interval!r} must be seconds, from 0.1 to 600")
    t.done()
    return HostdConfig(socket=sock, state_dir=state_dir, strict=strict,
                       hook_timeout=float(timeout), metrics_listen=metrics, libvirt_uri=uri,
                       guest_exec_command=tuple(command), accel_domains_interval=float(interval))
