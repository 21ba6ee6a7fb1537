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

import logging
import threading

from accelmig.pool.cluster.keys import PREFIX, check_name
from accelmig.pool.cluster.store import ClusterStore
from accelmig.wire.errors import QuotaExceeded, Unavailable

LOG = logging.getLogger("accelmig.pool.cluster")

QUOTA = PREFIX + "quota/"
#: a reservation's id: what the node knows it by (a session id and a handle)
MAX_ID = 96
#: compare-and-swap rounds lost to other nodes before giving up (they made progress)
MAX_ROUNDS = 32


def tenant_prefix(tenant: str) -> str:
    return QUOTA + check_name(tenant, "tenant name") + "/"


class QuotaLedger:
    """This node's reservations in the pool-wide ledger, under ``lease``."""

    def __init__(self, store: ClusterStore, node: str, lease: int = 0):
        self.store = store
        self.node = check_name(node, "node name")
        self.lease = lease
        self._mine: dict[str, tuple[str, int]] = {}     # key -> (tenant, bytes): to put back on a new lease
        self._lock = threading.Lock()

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
            if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size < 1 << 62:
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
