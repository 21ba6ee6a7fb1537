"""``accelmig hostd``: the host daemon.

It follows libvirt's domain events (one connection, see libvirt_conn), talks
to the pool's control plane, and is the only process that opens the guests'
agent channels.  For each live migration of an accelmig domain:

- destination, at the hook's ``migrate begin`` note: open the migration
  record at the pool (carrying the operator's intent, if any);
- destination, at ``STARTED_MIGRATED``: connect to the new domain's channel
  socket (its path changes with every incoming migration) so the first
  message waits there;
- source, at ``SUSPENDED_MIGRATED``: if the domain's job really is an
  outgoing migration, switch the record over (and stop using the channel:
  what is written to the source after switchover is lost);
- destination, at ``RESUMED_MIGRATED`` or ``RESUMED_POSTCOPY`` (then commit
  first: the source is never revived): complete the record (tickets),
  discover this host's identity, send ``rehome`` to the guest agent (or, for
  a VM with only qemu-guest-agent, run ``accelmig-agent rehome --stdin``
  through guest-exec), and report the outcome;
- source, at ``STOPPED_MIGRATED``: close the record; a failed or cancelled
  migration (``STOPPED_FAILED`` on the destination, the source resuming)
  aborts it;
- ``STOPPED_SAVED`` parks the domain's sessions; a restore unparks them and
  tells the drivers to resume.

libvirt replays no events: at start and whenever its libvirt connection
comes back, hostd reconciles the domains it sees with the pool's open
records, and finishes, aborts or rehomes what it missed.  It renews the
leases of the records it takes part in, and relays the agent's
session-opened/closed reports to the pool (attestation).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import os
import random
import time
import uuid as uuid_module

import libvirt

from accelmig.plugin.channel import AsyncGuestChannel
from accelmig.plugin.config import HostConfig
from accelmig.plugin.domain.model import DomainXML
from accelmig.plugin.libvirt_conn import LibvirtSession, event_name
from accelmig.plugin.localapi import LocalServer
from accelmig.wire.control import AsyncControlClient
from accelmig.wire.errors import (AccelmigError, BadRequest, LibvirtFailure, NoSuchRecord, RecordState,
                                  Timeout, Unavailable)

LOG = logging.getLogger("accelmig.hostd")

GATED = {("migrate", "begin"), ("restore", "begin")}
IN_FLIGHT = {"open", "switched_over", "committed"}
#: s after a record opened before its absence of progress is a verdict (the
#: destination's prepare and the source's first job stats take a moment)
VOUCH_GRACE = 5.0
RECORD_STEPS = {"open_migration", "switchover", "commit", "complete", "close", "abort", "park", "unpark"}


class Phase(enum.Enum):
    """One domain as this host sees it."""

    IDLE = "idle"            # known; not (yet) serving sessions here
    RUNNING = "running"      # running here; channel synced, sessions attested
    OUTGOING = "outgoing"    # source: switched over; the channel is left alone
    INCOMING = "incoming"    # destination: record open, guest not running yet
    REHOMING = "rehoming"    # destination: guest runs, sessions being moved
    SAVED = "saved"          # saved to disk; sessions parked
    GONE = "gone"            # migrated away, stopped or undefined


class DomainWatch:
    def __init__(self, uuid: str, name: str):
        self.uuid = uuid
        self.name = name
        self.phase = Phase.IDLE
        self.lock = asyncio.Lock()
        self.record: dict | None = None          # the migration record this host takes part in
        self.channel: AsyncGuestChannel | None = None
        self.connecting: asyncio.Future | None = None   # a channel connection under way
        self.channel_path: str | None = None
        self.sessions: set[str] = set()
        self.accelmig = False
        self.agent_channel = False
        self.guest_agent = False
        self.fabric_mac: str | None = None
        self.job: dict | None = None              # the last completed job's stats (downtime)
        self.last_rehome: dict | None = None
        self.rehome_retry: dict | None = None     # a rehome waiting to be tried again, and why
        self.retry_task: asyncio.Task | None = None
        self.events: collections.deque = collections.deque(maxlen=20)

    def describe(self) -> dict:
        return {"uuid": self.uuid, "name": self.name, "phase": self.phase.value,
                "state": self.phase.value, "accelmig": self.accelmig,
                "channel": {"path": self.channel_path, "connected": self.channel is not None,
                            "synced": bool(self.channel and self.channel.hello)},
                "guest_agent": self.guest_agent, "sessions": sorted(self.sessions),
                "record": self.record, "job": self.job, "last_rehome": self.last_rehome,
                "rehome_retry": self.rehome_retry,
                "events": list(self.events)}


class HostDaemon:
    def __init__(self, config: HostConfig, *, rehome_timeout: float = 30.0, renew_interval: float = 3.0,
                 retry_first: float = 0.5, retry_max: float = 10.0):
        self.config = config
        self.retry_first = retry_first        # s before a failed rehome is tried again, doubling
        self.retry_max = retry_max
        self.host = config.host_id
        self.rehome_timeout = rehome_timeout
        self.renew_interval = renew_interval
        self.pool = AsyncControlClient(config.pool.control, config.host_id, config.read_secret())
        self.pool_reachable = False
        self.pool_instance: str | None = None
        self.identity = None
        self.allocator = None
        if config.fabric.host_bound:
            from accelmig.plugin.identity import GuestAddressAllocator
            self.allocator = GuestAddressAllocator.for_config(config)
        self.watches: dict[str, DomainWatch] = {}
        self.libvirt = LibvirtSession(config.hostd.libvirt_uri, on_lifecycle=self._lifecycle,
                                      on_job_completed=self._job_completed, on_connected=self.reconcile)
        self.local = LocalServer(config.hostd.socket, {
            "ping": self._api_ping, "status": self._api_status, "hook": self._api_hook,
            "intent": self._api_intent, "wait_rehomed": self._api_wait_rehomed,
            "metrics": self._api_metrics,
        })
        from accelmig.plugin.metrics import HostMetrics
        self.metrics = HostMetrics(self)
        self.counters = collections.Counter()
        self.started = time.time()
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()

    # -- lifecycle ---------------------------------------------------------------------
    async def run(self) -> None:
        await self.local.start()
        if self.config.hostd.metrics_listen:
            from prometheus_client import start_http_server
            from accelmig.wire.dataplane import parse_endpoint
            host, port = parse_endpoint(self.config.hostd.metrics_listen)
            start_http_server(port, addr=host, registry=self.metrics.registry)
        LOG.info("hostd for host %s: libvirt %s, pool %s, local API %s", self.host,
                 self.config.hostd.libvirt_uri, self.config.pool.control, self.config.hostd.socket)
        self._spawn(self._register_loop(), "register")
        self._spawn(self.libvirt.run(), "libvirt")
        self._spawn(self._renew_loop(), "renew")
        self._spawn(self._attest_loop(), "attest")
        await self._stop.wait()
        await self.shutdown()

    def stop(self) -> None:
        self._stop.set()

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for watch in self.watches.values():
            if watch.channel is not None:
                await watch.channel.close()
        await self.libvirt.stop()
        await self.local.close()
        await self.pool.close()
        LOG.info("hostd stopped")

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            LOG.error("task %s failed: %r", task.get_name(), task.exception(),
                      exc_info=task.exception())

    async def _pool_call(self, method: str, **args):
        if method in RECORD_STEPS:
            self.metrics.record_steps.labels(method).inc()
        try:
            result = await self.pool.call(method, **args)
        except Unavailable:
            self.pool_reachable = False
            raise
        self.pool_reachable = True
        self.pool_instance = self.pool.instance
        return result

    # -- host identity -----------------------------------------------------------------
    async def _discover(self, domain_uuid: str | None = None, guest_mac: str | None = None):
        from accelmig.plugin.identity import discover_identity
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, lambda: discover_identity(
            self.config, domain_uuid=domain_uuid, guest_mac=guest_mac, allocator=self.allocator))

    async def _register_loop(self) -> None:
        """Register this host's identity and addresses at the pool, and again
        whenever the pool restarted (a new instance forgot them)."""
        registered_for = None
        while True:
            try:
                identity = await self._discover()
                self.identity = identity
                addresses = [self.config.fabric.guest_subnet] if self.config.fabric.guest_subnet else []
                if identity.host_address:
                    addresses.append(f"{identity.host_address}/{32 if ':' not in identity.host_address else 128}")
                await self._pool_call("ping")
                if registered_for != self.pool.instance:
                    await self._pool_call("register_host", addresses=[str(a) for a in addresses],
                                          identity=identity.to_wire())
                    registered_for = self.pool.instance
                    LOG.info("registered at pool %s: %s", registered_for, ", ".join(map(str, addresses)))
            except AccelmigError as exc:
                LOG.warning("pool registration: %s", exc)
                registered_for = None
            await asyncio.sleep(2.0 if registered_for is None else 10.0)

    # -- libvirt events ----------------------------------------------------------------
    def _watch(self, uuid: str, name: str) -> DomainWatch:
        watch = self.watches.get(uuid)
        if watch is None:
            watch = self.watches[uuid] = DomainWatch(uuid, name)
        watch.name = name
        return watch

    def _lifecycle(self, dom, event: int, detail: int) -> None:
        uuid, name = dom.UUIDString(), dom.name()
        what = event_name(event, detail)
        watch = self._watch(uuid, name)
        watch.events.append((round(time.time(), 3), what))
        self._spawn(self._on_event(dom, watch, what), f"{what}:{name}")

    def _job_completed(self, dom, params: dict) -> None:
        watch = self._watch(dom.UUIDString(), dom.name())
        watch.job = {k: v for k, v in params.items() if isinstance(v, (int, float, str))}
        LOG.info("domain %s: job completed (downtime %s ms)", watch.name, params.get("downtime"),
                 extra={"domain": watch.name, "downtime_ms": params.get("downtime")})

    async def _on_event(self, dom, watch: DomainWatch, what: str) -> None:
        async with watch.lock:
            await self._inspect(dom, watch)
            if not watch.accelmig and what not in ("STOPPED_MIGRATED", "UNDEFINED_REMOVED"):
                return
            LOG.info("domain %s: %s (%s)", watch.name, what, watch.phase.value,
                     extra={"domain": watch.name, "event": what})
            self.metrics.events.labels(what).inc()
            try:
                await self._dispatch(dom, watch, what)
            except AccelmigError as exc:
                LOG.error("domain %s: handling %s failed: %s", watch.name, what, exc,
                          extra={"domain": watch.name, "event": what})

    async def _dispatch(self, dom, watch: DomainWatch, what: str) -> None:
        if what == "STARTED_MIGRATED":
            watch.phase = Phase.INCOMING
            self._spawn(self._preconnect(dom, watch), f"preconnect:{watch.name}")
        elif what in ("RESUMED_MIGRATED", "RESUMED_POSTCOPY"):
            if watch.phase is Phase.OUTGOING:
                # The source resumed its guest: the migration failed or was cancelled.
                await self._abort(watch, "the migration failed; the guest resumed on the source")
                watch.phase = Phase.RUNNING
                self._spawn(self._attest(dom, watch), f"attest:{watch.name}")
            else:
                await self._rehome(dom, watch, postcopy=what == "RESUMED_POSTCOPY")
        elif what in ("SUSPENDED_MIGRATED", "SUSPENDED_POSTCOPY"):
            await self._switchover(dom, watch, postcopy=what == "SUSPENDED_POSTCOPY")
        elif what == "STOPPED_MIGRATED":
            await self._close_channel(watch)
            try:
                await self._pool_call("close", domain_uuid=watch.uuid,
                                      migration_id=(watch.record or {}).get("migration_id"))
            except NoSuchRecord:
                LOG.warning("domain %s left this host without a migration record", watch.name)
            watch.phase, watch.record = Phase.GONE, None
        elif what.startswith("STOPPED") and what != "STOPPED_SAVED" and \
                watch.phase in (Phase.INCOMING, Phase.REHOMING):
            # Whatever the reason libvirt gives (FAILED, CRASHED, DESTROYED), a
            # domain that stops while still arriving is a failed migration.
            await self._close_channel(watch)
            await self._abort(watch, f"the incoming migration failed on the destination ({what})")
            watch.phase = Phase.GONE
        elif what == "STOPPED_SAVED":
            await self._close_channel(watch)
            out = await self._pool_call("park", domain_uuid=watch.uuid)
            watch.phase = Phase.SAVED
            LOG.info("domain %s saved: parked %s", watch.name, out["parked"])
        elif what in ("STARTED_RESTORED", "STARTED_FROM_SNAPSHOT", "RESUMED_FROM_SNAPSHOT"):
            # An older copy of the guest's memory runs again: tell its drivers to
            # resume now; the pool refuses them if they are not the latest copy.
            await self._pool_call("unpark", domain_uuid=watch.uuid)
            await self._local_rehome(dom, watch, reason=what.lower())
        elif what.startswith("STARTED") or what == "RESUMED_UNPAUSED":
            watch.phase = Phase.RUNNING
            self._spawn(self._attest(dom, watch), f"attest:{watch.name}")
        elif what.startswith("STOPPED") or what.startswith("UNDEFINED"):
            await self._close_channel(watch)
            watch.phase = Phase.GONE

    async def _inspect(self, dom, watch: DomainWatch) -> None:
        """Read the live XML: accelmig or not, the channel socket's path."""
        try:
            xml = await self.libvirt.call(dom.XMLDesc, 0, timeout=10)
        except (LibvirtFailure, asyncio.TimeoutError):
            return
        try:
            model = DomainXML.parse(xml)
        except AccelmigError:
            return
        watch.accelmig = model.is_accelmig()
        channel = model.agent_channel()
        watch.agent_channel = channel is not None
        if channel is not None and channel.path:
            watch.channel_path = channel.path
        watch.guest_agent = model.has_guest_agent()
        nic = model.fabric_interface()
        watch.fabric_mac = nic.mac if nic is not None else None

    # -- the channel -------------------------------------------------------------------
    async def _preconnect(self, dom, watch: DomainWatch) -> None:
        """Destination, before the guest runs: be connected when it resumes."""
        if not watch.agent_channel:
            return
        try:
            await self._channel(dom, watch, sync_timeout=self.rehome_timeout)
        except AccelmigError as exc:
            LOG.info("domain %s: early channel connection failed (%s); retrying at resume", watch.name, exc)

    async def _channel(self, dom, watch: DomainWatch, sync_timeout: float = 15.0) -> AsyncGuestChannel:
        """The domain's synced channel: the one being connected already (the
        destination's early connection), or a new one."""
        if watch.channel is not None and watch.channel.hello is not None:
            return watch.channel
        connecting = watch.connecting
        if connecting is not None and not connecting.done():
            try:
                return await asyncio.shield(connecting)
            except AccelmigError:
                pass        # it failed: make our own below
        watch.connecting = asyncio.ensure_future(self._connect_channel(dom, watch, sync_timeout))
        return await asyncio.shield(watch.connecting)

    async def _connect_channel(self, dom, watch: DomainWatch, sync_timeout: float) -> AsyncGuestChannel:
        if watch.channel is not None:
            await self._close_channel(watch)
        await self._inspect(dom, watch)
        if not watch.channel_path:
            raise Unavailable(what=f"the accelmig channel of {watch.name}", reason="no socket path in the live XML")
        channel = AsyncGuestChannel(watch.channel_path, on_event=lambda m: self._on_guest_event(watch, m))
        watch.channel = channel
        try:
            hello = await channel.connect(connect_timeout=5.0, sync_timeout=sync_timeout)
        except AccelmigError:
            await self._close_channel(watch)
            raise
        LOG.info("domain %s: agent %s synced on %s, %d session(s)", watch.name, hello.get("agent_version"),
                 watch.channel_path, len(hello.get("sessions") or []), extra={"domain": watch.name})
        return channel

    async def _close_channel(self, watch: DomainWatch) -> None:
        channel, watch.channel = watch.channel, None
        if channel is not None:
            await channel.close()

    def _on_guest_event(self, watch: DomainWatch, message: dict) -> None:
        kind = message.get("type")
        if kind == "hello":
            for session in message.get("sessions") or []:
                self._spawn(self._bind(watch, session.get("sid")), "bind")
        elif kind == "session_opened":
            self._spawn(self._bind(watch, message.get("sid")), "bind")
        elif kind == "session_closed":
            watch.sessions.discard(message.get("sid"))
            self._spawn(self._unbind(message.get("sid")), "unbind")

    async def _bind(self, watch: DomainWatch, sid) -> None:
        """Attest to the pool that session ``sid`` belongs to this domain on this host."""
        if not isinstance(sid, str) or watch.phase is Phase.OUTGOING:
            return
        try:
            await self._pool_call("bind_session", sid=sid, domain_uuid=watch.uuid, domain_name=watch.name)
            watch.sessions.add(sid)
        except AccelmigError as exc:
            LOG.warning("domain %s: session %s not attested: %s", watch.name, sid, exc)

    async def _unbind(self, sid) -> None:
        try:
            await self._pool_call("unbind_session", sid=sid)
        except AccelmigError:
            pass

    async def _attest(self, dom, watch: DomainWatch) -> None:
        """A domain running here: connect, tell it where the pool is, attest."""
        if not watch.agent_channel or watch.phase not in (Phase.RUNNING, Phase.IDLE):
            return
        async with watch.lock:
            try:
                fresh = watch.channel is None or watch.channel.hello is None
                channel = await self._channel(dom, watch)
                if fresh:
                    identity = await self._discover(watch.uuid, watch.fabric_mac)
                    await channel.request("identity", identity=identity.to_wire(), timeout=10)
            except AccelmigError as exc:
                LOG.info("domain %s: channel not ready: %s", watch.name, exc)

    async def _attest_loop(self) -> None:
        while True:
            await asyncio.sleep(5.0)
            conn = self.libvirt.conn
            if conn is None:
                continue
            for watch in list(self.watches.values()):
                if watch.phase is Phase.RUNNING and watch.agent_channel and \
                        (watch.channel is None or watch.channel.hello is None):
                    try:
                        dom = await self.libvirt.call(conn.lookupByUUIDString, watch.uuid)
                    except LibvirtFailure:
                        continue
                    self._spawn(self._attest(dom, watch), f"attest:{watch.name}")

    # -- migrations --------------------------------------------------------------------
    async def _switchover(self, dom, watch: DomainWatch, *, postcopy: bool = False) -> None:
        """Source: only for a real outgoing migration (a failed one pauses too).
        ``postcopy``: the guest is handed to the destination for good."""
        try:
            stats = await self.libvirt.call(dom.jobStats, 0, timeout=5)
        except (LibvirtFailure, asyncio.TimeoutError) as exc:
            LOG.warning("domain %s: no job stats (%s); not switching over", watch.name, exc)
            return
        operation = stats.get("operation")
        if operation != libvirt.VIR_DOMAIN_JOB_OPERATION_MIGRATION_OUT:
            LOG.info("domain %s paused by job operation %s, not an outgoing migration", watch.name, operation)
            return
        watch.phase = Phase.OUTGOING
        await self._close_channel(watch)     # writes after switchover are lost: stop here
        try:
            record = await self._pool_call("switchover", domain_uuid=watch.uuid, postcopy=postcopy)
            watch.record = record
            LOG.info("domain %s: switched over (record %s/%s)", watch.name, record["domain_uuid"],
                     record["migration_id"], extra={"domain": watch.name, "migration": record["migration_id"]})
        except NoSuchRecord:
            LOG.warning("domain %s migrates out without a record (destination without accelmig?)", watch.name)

    async def _abort(self, watch: DomainWatch, reason: str) -> None:
        mid = (watch.record or {}).get("migration_id")
        try:
            record = await self._pool_call("abort", domain_uuid=watch.uuid, migration_id=mid, reason=reason)
            LOG.warning("domain %s: record %s aborted: %s", watch.name, record["migration_id"], reason,
                        extra={"domain": watch.name, "migration": record["migration_id"]})
        except (NoSuchRecord, RecordState) as exc:
            LOG.info("domain %s: nothing to abort (%s)", watch.name, exc)
        watch.record = None

    async def _rehome(self, dom, watch: DomainWatch, *, postcopy: bool = False) -> dict:
        """Destination: the guest runs here now.  Move its sessions here.

        One attempt; an attempt that fails, or after which not every session
        resumed, is retried in the background until they all have (or the
        record or the domain ends): a guest is never left knocking with
        ``TICKET_REQUIRED``."""
        watch.phase = Phase.REHOMING
        try:
            summary = await self._rehome_once(dom, watch, postcopy=postcopy)
        except AccelmigError as exc:
            self._retry_rehome_later(watch, f"{type(exc).__name__}: {exc}")
            raise
        if not summary["ok"]:
            self._retry_rehome_later(watch, summary["why"])
        return summary

    async def _rehome_once(self, dom, watch: DomainWatch, *, postcopy: bool = False) -> dict:
        started = time.monotonic()
        record = watch.record
        if record is None or record.get("dest_host") != self.host:
            record = await self._find_or_open(watch)
        mid = record["migration_id"]
        log_extra = {"domain": watch.name, "migration": mid}
        if not watch.agent_channel and watch.guest_agent:
            await self._attest_through_guest_agent(dom, watch)
        if postcopy:
            await self._pool_call("commit", domain_uuid=watch.uuid, migration_id=mid)
        done = await self._pool_call("complete", domain_uuid=watch.uuid, migration_id=mid)
        watch.record = done["record"]
        tickets = done["tickets"]
        completed = time.monotonic()
        identity = await self._discover(watch.uuid, watch.fabric_mac)
        document = {"migration_id": mid, "identity": identity.to_wire(), "tickets": tickets}
        result = await self._deliver(dom, watch, document)
        delivered = time.monotonic()
        ok = bool(result and result.get("ok"))
        summary = {"migration_id": mid, "postcopy": postcopy, "tickets": len(tickets), "result": result,
                   "ok": ok, "why": None if ok else _why_not_resumed(result),
                   "attempt": (result or {}).get("attempts", 1),
                   "complete_s": round(completed - started, 6), "deliver_s": round(delivered - completed, 6),
                   "total_s": round(delivered - started, 6), "at": time.time()}
        watch.last_rehome = summary
        if ok:
            watch.phase = Phase.RUNNING
            watch.rehome_retry = None
        self.counters["rehomes"] += 1
        self.metrics.rehomes.labels("ok" if ok else "incomplete").inc()
        self.metrics.rehome_seconds.observe(summary["total_s"])
        try:
            await self._pool_call("report_resume", domain_uuid=watch.uuid, migration_id=mid,
                                  results=(result or {}).get("sessions"))
        except AccelmigError:
            pass
        (LOG.info if ok else LOG.error)(
            "domain %s: rehome %s in %.1f ms (complete %.1f ms, deliver %.1f ms): %s", watch.name, mid,
            summary["total_s"] * 1000, summary["complete_s"] * 1000, summary["deliver_s"] * 1000,
            "all sessions resumed" if ok else f"NOT all resumed ({summary['why']}); will retry",
            extra=log_extra)
        return summary

    def _retry_rehome_later(self, watch: DomainWatch, why: str) -> None:
        """Keep one background retry loop per domain (backoff, capped)."""
        retry = watch.rehome_retry or {"attempts": 1, "since": time.time()}
        retry["why"] = why
        watch.rehome_retry = retry
        if watch.retry_task is None or watch.retry_task.done():
            watch.retry_task = self._spawn(self._rehome_retries(watch), f"rehome-retry:{watch.name}")

    async def _rehome_retries(self, watch: DomainWatch) -> None:
        delay = self.retry_first
        while watch.rehome_retry is not None:
            retry = watch.rehome_retry
            # jitter: the rehomes of an evacuation do not retry in lockstep
            wait = delay * random.uniform(0.8, 1.2)
            retry["next_at"] = round(time.time() + wait, 3)
            LOG.warning("domain %s: rehome retry %d in %.1f s: %s", watch.name, retry["attempts"] + 1,
                        wait, retry["why"], extra={"domain": watch.name})
            await asyncio.sleep(wait)
            delay = min(delay * 2, self.retry_max)
            async with watch.lock:
                if watch.rehome_retry is None or watch.phase is not Phase.REHOMING:
                    return            # done meanwhile (reconciliation, an event), or gone
                retry["attempts"] += 1
                retry.pop("next_at", None)
                try:
                    dom = await self.libvirt.call(self.libvirt.conn.lookupByUUIDString, watch.uuid)
                except (LibvirtFailure, AttributeError) as exc:
                    if isinstance(exc, LibvirtFailure) and exc.kind == "no-domain":
                        LOG.info("domain %s is gone: no more rehome retries", watch.name)
                        watch.rehome_retry = None
                        return
                    retry["why"] = f"libvirt: {exc}"
                    continue
                try:
                    summary = await self._rehome_once(dom, watch)
                except (NoSuchRecord, RecordState) as exc:
                    LOG.error("domain %s: its migration record ended before every session resumed: %s",
                              watch.name, exc, extra={"domain": watch.name})
                    watch.rehome_retry = None
                    watch.phase = Phase.RUNNING
                    return
                except AccelmigError as exc:
                    retry["why"] = f"{type(exc).__name__}: {exc}"
                    continue
                if summary["ok"]:
                    LOG.info("domain %s: rehome %s succeeded on attempt %d", watch.name,
                             summary["migration_id"], retry["attempts"], extra={"domain": watch.name})
                    return
                retry["why"] = summary["why"]

    async def _attest_through_guest_agent(self, dom, watch: DomainWatch) -> None:
        """A VM without the accelmig channel cannot report its sessions: ask
        its agent through qemu-guest-agent (guest-exec), and attest them as
        the destination of this migration, before the record freezes them."""
        from accelmig.plugin import qga
        try:
            status = await self._qga(lambda: qga.agent_status(dom, timeout=15.0))
        except AccelmigError as exc:
            LOG.warning("domain %s: its sessions could not be read through qemu-guest-agent: %s",
                        watch.name, exc)
            return
        for session in status.get("sessions") or []:
            await self._bind(watch, session.get("sid"))

    async def _qga(self, call):
        """A blocking qemu-guest-agent call, off the loop, retried while qemu-ga
        is not connected yet (right after a migration libvirt sees it tens of
        milliseconds after the guest resumed)."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.rehome_timeout
        while True:
            try:
                return await loop.run_in_executor(None, call)
            except AccelmigError as exc:
                if not exc.retriable or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)

    async def _find_or_open(self, watch: DomainWatch) -> dict:
        """The record of this incoming migration; opened now if the hook's note
        never reached us (hostd was down, lenient mode) or was lost."""
        out = await self._pool_call("list_records", open_only=True, domain_uuid=watch.uuid)
        mine = [r for r in out["records"] if r["dest_host"] == self.host and r["state"] in IN_FLIGHT | {"completed"}]
        if mine:
            return max(mine, key=lambda r: r["times"]["opened"])
        LOG.warning("domain %s runs here without a migration record: opening one now", watch.name)
        return await self._pool_call("open_migration", domain_uuid=watch.uuid, domain_name=watch.name)

    async def _deliver(self, dom, watch: DomainWatch, document: dict) -> dict | None:
        """Send the rehome to the guest: its accelmig channel, else qemu-guest-agent."""
        deadline = time.monotonic() + self.rehome_timeout
        last_error = None
        if watch.agent_channel:
            while time.monotonic() < deadline:
                try:
                    channel = await self._channel(dom, watch, sync_timeout=max(1.0, deadline - time.monotonic()))
                    return await channel.request("rehome", timeout=max(1.0, deadline - time.monotonic()),
                                                 **document)
                except AccelmigError as exc:
                    # The rehome is idempotent per migration id: trying again is safe.
                    last_error = exc
                    LOG.warning("domain %s: rehome delivery failed (%s); retrying", watch.name, exc)
                    await self._close_channel(watch)
                    await asyncio.sleep(0.2)
            raise Timeout(what=f"rehome of {watch.name} ({last_error})", timeout=self.rehome_timeout)
        if watch.guest_agent:
            from accelmig.plugin import qga
            LOG.warning("domain %s has no accelmig channel: rehoming through qemu-guest-agent guest-exec "
                        "(libvirt marks the domain tainted: custom-ga-command)", watch.name)
            return await self._qga(lambda: qga.deliver_rehome(dom, document, timeout=self.rehome_timeout))
        raise Unavailable(what=f"the guest of {watch.name}",
                          reason="it has neither the accelmig channel nor qemu-guest-agent")

    async def _local_rehome(self, dom, watch: DomainWatch, reason: str) -> None:
        """Tell the drivers to resume here (after a restore), no ticket needed."""
        watch.phase = Phase.RUNNING
        identity = await self._discover(watch.uuid, watch.fabric_mac)
        document = {"migration_id": f"{reason}-{uuid_module.uuid4().hex[:8]}",
                    "identity": identity.to_wire(), "tickets": {}}
        try:
            result = await self._deliver(dom, watch, document)
        except AccelmigError as exc:
            LOG.error("domain %s: resume after %s not delivered: %s", watch.name, reason, exc)
            return
        watch.last_rehome = {"migration_id": document["migration_id"], "result": result, "at": time.time()}
        for sid, outcome in ((result or {}).get("sessions") or {}).items():
            if outcome.get("ok"):
                LOG.info("domain %s: session %s resumed after %s", watch.name, sid, reason)
            else:
                LOG.error("domain %s: session %s REFUSED after %s: %s", watch.name, sid, reason,
                          (outcome.get("error") or {}).get("message"))

    # -- reconciliation ----------------------------------------------------------------
    async def reconcile(self) -> None:
        """What did we miss?  Domains here against the pool's open records."""
        conn = self.libvirt.conn
        started = time.monotonic()
        domains = await self.libvirt.call(conn.listAllDomains, 0)
        here = {}
        for dom in domains:
            try:
                state, reason = await self.libvirt.call(dom.state, 0)
            except LibvirtFailure:
                continue
            watch = self._watch(dom.UUIDString(), dom.name())
            await self._inspect(dom, watch)
            here[watch.uuid] = (dom, state, reason, watch)
        try:
            records = (await self._pool_call("list_records", open_only=True))["records"]
        except AccelmigError as exc:
            LOG.warning("reconcile: pool unreachable (%s); domains only", exc)
            records = []
        actions = []
        for record in records:
            uuid = record["domain_uuid"]
            dom, state, reason, watch = here.get(uuid, (None, None, None, None))
            if record["dest_host"] == self.host:
                if dom is not None and state == libvirt.VIR_DOMAIN_RUNNING:
                    if record["state"] in IN_FLIGHT or set(record["sessions"]) - set(record["resumed"]):
                        watch.record = record
                        actions.append(("rehome", watch.name))
                        self._spawn(self._locked(watch, self._rehome(dom, watch)), f"reconcile:{watch.name}")
                elif dom is not None and state == libvirt.VIR_DOMAIN_PAUSED:
                    watch.record, watch.phase = record, Phase.INCOMING        # still arriving
                elif record["state"] in ("open", "switched_over"):
                    actions.append(("abort", uuid))
                    await self._abort_quiet(uuid, record, "the incoming domain is not on the destination")
            elif record["source_host"] == self.host:
                if dom is None or state == libvirt.VIR_DOMAIN_SHUTOFF:
                    actions.append(("close", uuid))
                    try:
                        await self._pool_call("close", domain_uuid=uuid, migration_id=record["migration_id"])
                    except AccelmigError:
                        pass
                elif state == libvirt.VIR_DOMAIN_RUNNING and record["state"] in ("open", "switched_over"):
                    actions.append(("abort", watch.name))
                    await self._abort_quiet(uuid, record, "the guest runs on the source: the migration failed")
                    watch.record = None
        # accelmig domains running here that no record explains: attest them;
        # and if their sessions are bound elsewhere, they arrived while we were away.
        explained = {r["domain_uuid"] for r in records if r["dest_host"] == self.host}
        for uuid, (dom, state, reason, watch) in here.items():
            if not watch.accelmig or state != libvirt.VIR_DOMAIN_RUNNING or uuid in explained:
                continue
            try:
                sessions = (await self._pool_call("list_sessions", domain_uuid=uuid))["sessions"]
            except AccelmigError:
                sessions = []
            if any(s["bound_host"] not in (None, self.host) for s in sessions):
                actions.append(("rehome-missed", watch.name))
                self._spawn(self._locked(watch, self._rehome(dom, watch)), f"reconcile:{watch.name}")
            else:
                watch.phase = Phase.RUNNING
                self._spawn(self._attest(dom, watch), f"attest:{watch.name}")
        LOG.info("reconciled in %.1f ms: %d domain(s), %d open record(s); %s",
                 (time.monotonic() - started) * 1000, len(here), len(records),
                 ", ".join(f"{a} {d}" for a, d in actions) or "nothing to do")

    async def _locked(self, watch: DomainWatch, coro):
        async with watch.lock:
            try:
                return await coro
            except AccelmigError as exc:
                LOG.error("domain %s: %s", watch.name, exc)

    async def _abort_quiet(self, uuid: str, record: dict, reason: str) -> None:
        try:
            await self._pool_call("abort", domain_uuid=uuid, migration_id=record["migration_id"], reason=reason)
        except AccelmigError as exc:
            LOG.info("reconcile: abort of %s/%s: %s", uuid, record["migration_id"], exc)

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.renew_interval)
            if self.libvirt.conn is None:
                # Blind to our domains: vouch for no record.  Their leases run
                # out, and the pool aborts (or completes) them by itself.
                continue
            try:
                records = (await self._pool_call("list_records", open_only=True))["records"]
                mine = []
                for record in records:
                    if self.host not in (record["source_host"], record["dest_host"]):
                        continue
                    if await self._vouch(record):
                        mine.append([record["domain_uuid"], record["migration_id"]])
                if mine:
                    await self._pool_call("renew", records=mine)
            except AccelmigError as exc:
                LOG.debug("lease renewal: %s", exc)

    async def _vouch(self, record: dict) -> bool:
        """Renew a record only while this host sees its migration going on.

        libvirt emits no event for everything that ends a migration (an
        incoming QEMU that dies during prepare vanishes silently; a job that
        fails before switchover leaves the source running): a record nobody
        can vouch for is aborted here, or left to its lease.
        """
        age = time.time() - record["times"]["opened"]
        in_flight = record["state"] in ("open", "switched_over")
        try:
            dom = await self.libvirt.call(self.libvirt.conn.lookupByUUIDString, record["domain_uuid"])
        except LibvirtFailure as exc:
            dom = None if exc.kind == "no-domain" else False
        if dom is False:
            return True                      # libvirt trouble: not a verdict
        if record["dest_host"] == self.host:
            if dom is None:
                if in_flight and age > VOUCH_GRACE:
                    await self._abort_quiet(record["domain_uuid"], record,
                                            "the incoming domain is gone from the destination")
                return False
            return True
        # the source
        if dom is None:
            return True                      # it left: the destination completes the record
        if in_flight and age > VOUCH_GRACE:
            try:
                job = (await self.libvirt.call(dom.jobInfo))[0]
            except LibvirtFailure:
                return True
            if job == libvirt.VIR_DOMAIN_JOB_NONE:
                state = (await self.libvirt.call(dom.state, 0))[0]
                if state == libvirt.VIR_DOMAIN_RUNNING:
                    await self._abort_quiet(record["domain_uuid"], record,
                                            "no migration job on the source any more: the migration "
                                            "ended without reaching the destination")
                    return False
        return True

    # -- local API ---------------------------------------------------------------------
    async def _api_ping(self, message: dict) -> dict:
        return {"host": self.host, "pid": os.getpid(), "pool": self.pool_reachable,
                "libvirt": self.libvirt.conn is not None}

    async def _api_status(self, message: dict) -> dict:
        try:
            records = (await self._pool_call("list_records", open_only=False))["records"]
            records = [r for r in records if self.host in (r["source_host"], r["dest_host"])][-20:]
        except AccelmigError:
            records = []
        return {"host": self.host, "pid": os.getpid(), "uptime": round(time.time() - self.started, 1),
                "libvirt": {"uri": self.config.hostd.libvirt_uri, "connected": self.libvirt.conn is not None,
                            "reconnects": self.libvirt.reconnects},
                "pool": {"control": self.config.pool.control, "reachable": self.pool_reachable,
                         "instance": self.pool_instance},
                "identity": self.identity.to_wire() if self.identity else None,
                "domains": [w.describe() for w in self.watches.values() if w.phase is not Phase.GONE],
                "records": records, "counters": dict(self.counters)}

    async def _api_hook(self, message: dict) -> dict:
        op, sub, uuid, name = (message.get(k) for k in ("op", "sub", "uuid", "name"))
        if not isinstance(uuid, str):
            raise BadRequest(reason="hook note without a domain uuid")
        self.counters[f"hook_{op}_{sub}"] += 1
        self.metrics.hook_notes.labels(f"{op} {sub}").inc()
        watch = self._watch(uuid, name or uuid)
        watch.accelmig = True
        watch.events.append((round(time.time(), 3), f"hook {op} {sub}"))
        budget = float(message.get("budget") or 5.0)      # what the hook can still wait
        if (op, sub) == ("migrate", "begin"):
            # No libvirt call here: libvirt is waiting for this hook.
            record = await self._pool_call_within(budget, "open_migration", domain_uuid=uuid, domain_name=name)
            watch.record, watch.phase = record, Phase.INCOMING
            LOG.info("domain %s incoming: record %s opened (policy %s)", name, record["migration_id"],
                     record["policy"], extra={"domain": name, "migration": record["migration_id"]})
            return {"record": record}
        if (op, sub) == ("restore", "begin"):
            await self._pool_call_within(budget, "ping")   # strict mode: the pool must be there to unpark
            return {"restoring": uuid}
        return {"noted": True}

    async def _pool_call_within(self, budget: float, method: str, **args):
        """A pool call the hook is waiting for: a slow pool is an unreachable one."""
        try:
            return await asyncio.wait_for(self._pool_call(method, **args), budget)
        except asyncio.TimeoutError:
            raise Unavailable(what="the pool's control plane",
                              reason=f"no answer within the hook's {budget:.1f} s") from None

    async def _api_intent(self, message: dict) -> dict:
        return await self._pool_call("register_intent", domain_uuid=message.get("uuid"),
                                     policy=message.get("policy") or "none",
                                     dest_host=message.get("dest_host"),
                                     migration_id=message.get("migration_id"))

    async def _api_wait_rehomed(self, message: dict) -> dict:
        """Until the domain's migration record shows every session resumed."""
        uuid, mid = message.get("uuid"), message.get("migration_id")
        timeout = float(message.get("wait") or 60)
        deadline = time.monotonic() + timeout
        while True:
            records = (await self._pool_call("list_records", domain_uuid=uuid))["records"]
            if mid:
                records = [r for r in records if r["migration_id"] == mid]
            if records:
                record = max(records, key=lambda r: r["times"]["opened"])
                if record["state"] == "aborted":
                    return {"record": record, "rehomed": False, "job": self._job_of(uuid)}
                if record["state"] in ("completed", "closed") and \
                        set(record["sessions"]) <= set(record["resumed"]):
                    return {"record": record, "rehomed": True, "job": self._job_of(uuid)}
            if time.monotonic() > deadline:
                raise Timeout(what=f"the rehome of {uuid}", timeout=timeout)
            await asyncio.sleep(0.1)

    async def _api_metrics(self, message: dict) -> dict:
        return {"text": self.metrics.text()}

    def _job_of(self, uuid: str) -> dict | None:
        watch = self.watches.get(uuid)
        return watch.job if watch else None


def _why_not_resumed(result: dict | None) -> str:
    """What an agent's rehome outcome says went wrong, in a line."""
    if not result:
        return "no answer from the guest"
    if result.get("error"):
        return str(result["error"].get("message") or result["error"])
    parts = []
    if result.get("network_error"):
        parts.append(f"guest network: {result['network_error'].get('message')}")
    failed = {sid: o for sid, o in (result.get("sessions") or {}).items() if not o.get("ok")}
    for sid, outcome in list(failed.items())[:3]:
        error = outcome.get("error") or {}
        parts.append(f"session {sid}: {error.get('code', '?')}: {error.get('message', '')}")
    if len(failed) > 3:
        parts.append(f"and {len(failed) - 3} more session(s)")
    return "; ".join(parts) or "not every session resumed"
