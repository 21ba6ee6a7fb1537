"""Tenant quotas across every node of the pool, kept in etcd.

One key per reservation, ``/accelmig/v1/quota/<tenant>/<node>/<id>`` = ``{"bytes": N}``,
under the reserving node's lease — chosen over one usage counter per tenant
because a node that dies takes its reservations with it when its lease runs
out (a counter would keep a dead node's bytes forever, or need someone to
find and subtract them).  A reservation is one transaction: read the
tenant's keys at revision R, and put the new key only if no key under the
tenant's prefix changed since R (a compare over the whole range).  Two nodes
racing for the last bytes: one transaction wins, the other reads again and
is refused.  A stale read can only miss a release, so it errs on refusing.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading

from accelmig.pool.cluster.keys import PREFIX, check_name
from accelmig.pool.cluster.store import ClusterStore
from accelmig.wire.errors import QuotaExceeded, Unavailable
from accelmig.wire.values import is_int

LOG = logging.getLogger("accelmig.pool.cluster")

QUOTA = PREFIX + "quota/"
#: a reservation's id: what the node knows it by (a session id and a handle)
MAX_ID = 96
#: compare-and-swap rounds lost to other nodes before giving up (they made progress)
MAX_ROUNDS = 32


def tenant_prefix(tenant: str) -> str:
    """A tenant's keys; a name that is no plain key part (TOML allows any
    string) goes by its digest, marked with '~', which no plain name has."""
    try:
        part = check_name(tenant, "tenant name")
    except ValueError:
        part = "~" + hashlib.sha256(str(tenant).encode()).hexdigest()[:32]
    return QUOTA + part + "/"


class QuotaLedger:
    """This node's reservations in the pool-wide ledger, under ``lease``."""

    def __init__(self, store: ClusterStore, node: str, lease: int = 0):
        self.store = store
        self.node = check_name(node, "node name")
        self.lease = lease
        self._mine: dict[str, tuple[str, int]] = {}     # key -> (tenant, bytes): to put back on a new lease
        self._held: dict[str, int] = {}                  # tenant -> this node's bytes (take, give)
        self._lock = threading.Lock()
        self._take_lock = threading.Lock()
        self._gives: queue.Queue | None = None
        self.given = threading.Event()                   # set after each give is written (tests wait on it)

    def _key(self, tenant: str, rid: str) -> str:
        if not isinstance(rid, str) or not rid or len(rid) > MAX_ID or "/" in rid:
            raise ValueError(f"reservation id must be 1-{MAX_ID} characters without '/'")
        return tenant_prefix(tenant) + self.node + "/" + rid

    def used(self, tenant: str) -> tuple[int, int]:
        """(bytes reserved by every live node, the revision read at)."""
        kvs, revision = self.store.range(tenant_prefix(tenant))
        total = 0
        for key, value, _ in kvs:
            size = value.get("bytes")
            if not is_int(size, 0, (1 << 62) - 1):
                LOG.warning("etcd: reservation %s holds no byte count: counted as nothing", key[:120])
                continue
            total += size
        return total, revision

    def reserve(self, tenant: str, rid: str, nbytes: int, quota: int) -> int:
        """Reserve ``nbytes`` of ``tenant``'s ``quota`` pool-wide, or raise
        ``QuotaExceeded``; the tenant's use with it."""
        key = self._key(tenant, rid)
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError("nbytes must be a non-negative integer")
        for _ in range(MAX_ROUNDS):
            used, revision = self.used(tenant)
            if used + nbytes > quota:
                raise QuotaExceeded(tenant=tenant, size=nbytes, used=used, quota=quota,
                                    details={"pool_wide": True})
            ok, _ = self.store.txn([self.store.unchanged_since(tenant_prefix(tenant), revision)],
                                   [self.store.op_put(key, {"bytes": nbytes}, self.lease or None)])
            if ok:
                with self._lock:
                    self._mine[key] = (tenant, nbytes)
                return used + nbytes
        raise Unavailable(what="the pool-wide quota ledger", reason=(
            f"tenant {tenant}: {MAX_ROUNDS} reservations in a row lost to other nodes' (try again)"))

    def release(self, tenant: str, rid: str) -> None:
        key = self._key(tenant, rid)
        self.store.delete(key)
        with self._lock:
            self._mine.pop(key, None)

    # -- a node's device memory, per tenant (what Tenant.reserve and give_back call) --------
    def take(self, tenant: str, nbytes: int, quota: int) -> None:
        """Blocking (a session's worker thread): this node's bytes of
        ``tenant`` grow by ``nbytes`` if the pool-wide total stays within
        ``quota``; ``QuotaExceeded`` otherwise.  One key per tenant and node
        (``.../<node>/held``), one change at a time on this node."""
        key = self._key(tenant, "held")
        with self._take_lock:
            for _ in range(MAX_ROUNDS):
                with self._lock:
                    held = self._held.get(tenant, 0)
                used, revision = self.used(tenant)
                if used + nbytes > quota:
                    raise QuotaExceeded(tenant=tenant, size=nbytes, used=used, quota=quota,
                                        details={"pool_wide": True})
                ok, _ = self.store.txn([self.store.unchanged_since(tenant_prefix(tenant), revision)],
                                       [self.store.op_put(key, {"bytes": held + nbytes}, self.lease or None)])
                if ok:
                    with self._lock:
                        self._held[tenant] = self._held.get(tenant, 0) + nbytes
                        self._mine[key] = (tenant, self._held[tenant])
                    return
        raise Unavailable(what="the pool-wide quota ledger", reason=(
            f"tenant {tenant}: {MAX_ROUNDS} reservations in a row lost to other nodes' (try again)"))

    def give(self, tenant: str, nbytes: int) -> None:
        """Non-blocking (the pool's loop calls it too): written by the
        ledger's own thread.  Until then the pool-wide total counts the
        bytes still: late errs on refusing, never on exceeding."""
        if self._gives is None:
            self._gives = queue.Queue()
            threading.Thread(target=self._give_loop, name="cluster-quota", daemon=True).start()
        self._gives.put((tenant, nbytes))

    def _give_loop(self) -> None:
        while True:
            item = self._gives.get()
            if item is None:
                return
            tenant, nbytes = item
            key = self._key(tenant, "held")
            with self._take_lock:
                with self._lock:
                    held = self._held[tenant] = max(0, self._held.get(tenant, 0) - nbytes)
                    self._mine[key] = (tenant, held)
                try:
                    self.store.put(key, {"bytes": held}, self.lease or None)
                except Unavailable as exc:       # the next take or give writes the total again
                    LOG.warning("node %s: giving back %d bytes of tenant %s in etcd failed: %s",
                                self.node, nbytes, tenant, exc)
            self.given.set()

    def close(self) -> None:
        if self._gives is not None:
            self._gives.put(None)

    def follow_lease(self, lease: int) -> None:
        """The node's lease changed (the old one expired while etcd was
        unreachable): put this node's reservations back under the new one.
        They are put back whatever the quota: the memory is held."""
        self.lease = lease
        with self._lock:
            mine = dict(self._mine)
        for key, (tenant, nbytes) in mine.items():
            self.store.put(key, {"bytes": nbytes}, lease)
        if mine:
            LOG.warning("node %s: %d reservation(s) put back under its new lease %x", self.node, len(mine), lease)
