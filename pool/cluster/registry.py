"""This pool node in etcd, under a lease it keeps alive; the other nodes as
the store shows them.

Key ``/accelmig/v1/nodes/<name>``, under the node's lease (TTL
``cluster_ttl``): ``NodeView``'s fields.  A node that dies stops renewing and
etcd deletes the key when the TTL runs out; a clean stop revokes the lease
at once.  ``instance`` changes with every process start: a node that comes
back under the same name is a new instance, and everything that named the
old one (a session id, a placement) names something that is gone.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import re
import threading
import time

from accelmig.pool.cluster.keys import PREFIX, check_name
from accelmig.pool.cluster.store import ClusterStore
from accelmig.wire.dataplane import parse_endpoint
from accelmig.wire.errors import BadRequest, Conflict, Unavailable
from accelmig.wire.values import is_a, is_int

LOG = logging.getLogger("accelmig.pool.cluster")

NODES = PREFIX + "nodes/"
MAX_DEVICES = 64
#: what a node publishes of each device: what placement may select on, never device data
DEVICE_FIELDS = {"id": str, "spec": str, "name": str, "vendor": str, "type": str, "global_mem_size": int}
_INSTANCE = re.compile(r"^[0-9a-f]{4,32}$")
#: how often the node's load is looked at, and put in etcd when it changed:
#: placement reads it, and a storm of opens at one node must not pile onto
#: another whose load etcd shows from a TTL ago
LOAD_PERIOD = 0.25


def node_key(name: str) -> str:
    return NODES + check_name(name, "node name")


@dataclasses.dataclass(frozen=True)
class NodeView:
    """One live node as read from etcd, every field checked (the store is input)."""
    name: str
    instance: str
    data: str                 # the data-plane endpoint drivers are placed on
    control: str | None
    devices: tuple            # of dicts with DEVICE_FIELDS
    sessions: int             # its load: live sessions
    lease: int = 0

    @classmethod
    def parse(cls, key: str, value: dict, lease: int = 0) -> "NodeView":
        name = check_name(value.get("name"), "name")
        if key != NODES + name:
            raise ValueError(f"key {key!r:.80} does not name node {name}")
        instance = value.get("instance")
        if not isinstance(instance, str) or not _INSTANCE.match(instance):
            raise ValueError("instance is not 4-32 hex digits")
        data = value.get("data")
        if not isinstance(data, str):
            raise ValueError("data endpoint missing")
        parse_endpoint(data)
        control = value.get("control")
        if control is not None:
            if not isinstance(control, str):
                raise ValueError("control endpoint is not a string")
            parse_endpoint(control)
        devices = value.get("devices")
        if not isinstance(devices, list) or len(devices) > MAX_DEVICES:
            raise ValueError(f"devices is not a list of at most {MAX_DEVICES}")
        sessions = value.get("sessions")
        if not is_int(sessions, 0, (1 << 31) - 1):
            raise ValueError("sessions is not a count")
        return cls(name, instance, data, control, tuple(_device(d) for d in devices), sessions, lease)

    def to_value(self) -> dict:
        return {"name": self.name, "instance": self.instance, "data": self.data, "control": self.control,
                "devices": [dict(d) for d in self.devices], "sessions": self.sessions}


def _device(value) -> dict:
    if not isinstance(value, dict):
        raise ValueError("a device is not an object")
    out = {}
    for field, kind in DEVICE_FIELDS.items():
        item = value.get(field)
        if item is None:
            continue
        if not is_a(item, kind) or (kind is str and len(item) > 128):
            raise ValueError(f"device {field} is not a short {kind.__name__}")
        out[field] = item
    return out


def device_summary(info: dict) -> dict:
    """A backend's ``info()`` cut to what placement may select on."""
    return {field: info[field] for field, kind in DEVICE_FIELDS.items()
            if isinstance(info.get(field), kind) and not isinstance(info.get(field), bool)}


def live_nodes(store: ClusterStore) -> dict[str, NodeView]:
    """Every node whose lease is alive (etcd deleted the others' keys)."""
    nodes = {}
    for key, value, meta in store.range(NODES, limit=1024)[0]:
        try:
            view = NodeView.parse(key, value, meta["lease"])
        except (ValueError, BadRequest) as exc:     # BadRequest: an endpoint that does not parse
            LOG.warning("etcd: skipping node record %s: %s", key[:120], exc)
            continue
        nodes[view.name] = view
    return nodes


class RegistrationState(str, enum.Enum):
    UNREGISTERED = "unregistered"
    REGISTERED = "registered"
    LEASE_LOST = "lease_lost"       # etcd expired our lease (unreachable past the TTL): register again
    STOPPED = "stopped"


