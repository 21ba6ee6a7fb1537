"""The steps of a live migration, as hostd takes them on each side.

- destination, at the hook's ``migrate begin``: the record is opened
  (``HostDaemon`` does it, within the hook's budget);
- source, when the guest pauses for a migration: if the domain's job really
  is an outgoing migration, switch the record over (and stop using the
  channel: what is written to the source after switchover is lost); at
  SUSPENDED_POSTCOPY the record is committed (the source never resumes);
- destination, once the guest runs here (RESUMED_MIGRATED, or
  RESUMED_POSTCOPY: commit first): complete the record (tickets), give the
  guest this host's identity and the tickets, and retry until every session
  resumed here;
- source, when the guest left (STOPPED_MIGRATED): close the record; a
  failed or cancelled migration (the arrival stops on the destination, the
  guest resumes on the source) aborts it;
- a saved domain's sessions are parked; a restored copy is told to resume.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid as uuid_module

import libvirt

from accelmig.plugin.hostd.watch import DomainWatch, Phase, Trigger
from accelmig.wire.errors import AccelmigError, Conflict, LibvirtFailure, NoSuchRecord, ProtocolError, RecordState
from accelmig.wire.records import (IN_FLIGHT, ClockOffset, RecordStateName, RecordView, Side, Stamp, Timeline,
                                   latest)
from accelmig.wire.values import is_number

LOG = logging.getLogger("accelmig.hostd")

#: the steps of a rehome that the guest stamps (its claims)
GUEST_STEPS = ("agent_received", "nic_readdressed", "driver_connected")



class MigrationSteps:
    def __init__(self, daemon, *, retry_first: float, retry_max: float):
        self.daemon = daemon
        self.retry_first = retry_first        # s before a failed rehome is tried again, doubling
        self.retry_max = retry_max

    @property
    def host(self) -> str:
        return self.daemon.host

    async def pool(self, method: str, **args):
        return await self.daemon.pool_call(method, **args)

    async def pool_all(self, method: str, **args):
        """Every page of a paged method (``complete``'s tickets, listings)."""
        return await self.daemon.pool_call_all(method, **args)

    # -- the source ---------------------------------------------------------------------
    async def check_outgoing(self, dom, watch: DomainWatch, *, postcopy: bool) -> None:
        """A pause is an outgoing migration only if the domain's job says so
        (a failed migration pauses too)."""
        try:
            stats = await self.daemon.libvirt.call(dom.jobStats, 0, timeout=5)
        except (LibvirtFailure, asyncio.TimeoutError) as exc:
            LOG.warning("domain %s: no job stats (%s); not switching over", watch.name, exc)
            return
        operation = stats.get("operation")
        if operation != libvirt.VIR_DOMAIN_JOB_OPERATION_MIGRATION_OUT:
            LOG.info("domain %s paused by job operation %s, not an outgoing migration", watch.name, operation)
            return
        await self.daemon.take(dom, watch, Trigger.SWITCHED_OVER_POSTCOPY if postcopy
                               else Trigger.SWITCHED_OVER)

    async def switch_over(self, dom, watch: DomainWatch, *, postcopy: bool = False) -> None:
        """``postcopy``: the guest is handed to the destination for good."""
        await watch.delivery.close(watch)     # writes after switchover are lost: stop here
        try:
            record = RecordView.from_wire(await self.pool("switchover", domain_uuid=watch.uuid,
                                                          postcopy=postcopy))
        except NoSuchRecord:
            LOG.warning("domain %s migrates out without a record (destination without accelmig?)", watch.name)
            return
        watch.record = record
        LOG.info("domain %s: switched over%s (record %s)", watch.name, " for post-copy" if postcopy else "",
                 record.key, extra={"domain": watch.name, "migration": record.migration_id})
        seen = watch.event_seen.pop("SUSPENDED_POSTCOPY" if postcopy else "SUSPENDED_MIGRATED", None)
        if seen is not None:      # off the blackout's path: the guest is already paused
            self.daemon.spawn(self._note_source_timeline(watch, record.migration_id, seen),
                              f"timeline:{watch.name}")

    async def close(self, dom, watch: DomainWatch) -> None:
        await watch.delivery.close(watch)
        try:
            await self.pool("close", domain_uuid=watch.uuid,
                            migration_id=watch.record.migration_id if watch.record else None)
        except NoSuchRecord:
            LOG.warning("domain %s left this host without a migration record", watch.name)
        watch.record = None

    async def _note_source_timeline(self, watch: DomainWatch, mid: str, seen: float) -> None:
        """When this host saw the pause, on the pool's clock (a ``ping``'s
        round trip gives the offset)."""
        try:
            asked = time.time()
            pong = await self.pool("ping")
            pool_clock = ClockOffset.from_round_trip(asked, pong.get("time"), pong.get("time"), time.time())
            stamp = Stamp(*pool_clock.to_remote(seen), Side.SOURCE)
            await self.pool("note_timeline", domain_uuid=watch.uuid, migration_id=mid,
                            steps=Timeline({"suspended_seen": stamp}).to_wire())
        except AccelmigError as exc:
            LOG.info("domain %s: the timeline of %s misses this host's step: %s", watch.name, mid, exc)

    async def abort_stayed(self, dom, watch: DomainWatch) -> None:
        """The source resumed its guest: the migration failed or was cancelled."""
        await self.abort(watch, "the migration failed; the guest resumed on the source")
        await self.daemon.first_contact(dom, watch)

    async def abort(self, watch: DomainWatch, reason: str) -> None:
        mid = watch.record.migration_id if watch.record else None
        try:
            record = await self.pool("abort", domain_uuid=watch.uuid, migration_id=mid, reason=reason)
            LOG.warning("domain %s: record %s aborted: %s", watch.name, record["migration_id"], reason,
                        extra={"domain": watch.name, "migration": record["migration_id"]})
        except (NoSuchRecord, RecordState) as exc:
            LOG.info("domain %s: nothing to abort (%s)", watch.name, exc)
        watch.record = None

    # -- the destination ------------------------------------------------------------------
    async def abort_arrival(self, dom, watch: DomainWatch) -> None:
        await watch.delivery.close(watch)
        await self.abort(watch, "the incoming migration failed on the destination")

    async def rehome(self, dom, watch: DomainWatch, *, postcopy: bool = False) -> dict | None:
        """The guest runs here now: move its sessions here.

        One attempt; an attempt that fails, or after which not every session
        resumed, is retried in the background until they all have (or the
        record or the domain ends): a guest is never left knocking with
        ``TICKET_REQUIRED``."""
        seen = watch.event_seen.pop("RESUMED_POSTCOPY" if postcopy else "RESUMED_MIGRATED", None)
        try:
            summary = await self._rehome_once(dom, watch, postcopy=postcopy, seen=seen)
        except AccelmigError as exc:
            self._retry_later(watch, f"{type(exc).__name__}: {exc}")
            LOG.error("domain %s: rehome failed: %s; will retry", watch.name, exc, extra={"domain": watch.name})
            return None
        if summary["ok"]:
            await self.daemon.take(dom, watch, Trigger.REHOMED)
            self._after_arrival(watch)
        else:
            self._retry_later(watch, summary["why"])
        return summary

    def _after_arrival(self, watch: DomainWatch) -> None:
        """Every session resumed here: the domain is this host's now, and the
        token in its XML its former host's: off the blackout's path, a new one."""
        self.daemon.spawn(self.daemon.attestation.ensure_token(watch), f"token:{watch.name}")

    async def _rehome_once(self, dom, watch: DomainWatch, *, postcopy: bool = False,
                           seen: float | None = None) -> dict:
        """``seen``: when this host read the RESUMED event (the timeline's
        ``resumed_seen``; None for a retry)."""
        started = time.monotonic()
        record = watch.record
        if record is None or record.dest_host != self.host:
            record = await self._find_or_open(watch)
        mid = record.migration_id
        if watch.delivery.attests_at_migration:
            waiting = await self.daemon.attestation.arrived(dom, watch)
            if waiting:       # completing now would leave those sessions behind for good
                return {"migration_id": mid, "postcopy": postcopy, "ok": False, "why": waiting}
        if postcopy:
            await self.pool("commit", domain_uuid=watch.uuid, migration_id=mid)
        asked = time.time()
        done = await self.pool_all("complete", domain_uuid=watch.uuid, migration_id=mid)
        clock = {"asked": asked, "answered": time.time(), "pool_now": done.get("now")}
        watch.record = RecordView.from_wire(done["record"])
        tickets = done["tickets"]
        completed = time.monotonic()
        # staged before the guest ran (``HostDaemon.prestage``); once only
        identity, watch.staged_identity = watch.staged_identity, None
        if identity is None:
            identity = await self.daemon.identity_for(watch)
        clock["identity"] = clock["delivering"] = time.time()
        document = {"migration_id": mid, "identity": identity.to_wire(), "tickets": tickets}
        result = await watch.delivery.rehome(dom, watch, document)
        clock["answer"] = time.time()
        clock["sent"] = watch.delivery.rehome_sent or clock["delivering"]
        delivered = time.monotonic()
        # off the blackout's path: the guest's drivers have resumed by now
        self.daemon.spawn(self._note_dest_timeline(watch, mid, seen, clock, result), f"timeline:{watch.name}")
        ok = bool(result and result.get("ok"))
        summary = {"migration_id": mid, "postcopy": postcopy, "tickets": len(tickets), "result": result,
                   "ok": ok, "why": None if ok else why_not_resumed(result),
                   "attempt": (result or {}).get("attempts", 1),
                   "complete_s": round(completed - started, 6), "deliver_s": round(delivered - completed, 6),
                   "total_s": round(delivered - started, 6), "at": time.time()}
        watch.last_rehome = summary
        if ok:
            watch.rehome_retry = None
        self.daemon.counters["rehomes"] += 1
        self.daemon.metrics.rehomes.labels("ok" if ok else "incomplete").inc()
        self.daemon.metrics.rehome_seconds.observe(summary["total_s"])
        (LOG.info if ok else LOG.error)(
            "domain %s: rehome %s in %.1f ms (complete %.1f ms, deliver %.1f ms): %s", watch.name, mid,
            summary["total_s"] * 1000, summary["complete_s"] * 1000, summary["deliver_s"] * 1000,
            "all sessions resumed" if ok else f"NOT all resumed ({summary['why']}); will retry",
            extra={"domain": watch.name, "migration": mid})
        return summary

    async def _note_dest_timeline(self, watch: DomainWatch, mid: str, seen, clock: dict, result) -> None:
        try:
            steps = rehome_timeline(seen, clock, result)
            await self.pool("note_timeline", domain_uuid=watch.uuid, migration_id=mid,
                            steps=Timeline(steps).to_wire())
        except AccelmigError as exc:
            LOG.info("domain %s: the timeline of %s misses this host's steps: %s", watch.name, mid, exc)

    async def _find_or_open(self, watch: DomainWatch) -> RecordView:
        """The record of this incoming migration; opened now if the hook's note
        never reached us (hostd was down, lenient mode) or was lost."""
        out = await self.pool_all("list_records", open_only=True, domain_uuid=watch.uuid)
        records = [RecordView.from_wire(r) for r in out["records"]]
        mine = latest(r for r in records if r.dest_host == self.host
                      and (r.state in IN_FLIGHT or r.state is RecordStateName.COMPLETED))
        if mine is not None:
            return mine
        LOG.warning("domain %s runs here without a migration record: opening one now", watch.name)
        # the token that came with the domain (its live XML) vouches for this host
        return RecordView.from_wire(await self.pool("open_migration", domain_uuid=watch.uuid,
                                                    domain_name=watch.name,
                                                    **({"token": watch.token} if watch.token else {})))

    def _retry_later(self, watch: DomainWatch, why: str) -> None:
        """One background retry loop per domain (backoff, capped, jittered)."""
        retry = watch.rehome_retry or {"attempts": 1, "since": time.time()}
        retry["why"] = why
        watch.rehome_retry = retry
        if watch.retry_task is None or watch.retry_task.done():
            watch.retry_task = self.daemon.spawn(self._retries(watch), f"rehome-retry:{watch.name}")

    async def _retries(self, watch: DomainWatch) -> None:
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
                dom = await self.daemon.lookup(watch)
                if dom is None:
                    retry["why"] = "libvirt does not answer"
                    continue
                if dom is False:
                    LOG.info("domain %s is gone: no more rehome retries", watch.name)
                    watch.rehome_retry = None
                    return
                try:
                    summary = await self._rehome_once(dom, watch)
                except (NoSuchRecord, RecordState) as exc:
                    LOG.error("domain %s: its migration record ended before every session resumed: %s",
                              watch.name, exc, extra={"domain": watch.name})
                    watch.rehome_retry = None
                    await self.daemon.take(dom, watch, Trigger.REHOME_ENDED)
                    return
                except AccelmigError as exc:
                    retry["why"] = f"{type(exc).__name__}: {exc}"
                    continue
                if summary["ok"]:
                    LOG.info("domain %s: rehome %s succeeded on attempt %d", watch.name,
                             summary["migration_id"], retry["attempts"], extra={"domain": watch.name})
                    await self.daemon.take(dom, watch, Trigger.REHOMED)
                    self._after_arrival(watch)
                    return
                retry["why"] = summary["why"]

    # -- saved and restored domains -----------------------------------------------------
    async def park(self, dom, watch: DomainWatch) -> None:
        await watch.delivery.close(watch)
        out = await self.pool("park", domain_uuid=watch.uuid)
        LOG.info("domain %s saved: parked %s%s", watch.name, out["parked"],
                 f" and {out['more']} more" if out.get("more") else "")

    async def unpark(self, dom, watch: DomainWatch) -> None:
        """An older copy of the guest's memory runs again: tell its drivers to
        resume now, no ticket needed; the pool refuses them if they are not
        the latest copy."""
        await self.pool("unpark", domain_uuid=watch.uuid)
        identity = await self.daemon.identity_for(watch)
        document = {"migration_id": f"restored-{uuid_module.uuid4().hex[:8]}",
                    "identity": identity.to_wire(), "tickets": {}}
        try:
            result = await watch.delivery.rehome(dom, watch, document)
        except AccelmigError as exc:
            LOG.error("domain %s: resume after a restore not delivered: %s", watch.name, exc)
            return
        watch.last_rehome = {"migration_id": document["migration_id"], "result": result, "at": time.time()}
        for sid, outcome in ((result or {}).get("sessions") or {}).items():
            if outcome.get("ok"):
                LOG.info("domain %s: session %s resumed after a restore", watch.name, sid)
            else:
                LOG.error("domain %s: session %s REFUSED after a restore: %s", watch.name, sid,
                          (outcome.get("error") or {}).get("message"))

    # -- a guest that stays -------------------------------------------------------------
    async def rehome_here(self, dom, watch: DomainWatch, *, address: str = "lease") -> dict:
        """Rehome the guest of a domain that runs here, and stays, to this
        host once more: the rehome a migration's destination delivers (the
        same channel, the same agent code, the drivers' same resume over a
        new connection), with no migration under it and so no tickets — each
        driver resumes at its epoch from the host its session is bound to,
        as after a restore.  ``address``: ``lease`` (the domain's own) or
        ``spare`` (a second address of this host's guest subnet, leased to
        the domain too): going from one to the other re-addresses the fabric
        NIC for real.  What it is for: the warm guest's time for the steps a
        migration's cold guest takes (``bench/blackout --warm``), measured
        the same way.  Its steps on this host's clock, in the answer only
        (no record holds them).  The caller holds the watch's lock."""
        if watch.phase is not Phase.RUNNING:
            raise Conflict(reason=f"domain {watch.name} is {watch.phase.value} here, not running: "
                                  "only a guest that runs here, and no migration of it, is rehomed here")
        identity = await self.daemon.identity_for(watch, spare=address == "spare")
        mid = f"here-{uuid_module.uuid4().hex[:8]}"
        document = {"migration_id": mid, "identity": identity.to_wire(), "tickets": {}}
        clock = {"delivering": time.time()}
        result = await watch.delivery.rehome(dom, watch, document)
        clock["answer"] = time.time()
        clock["sent"] = watch.delivery.rehome_sent or clock["delivering"]
        steps = {"delivering": Stamp(clock["delivering"], 0.0, Side.DEST),
                 **guest_steps(clock, result), "answered": Stamp(clock["answer"], 0.0, Side.DEST)}
        ok = bool(result and result.get("ok"))
        (LOG.info if ok else LOG.error)(
            "domain %s: rehomed here (%s, %s address) in %.1f ms: %s", watch.name, mid, address,
            (clock["answer"] - clock["delivering"]) * 1000,
            "all sessions resumed" if ok else f"NOT all resumed ({why_not_resumed(result)})",
            extra={"domain": watch.name, "migration": mid})
        return {"migration_id": mid, "ok": ok, "why": None if ok else why_not_resumed(result),
                "address": identity.guest_nic.address if identity.guest_nic else None,
                "network": (result or {}).get("network"), "sessions": (result or {}).get("session_count"),
                "resumed": (result or {}).get("resumed_count"),
                "timeline": Timeline(steps).to_wire(),
                # the guest's own durations (its claims, shown only): where its time went
                "guest": _guest_durations(result)}


def _guest_durations(result: dict | None) -> dict:
    """From an agent's rehome outcome, its durations in s (finite numbers
    only, a few sessions at most): the whole rehome, up to its network
    applied, and each driver's resume (connect, resume, re-sends)."""
    def number(value):
        return round(float(value), 6) if is_number(value, 0) and value < 3600 else None
    result = result if isinstance(result, dict) else {}
    sessions = result.get("sessions") if isinstance(result.get("sessions"), dict) else {}
    resumes = [number(o.get("seconds")) for o in list(sessions.values())[:8] if isinstance(o, dict)]
    return {"seconds": number(result.get("seconds")), "network_seconds": number(result.get("network_seconds")),
            "resume_seconds": [r for r in resumes if r is not None]}


def why_not_resumed(result: dict | None) -> str:
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
    # (an agent lists the failed sessions first, within its answer's budget)
    count = result.get("session_count")
    not_resumed = count - result.get("resumed_count", 0) if isinstance(count, int) else len(failed)
    if not_resumed > 3:
        parts.append(f"and {not_resumed - 3} more session(s)")
    return "; ".join(parts) or "not every session resumed"


def rehome_timeline(seen: float | None, clock: dict, outcome) -> dict[str, Stamp]:
    """The destination's steps of one rehome on the pool's clock.

    ``clock``: hostd's own stamps (``asked``/``answered``: ``complete``'s
    round trip, ``pool_now``: the pool's clock in its answer; ``identity``,
    ``delivering``; ``sent``/``answer``: the rehome's round trip to the
    guest).  ``outcome``: the agent's answer, whose ``clock`` (when it read
    the rehome and answered it, the guest's clock) gives the guest's offset
    and whose ``times`` are the guest's steps: claims, clamped into that
    round trip, dropped when they are not numbers."""
    try:
        pool_clock = ClockOffset.from_round_trip(clock["asked"], clock["pool_now"], clock["pool_now"],
                                                 clock["answered"])
    except ProtocolError:
        return {}                   # a pool from before ``now``: no common clock to put them on
    ours = {"resumed_seen": seen, "identity": clock.get("identity"), "delivering": clock.get("delivering"),
            "answered": clock.get("answer")}
    steps = {step: Stamp(*pool_clock.to_remote(t), Side.DEST) for step, t in ours.items() if t is not None}
    steps.update(guest_steps(clock, outcome, pool_clock))
    return steps


def guest_steps(clock: dict, outcome, then: ClockOffset | None = None) -> dict[str, Stamp]:
    """The guest's steps of one rehome (its claims: ``outcome``'s ``times``)
    on hostd's clock through the rehome's round trip (``clock``'s ``sent``
    and ``answer``), then, with ``then``, onto the pool's; clamped into that
    round trip, left out when they are not numbers."""
    claimed = (outcome or {}).get("clock")
    if not isinstance(claimed, dict):
        return {}
    try:
        guest_clock = ClockOffset.from_round_trip(clock["sent"], claimed.get("received"), claimed.get("answered"),
                                                  clock["answer"])
    except ProtocolError:
        return {}
    times = (outcome or {}).get("times")
    steps = {}
    for step in GUEST_STEPS:
        value = times.get(step) if isinstance(times, dict) else None
        try:
            steps[step] = guest_clock.onto(then, value, Side.GUEST)
        except ProtocolError:
            continue            # absent, or not a number: the guest's claim is left out
    return steps
