"""The files each node of the fleet gets, rendered from the inventory and
checked by the loaders of the side that reads them (``HostConfig``,
``PoolConfig``, ``load_hosts``, ``load_tenants``) before anything is sent:
a deploy never leaves a node with a configuration its daemon refuses.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import tomli_w

from accelmig.fleet.inventory import Inventory, Node
from accelmig.plugin.config import HostConfig
from accelmig.pool.config import PoolConfig, load_hosts, load_tenants
from accelmig.wire.errors import ConfigInvalid

ETC = "/etc/accelmig"
TLS_DIR = f"{ETC}/tls"
HOST_CONFIG = f"{ETC}/host.toml"
HOST_SECRET = f"{ETC}/host.secret"
POOL_CONFIG = f"{ETC}/pool.toml"
POOL_HOSTS = f"{ETC}/hosts.toml"
POOL_TOKENS = f"{ETC}/tokens.toml"
#: the etcd CA, the pool node's client certificate and key for etcds:// ([pool.cluster])
CLUSTER_TLS_FILES = (f"{TLS_DIR}/etcd-ca.pem", f"{TLS_DIR}/etcd-client.pem", f"{TLS_DIR}/etcd-client.key")
#: the pool node's etcd password ([pool.cluster] user, password_file)
CLUSTER_PASSWORD_FILE = f"{ETC}/etcd-password"
#: the pool's service user (pool/data/accelmig-pool.sysusers)
POOL_USER = "accelmig-pool"


@dataclasses.dataclass(frozen=True)
class RemoteFile:
    """One file to have on a node: exact bytes, mode, owner."""
    path: str
    data: bytes
    mode: int = 0o644
    owner: str = "root"
    group: str = "root"
    secret: bool = False          # never shown in a diff or a log


def header(inventory: Inventory, what: str) -> str:
    return (f"# {what}, written by 'accelmig fleet deploy' from {os.path.basename(inventory.path)}:\n"
            f"# change the inventory and deploy again rather than edit this file.\n")


def _toml(inventory: Inventory, what: str, data: dict) -> bytes:
    return (header(inventory, what) + tomli_w.dumps(data)).encode()


def tls_files(inventory: Inventory, node: Node, group: str = "root") -> list[RemoteFile]:
    """The CA and the node's certificate and key (key: 0600, or 0640 to
    the service's group); a pool node on etcds:// also gets etcd's CA and
    its etcd client certificate and key (etcd's TLS is its own: not tied
    to [tls] insecure, which is about the pool's planes), and with an etcd
    user the file of its password (a secret like a key)."""
    key_mode = 0o640 if group != "root" else 0o600
    out = []
    if not inventory.insecure:
        stem = "pool" if node.role == "pool" else "host"
        out += [RemoteFile(f"{TLS_DIR}/ca.pem", _read(inventory.ca)),
                RemoteFile(f"{TLS_DIR}/{stem}.pem", _read(node.cert)),
                RemoteFile(f"{TLS_DIR}/{stem}.key", _read(node.key), mode=key_mode, group=group, secret=True)]
    if node.role == "pool" and node.cluster_tls:
        ca, cert, key = node.cluster_tls
        out += [RemoteFile(CLUSTER_TLS_FILES[0], _read(ca)), RemoteFile(CLUSTER_TLS_FILES[1], _read(cert)),
                RemoteFile(CLUSTER_TLS_FILES[2], _read(key), mode=key_mode, group=group, secret=True)]
    if node.role == "pool" and node.cluster_password:
        out.append(RemoteFile(CLUSTER_PASSWORD_FILE, _read(node.cluster_password), mode=key_mode, group=group,
                              secret=True))
    return out


def _read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def host_config(inventory: Inventory, node: Node) -> RemoteFile:
    pool = {"endpoint": inventory.endpoint, "control": inventory.control, "secret_file": HOST_SECRET}
    if inventory.insecure:
        pool["insecure"] = True
    else:
        pool.update(ca_file=f"{TLS_DIR}/ca.pem", cert_file=f"{TLS_DIR}/host.pem",
                    key_file=f"{TLS_DIR}/host.key")
    data = {"host": {"id": node.name}, "pool": pool}
    if node.fabric:
        data["fabric"] = node.fabric
    if node.hostd:
        data["hostd"] = node.hostd
    source = f"{node.name}:{HOST_CONFIG} (from {inventory.path} [hosts.{node.name}])"
    HostConfig.from_dict(data, source=source)          # what hostd and the hook will say of it
    return RemoteFile(HOST_CONFIG, _toml(inventory, f"host {node.name}'s configuration", data))


def pool_config(inventory: Inventory) -> RemoteFile:
    section = {k: v for k, v in inventory.pool.settings.items()}
    section.update(tokens=POOL_TOKENS, hosts=POOL_HOSTS)
    if inventory.insecure:
        section["insecure"] = True
    else:
        section.update(tls_cert=f"{TLS_DIR}/pool.pem", tls_key=f"{TLS_DIR}/pool.key",
                       tls_client_ca=f"{TLS_DIR}/ca.pem")
    if inventory.pool.cluster_tls:      # where tls_files uploads them
        section.update(zip(("cluster_tls_ca", "cluster_tls_cert", "cluster_tls_key"), CLUSTER_TLS_FILES))
    if inventory.pool.cluster_password:
        section["cluster_password_file"] = CLUSTER_PASSWORD_FILE
    try:
        PoolConfig.load(None, overrides=section)
    except ConfigInvalid as exc:
        raise ConfigInvalid(source=inventory.path, reason=f"[pool]: {exc.kwargs.get('reason', exc.message)}") from None
    return RemoteFile(POOL_CONFIG, _toml(inventory, "the pool's configuration", {"pool": section}))


def _checked(loader, inventory: Inventory, what: str, data: dict) -> None:
    """Run a pool loader that takes a path on ``data`` written to a private
    temporary file (it holds secrets: mode 0600, removed at once)."""
    fd, path = tempfile.mkstemp(prefix="accelmig-fleet-", suffix=".toml")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(tomli_w.dumps(data).encode())
        loader(path)
    except ConfigInvalid as exc:
        raise ConfigInvalid(source=inventory.path, reason=f"{what}: {exc.kwargs.get('reason', exc.message)}") from None
    finally:
        os.unlink(path)


def pool_hosts(inventory: Inventory, secrets: dict[str, str], group: str) -> RemoteFile:
    """The pool's hosts file: each host's secret (as read from, or made
    on, that host) and the networks its guests come from."""
    data = {"hosts": {h.name: {"secret": secrets[h.name], "addresses": list(h.pool_addresses)}
                      for h in inventory.hosts if h.name in secrets}}
    _checked(load_hosts, inventory, "the pool's hosts file", data)
    return RemoteFile(POOL_HOSTS, _toml(inventory, "the hypervisor hosts the pool serves", data),
                      mode=0o640 if group != "root" else 0o600, group=group, secret=True)


def pool_tokens(inventory: Inventory, tokens: dict[str, str], group: str) -> RemoteFile:
    """The tenants file: quotas from the inventory, tokens as the pool has
    them (made there at the first deploy, never changed after)."""
    tenants = {}
    for tenant in inventory.tenants:
        table = {"token": tokens[tenant.name], "quota": tenant.quota}
        if tenant.max_sessions is not None:
            table["max_sessions"] = tenant.max_sessions
        if tenant.quota_by_type:
            table["quota_by_type"] = dict(tenant.quota_by_type)
        tenants[tenant.name] = table
    data = {"tenants": tenants}
    _checked(load_tenants, inventory, "[tenants]", data)
    return RemoteFile(POOL_TOKENS, _toml(inventory, "the pool's tenants and their tokens", data),
                      mode=0o640 if group != "root" else 0o600, group=group, secret=True)
