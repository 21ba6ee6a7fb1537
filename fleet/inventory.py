"""The fleet's inventory: one TOML file that says which machines make up a
deployment, how to reach them and what each one runs.

::

    [ssh]                          # how every node is reached
    user = "root"                  # another user: remote commands run with 'sudo -n'
    key = "keys/id_ed25519"        # private key (default: ssh-agent, then ~/.ssh/id_*)
    known_hosts = "keys/known_hosts"   # default ~/.ssh/known_hosts; unknown host = refused
    port = 22
    jump = "root@10.0.0.5:22"      # optional: every node through this host

    [install]
    wheelhouse = ["dist"]          # the accelmig wheel and every dependency's wheel
    prefix = "/opt/accelmig"
    python = "/usr/bin/python3"    # the nodes' interpreter (>= 3.11, with venv)

    [tls]
    ca = "pki/ca.pem"              # or: insecure = true (plain TCP, said explicitly)

    [pool]
    address = "10.88.0.10"         # where ssh connects
    listen = "10.88.0.10:7070"
    control_listen = "10.88.0.10:7071"
    cert = "pki/pool.pem"
    key = "pki/pool.key"

    [pool.cluster]                 # optional: this pool node joins others on etcd
    url = "etcds://10.88.0.5:2379" # etcds:// (TLS, client certificate); etcd:// (plain) only with [tls] insecure
    node_name = "pool-1"           # default: [pool] name
    advertise = "10.88.0.10:7070"  # default: the endpoint guests use
    ttl = 10.0
    ca = "pki/etcd-ca.pem"         # etcds:// only: etcd's CA, this node's client cert and key,
    cert = "pki/pool-etcd.pem"     # uploaded to /etc/accelmig/tls/etcd-*.pem like the pool's own
    key = "pki/pool-etcd.key"
    user = "accelmig-pool"         # etcds:// with etcd's access control on: this node's etcd user
    password_file = "pki/etcd-password"   # its password, uploaded to /etc/accelmig/etcd-password

    [tenants.alice]
    quota = "8GiB"

    [hosts.hostA]
    address = "10.88.0.11"
    cert = "pki/hostA.pem"
    key = "pki/hostA.key"
    [hosts.hostA.fabric]           # host.toml's [fabric], as is
    mode = "bridge"
    bridge = "fab0"
    guest_subnet = "10.89.1.0/24"

Relative paths are relative to the inventory file.  Every mistake is found
here, before any node is touched, and named by its key.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from pathlib import Path

from accelmig.runtime.files import load_toml
from accelmig.wire.dataplane import parse_endpoint
from accelmig.wire.errors import BadRequest, ConfigInvalid
from accelmig.wire.values import is_a, is_int, is_number

DEFAULT_PREFIX = "/opt/accelmig"
#: the distribution's interpreter: not whatever 'python3' a login shell's
#: PATH finds (a pyenv shim under /root would leave the services' users
#: unable to run it)
DEFAULT_PYTHON = "/usr/bin/python3"
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"
#: a node's name: what the pool's hosts file and host.toml's [host] id say
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
#: user@host:port, each part but host optional (IPv6 in brackets)
JUMP = re.compile(r"^(?:(?P<user>[A-Za-z0-9._-]+)@)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)"
                  r"(?::(?P<port>[0-9]{1,5}))?$")


@dataclasses.dataclass(frozen=True)
class SshSettings:
    user: str = "root"
    key: str | None = None                 # absolute path, or None: agent and default keys
    known_hosts: str = ""                  # absolute path
    port: int = 22
    jump: tuple[str, str, int] | None = None   # (user, host, port)
    connect_timeout: float = 10.0
    command_timeout: float = 900.0


@dataclasses.dataclass(frozen=True)
class Node:
    """One machine of the fleet."""
    name: str
    role: str                              # "pool" | "host"
    address: str                           # where ssh connects
    port: int
    user: str
    cert: str | None = None                # local files (absolute), uploaded
    key: str | None = None
    # host only
    fabric: dict = dataclasses.field(default_factory=dict)
    hostd: dict = dataclasses.field(default_factory=dict)
    pool_addresses: tuple[str, ...] = ()   # what the pool's hosts file says its guests come from
    libvirtd_pid_file: str | None = None
    # pool only
    settings: dict = dataclasses.field(default_factory=dict)   # pool.toml [pool] keys
    endpoint: str | None = None            # the data plane as guests reach it
    cluster_tls: tuple[str, str, str] | None = None   # local etcd CA, client cert, key: uploaded
    cluster_password: str | None = None    # local file of the etcd user's password: uploaded

    @property
    def sudo(self) -> bool:
        return self.user != "root"


@dataclasses.dataclass(frozen=True)
class Tenant:
    name: str
    quota: str | int
    max_sessions: int | None = None
    quota_by_type: dict | None = None     # device type -> size (the pool's loader checks it at render)


@dataclasses.dataclass(frozen=True)
class Inventory:
    path: str
    ssh: SshSettings
    wheelhouse: tuple[str, ...]
    prefix: str
    python: str
    insecure: bool
    ca: str | None
    pool: Node
    hosts: tuple[Node, ...]
    tenants: tuple[Tenant, ...]

    @property
    def nodes(self) -> tuple[Node, ...]:
        return (self.pool, *self.hosts)

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise ConfigInvalid(source=self.path, reason=f"no node {name!r} (nodes: "
                                                      f"{', '.join(n.name for n in self.nodes)})")

    def command(self, node: Node) -> str:
        """The node's side's command in its deployed environment."""
        return f"{self.prefix}/venv/bin/{'accelmig-pool' if node.role == 'pool' else 'accelmig'}"

    @property
    def endpoint(self) -> str:
        """The pool's data plane as guests reach it."""
        return self.pool.endpoint or self.pool.settings["listen"].split(",")[0].strip()

    @property
    def control(self) -> str:
        return self.pool.settings["control_listen"]

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Inventory":
        path = os.path.abspath(os.fspath(path))
        return _Reader(path).inventory(load_toml(path, "inventory file"))


