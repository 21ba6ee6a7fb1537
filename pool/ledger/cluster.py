"""What the ledger does in a pool of several nodes: it follows etcd.

One VM's sessions may live on several nodes; its migration is one record in
etcd with a part per node (``pool.cluster.records.EtcdRecords``, the etcd
schema and door).  A record's step is authorised here as on a node alone
(the ledger's own checks), taken in etcd first (one transaction moving the
record and every node's part), then by this node's own record, which first
follows whatever etcd's took meanwhile.  A step etcd's record cannot take
(another node aborted it) is refused here too: no node is ever ahead of
etcd.  Completing is never followed: each node mints the tickets of its own
sessions, only when the destination asks it.

Blocking etcd calls run off the loop; what they find is applied on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from accelmig.wire.errors import AccelmigError, Conflict, Forbidden, NoSuchRecord, RecordState
from accelmig.wire.records import ABORTABLE, RecordStateName, record_key

LOG = logging.getLogger("accelmig.pool")
S = RecordStateName

#: the control plane's methods a node of a cluster takes through etcd first
CLUSTERED = frozenset({"open_migration", "switchover", "commit", "complete", "close", "abort", "list_nodes"})


class EtcdFollower:
    def __init__(self, etcd, loop: asyncio.AbstractEventLoop | None = None):
        self.etcd = etcd                 # pool.cluster.records.EtcdRecords
        self.loop = loop
        self.ledger = None               # set by MigrationLedger.follow

    @property
    def node(self) -> str:
        return self.etcd.node

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # -- a host's call -------------------------------------------------------------------
    async def list_nodes(self, instance: str) -> dict:
        from accelmig.pool.cluster.registry import live_nodes
        nodes = await self._off_loop(live_nodes, self.etcd.store)
        return {"cluster": True, "node": self.node, "instance": instance,
                "nodes": [{"name": n.name, "instance": n.instance, "control": n.control}
                          for n in sorted(nodes.values(), key=lambda n: n.name)]}

    async def call(self, caller, method: str, args: dict, run: Callable[[], dict]) -> dict:
        """A record's step (``method``, whose caller and arguments the
        control plane checked) through etcd; ``run`` then takes it on this
        node (the control plane's method, which checks again: etcd is
        written in between) and returns its answer."""
        ledger, domain, mid = self.ledger, args.get("domain_uuid"), args.get("migration_id")
        if method == "open_migration":
            return await self._open(caller, domain, mid, run)
        try:
            try:
                record, steps = self._plan(caller, method, args)
            except Forbidden:
                # (a node that missed the source's switchover follows etcd's record
                # first: the vouching is there)
                local = ledger.records.get(record_key(domain, mid))
                if method not in ("complete", "commit") or local is None or local.vouched:
                    raise
                stored = await self._off_loop(self.etcd.read, domain, mid)
                if stored is None or not stored.vouched:
                    raise
                self.follow(local, stored)
                record, steps = self._plan(caller, method, args)
        except NoSuchRecord:
            # a record this node never opened (the open did not reach it): etcd's, if it has it
            if mid is not None and record_key(domain, mid) in ledger.records:
                raise
            stored = await self._off_loop(self.etcd.read, domain, mid) if mid is not None else \
                await self._off_loop(self.etcd.latest_open, domain)
            if stored is None or record_key(stored.domain_uuid, stored.migration_id) in ledger.records:
                raise
            self.adopt(stored)
            record, steps = self._plan(caller, method, args)
        stored = None
        for event, changes in steps:
            try:
                stored = await self._off_loop(self._advance, record, event, changes)
            except RecordState:
                stored = await self._off_loop(self.etcd.read, record.domain_uuid, record.migration_id)
                if stored is not None:
                    self.follow(record, stored)
                raise
            self.follow(record, stored)
        body = run()
        if body["ok"] and stored is not None and isinstance(body["result"], dict):
            body["result"]["cluster"] = cluster_view(stored)
        return body

    async def _open(self, caller, domain, mid, run: Callable[[], dict]) -> dict:
        ledger = self.ledger
        if isinstance(domain, str) and isinstance(mid, str) and record_key(domain, mid) not in ledger.records:
            # another node's migration under that id goes elsewhere: nothing opens here
            known = await self._off_loop(self.etcd.read, domain, mid)
            if known is not None and known.dest_host != caller:
                raise Conflict(reason=f"migration {mid} of domain {domain} goes to host "
                                      f"{known.dest_host} (as etcd has it), not {caller}")
        body = run()
        if not body["ok"]:
            return body
        record = ledger.records[record_key(body["result"]["domain_uuid"], body["result"]["migration_id"])]
        try:
            stored = await self._off_loop(self.etcd.open, record)
        except AccelmigError as exc:
            # a record the other nodes cannot follow must not go on here
            ledger.abort_record(record, f"not opened in etcd: {exc}")
            raise
        self.follow(record, stored)
        return {"ok": True, "result": dict(record.to_wire(), cluster=cluster_view(stored))}

    def _plan(self, caller, method: str, args: dict):
        """The record a step acts on and the events etcd's record takes for
        it, after the same checks as the method's own."""
        ledger, domain, mid = self.ledger, args.get("domain_uuid"), args.get("migration_id")
        if method == "switchover":
            postcopy = args.get("postcopy", False)
            record = ledger.switch_target(caller, domain, mid, postcopy)
            vouches = {"vouched": True} if ledger.parties.source_vouches(record, caller) else {}
            steps = [("switchover", {"source_host": record.source_host or caller, **vouches})] \
                if record.state in ABORTABLE else []
            return record, steps + ([("commit", {"postcopy": True, **vouches})] if postcopy else [])
        if method == "complete" and args.get("cursor") is not None:
            return ledger.find(domain, mid), []          # a next page: no step
        if method in ("commit", "complete"):
            return ledger.dest_target(caller, domain, mid, method), [(method, {})]
        if method == "close":
            return ledger.close_target(caller, domain, mid), [("close", {})]
        record = ledger.abort_target(caller, domain, mid)
        reason = args.get("reason", "aborted by a host")
        return record, [("abort", {"abort_reason": f"{reason} (by {caller})"[:256]})]

    def _advance(self, record, event: str, changes: dict):
        """Blocking: ``event`` on etcd's record; one this node still has
        but etcd lost (its lease of a day ran out, a store wiped) is put
        back first."""
        try:
            return self.etcd.advance(record.domain_uuid, record.migration_id, event, **changes)
        except NoSuchRecord:
            LOG.warning("record %s is not in etcd: putting it back", record.key)
            self.etcd.open(record)
            return self.etcd.advance(record.domain_uuid, record.migration_id, event, **changes)

    # -- following etcd ------------------------------------------------------------------
    def adopt(self, stored):
        """A record etcd holds (``stored``) that this node never opened (the
        destination's open did not reach it): this node's own, from etcd's
        parties, then following etcd's state."""
        from accelmig.pool.ledger.record import LedgerRecord
        ledger, now = self.ledger, time.time()
        record = LedgerRecord(stored.domain_uuid, stored.migration_id, stored.source_host, stored.dest_host,
                              stored.policy, ledger.config.lease_ttl, now, postcopy=stored.postcopy)
        # (the node that vouched for it authorised it)
        ledger._add(record, stored.vouched, now, f"taken from etcd, {stored.state.value} there")
        self.follow(record, stored)
        ledger.record_changed(record)
        return record

    def follow(self, record, stored) -> None:
        """This node's ``record`` takes the steps etcd's (``stored``: a
        ``pool.cluster.records.StoredRecord``) has taken: another node took
        them, or this one was unreachable then."""
        ledger, now = self.ledger, time.time()
        if stored.state is S.ABORTED:
            if record.state in ABORTABLE:
                ledger.abort_record(record, f"aborted in etcd: {stored.abort_reason or 'no reason given'}", now)
            elif not record.final:        # (etcd is written first: only a node's lone decision gets here)
                LOG.error("record %s is %s here but aborted in etcd (%s): its sessions keep their tickets",
                          record.key, record.state.value, stored.abort_reason,
                          extra={"domain": record.domain_uuid, "migration": record.migration_id})
            return
        if record.source_host is None and stored.source_host is not None:
            record.source_host = stored.source_host
        if stored.vouched and not record.vouched:
            ledger.vouch_record(record, now)
        if record.state is S.OPEN and stored.state is not S.OPEN:
            ledger.switchover_record(record, record.source_host, now)
        if (stored.state is S.COMMITTED or stored.postcopy) and record.state in ABORTABLE:
            record.postcopy = True
            record.commit(now)
        if (stored.source_stopped or stored.state is S.CLOSED) and not record.final:
            record.close(now)

    def expire(self, record, now: float) -> None:
        """No host renewed this node's record: abort it in etcd first (off
        the loop), then here.  Where etcd's has gone on meanwhile (another
        node completed it: its hosts renewed there) this node follows
        instead and keeps its record until the host's next call."""
        record.lease_expiry = now + record.lease_ttl      # one attempt at a time, not one per sweep
        loop = self.loop
        if loop is None or loop.is_closed():
            return

        def expire():
            try:
                return self.etcd.advance(record.domain_uuid, record.migration_id, "abort",
                                         abort_reason="lease expired: no host renewed it")
            except AccelmigError as exc:
                try:
                    return self.etcd.read(record.domain_uuid, record.migration_id)
                except AccelmigError:
                    LOG.warning("record %s: lease expired, etcd unreachable (%s): aborting here",
                                record.key, exc)
                    return None

        def settle(future) -> None:
            stored = future.result()
            if stored is None:
                self.ledger.abort_record(record, "lease expired: no host renewed it")
            else:
                self.follow(record, stored)
        loop.run_in_executor(None, expire).add_done_callback(lambda f: _post(loop, lambda: settle(f)))

    def aborted(self, record, reason: str) -> None:
        """An abort this node decided alone (its lease ran out, a newer
        migration superseded it) releases every node's part too; off the
        loop.  Where etcd already has it (the usual case: a host's abort is
        written there first) it is a repeat that writes nothing."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return

        def write():
            try:
                self.etcd.advance(record.domain_uuid, record.migration_id, "abort", abort_reason=reason[:256])
            except AccelmigError as exc:
                LOG.warning("record %s: the abort is not in etcd: %s", record.key, exc,
                            extra={"domain": record.domain_uuid, "migration": record.migration_id})
        loop.run_in_executor(None, write)


def _post(loop: asyncio.AbstractEventLoop, fn) -> None:
    """From a worker thread: ``fn`` on the loop (none once it closed)."""
    if not loop.is_closed():
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:      # loop closing
            pass


def cluster_view(stored) -> dict:
    """What a step's answer says of etcd's record: its state, the nodes
    that take part and those lost (their sessions are gone with them)."""
    return {"state": stored.state.value, "nodes": dict(stored.nodes), "lost": list(stored.lost)}
