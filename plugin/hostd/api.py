"""hostd's local API: the server the hook and the CLI talk to (the requests
are listed in ``accelmig.wire.localapi``).

One hostd per socket: ``LocalServer.start()`` raises ``AlreadyRunning`` when
another one owns the path, before it changes anything.  Every client
connection and every request being answered is tracked, and all of them end
when the server closes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from accelmig.plugin.hostd.watch import Phase, Trigger
from accelmig.runtime.sockets import OwnedUnixSocket
from accelmig.wire import channel as ch
from accelmig.wire import control as wc
from accelmig.wire.attestation import check_hex
from accelmig.wire.errors import (AccelmigError, BadRequest, Conflict, InternalError, Timeout, Unavailable,
                                  UnknownOp)
from accelmig.wire.localapi import GATED_HOOK_STEPS, HERE_ADDRESSES
from accelmig.wire.records import RecordStateName, RecordView

LOG = logging.getLogger("accelmig.hostd")



class LocalServer:
    """asyncio server: ``handlers[type](message) -> awaitable result``."""

    def __init__(self, path: str, handlers: dict):
        self.path = path
        self.handlers = handlers
        self._server = None
        self._owned = OwnedUnixSocket(path, mode=0o600, what="accelmig hostd")
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        sock = self._owned.open()
        self._server = await asyncio.start_unix_server(self._client, sock=sock)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2)
            except (asyncio.TimeoutError, Exception):
                pass
        self._owned.close()

    def _track(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        self._writers.add(writer)
        parser = ch.LineParser(name="localapi")
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                for message in parser.feed(data):
                    self._track(self._answer(message, writer))
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            self._writers.discard(writer)
            self._tasks.discard(task)
            writer.close()

    async def _answer(self, message: dict, writer: asyncio.StreamWriter) -> None:
        kind, request_id = message.get("type"), message.get("id")
        try:
            handler = self.handlers.get(kind)
            if handler is None:
                raise UnknownOp(op=kind)
            reply = ch.result(request_id, result=await handler(message))
        except AccelmigError as exc:
            reply = ch.result(request_id, ok=False, error=exc.to_wire())
        except Exception as exc:
            LOG.exception("local API: %s failed", kind)
            reply = ch.result(request_id, ok=False,
                              error=InternalError(reason=f"{type(exc).__name__}: {exc}").to_wire())
        try:
            writer.write(ch.encode(reply))
            await writer.drain()
        except (OSError, ConnectionError):
            pass


class LocalApi:
    """The requests, answered from hostd's state and the pool."""

    def __init__(self, daemon):
        self.daemon = daemon
        self.server = LocalServer(daemon.config.hostd.socket, {
            "ping": self.ping, "status": self.status, "hook": self.hook, "intent": self.intent,
            "wait_rehomed": self.wait_rehomed, "sessions": self.sessions, "metrics": self.metrics,
            "rehome_here": self.rehome_here,
        })

    async def ping(self, message: dict) -> dict:
        d = self.daemon
        return {"host": d.host, "pid": os.getpid(), "pool": d.pool_reachable, "libvirt": d.libvirt.conn is not None}

    #: how long ``status`` waits for the pool's records before it answers without them
    STATUS_POOL_WAIT = 2.0

    async def status(self, message: dict) -> dict:
        d = self.daemon
        try:
            # status must answer while the pool does not: a short limit of its own
            records = await asyncio.wait_for(self._recent_records(20), self.STATUS_POOL_WAIT)
        except (AccelmigError, asyncio.TimeoutError):
            records = []
        watches = [w for w in d.watches if w.phase is not Phase.GONE]
        return {"host": d.host, "pid": os.getpid(), "uptime": round(time.time() - d.started, 1),
                "libvirt": {"uri": d.config.hostd.libvirt_uri, "connected": d.libvirt.conn is not None,
                            "reconnects": d.libvirt.reconnects, "calls": dict(d.libvirt.calls)},
                "pool": {"control": d.config.pool.control, "reachable": d.pool_reachable,
                         "instance": d.pool.instance, "registration_failures": d.registration.failures},
                "identity": d.identity.to_wire() if d.identity else None,
                "domains": [w.describe() for w in watches], "foreign_domains": d.watches.foreign_count,
                # every domain holding sessions anywhere (the hook's cache), not only here
                "accel_domains": sorted(d.accel_domains),
                "records": records, "counters": dict(d.counters)}

    async def _recent_records(self, count: int) -> list[dict]:
        """The ``count`` latest records this host takes part in, oldest of
        them first, with counts, not session lists (one line answers; a
        record's sessions: ``record_sessions``).  The pool lists records
        newest first: the pages stop once ``count`` are found."""
        d, found, cursor = self.daemon, [], None
        for _ in range(wc.MAX_PAGES):
            page = await d.pool.call("list_records", open_only=False, cursor=cursor)
            for data in page.get("records") or []:
                record = RecordView.from_wire(data)
                if record.involves(d.host):
                    found.append(record.to_wire(inline=False))
            cursor = page.get("next")
            if len(found) >= count or not cursor:
                break
        return sorted(found[:count], key=lambda r: r["times"].get("opened", 0.0))

    async def hook(self, message: dict) -> dict:
        d = self.daemon
        op, sub, uuid, name = (message.get(k) for k in ("op", "sub", "uuid", "name"))
        if not isinstance(uuid, str):
            raise BadRequest(reason="hook note without a domain uuid")
        if (op, sub) not in GATED_HOOK_STEPS:
            raise BadRequest(reason=f"hook {op} {sub}: hostd acts on migrate begin and restore begin only")
        d.counters[f"hook_{op}_{sub}"] += 1
        d.metrics.hook_notes.labels(f"{op} {sub}").inc()
        budget = float(message.get("budget") or 5.0)      # what the hook can still wait
        if (op, sub) == ("restore", "begin"):
            await self._within(budget, "ping")   # strict mode: the pool must be there to unpark
            return {"restoring": uuid}
        # migrate begin: no libvirt call here (libvirt is waiting for this hook).  The
        # domain's migration token, read by the hook from the XML that came with the
        # migration, vouches for this host as its destination
        token = message.get("token")
        if token is not None:
            token = check_hex(token, "hook: token")
        opening = asyncio.ensure_future(d.pool_call("open_migration", domain_uuid=uuid, domain_name=name,
                                                    **({"token": token} if token else {})))
        try:
            record = RecordView.from_wire(await asyncio.wait_for(asyncio.shield(opening), budget))
        except asyncio.TimeoutError:
            if d.config.hostd.strict:
                # The hook refuses the migration now; if the pool opens the
                # record after all, it must not stay behind.
                d.spawn(self._abort_late(opening, name or uuid), f"abort-late-record:{uuid}")
            raise Unavailable(what="the pool's control plane",
                              reason=f"no answer within the hook's {budget:.1f} s") from None
        watch = d.watches.add(uuid, name or uuid)
        watch.note(f"hook {op} {sub}")
        # Not under the watch's lock: the hook must not wait behind an event.
        watch.record = record
        watch.fire(Trigger.HOOK_INCOMING)
        (LOG.info if record.vouched else LOG.warning)(
            "domain %s incoming: record %s opened (policy %s)%s", name, record.migration_id, record.policy.value,
            "" if record.vouched else "; nobody vouched for this host as its destination yet (no valid "
                                      "migration token in its XML): its source does at switchover",
            extra={"domain": name, "migration": record.migration_id})
        return {"record": record.to_wire()}

    async def _abort_late(self, opening: asyncio.Future, label: str) -> None:
        try:
            record = RecordView.from_wire(await opening)
        except AccelmigError:
            return                               # it never opened
        try:
            await self.daemon.pool_call("abort", domain_uuid=record.domain_uuid,
                                        migration_id=record.migration_id,
                                        reason="the hook refused the migration: the pool answered too late")
            LOG.warning("domain %s: record %s opened after the hook gave up: aborted", label, record.key)
        except AccelmigError as exc:
            LOG.info("domain %s: late record %s not aborted: %s", label, record.key, exc)

    async def _within(self, budget: float, method: str, **args):
        """A pool call the hook is waiting for: a slow pool is an unreachable one."""
        try:
            return await asyncio.wait_for(self.daemon.pool_call(method, **args), budget)
        except asyncio.TimeoutError:
            raise Unavailable(what="the pool's control plane",
                              reason=f"no answer within the hook's {budget:.1f} s") from None

    async def intent(self, message: dict) -> dict:
        return await self.daemon.pool_call("register_intent", domain_uuid=message.get("uuid"),
                                           policy=message.get("policy") or "none",
                                           dest_host=message.get("dest_host"),
                                           migration_id=message.get("migration_id"))

    async def wait_rehomed(self, message: dict) -> dict:
        """Until the pool has the migration's sessions all resumed, or its
        record ended (``until="timeline"``: and the destination's steps are
        in its timeline)."""
        uuid, mid = message.get("uuid"), message.get("migration_id")
        wait = float(message.get("wait") or 60)
        until = message.get("until") or "rehomed"
        if until not in ("rehomed", "timeline"):
            raise BadRequest(reason=f"wait_rehomed: until {str(until)[:40]!r} (rehomed or timeline)")
        d = self.daemon
        try:
            answer = await d.nodes.call_within(wait + 5, "wait_record", domain_uuid=uuid, migration_id=mid,
                                              until=until, timeout=wait)
        except Unavailable as exc:
            raise Timeout(what=f"the rehome of {uuid} ({exc})", timeout=wait) from None
        record = RecordView.from_wire(answer["record"]) if answer.get("record") else None
        if record is None:
            raise Timeout(what=f"the rehome of {uuid} (no such migration record)", timeout=wait)
        out = {"record": record.to_wire(), "rehomed": record.rehomed, "job": d.watches.job(uuid)}
        if not answer.get("reached") and until == "timeline" and record.rehomed:
            out["error"] = f"the destination's steps are not in the timeline within {wait:.0f} s"
        elif not answer.get("reached"):
            out["error"] = (f"{record.unresumed_count} of {record.session_count} session(s) not resumed "
                            f"within {wait:.0f} s (record {record.state.value})")
        elif record.state is RecordStateName.ABORTED:
            out["error"] = f"the migration was aborted: {record.abort_reason or 'no reason given'}"
        return out

    async def sessions(self, message: dict) -> dict:
        """A page of the pool's sessions of a domain (``cursor``: the ``next``
        of the page before, passed back to the pool as it is): one line each."""
        return await self.daemon.pool_call("list_sessions", domain_uuid=message.get("uuid"),
                                           cursor=message.get("cursor"))

    async def rehome_here(self, message: dict) -> dict:
        """The guest of a domain running here rehomed here once more
        (``MigrationSteps.rehome_here``), under its watch's lock: no event
        of the domain is taken meanwhile, and a migration that began first
        makes it refuse (the domain is no longer RUNNING here)."""
        uuid, address = message.get("uuid"), message.get("address") or "lease"
        if not isinstance(uuid, str) or not 1 <= len(uuid) <= 64:
            raise BadRequest(reason="rehome_here: uuid must be a domain UUID")
        if address not in HERE_ADDRESSES:
            raise BadRequest(reason=f"rehome_here: address must be one of {', '.join(HERE_ADDRESSES)}, "
                                    f"not {str(address)[:40]!r}")
        d = self.daemon
        watch = d.watches.get(uuid)
        if watch is None or watch.phase is Phase.GONE:
            raise Conflict(reason=f"domain {uuid} is not an accelmig domain running on {d.host}")
        async with watch.lock:
            dom = await d.lookup(watch)
            if not dom:
                raise Unavailable(what=f"domain {watch.name}", reason="libvirt does not have it (now)")
            return await d.migrations.rehome_here(dom, watch, address=address)

    async def metrics(self, message: dict) -> dict:
        return {"text": self.daemon.metrics.text()}