class NodeRegistration:
    """This node's key under its lease, kept alive by a thread of its own
    (a renewal every TTL/3: two may fail before the TTL runs out)."""

    TRANSITIONS = {
        RegistrationState.UNREGISTERED: {RegistrationState.REGISTERED, RegistrationState.STOPPED},
        RegistrationState.REGISTERED: {RegistrationState.LEASE_LOST, RegistrationState.STOPPED},
        RegistrationState.LEASE_LOST: {RegistrationState.REGISTERED, RegistrationState.STOPPED},
        RegistrationState.STOPPED: set(),
    }

    def __init__(self, store: ClusterStore, view: NodeView, ttl: int, load=None, on_lease=None):
        self.store = store
        self.view = view
        self.ttl = max(2, int(ttl))
        self.load = load or (lambda: view.sessions)        # -> live sessions now
        self.on_lease = on_lease or (lambda lease: None)    # a new lease (reservations follow it)
        self.key = node_key(view.name)
        self.state = RegistrationState.UNREGISTERED
        self.lease = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _to(self, new: RegistrationState) -> None:
        if new not in self.TRANSITIONS[self.state]:
            raise RuntimeError(f"registration: {self.state.value} -> {new.value} is not a transition")
        self.state = new

    def start(self, wait_for_old: float | None = None) -> "NodeRegistration":
        self._register(self.ttl + 1 if wait_for_old is None else wait_for_old)
        self._thread = threading.Thread(target=self._keep_alive, name="cluster-lease", daemon=True)
        self._thread.start()
        return self

    def _register(self, wait_for_old: float) -> None:
        deadline = time.monotonic() + wait_for_old
        while True:
            lease = self.store.grant(self.ttl)
            view = dataclasses.replace(self.view, sessions=self.load())
            ok, _ = self.store.txn([self.store.absent(self.key)],
                                   [self.store.op_put(self.key, view.to_value(), lease)])
            if ok:
                break
            self.store.revoke(lease)
            holder = live_nodes(self.store).get(self.view.name)
            if holder is not None and holder.instance == self.view.instance:
                raise Conflict(reason=f"node {self.view.name}: this instance is registered twice")
            left = deadline - time.monotonic()
            if left <= 0 or self._stop.is_set():
                raise Conflict(reason=(
                    f"node name {self.view.name} is held in etcd by instance "
                    f"{holder.instance if holder else '?'} (another node with this name runs, or one "
                    f"that died has lease time left): give this node another name, or stop that one"))
            LOG.warning("node name %s is still held by instance %s (a node that died?): waiting "
                        "up to %.0f s for its lease to run out", self.view.name,
                        holder.instance if holder else "?", left)
            self._stop.wait(min(1.0, left))
        self.lease = lease
        self._to(RegistrationState.REGISTERED)
        LOG.info("node %s (instance %s) registered in etcd under lease %x (ttl %d s)%s", self.view.name,
                 self.view.instance, lease, self.ttl,
                 "" if self.store.tls else ": INSECURE plain etcd://, anyone who reaches etcd reads and "
                                           "writes the pool's records",
                 extra={"node": self.view.name, "instance": self.view.instance, "lease": lease,
                        "tls": self.store.tls is not None})
        self.on_lease(lease)

    def _keep_alive(self) -> None:
        published = None
        renewed = time.monotonic()
        while not self._stop.wait(min(LOAD_PERIOD, self.ttl / 3)):
            try:
                if self.state is RegistrationState.LEASE_LOST:
                    self._register(0)
                    published, renewed = None, time.monotonic()
                    continue
                if time.monotonic() - renewed >= self.ttl / 3:
                    if self.store.keepalive(self.lease) < 0:
                        LOG.warning("node %s: etcd expired its lease %x (unreachable past %d s): "
                                    "registering again", self.view.name, self.lease, self.ttl)
                        self._to(RegistrationState.LEASE_LOST)
                        continue
                    renewed = time.monotonic()
                sessions = self.load()
                if sessions != published:        # the load, when it changed
                    view = dataclasses.replace(self.view, sessions=sessions)
                    self.store.put(self.key, view.to_value(), self.lease)
                    published = sessions
            except (Unavailable, Conflict) as exc:
                LOG.warning("node %s: etcd: %s (retrying)", self.view.name, exc)
            except Exception:  # pragma: no cover - the lease thread never dies
                LOG.exception("node %s: keeping the lease alive failed", self.view.name)

    def stop(self) -> None:
        """Deregister: revoke the lease (the key and every reservation under it go at once)."""
        if self.state is RegistrationState.STOPPED:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.store.timeout * 3)
        registered = self.state is RegistrationState.REGISTERED
        self._to(RegistrationState.STOPPED)
        if registered:
            try:
                self.store.revoke(self.lease)
                LOG.info("node %s (instance %s) deregistered from etcd", self.view.name, self.view.instance)
            except Unavailable as exc:
                LOG.warning("node %s: could not deregister (its lease runs out in %d s): %s",
                            self.view.name, self.ttl, exc)
