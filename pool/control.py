"""The pool's control plane: authenticated hosts (and the local admin socket).

Transport and signatures are in ``accelmig.wire.control``; each
connection (its hello, the request MACs, issue 28's certificate names, its
admission, its answers) is ``pool.controlconn``'s.  This module checks each
authenticated call against the method table (``wire.control.METHODS``, one
``Dispatch``) and who may call it, bounds its arguments (``check_args``),
pages what grows, and forwards it: every rule about who may do what to a
migration, a session's binding or a domain is the migration ledger's
(``pool.ledger``); sessions and hosts are the ``Pool``'s.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import time

from accelmig.pool.controlconn import ControlConnection
from accelmig.pool.paging import Pager, page_limit, take
from accelmig.runtime.dispatch import Dispatch
from accelmig.wire import attestation as att
from accelmig.wire import control as wc
from accelmig.wire.errors import (AccelmigError, AuthFailed, BadRequest, InternalError, ProtocolError,
                                  RecordState, UnknownOp)
from accelmig.wire.records import RECORD_INLINE_SESSIONS, STEP_NAMES, RecordStateName, Timeline
from accelmig.wire.values import describe, is_number, shown

LOG = logging.getLogger(__name__)

#: Bounds of a saved domain's retention (``park``), in seconds.
MIN_RETENTION = 1.0
MAX_RETENTION = 30 * 86400.0
#: Identifiers (domain uuids and names, migration and session ids, host
#: names) are strings of at most this many characters; reasons of at most
#: MAX_REASON.
MAX_NAME = 256
MAX_REASON = 1024

#: records by position in ``list_records``' pages, newest first: this minus the serial
_NEWEST = 10 ** 11

_NAME_ARGS = {"domain_uuid", "migration_id", "domain_name", "sid", "dest_host", "source_host", "since",
              "cursor"}
_FLAG_ARGS = {"postcopy", "open_only"}

ADMIN_METHODS = {"list_nodes", "list_sessions", "list_records", "record_sessions", "list_hosts", "list_devices", "metrics", "ping",
                 "abort", "park", "unpark", "register_intent", "wait_record"}


class ControlServer:
    on_call = Dispatch("a control-plane method", wc.METHODS)

    def __init__(self, pool):
        self.pool = pool
        self.ledger = pool.ledger
        self.pager = Pager()                  # cursors of the pages below
        self._tasks: set[asyncio.Task] = set()

    async def handle_host(self, reader, writer, admitted=None) -> None:
        """A host's connection, counted from accept by ``admitted`` (a
        ``pool.admission.AcceptedConnection``: its TLS handshake done, its
        deadline running)."""
        await self._tracked(ControlConnection(self).serve(reader, writer, admin=False, admitted=admitted))

    async def handle_admin(self, reader, writer) -> None:
        await self._tracked(ControlConnection(self).serve(reader, writer, admin=True))

    async def _tracked(self, coro) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await coro
        finally:
            self._tasks.discard(task)

    async def close(self) -> None:
        """End every open control connection (servers stop only accepting)."""
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def call_waiting(self, host, admin: bool, method, args: dict) -> dict:
        """A call that waits (``wire.control.WAITING_METHODS``): its answer's body."""
        try:
            self._check_caller(host, admin, method)
            handler = self.on_call.lookup(method)
            check_args(method, handler, args)
            result = await handler(self, _caller(host), **args)
            return {"ok": True, "result": result}
        except TypeError as exc:
            return {"ok": False, "error": BadRequest(reason=f"{method}: {exc}").to_wire()}
        except AccelmigError as exc:
            return {"ok": False, "error": exc.to_wire()}

    async def call_clustered(self, host, admin: bool, method, args: dict) -> dict:
        """A record's step in a pool of several nodes: etcd first (the
        ledger's ``EtcdFollower``), then this node's method as ever."""
        follower = self.ledger.follower
        try:
            self._check_caller(host, admin, method)
            if method == "list_nodes":
                return {"ok": True, "result": await follower.list_nodes(self.pool.instance)}
            try:
                handler = self.on_call.lookup(method)
                check_args(method, handler, args)
                inspect.signature(handler).bind(self, _caller(host), **args)
            except TypeError as exc:
                raise BadRequest(reason=f"{method}: {exc}") from None
            return await follower.call(_caller(host), method, args, lambda: self.call(host, admin, method, args))
        except AccelmigError as exc:
            return {"ok": False, "error": exc.to_wire()}
        except Exception as exc:
            LOG.exception("control plane: %s failed", method)
            return {"ok": False, "error": InternalError(reason=f"{type(exc).__name__}: {exc}").to_wire()}

    def _check_caller(self, host, admin: bool, method) -> None:
        if method not in wc.METHODS:
            raise UnknownOp(op=method)
        if admin and method not in ADMIN_METHODS:
            raise AuthFailed(reason=f"{method} is for hypervisor hosts, not the admin socket")
        if not admin and wc.METHODS[method] == "host" and host is None:
            raise AuthFailed(reason="host methods need an authenticated host")

    def call(self, host, admin: bool, method, args: dict) -> dict:
        """A call answered at once: its answer's body (a failure is an error
        in it, never an exception: the connection goes on)."""
        try:
            self._check_caller(host, admin, method)
            handler = self.on_call.lookup(method)
            check_args(method, handler, args)
            try:
                result = handler(self, _caller(host), **args)
            except TypeError as exc:
                raise BadRequest(reason=f"{method}: {exc}") from None
            return {"ok": True, "result": result}
        except AccelmigError as exc:
            return {"ok": False, "error": exc.to_wire()}
        except Exception as exc:
            LOG.exception("control plane: %s failed", method)
            return {"ok": False, "error": InternalError(reason=f"{type(exc).__name__}: {exc}").to_wire()}

    def _page(self, method: str, scope: str, caller, cursor, limit, items, size=None) -> tuple[list, str | None]:
        """A page of ``items(start)`` (``(position, item)`` from the cursor's
        position on) and the cursor of the next page (None: the last)."""
        page, following = take(items(self.pager.position(method, scope, caller, cursor)),
                               page_limit(method, limit), size=size)
        return page, None if following is None else self.pager.cursor(method, scope, caller, following)

    # -- methods: each bounds its arguments and forwards ---------------------------------
    @on_call("ping")
    def do_ping(self, caller):
        return {"instance": self.pool.instance, "caller": caller, "time": time.time()}

    @on_call("register_host")
    def do_register_host(self, caller, addresses=(), identity=None):
        return self.pool.hosts.register(caller, addresses, identity)

    @on_call("bind_challenge")
    def do_bind_challenge(self, caller, domain_uuid=None):
        return {"instance": self.pool.instance, **self.ledger.bind_challenge(caller, domain_uuid)}

    @on_call("bind_sessions")
    def do_bind_sessions(self, caller, domain_uuid, sessions, challenge=None, domain_name=None):
        """``sessions``: ``{sid: proof or null}`` (``MigrationLedger.bind_sessions``)."""
        if not isinstance(sessions, dict) or not 0 < len(sessions) <= att.MAX_BIND:
            raise BadRequest(reason=f"bind_sessions: sessions must be an object of 1 to {att.MAX_BIND} "
                                    f"{{sid: proof or null}}, not {describe(sessions)}")
        for sid, proof in sessions.items():
            if not 0 < len(sid) <= MAX_NAME or not (proof is None or isinstance(proof, str) and
                                                    len(proof) <= att.MAX_TOKEN):
                raise BadRequest(reason=f"bind_sessions: {shown(sid)}: a session id of 1 to {MAX_NAME} "
                                        f"characters and a proof (a hex string) or null")
        out = self.ledger.bind_sessions(caller, domain_uuid, sessions, challenge, self.pool.instance)
        return dict(out, refused={sid: _brief(exc) for sid, exc in out["refused"].items()})

    @on_call("unbind_session")
    def do_unbind_session(self, caller, sid, domain_uuid):
        self.ledger.unbind(caller, sid, domain_uuid)
        return {"sid": sid}

    @on_call("register_token")
    def do_register_token(self, caller, domain_uuid, digest):
        return self.ledger.register_token(caller, domain_uuid, digest)

    @on_call("register_intent")
    def do_register_intent(self, caller, domain_uuid, policy="none", dest_host=None,
                           migration_id=None, source_host=None):
        return self.ledger.register_intent(caller, domain_uuid, policy, dest_host, migration_id,
                                           source_host).to_wire()

    @on_call("open_migration")
    def do_open_migration(self, caller, domain_uuid, migration_id=None, domain_name=None,
                          policy=None, postcopy=False, token=None):
        return self.ledger.open(caller, domain_uuid, migration_id, domain_name, policy, postcopy,
                                token).to_wire()

    @on_call("switchover")
    def do_switchover(self, caller, domain_uuid, migration_id=None, postcopy=False):
        return self.ledger.switchover(caller, domain_uuid, migration_id, postcopy).to_wire()

    @on_call("commit")
    def do_commit(self, caller, domain_uuid, migration_id=None):
        return self.ledger.commit(caller, domain_uuid, migration_id).to_wire()

    @on_call("complete")
    def do_complete(self, caller, domain_uuid, migration_id=None, cursor=None, limit=None):
        """Freeze the domain's sessions and mint their tickets (the first
        call), and hand back a page of the live tickets of the sessions
        still moving: ``next`` for the following page (``cursor``, bound to
        this record and this host).  Every page of every repeat hands back
        the same live tickets."""
        page_limit("complete", limit)
        if cursor is not None:
            # a next page: the record the cursor was made for, as it is now
            record = self.ledger.find(domain_uuid, migration_id)
            self.pager.position("complete", record.key, caller, cursor)
            if record.state not in (RecordStateName.COMPLETED, RecordStateName.CLOSED):
                raise RecordState(record=record.key, state=record.state.value, action="page its tickets")
        else:
            record = self.ledger.complete(caller, domain_uuid, migration_id)
        page, following = self._page("complete", record.key, caller, cursor, limit, lambda start: (
            (index, (sid, ticket)) for index, sid, ticket in self.ledger.ticket_page(record, start)),
            size=lambda item: len(item[0]) + len(item[1]) + 6)
        # ``now``: the pool's clock, for the caller's offset estimate (the timeline)
        return {"record": record.to_wire(), "tickets": dict(page), "next": following, "now": time.time()}

    @on_call("note_timeline")
    def do_note_timeline(self, caller, domain_uuid, migration_id, steps=None):
        """Bounded: known steps only, each one a small object.  The steps taken."""
        self.ledger.timeline_side(caller, domain_uuid, migration_id)     # a party's, before its steps are read
        if not isinstance(steps, dict) or len(steps) > len(STEP_NAMES):
            raise BadRequest(reason=f"note_timeline: steps must be an object of at most "
                                    f"{len(STEP_NAMES)} steps, not {describe(steps)}")
        try:
            timeline = Timeline.from_wire(steps)
        except ProtocolError as exc:
            raise BadRequest(reason=f"note_timeline: {exc.kwargs.get('reason', exc.message)}") from None
        return {"taken": self.ledger.note_timeline(caller, domain_uuid, migration_id, timeline)}

    @on_call("close")
    def do_close(self, caller, domain_uuid, migration_id=None):
        return self.ledger.close(caller, domain_uuid, migration_id).to_wire()

    @on_call("abort")
    def do_abort(self, caller, domain_uuid, migration_id=None, reason="aborted by a host"):
        return self.ledger.abort(caller, domain_uuid, migration_id, reason).to_wire()

    @on_call("renew")
    def do_renew(self, caller, records=()):
        if not isinstance(records, (list, tuple)) or not all(
                isinstance(item, (list, tuple)) and len(item) == 2 and all(isinstance(p, str) for p in item)
                for item in records):
            raise BadRequest(reason="renew: records are [domain_uuid, migration_id] pairs")
        renewed, unknown = self.ledger.renew(caller, records)
        return {"renewed": [r.to_wire() for r in renewed], "unknown": unknown}

    # -- saved domains -----------------------------------------------------------------
    @on_call("park")
    def do_park(self, caller, domain_uuid, retention=None):
        retention = self._retention(retention)
        parked = self.pool.park(self.ledger.saved_domain(caller, domain_uuid, "park"), retention)
        LOG.info("domain %s saved: %d session(s) parked for %.0f s", domain_uuid, len(parked),
                 retention, extra={"domain": domain_uuid})
        return {**_listed("parked", parked), "retention": retention}

    def _retention(self, value) -> float:
        """A saved domain's retention: finite, from 1 s to 30 days (the
        pool's own default if none is given)."""
        if value is None:
            return float(self.pool.config.park_retention)
        if not is_number(value, MIN_RETENTION, MAX_RETENTION):
            raise BadRequest(reason=f"retention must be seconds from {MIN_RETENTION:g} to "
                                    f"{MAX_RETENTION:g}, not {value!r}")
        return float(value)

    @on_call("unpark")
    def do_unpark(self, caller, domain_uuid):
        return _listed("unparked", self.pool.unpark(self.ledger.saved_domain(caller, domain_uuid, "unpark")))

    # -- reading -----------------------------------------------------------------------
    @on_call("list_sessions")
    def do_list_sessions(self, caller, domain_uuid=None, cursor=None, limit=None):
        """A page of the pool's sessions (a domain's), in the order they
        opened: for a host, only its own (``Parties.visible``) and, of a
        domain, those its migrations from here moved; of a domain, also how
        many of its sessions are bound elsewhere (``elsewhere``: a host
        finding a domain here that arrived while its hostd was away)."""
        visible = self.ledger.parties.visible
        chosen = [s for s in list(self.pool.sessions.values()) if domain_uuid is None or s.domain_uuid == domain_uuid]
        moved = self.ledger.moved_by(caller, domain_uuid) if domain_uuid is not None else set()
        page, following = self._page(
            "list_sessions", "*" if domain_uuid is None else f"domain {domain_uuid}", caller, cursor, limit,
            lambda start: ((s.serial, s.describe()) for s in chosen
                           if s.serial >= start and (visible(s, caller) or s.sid in moved)))
        out = {"instance": self.pool.instance, "sessions": page, "next": following}
        if domain_uuid is not None and cursor is None:
            out["elsewhere"] = sum(1 for s in chosen if not visible(s, caller))
        return out

    @on_call("list_records")
    def do_list_records(self, caller, open_only=False, domain_uuid=None, cursor=None, limit=None):
        """A page of the records the caller takes part in (each one bounded:
        ``RecordView``), newest first: a caller after the latest (most are)
        finds it on the first page, even one that does not follow pages."""
        records = self.ledger.listed(caller, open_only, domain_uuid)
        # (a position grows as serials fall: the next page starts one past the last given)
        page, following = self._page("list_records", f"{bool(open_only)} {domain_uuid}", caller, cursor, limit,
                                     lambda start: ((_NEWEST - r.serial, r.to_wire()) for r in records
                                                    if _NEWEST - r.serial >= start))
        return {"records": page, "next": following}

    @on_call("record_sessions")
    def do_record_sessions(self, caller, domain_uuid, migration_id, cursor=None, limit=None):
        """A page of a record's frozen sessions and their blackouts (None:
        not resumed yet): what a record view lists inline only while short.
        For its parties (and the admin socket) only."""
        page_limit("record_sessions", limit)
        record = self.ledger.find(domain_uuid, migration_id)
        self.ledger.parties.require_party(record, caller, "list the sessions of")
        page, following = self._page("record_sessions", record.key, caller, cursor, limit, lambda start: (
            (index, {"sid": sid, "blackout": record.resumed.get(sid)})
            for index, sid in enumerate(record.sessions) if index >= start))
        return {"record": record.key, "session_count": len(record.sessions), "sessions": page, "next": following}

    @on_call("wait_record")
    async def wait_record(self, caller, domain_uuid, migration_id=None, until="rehomed", timeout=60.0):
        """The record once rehomed, timeline noted or final (``until``), or
        as it is after ``timeout`` seconds (``MigrationLedger.wait``)."""
        if until not in ("rehomed", "timeline", "final"):
            raise BadRequest(reason=f"wait_record: until {until!r} (rehomed, timeline or final)")
        if not is_number(timeout, 0, 600):
            raise BadRequest(reason="wait_record: timeout must be 0 to 600 seconds")
        record, reached = await self.ledger.wait(caller, domain_uuid, migration_id, until, float(timeout))
        return {"record": None if record is None else record.to_wire(), "reached": reached}

    @on_call("accel_domains")
    def do_accel_domains(self, caller, since=None, cursor=None, limit=None):
        """Which domains hold sessions, marked or not (hosts cache it so their
        hook can be strict for a Nova instance while hostd is down), each
        with how many of its sessions wait to be attested — never the
        sessions' ids.  ``since``: the version the caller has; an unchanged
        set answers in a few bytes, however many sessions there are.  Paged
        by domain: each page says the version as it is now, and a caller
        keeps the first page's (whatever changed while it paged shows as a
        new version at its next look)."""
        page_limit("accel_domains", limit)
        domains = self.ledger.accel_domains()
        version = hashlib.sha256(wc.canonical(domains)).hexdigest()[:32]
        if cursor is None and since == version:
            return {"version": version, "unchanged": True}
        page, following = self._page("accel_domains", "*", caller, cursor, limit, lambda start: (
            (index, (domain, domains[domain])) for index, domain in enumerate(sorted(domains)) if index >= start),
            size=lambda item: len(item[0]) + 12)
        return {"version": version, "domains": dict(page), "next": following}

    @on_call("list_hosts")
    def do_list_hosts(self, caller):
        return {"hosts": [h.describe() for h in self.pool.hosts.values()]}

    @on_call("list_devices")
    def do_list_devices(self, caller):
        """The node's devices with what is in use (at most MAX_DEVICES of them)."""
        return {"instance": self.pool.instance, "devices": self.pool.devices.describe()}

    @on_call("list_nodes")
    def do_list_nodes(self, caller):
        """A node alone (no etcd): no cluster; hostd talks to this node only.
        (A node of a cluster answers from etcd: ``EtcdFollower.list_nodes``.)"""
        return {"cluster": False, "node": None, "instance": self.pool.instance, "nodes": []}

    @on_call("metrics")
    def do_metrics(self, caller):
        return {"text": self.pool.metrics.text()}