class _Reader:
    """Reads one inventory; every error names the file and the key."""

    SECTIONS = {"ssh", "install", "tls", "pool", "tenants", "hosts"}

    def __init__(self, path: str):
        self.path = path
        self.base = Path(path).parent

    def error(self, key: str, why: str) -> ConfigInvalid:
        return ConfigInvalid(source=self.path, reason=f"{key}: {why}")

    def table(self, data: dict, key: str, required: bool = False) -> dict:
        value = data.get(key.rsplit(".", 1)[-1])
        if value is None:
            if required:
                raise self.error(key, "missing (a table is required)")
            return {}
        if not isinstance(value, dict):
            raise self.error(key, "must be a table")
        return value

    def only(self, table: dict, where: str, known: set[str]) -> None:
        unknown = sorted(set(table) - known)
        if unknown:
            raise self.error(where, f"unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")

    def string(self, table: dict, key: str, where: str, default=None, required=False):
        value = table.get(key, default)
        if value is None:
            if required:
                raise self.error(f"{where}.{key}", "missing")
            return None
        if not isinstance(value, str) or not value.strip():
            raise self.error(f"{where}.{key}", "must be a non-empty string")
        return value

    def number(self, table: dict, key: str, where: str, default: float, low: float, high: float) -> float:
        value = table.get(key, default)
        if not is_number(value, low, high):
            raise self.error(f"{where}.{key}", f"must be a number from {low:g} to {high:g}")
        return float(value)

    def port(self, table: dict, key: str, where: str, default: int) -> int:
        value = table.get(key, default)
        if not is_int(value, 1, 65535):
            raise self.error(f"{where}.{key}", "must be a port number (1-65535)")
        return value

    def local_file(self, table: dict, key: str, where: str, *, must_exist: bool = True) -> str | None:
        value = self.string(table, key, where)
        if value is None:
            return None
        path = os.path.abspath(os.path.join(self.base, os.path.expanduser(value)))
        if must_exist and not os.path.isfile(path):
            raise self.error(f"{where}.{key}", f"{path} is not a file")
        return path

    def address(self, table: dict, where: str) -> str:
        value = self.string(table, "address", where, required=True)
        if not JUMP.match(value) or "@" in value:
            raise self.error(f"{where}.address", f"{value!r} is not a host name or address")
        return value.strip("[]")

    # ------------------------------------------------------------ sections

    def inventory(self, data: dict) -> Inventory:
        self.only(data, "inventory", self.SECTIONS)
        ssh = self.ssh(self.table(data, "ssh"))
        install = self.table(data, "install")
        self.only(install, "install", {"wheelhouse", "prefix", "python"})
        wheelhouse = install.get("wheelhouse", [])
        if isinstance(wheelhouse, str):
            wheelhouse = [wheelhouse]
        if not isinstance(wheelhouse, list) or not all(isinstance(w, str) and w for w in wheelhouse):
            raise self.error("install.wheelhouse", "must be a directory or a list of directories")
        wheelhouse = tuple(os.path.abspath(os.path.join(self.base, os.path.expanduser(w))) for w in wheelhouse)
        prefix = self.string(install, "prefix", "install", default=DEFAULT_PREFIX)
        if not prefix.startswith("/") or not re.fullmatch(r"/[A-Za-z0-9._/-]+", prefix) or ".." in prefix:
            raise self.error("install.prefix", f"{prefix!r}: an absolute path (letters, digits, . _ - /)")
        python = self.string(install, "python", "install", default=DEFAULT_PYTHON)
        if not re.fullmatch(r"/[A-Za-z0-9._/-]+", python):
            raise self.error("install.python", f"{python!r}: the absolute path of the nodes' python3")
        tls = self.table(data, "tls")
        self.only(tls, "tls", {"insecure", "ca"})
        insecure = tls.get("insecure", False)
        if not isinstance(insecure, bool):
            raise self.error("tls.insecure", "must be true or false")
        ca = self.local_file(tls, "ca", "tls")
        if insecure and ca:
            raise self.error("tls", "insecure = true and a ca: choose one")
        if not insecure and not ca:
            raise self.error("tls", "give the CA (ca = FILE) and each node's cert and key, or say "
                                    "insecure = true for plain TCP (tenant tokens and tickets in clear)")
        pool = self.pool(self.table(data, "pool", required=True), ssh, insecure)
        tenants = self.tenants(self.table(data, "tenants"))
        hosts_table = self.table(data, "hosts", required=True)
        if not hosts_table:
            raise self.error("hosts", "no [hosts.NAME] table")
        hosts = tuple(self.host(name, table, ssh, insecure) for name, table in hosts_table.items())
        names = [pool.name, *(h.name for h in hosts)]
        if len(set(names)) != len(names):
            raise self.error("hosts", f"a name is used twice: {', '.join(names)}")
        where = {}
        for node in (pool, *hosts):
            key = (node.address, node.port)
            if key in where:
                raise self.error(f"hosts.{node.name}.address", f"{node.address}:{node.port} is also "
                                 f"{where[key]}'s (one node per machine)")
            where[key] = node.name
        return Inventory(path=self.path, ssh=ssh, wheelhouse=wheelhouse, prefix=prefix.rstrip("/"),
                         python=python, insecure=insecure, ca=ca, pool=pool, hosts=hosts, tenants=tenants)

    def ssh(self, table: dict) -> SshSettings:
        self.only(table, "ssh", {"user", "key", "known_hosts", "port", "jump", "connect_timeout",
                                 "command_timeout"})
        user = self.string(table, "user", "ssh", default="root")
        if not NAME.match(user):
            raise self.error("ssh.user", f"{user!r} is not a user name")
        known_hosts = os.path.abspath(os.path.join(
            self.base, os.path.expanduser(self.string(table, "known_hosts", "ssh", default=DEFAULT_KNOWN_HOSTS))))
        jump = None
        if table.get("jump") is not None:
            text = self.string(table, "jump", "ssh")
            match = JUMP.match(text)
            if not match:
                raise self.error("ssh.jump", f"{text!r}: [USER@]HOST[:PORT]")
            jump = (match["user"] or user, match["host"].strip("[]"), int(match["port"] or 22))
            if not 1 <= jump[2] <= 65535:
                raise self.error("ssh.jump", "bad port")
        return SshSettings(user=user, key=self.local_file(table, "key", "ssh"), known_hosts=known_hosts,
                           port=self.port(table, "port", "ssh", 22), jump=jump,
                           connect_timeout=self.number(table, "connect_timeout", "ssh", 10.0, 0.1, 600),
                           command_timeout=self.number(table, "command_timeout", "ssh", 900.0, 1, 86400))

    def node_ssh(self, table: dict, where: str, ssh: SshSettings) -> tuple[int, str]:
        port = self.port(table, "ssh_port", where, ssh.port)
        user = self.string(table, "ssh_user", where, default=ssh.user)
        if not NAME.match(user):
            raise self.error(f"{where}.ssh_user", f"{user!r} is not a user name")
        return port, user

    def tls_files(self, table: dict, where: str, insecure: bool) -> tuple[str | None, str | None]:
        cert = self.local_file(table, "cert", where)
        key = self.local_file(table, "key", where)
        if insecure and (cert or key):
            raise self.error(where, "cert/key with [tls] insecure = true: choose one")
        if not insecure and not (cert and key):
            raise self.error(where, "needs cert and key (TLS; or [tls] insecure = true)")
        return cert, key

    def pool(self, table: dict, ssh: SshSettings, insecure: bool) -> Node:
        known = {"name", "address", "ssh_port", "ssh_user", "cert", "key", "listen", "control_listen",
                 "endpoint", "device", "devices", "settings", "cluster"}
        self.only(table, "pool", known)
        name = self.string(table, "name", "pool", default="pool")
        if not NAME.match(name):
            raise self.error("pool.name", f"{name!r}: letters, digits, . _ - (at most 64)")
        port, user = self.node_ssh(table, "pool", ssh)
        cert, key = self.tls_files(table, "pool", insecure)
        settings = dict(self.table(table, "pool.settings"))
        for reserved in ("tls_cert", "tls_key", "tls_client_ca", "insecure", "tokens", "hosts"):
            if reserved in settings:
                raise self.error(f"pool.settings.{reserved}", "set by the fleet (see [tls], [tenants], [hosts])")
        for reserved in ("cluster", "node_name", "cluster_advertise", "cluster_ttl", "cluster_tls_ca",
                         "cluster_tls_cert", "cluster_tls_key", "cluster_user", "cluster_password_file"):
            if reserved in settings:
                raise self.error(f"pool.settings.{reserved}", "set by the fleet (see [pool.cluster])")
        settings["listen"] = self.string(table, "listen", "pool", required=True)
        settings["control_listen"] = self.string(table, "control_listen", "pool", required=True)
        # devices (default: every device of the node) or the older one-device form;
        # the pool's own loader refuses both at once (render checks with it)
        for key_name in ("devices", "device"):
            value = self.string(table, key_name, "pool", default=settings.get(key_name))
            if value:
                settings[key_name] = value
        for key_name in ("listen", "control_listen"):
            for part in settings[key_name].split(","):
                self.endpoint(part.strip(), f"pool.{key_name}", listen=True)
        endpoint = self.string(table, "endpoint", "pool") or settings["listen"].split(",")[0].strip()
        self.endpoint(endpoint, "pool.endpoint" if "endpoint" in table else "pool.listen (the "
                      "endpoint guests use, unless pool.endpoint says another)", listen=False)
        self.endpoint(settings["control_listen"], "pool.control_listen (what hosts call)", listen=False)
        cluster = self.table(table, "pool.cluster")
        cluster_tls = self.cluster(cluster, settings, name, endpoint)
        cluster_password = self.cluster_user(cluster, settings)
        return Node(name=name, role="pool", address=self.address(table, "pool"), port=port, user=user,
                    cert=cert, key=key, settings=settings, endpoint=endpoint, cluster_tls=cluster_tls,
                    cluster_password=cluster_password)

    def cluster(self, table: dict, settings: dict, name: str, endpoint: str) -> tuple[str, str, str] | None:
        """``[pool.cluster]`` into the pool's ``cluster*`` settings; the local
        etcd TLS files (uploaded by render), or None.  Which URL needs which
        files is the pool's own loader's rule, applied at render."""
        if not table:
            return None
        self.only(table, "pool.cluster", {"url", "node_name", "advertise", "ttl", "ca", "cert", "key",
                                          "user", "password_file"})
        settings["cluster"] = self.string(table, "url", "pool.cluster", required=True)
        settings["node_name"] = self.string(table, "node_name", "pool.cluster", default=name)
        settings["cluster_advertise"] = self.string(table, "advertise", "pool.cluster", default=endpoint)
        self.endpoint(settings["cluster_advertise"], "pool.cluster.advertise", listen=False)
        settings["cluster_ttl"] = self.number(table, "ttl", "pool.cluster", 10.0, 1, 3600)
        files = tuple(self.local_file(table, key, "pool.cluster") for key in ("ca", "cert", "key"))
        if not any(files):
            return None
        if not all(files):
            raise self.error("pool.cluster", "ca, cert and key go together (etcds://: etcd's CA, this "
                                             "node's client certificate and its key)")
        return files

    def cluster_user(self, table: dict, settings: dict) -> str | None:
        """``[pool.cluster] user`` into ``cluster_user``; the local file of its
        password (uploaded by render), or None.  The pool's loader checks the
        rest (TLS only, the user's spelling) at render."""
        if not table:
            return None
        user = self.string(table, "user", "pool.cluster")
        password = self.local_file(table, "password_file", "pool.cluster")
        if bool(user) != bool(password):
            raise self.error("pool.cluster", "user and password_file go together (etcd's access control: "
                                             "this node's etcd user and the file of its password)")
        if user:
            settings["cluster_user"] = user
        return password or None

    def endpoint(self, value: str, where: str, listen: bool) -> None:
        try:
            host, _ = parse_endpoint(value, listen=listen)
        except (BadRequest, ValueError) as exc:
            raise self.error(where, getattr(exc, "message", str(exc))) from None
        if not listen and host in ("0.0.0.0", "::", ""):
            raise self.error(where, f"{value}: guests and hosts cannot reach a wildcard address")

    def tenants(self, table: dict) -> tuple[Tenant, ...]:
        if not table:
            raise self.error("tenants", "no [tenants.NAME] table: the pool refuses to start without a tenant")
        out = []
        for name, spec in table.items():
            where = f"tenants.{name}"
            if not NAME.match(name):
                raise self.error(where, "a tenant name: letters, digits, . _ -")
            if not isinstance(spec, dict):
                raise self.error(where, "must be a table")
            self.only(spec, where, {"quota", "max_sessions", "quota_by_type"})
            quota = spec.get("quota")
            if not is_a(quota, (str, int)):
                raise self.error(f"{where}.quota", "required: bytes or a size such as \"8GiB\"")
            max_sessions = spec.get("max_sessions")
            if max_sessions is not None and not is_int(max_sessions, 1):
                raise self.error(f"{where}.max_sessions", "a positive integer")
            by_type = spec.get("quota_by_type")
            if by_type is not None and not isinstance(by_type, dict):
                raise self.error(f"{where}.quota_by_type", "a table of sizes, e.g. { gpu = \"1GiB\" }")
            out.append(Tenant(name, quota, max_sessions, by_type))
        return tuple(out)

    def host(self, name: str, table, ssh: SshSettings, insecure: bool) -> Node:
        where = f"hosts.{name}"
        if not isinstance(table, dict):
            raise self.error(where, "must be a table")
        if not NAME.match(name) or name == "admin":
            raise self.error(where, "a host name: letters, digits, . _ - (at most 64; not 'admin')")
        self.only(table, where, {"address", "ssh_port", "ssh_user", "cert", "key", "fabric", "hostd",
                                 "pool_addresses", "libvirtd_pid_file"})
        port, user = self.node_ssh(table, where, ssh)
        cert, key = self.tls_files(table, where, insecure)
        fabric = dict(self.table(table, f"{where}.fabric"))
        hostd = dict(self.table(table, f"{where}.hostd"))
        pool_addresses = table.get("pool_addresses")
        if pool_addresses is None:
            pool_addresses = [fabric["guest_subnet"]] if isinstance(fabric.get("guest_subnet"), str) else []
        if not isinstance(pool_addresses, list) or not all(isinstance(a, str) for a in pool_addresses):
            raise self.error(f"{where}.pool_addresses", "a list of CIDRs")
        for cidr in pool_addresses:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise self.error(f"{where}.pool_addresses", f"{cidr!r} is not a CIDR") from None
        pid_file = self.string(table, "libvirtd_pid_file", where)
        if pid_file is not None and not pid_file.startswith("/"):
            raise self.error(f"{where}.libvirtd_pid_file", "an absolute path on the host")
        return Node(name=name, role="host", address=self.address(table, where), port=port, user=user,
                    cert=cert, key=key, fabric=fabric, hostd=hostd, pool_addresses=tuple(pool_addresses),
                    libvirtd_pid_file=pid_file)
