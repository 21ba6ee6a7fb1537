"""The pool's configuration: a TOML file plus command-line flags.

``pool.toml`` (every key optional; flags override; every key with its type,
default and meaning: docs/config-reference.md, generated from the fields'
metadata below by ``python docs/configref.py``)::

    [pool]
    listen = "0.0.0.0:7070"            # data plane (guest drivers)
    control_listen = "0.0.0.0:7071"    # control plane (hypervisor hosts)
    admin_socket = "/run/accelmig/pool.sock"
    metrics_listen = "127.0.0.1:9470"  # Prometheus HTTP; "" = off
    tls_cert = "/etc/accelmig/pool.crt"  # TLS on both planes (an IP SAN for IP endpoints)
    tls_key = "/etc/accelmig/pool.key"
    tls_client_ca = "/etc/accelmig/hosts-ca.crt"  # control plane: hosts' certificates (mutual TLS)
    # insecure = true                  # plain TCP instead (both ends must say so; a warning)
    devices = "all"                    # or ids/opencl:N, comma-separated (accelmig-pool devices)
    # device = "opencl:0"              # the older one-device form (auto: the first); not with devices
    tokens = "/etc/accelmig/tokens.toml"
    hosts = "/etc/accelmig/hosts.toml"
    grace = 30.0                       # s a detached session is kept
    park_retention = 86400.0           # s a parked (saved) session is kept
    lease_ttl = 30.0                   # s a migration record lives unrenewed
    ticket_ttl = 300.0                 # s a resume ticket is valid
    max_header = 65536
    max_payload = "1GiB"
    max_reply_bytes = "256MiB"         # per session: replies kept until acknowledged
    log_format = "json"                # or "text"
    # cluster = "etcds://10.0.0.5:2379" # several nodes as one pool (docs/DESIGN.md, Pool: many nodes)
    # cluster_tls_ca = "/etc/accelmig/etcd-ca.crt"   # etcds://: the CA that signs etcd's certificate
    # cluster_tls_cert = "/etc/accelmig/etcd-client.crt"  # etcds://: this node's client certificate
    # cluster_tls_key = "/etc/accelmig/etcd-client.key"   # its key (not readable by others)
    # cluster_user = "accelmig-pool"   # etcd's access control: a user whose role has /accelmig/v1/
    # cluster_password_file = "/etc/accelmig/etcd-password"  # its password (not readable by others)
    # node_name = "pool-1"             # default: the short host name
    # cluster_advertise = "10.0.0.21:7070"  # what other nodes redirect drivers to
    # cluster_ttl = 10.0               # s of the node's etcd lease

``tokens.toml``: one table per tenant::

    [tenants.alice]
    token = "s3cret"
    quota = "2GiB"
    max_sessions = 16                 # optional: else [pool] max_sessions_per_tenant
    quota_by_type = { gpu = "1GiB" }  # optional: at most this much on devices of a type

``hosts.toml``: one table per hypervisor host::

    [hosts.hostA]
    secret = "long random string"
    addresses = ["10.89.1.0/24"]      # optional: where its guests' connections come from
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import re
import shlex
import stat

from accelmig.runtime.files import load_toml
from accelmig.runtime.logs import level_number
from accelmig.wire.dataplane import MIN_PAYLOAD_LIMIT, parse_endpoint, parse_listen_list
from accelmig.wire.errors import BadRequest, ConfigInvalid
from accelmig.wire.values import is_int

LOG = logging.getLogger("accelmig.pool")

MAX_PASSWORD_BYTES = 1024       # an etcd password (cluster_password_file's first line)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(value, source: str = "config") -> int:
    """``1048576``, ``"64MiB"``, ``"2G"`` -> bytes."""
    if is_int(value, 0):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ConfigInvalid(source=source, reason=f"{value!r} is not a size (e.g. 512MiB)")
    unit = (match.group(2) or "").upper()[:1]
    return int(float(match.group(1)) * _UNITS[unit])


# Every key's meaning sits next to its field, in ``metadata``: docs/configref.py
# writes docs/config-reference.md from it (the conventions are in its docstring).
@dataclasses.dataclass
class TenantSpec:
    name: str = dataclasses.field(metadata={"toml": False})        # the NAME of [tenants.NAME]
    token: str = dataclasses.field(metadata={
        "doc": "The tenant's secret token (8+ characters, no two tenants alike): what its "
               "applications pass to `connect(token=...)`.", "example": "a-long-random-token"})
    quota: int = dataclasses.field(metadata={
        "doc": "How much device memory the tenant's sessions may hold together, on every "
               "device of the pool.",
        "type": "size", "example": "2GiB"})
    max_sessions: int | None = dataclasses.field(default=None, metadata={
        "doc": "Live sessions (attached, detached or parked) the tenant may hold at once; "
               "unset: the pool's `max_sessions_per_tenant`. Each costs a worker thread and "
               "host memory, quota or not.", "type": "integer", "example": 16})
    quota_by_type: dict = dataclasses.field(default_factory=dict, metadata={
        "doc": "Optional: per device type (`gpu`, `accelerator` or `fpga`, `cpu`, `custom`), how "
               "much device memory the tenant's sessions may hold together on devices of that "
               "type, within `quota` (which counts every device of the pool).",
        "type": "table of sizes", "default": "unset (only `quota`)", "example": {"gpu": "1GiB"}})


@dataclasses.dataclass
class HostSpec:
    name: str = dataclasses.field(metadata={"toml": False})        # the NAME of [hosts.NAME]
    secret: bytes = dataclasses.field(metadata={
        "doc": "The host's control-plane secret (16+ characters), the HMAC key of its calls: "
               "the same string as the host's `[pool] secret_file`.",
        "type": "string", "example": "0123456789abcdef0123456789abcdef"})
    addresses: list = dataclasses.field(default_factory=list, metadata={
        "doc": "Networks (CIDRs or addresses) its guests' data-plane connections come from, "
               "known before the host registers. hostd also registers its `[fabric] "
               "guest_subnet` and its own address at every pool start; the longest prefix wins.",
        "type": "array of strings (CIDRs)", "example": ["10.89.1.0/24"]})


@dataclasses.dataclass
class PoolConfig:
    listen: str = dataclasses.field(default="127.0.0.1:7070", metadata={
        "doc": "The data plane for guest drivers, HOST:PORT; several comma-separated "
               "(`0.0.0.0:7070,[::]:7070`)."})
    control_listen: str = dataclasses.field(default="127.0.0.1:7071", metadata={
        "doc": "The control plane for hypervisor hosts (every call HMAC-authenticated), "
               "HOST:PORT; `\"\"` = off."})
    admin_socket: str = dataclasses.field(default="/run/accelmig/pool.sock", metadata={
        "doc": "The local admin socket (`accelmig-pool sessions`, `migrations`), mode 0600, "
               "guarded by file permissions; `\"\"` = off."})
    metrics_listen: str = dataclasses.field(default="", metadata={
        "doc": "HOST:PORT where Prometheus metrics are served over HTTP (they are also on the "
               "control plane, method `metrics`); `\"\"` = off.",
        "example": "127.0.0.1:9470"})
    tls_cert: str = dataclasses.field(default="", metadata={
        "doc": "The pool's certificate (PEM, chain after it) for TLS on the data and control "
               "planes. Drivers check that it names the endpoint they were given: an endpoint "
               "that is an IP address needs an IP subjectAltName. Required unless `insecure`.",
        "example": "/etc/accelmig/pool.crt"})
    tls_key: str = dataclasses.field(default="", metadata={
        "doc": "The certificate's private key (PEM); `\"\"`: it is in `tls_cert`.",
        "example": "/etc/accelmig/pool.key"})
    tls_client_ca: str = dataclasses.field(default="", metadata={
        "doc": "CA certificate(s) (PEM) the control plane checks hosts' certificates against "
               "(mutual TLS: a host without a certificate signed by it is refused before any "
               "call, and a host acts only as the name its certificate gives: its subject's "
               "CommonName, or a DNS subjectAltName). Each call is still HMAC-signed with the "
               "host's secret. Required with a control plane (`control_listen`) unless "
               "`insecure`.",
        "example": "/etc/accelmig/hosts-ca.crt"})
    insecure: bool = dataclasses.field(default=False, metadata={
        "doc": "Serve both planes over plain TCP (no `tls_cert`): a passive tap reads tenant "
               "tokens, session secrets, tickets and data. Logged as a warning; drivers and "
               "hosts must be insecure too (`ACCELMIG_INSECURE=1`, `[pool] insecure = true`).",
        "type": "boolean"})
    devices: str = dataclasses.field(default="all", metadata={
        "doc": "The devices this node serves, each with its own queues and memory accounting: "
               "`all` (every OpenCL device found) or a comma-separated list of device ids or "
               "`opencl:N` (see `accelmig-pool devices`). Sessions are placed on one of them "
               "(`connect(device=...)`, else the least loaded)."})
    device: str = dataclasses.field(default="", metadata={
        "doc": "The older one-device form, kept for existing configs: serve only this device, "
               "`auto` (the first), `opencl:N` or a device id; `\"\"`: use `devices`. Not "
               "together with `devices`.", "example": "auto"})
    device_isolation: str = dataclasses.field(default="process", metadata={
        "doc": "`process`: each tenant's sessions run their device work in a process of the "
               "tenant's own, which the pool kills when a call overruns `device_time_limit` "
               "(a kernel that never ends stalls only its tenant; each tenant has its own kernel "
               "cache), confined so that its builds and kernels see none of the node's files. "
               "`none`: all in the pool's process (no copy across processes; a spinning kernel "
               "cannot be stopped; builds are refused unless `allow_unconfined_builds`): for a "
               "single trusted tenant only.",
        "type": "string: process | none"})
    allow_unconfined_builds: bool = dataclasses.field(default=False, metadata={
        "doc": "Serve program builds where nothing confines them: with `device_isolation = "
               "\"none\"`, or where the node cannot confine device processes (no user or mount "
               "namespaces for the pool's user: the pool says so at start). Such a build can read "
               "every file the pool can (`#include`), and a kernel can do what the pool's user can. "
               "`false`: those builds are refused with FORBIDDEN. For a single trusted tenant only.",
        "type": "boolean"})
    device_time_limit: float = dataclasses.field(default=60.0, metadata={
        "doc": "Seconds one device call of a tenant (a finish or read waiting for its queued "
               "kernels, a build) may take; then the tenant's device process is killed and its "
               "sessions end with KILLED. Only with `device_isolation = \"process\"`.",
        "type": "number (seconds)"})
    upload_arena: int = dataclasses.field(default=256 << 20, metadata={
        "doc": "Per tenant and device (with `device_isolation = \"process\"`): shared memory "
               "between the pool and the tenant's device process that write payloads are "
               "received into straight from the network, so they do not cross a socket to the "
               "device process; at most the tenant's `quota`. A payload that finds no room "
               "takes the older path (copied through the socket). 256 MiB holds a driver's "
               "whole flight of chunks; `0`: off.", "type": "size"})
    upload_arena_keep: float = dataclasses.field(default=30.0, metadata={
        "doc": "Seconds an upload arena that holds no payload keeps its pages resident (written "
               "pages are reused: touching fresh ones costs ten times the copy into them); then "
               "they go back to the system until the next write.", "type": "number (seconds)"})
    max_source_bytes: int = dataclasses.field(default=1 << 20, metadata={
        "doc": "Largest program source a build takes.", "type": "size"})
    max_concurrent_builds: int = dataclasses.field(default=2, metadata={
        "doc": "Builds one tenant may run at once (the rest wait in its device process; other "
               "tenants build beside them).", "type": "integer"})
    tokens: str = dataclasses.field(default="/etc/accelmig/tokens.toml", metadata={
        "doc": "The tenants file (below)."})
    hosts: str = dataclasses.field(default="", metadata={
        "doc": "The hypervisor hosts file (below); `\"\"`: no host may use the control plane.",
        "example": "/etc/accelmig/hosts.toml"})
    grace: float = dataclasses.field(default=30.0, metadata={
        "doc": "Seconds a session whose connection died keeps its device state, waiting for "
               "its driver to resume.", "type": "number (seconds)"})
    park_retention: float = dataclasses.field(default=86400.0, metadata={
        "doc": "Seconds the sessions of a saved domain (`virsh save`, managedsave) are kept.",
        "type": "number (seconds)"})
    lease_ttl: float = dataclasses.field(default=30.0, metadata={
        "doc": "Seconds a migration record lives unless a hostd renews its lease.",
        "type": "number (seconds)"})
    ticket_ttl: float = dataclasses.field(default=300.0, metadata={
        "doc": "Seconds a resume ticket is valid.", "type": "number (seconds)"})
    handshake_timeout: float = dataclasses.field(default=10.0, metadata={
        "doc": "Seconds a connection (either plane) may take from the moment it is accepted "
               "through its TLS handshake to a successful open or resume (a host's hello); "
               "then it is closed.", "type": "number (seconds)"})
    idle_timeout: float = dataclasses.field(default=300.0, metadata={
        "doc": "Seconds an authenticated connection (either plane) may send nothing; then it is "
               "closed (a driver's session detaches and its grace starts). Drivers are told at "
               "hello and send a keepalive at a third of it; hostd calls every few seconds.",
        "type": "number (seconds)"})
    max_connections: int = dataclasses.field(default=0, metadata={
        "doc": "Connections of both planes the pool holds at once, authenticated or not; `0`: "
               "the process's descriptor limit (its soft limit raised to the hard one) less a "
               "quarter of it (at least 64) kept for the pool's own files. A number that "
               "cannot fit under the descriptor limit stops the pool at start. Past it, a "
               "newcomer evicts a connection that has not authenticated, or is refused.",
        "type": "integer"})
    max_unauthenticated: int = dataclasses.field(default=512, metadata={
        "doc": "Connections (data and control plane) that have not authenticated yet, counted "
               "from accept, all peers together (at most half of `max_connections`). Past it a "
               "newcomer evicts the oldest such connection of the address holding the most of "
               "them, so a working client gets in during a flood.", "type": "integer"})
    max_unauthenticated_per_peer: int = dataclasses.field(default=32, metadata={
        "doc": "Connections (data and control plane) from one address that have not authenticated yet, "
               "counted from accept; more are closed at once, before any TLS handshake.",
        "type": "integer"})
    max_header: int = dataclasses.field(default=64 * 1024, metadata={
        "doc": "Largest data-plane frame header; a bigger frame closes that connection.",
        "type": "size"})
    max_payload: int = dataclasses.field(default=1 << 30, metadata={
        "doc": "Largest data-plane frame payload, told to drivers at hello; they send larger "
               "writes and reads as chunks of at most this (and at most 64 MiB); at least 4 KiB.", "type": "size"})
    max_reply_bytes: int = dataclasses.field(default=256 << 20, metadata={
        "doc": "Per session: replies (their payloads and bookkeeping) kept until the driver "
               "acknowledges them, counted from the moment a command goes to the device (a read "
               "by its size); past it the session's next commands wait for acknowledgements. "
               "A read larger than it is refused with QUOTA_EXCEEDED, and drivers are told at "
               "hello to read in chunks of at most it. Also bounds the write payloads queued per "
               "session. At least 4 KiB.", "type": "size"})
    max_objects_per_session: int = dataclasses.field(default=8192, metadata={
        "doc": "Per session: buffers and programs held at once (a zero-byte buffer costs "
               "no quota but still host memory); one more is refused with QUOTA_EXCEEDED.",
        "type": "integer"})
    max_sessions_per_tenant: int = dataclasses.field(default=64, metadata={
        "doc": "Live sessions one tenant may hold at once (each has a worker thread), unless "
               "its `[tenants.NAME] max_sessions` says otherwise; one more open is refused "
               "with QUOTA_EXCEEDED.", "type": "integer"})
    cluster: str = dataclasses.field(default="", metadata={
        "doc": "etcd endpoints that make several pool nodes one pool: `etcds://HOST:PORT[,HOST:PORT...]` "
               "(TLS, this node authenticated by its client certificate: `cluster_tls_*`) or "
               "`etcd://...` (plain HTTP, no authentication: anyone who reaches etcd can redirect "
               "drivers and erase quotas; a test rig only, refused unless `insecure`). The node registers there under a lease "
               "(docs/DESIGN.md, Pool: many nodes). `http://`/`https://` are refused. `\"\"`: a single "
               "node, no etcd.", "example": "etcds://10.0.0.5:2379"})
    cluster_tls_ca: str = dataclasses.field(default="", metadata={
        "doc": "`etcds://` only (required): CA certificate(s) (PEM) etcd's server certificate must "
               "verify against; the certificate must name the host of each endpoint (an IP SAN "
               "for an address).", "example": "/etc/accelmig/etcd-ca.crt"})
    cluster_tls_cert: str = dataclasses.field(default="", metadata={
        "doc": "`etcds://` only (required): this node's client certificate (PEM) for etcd "
               "(`etcd --client-cert-auth --trusted-ca-file`).",
        "example": "/etc/accelmig/etcd-client.crt"})
    cluster_tls_key: str = dataclasses.field(default="", metadata={
        "doc": "`etcds://` only: the client certificate's private key (PEM); `\"\"`: it is in "
               "`cluster_tls_cert`. The file holding the key must not be readable by other users "
               "(mode 0600 or 0640): the pool refuses to start otherwise.",
        "example": "/etc/accelmig/etcd-client.key"})
    cluster_user: str = dataclasses.field(default="", metadata={
        "doc": "`etcds://` only: this node's etcd user, for etcd's role-based access control on top "
               "of the certificates (`etcdctl auth enable`): its role should grant readwrite on the "
               "prefix `/accelmig/v1/` and nothing else. With it, `cluster_tls_cert` must carry no "
               "CommonName (etcd's JSON gateway refuses one once auth is on). `\"\"`: none (etcd "
               "without auth).", "example": "accelmig-pool"})
    cluster_password_file: str = dataclasses.field(default="", metadata={
        "doc": "With `cluster_user` (required): the file whose first line is that user's etcd "
               "password; not readable by other users (mode 0600 or 0640), or the pool refuses "
               "to start.", "example": "/etc/accelmig/etcd-password"})
    node_name: str = dataclasses.field(default="", metadata={
        "doc": "This node's name in the cluster (unique among the pool's nodes); `\"\"`: the "
               "short host name.", "example": "pool-1"})
    cluster_advertise: str = dataclasses.field(default="", metadata={
        "doc": "The data-plane endpoint other nodes redirect drivers to, HOST:PORT as drivers reach "
               "it; `\"\"`: the first `listen` address (which must then not be 0.0.0.0 or ::).",
        "example": "10.0.0.21:7070"})
    cluster_ttl: float = dataclasses.field(default=10.0, metadata={
        "doc": "Seconds of the node's etcd lease: a node that dies disappears from the pool "
               "(and its quota reservations with it) this long after its last renewal.",
        "type": "number (seconds)"})
    log_format: str = dataclasses.field(default="json", metadata={
        "doc": "Log lines on stderr.", "type": "string: json | text"})
    log_level: str = dataclasses.field(default="INFO", metadata={
        "doc": "Least severe log level written.", "type": "string: DEBUG | INFO | WARNING | ERROR"})

    _FLOATS = ("cluster_ttl", "grace", "park_retention", "lease_ttl", "ticket_ttl", "handshake_timeout",
               "idle_timeout", "device_time_limit", "upload_arena_keep")
    _COUNTS = ("max_unauthenticated", "max_unauthenticated_per_peer", "max_objects_per_session",
               "max_sessions_per_tenant", "max_concurrent_builds")
    _COUNTS_OR_AUTO = ("max_connections",)          # 0: derived (pool.admission.ConnectionLimits)
    _SIZES = ("max_header", "max_payload", "max_reply_bytes", "max_source_bytes", "upload_arena")
    _BOOLS = ("insecure", "allow_unconfined_builds")

    @classmethod
    def load(cls, path: str | None, overrides: dict | None = None) -> "PoolConfig":
        values: dict = {}
        if path:
            data = load_toml(path)
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
            elif key in cls._BOOLS:
                if not isinstance(value, bool):
                    raise ConfigInvalid(source=path or "flags", reason=f"{key} must be true or false")
            elif key in cls._COUNTS or key in cls._COUNTS_OR_AUTO:
                least = 0 if key in cls._COUNTS_OR_AUTO else 1
                if not is_int(value, least):
                    raise ConfigInvalid(source=path or "flags", reason=(
                        f"{key} must be a positive integer" + (" (or 0: automatic)" if least == 0 else "")))
            elif not isinstance(value, str):
                raise ConfigInvalid(source=path or "flags", reason=f"{key} must be a string")
            setattr(config, key, value)
        if config.device and config.devices.strip() != "all":
            raise ConfigInvalid(source=path or "flags", reason="device (one device) and devices "
                                                              "(several): choose one")
        for key in ("max_payload", "max_reply_bytes"):     # (the welcome's max_payload is the lesser)
            if getattr(config, key) < MIN_PAYLOAD_LIMIT:
                raise ConfigInvalid(source=path or "flags", reason=f"{key} must be at least "
                                                                  f"{MIN_PAYLOAD_LIMIT} bytes (drivers refuse less)")
        if config.device_isolation not in ("process", "none"):
            raise ConfigInvalid(source=path or "flags", reason="device_isolation is process or none")
        if config.log_format not in ("json", "text"):
            raise ConfigInvalid(source=path or "flags", reason="log_format is json or text")
        try:
            level_number(config.log_level)
            if config.cluster:
                from accelmig.pool.cluster.keys import parse_cluster_url   # without the etcd client
                parse_cluster_url(config.cluster, path or "flags")
            config.check_cluster_tls_keys(path or "flags")
            if config.cluster_advertise:
                parse_endpoint(config.cluster_advertise)
            parse_listen_list(config.listen)
            for key in ("control_listen", "metrics_listen"):      # "" disables these two
                if getattr(config, key):
                    parse_endpoint(getattr(config, key), listen=True)
        except (BadRequest, ValueError) as exc:
            reason = exc.kwargs.get("reason", exc.message) if isinstance(exc, BadRequest) else str(exc)
            raise ConfigInvalid(source=path or "flags", reason=reason) from None
        return config

    def check_tls(self, source: str = "config") -> None:
        """TLS, or plain TCP said explicitly: never plain by omission (checked
        by ``serve`` once the files load, and again when the listeners start)."""
        if self.insecure and (self.tls_cert or self.tls_key or self.tls_client_ca):
            raise ConfigInvalid(source=source, reason="insecure (plain TCP) and tls_* keys: "
                                                      "choose one")
        if not self.insecure and not self.tls_cert:
            raise ConfigInvalid(source=source, reason="the pool serves TLS: give tls_cert and "
                                                      "tls_key (--tls-cert/--tls-key), or "
                                                      "insecure = true (--insecure) for plain TCP")
        if not self.insecure and self.control_listen and not self.tls_client_ca:
            raise ConfigInvalid(source=source, reason=(
                "the control plane is mutual TLS: give tls_client_ca (--tls-client-ca), the CA "
                "that signs the hosts' certificates (each names its host), or serve no control "
                "plane (control_listen = \"\"), or say insecure = true (--insecure: plain TCP "
                "on both planes, test rigs only)"))
        for key in ("tls_cert", "tls_key", "tls_client_ca"):
            value = getattr(self, key)
            if value and not os.path.isfile(value):
                raise ConfigInvalid(source=source, reason=f"{key}: {value} is not a file")

    def check_cluster_tls_keys(self, source: str = "config") -> None:
        """TLS files exactly when the cluster URL says TLS: a config never
        half-says it (files given for plain ``etcd://`` would be ignored)."""
        from accelmig.pool.cluster.keys import cluster_uses_tls
        self.check_cluster_auth_keys(source)      # first: "a password over TLS only" says more
        given = [k for k in ("cluster_tls_ca", "cluster_tls_cert", "cluster_tls_key") if getattr(self, k)]
        if not self.cluster:
            if given:
                raise ConfigInvalid(source=source, reason=f"{', '.join(given)} without cluster: they "
                                                          f"are for etcds:// only")
        elif not cluster_uses_tls(self.cluster):
            if given:
                raise ConfigInvalid(source=source, reason=f"cluster {self.cluster} is plain etcd:// but "
                                                          f"{', '.join(given)} given: write etcds:// "
                                                          f"for TLS to etcd, or drop them")
            if not self.insecure:
                raise ConfigInvalid(source=source, reason=(
                    f"cluster {self.cluster} is plain etcd:// (HTTP, no authentication): anyone who "
                    f"reaches etcd could redirect drivers, abort migrations and erase quotas. Write "
                    f"etcds://HOST:PORT with cluster_tls_ca and cluster_tls_cert, or say insecure = "
                    f"true (--insecure: plain TCP everywhere, test rigs only)"))
        else:
            missing = [k for k in ("cluster_tls_ca", "cluster_tls_cert") if not getattr(self, k)]
            if missing:
                raise ConfigInvalid(source=source, reason=f"cluster {self.cluster} is etcds:// (TLS): "
                                                          f"give {' and '.join(missing)} "
                                                          f"(--{' --'.join(m.replace('_', '-') for m in missing)})")

    def check_cluster_auth_keys(self, source: str = "config") -> None:
        """An etcd user with its password file, over TLS only (the password
        would otherwise cross the network in clear)."""
        from accelmig.pool.cluster.keys import cluster_uses_tls
        if bool(self.cluster_user) != bool(self.cluster_password_file):
            given, missing = (("cluster_user", "cluster_password_file") if self.cluster_user
                              else ("cluster_password_file", "cluster_user"))
            raise ConfigInvalid(source=source, reason=f"{given} without {missing}: an etcd user and its "
                                                      f"password go together")
        if self.cluster_user and not (self.cluster and cluster_uses_tls(self.cluster)):
            raise ConfigInvalid(source=source, reason=(
                "cluster_user needs cluster = etcds://... : an etcd password goes over TLS only"
                if self.cluster else "cluster_user without cluster: it is for etcds:// only"))
        if self.cluster_user and not re.fullmatch(r"[A-Za-z0-9_.@-]{1,64}", self.cluster_user):
            raise ConfigInvalid(source=source, reason="cluster_user: 1 to 64 of A-Z a-z 0-9 _ . @ -")

    def cluster_password(self) -> str:
        """The first line of ``cluster_password_file`` (checked by
        ``check_cluster_tls_files`` before)."""
        with open(self.cluster_password_file, "rb") as handle:
            first = handle.read(MAX_PASSWORD_BYTES + 2).split(b"\n", 1)[0].rstrip(b"\r")
        try:
            password = first.decode()
        except UnicodeDecodeError:
            raise ConfigInvalid(source=self.cluster_password_file, reason="the etcd password is not UTF-8") from None
        if not password or len(first) > MAX_PASSWORD_BYTES:
            raise ConfigInvalid(source=self.cluster_password_file, reason=(
                f"its first line, the etcd password, must be 1 to {MAX_PASSWORD_BYTES} bytes"))
        return password

    def check_cluster_tls_files(self, source: str = "config") -> None:
        """The etcd TLS files exist and the private key is no other user's
        to read (checked by ``serve`` before it listens)."""
        for key in ("cluster_tls_ca", "cluster_tls_cert", "cluster_tls_key"):
            value = getattr(self, key)
            if value and not os.path.isfile(value):
                raise ConfigInvalid(source=source, reason=f"{key}: {value} is not a file")
        if self.cluster_password_file and not os.path.isfile(self.cluster_password_file):
            raise ConfigInvalid(source=source, reason=f"cluster_password_file: {self.cluster_password_file} "
                                                      f"is not a file")
        held = [("cluster_tls_key" if self.cluster_tls_key else "cluster_tls_cert (it holds the key)",
                    self.cluster_tls_key or self.cluster_tls_cert, "key"),
                   ("cluster_password_file", self.cluster_password_file, "password")]
        for what, secret, kind in held:
            if not secret:
                continue
            mode = os.stat(secret).st_mode
            if mode & stat.S_IRWXO:
                raise ConfigInvalid(source=source, reason=(
                    f"{what}: {secret} is mode {stat.S_IMODE(mode):04o}, other users may read the "
                    f"{kind} that authenticates this node to etcd: chmod 0600 {shlex.quote(secret)} (or 0640)"))
        if self.cluster_password_file:
            self.cluster_password()


def load_tenants(path: str) -> dict[str, TenantSpec]:
    data = load_toml(path)
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
        max_sessions = table.get("max_sessions")
        if max_sessions is not None and not is_int(max_sessions, 1):
            raise ConfigInvalid(source=path, reason=f"tenants.{name}.max_sessions must be a "
                                                    f"positive integer")
        out[name] = TenantSpec(name, token, parse_size(table["quota"], f"{path}: tenants.{name}.quota"),
                               max_sessions, parse_quota_by_type(table.get("quota_by_type"),
                                                                 f"{path}: tenants.{name}.quota_by_type"))
    warn_if_readable_by_others(path, "tenants file (it holds their tokens)")
    return out


def parse_quota_by_type(table, source: str) -> dict[str, int]:
    """``{gpu = "1GiB", fpga = "2GiB"}`` -> ``{"gpu": 1073741824, "accelerator": ...}``."""
    from accelmig.wire.devices import DEVICE_TYPES, TYPE_ALIASES
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise ConfigInvalid(source=source, reason="must be a table of sizes, e.g. { gpu = \"1GiB\" }")
    out: dict[str, int] = {}
    for key, value in table.items():
        name = TYPE_ALIASES.get(key, key)
        if name not in DEVICE_TYPES:
            raise ConfigInvalid(source=source, reason=f"{key!r} is no device type (one of "
                                                      f"{', '.join(DEVICE_TYPES + tuple(TYPE_ALIASES))})")
        if name in out:
            raise ConfigInvalid(source=source, reason=f"{name} is given twice")
        out[name] = parse_size(value, f"{source}.{key}")
    return out


def warn_if_readable_by_others(path: str, what: str) -> bool:
    """Log a warning when a file of secrets grants anything to other users
    (the pool still loads it: refusing would turn a deploy slip into an
    outage).  True when it warned."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    if not mode & stat.S_IRWXO:
        return False
    LOG.warning("%s %s is mode %04o: other users may read it; run: chmod 0640 %s (or 0600)",
                what, path, stat.S_IMODE(mode), shlex.quote(path),
                extra={"path": path, "mode": f"{stat.S_IMODE(mode):04o}"})
    return True


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
    data = load_toml(path)
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
    warn_if_readable_by_others(path, "hosts file (it holds their control-plane secrets)")
    return out