def _caller(host) -> str:
    return host.name if host is not None else wc.ADMIN_HOST


def check_args(method: str, handler, args: dict) -> None:
    """Identifiers are bounded strings and flags are booleans before any
    method sees them (numbers are checked by the methods that take them): a
    record with a number for its id would break every host that lists it."""
    params = inspect.signature(handler).parameters
    for key, value in args.items():
        if key in _NAME_ARGS:
            if value is None and key in params and params[key].default is None:
                continue
            if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME:
                raise BadRequest(reason=f"{method}: {key} must be a string of 1 to {MAX_NAME} "
                                        f"characters, not {describe(value)}")
        elif key in _FLAG_ARGS and not isinstance(value, bool):
            raise BadRequest(reason=f"{method}: {key} must be true or false, not {describe(value)}")
        elif key == "reason" and (not isinstance(value, str) or len(value) > MAX_REASON):
            raise BadRequest(reason=f"{method}: reason must be a string of at most {MAX_REASON} "
                                    f"characters, not {describe(value)}")


def _listed(key: str, sids: list[str]) -> dict:
    """``{key: sids}`` while short, else the first RECORD_INLINE_SESSIONS of
    them and ``more``: how many are not listed (an answer never grows with
    the number of a domain's sessions)."""
    if len(sids) <= RECORD_INLINE_SESSIONS:
        return {key: sids}
    return {key: sids[:RECORD_INLINE_SESSIONS], "more": len(sids) - RECORD_INLINE_SESSIONS}


def _brief(exc: AccelmigError) -> dict:
    """An error as one entry of an answer that lists many (``bind_sessions``'
    refusals): its code and the start of its message; the answer stays
    within a page's bound however many sessions its call named."""
    return {"code": exc.code.value, "message": exc.message[:240]}
