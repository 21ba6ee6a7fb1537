"""What hostd missed, and which records it still vouches for.

libvirt replays no events: at start and whenever its libvirt connection
comes back, hostd compares the domains it sees with the pool's open records
and finishes, aborts or rehomes what it missed (each domain under its
watch's lock, like an event).  And it renews the lease of a record only
while it can vouch for the migration — libvirt emits no event for
everything that ends one (an incoming QEMU that dies during prepare
vanishes silently; a job that fails before switchover leaves the source
running): a record nobody can vouch for is aborted here, or left to its lease.
"""

from __future__ import annotations

import asyncio
import logging
import time

import libvirt

from accelmig.plugin.hostd.watch import Trigger
from accelmig.wire.errors import AccelmigError, LibvirtFailure
from accelmig.wire.records import ABORTABLE, RecordView, SessionView

LOG = logging.getLogger("accelmig.hostd")

#: s after a record opened before its absence of progress is a verdict (the
#: destination's prepare and the source's first job stats take a moment)
VOUCH_GRACE = 5.0


class Reconciler:
    def __init__(self, daemon, *, renew_interval: float):
        self.daemon = daemon
        self.renew_interval = renew_interval

    @property
    def host(self) -> str:
        return self.daemon.host

    async def reconcile(self) -> None:
        """Domains here against the pool's open records."""
        daemon = self.daemon
        started = time.monotonic()
        conn = daemon.libvirt.conn
        here = {}
        for dom in await daemon.libvirt.call(conn.listAllDomains, 0):
            try:
                state, _reason = await daemon.libvirt.call(dom.state, 0)
            except LibvirtFailure:
                continue
            watch = await daemon.watch_of(dom)
            if watch is not None:
                here[watch.uuid] = (dom, state, watch)
        try:
            records = [RecordView.from_wire(r) for r in
                       (await daemon.pool_call_all("list_records", open_only=True))["records"]]
        except AccelmigError as exc:
            LOG.warning("reconcile: pool unreachable (%s); domains only", exc)
            records = []
        actions = []
        for record in records:
            dom, state, watch = here.get(record.domain_uuid, (None, None, None))
            if record.dest_host == self.host:
                if dom is not None and state == libvirt.VIR_DOMAIN_RUNNING:
                    if record.in_flight or not record.rehomed:     # (the pool's verdict)
                        actions.append(("rehome", watch.name))
                        await self._under_lock(dom, watch, Trigger.FOUND_ARRIVED, record)
                elif dom is not None and state == libvirt.VIR_DOMAIN_PAUSED:
                    await self._under_lock(dom, watch, Trigger.FOUND_ARRIVING, record)    # still arriving
                elif record.state in ABORTABLE:
                    actions.append(("abort", record.domain_uuid))
                    await self.abort_quietly(record, "the incoming domain is not on the destination")
            elif record.source_host == self.host:
                if dom is None or state == libvirt.VIR_DOMAIN_SHUTOFF:
                    actions.append(("close", record.domain_uuid))
                    try:
                        await daemon.pool_call("close", domain_uuid=record.domain_uuid,
                                               migration_id=record.migration_id)
                    except AccelmigError:
                        pass
                elif state == libvirt.VIR_DOMAIN_RUNNING and record.state in ABORTABLE:
                    actions.append(("abort", watch.name))
                    await self.abort_quietly(record, "the guest runs on the source: the migration failed")
                    async with watch.lock:
                        watch.record = None
        # accelmig domains running here that no record explains: attest them;
        # and if their sessions are bound elsewhere, they arrived while we were away.
        explained = {r.domain_uuid for r in records if r.dest_host == self.host}
        for uuid, (dom, state, watch) in here.items():
            if state != libvirt.VIR_DOMAIN_RUNNING or uuid in explained:
                continue
            try:
                # (the pool shows this host only its own sessions, and how many are bound elsewhere)
                listed = await daemon.pool_call_all("list_sessions", domain_uuid=uuid)
                sessions = [SessionView.from_wire(s) for s in listed["sessions"]]
                elsewhere = listed.get("elsewhere") or 0
            except AccelmigError:
                sessions, elsewhere = [], 0
            if elsewhere or any(s.bound_host not in (None, self.host) for s in sessions):
                actions.append(("rehome-missed", watch.name))
                await self._under_lock(dom, watch, Trigger.FOUND_ARRIVED)
            else:
                await self._under_lock(dom, watch, Trigger.FOUND_RUNNING)
        LOG.info("reconciled in %.1f ms: %d domain(s), %d open record(s); %s",
                 (time.monotonic() - started) * 1000, len(here), len(records),
                 ", ".join(f"{a} {d}" for a, d in actions) or "nothing to do")

    async def _under_lock(self, dom, watch, trigger: Trigger, record: RecordView | None = None) -> None:
        """Apply what reconciliation found as an event would be: under the
        watch's lock, in the background (a rehome may take seconds)."""
        async def apply():
            async with watch.lock:
                if record is not None:
                    watch.record = record
                await self.daemon.take(dom, watch, trigger)
        self.daemon.spawn(apply(), f"reconcile:{watch.name}")

    async def abort_quietly(self, record: RecordView, reason: str) -> None:
        try:
            await self.daemon.pool_call("abort", domain_uuid=record.domain_uuid,
                                        migration_id=record.migration_id, reason=reason)
        except AccelmigError as exc:
            LOG.info("reconcile: abort of %s: %s", record.key, exc)

    # -- leases ---------------------------------------------------------------------------
    async def renew_loop(self) -> None:
        daemon = self.daemon
        while True:
            await asyncio.sleep(self.renew_interval)
            if daemon.libvirt.conn is None:
                # Blind to our domains: vouch for no record.  Their leases run
                # out, and the pool aborts (or completes) them by itself.
                continue
            try:
                records = [RecordView.from_wire(r) for r in
                           (await daemon.pool_call_all("list_records", open_only=True))["records"]]
                mine = [[r.domain_uuid, r.migration_id] for r in records
                        if r.involves(self.host) and await self.vouch(r)]
                if mine:
                    await daemon.pool_call("renew", records=mine)
            except AccelmigError as exc:
                LOG.debug("lease renewal: %s", exc)

    async def vouch(self, record: RecordView) -> bool:
        """Whether this host still sees ``record``'s migration going on."""
        daemon = self.daemon
        age = time.time() - record.times.get("opened", time.time())
        in_flight = record.state in ABORTABLE
        try:
            dom = await daemon.libvirt.call(daemon.libvirt.conn.lookupByUUIDString, record.domain_uuid)
        except LibvirtFailure as exc:
            if exc.kind != "no-domain":
                return True                  # libvirt trouble: not a verdict
            dom = None
        if record.dest_host == self.host:
            if dom is None:
                if in_flight and age > VOUCH_GRACE:
                    await self.abort_quietly(record, "the incoming domain is gone from the destination")
                return False
            return True
        # the source
        if dom is None:
            return True                      # it left: the destination completes the record
        if in_flight and age > VOUCH_GRACE:
            try:
                job = (await daemon.libvirt.call(dom.jobInfo))[0]
            except LibvirtFailure:
                return True
            if job == libvirt.VIR_DOMAIN_JOB_NONE:
                state = (await daemon.libvirt.call(dom.state, 0))[0]
                if state == libvirt.VIR_DOMAIN_RUNNING:
                    await self.abort_quietly(record, "no migration job on the source any more: the "
                                                     "migration ended without reaching the destination")
                    return False
        return True
