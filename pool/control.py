"""The pool's control plane: authenticated hosts (and the local admin socket).

Transport and signatures are in ``accelmig.wire.control``; this module checks
them and carries out each method on the pool.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import logging
import secrets
import time

from accelmig.pool.config import parse_networks
from accelmig.pool.paging import page_limit, take
from accelmig.wire import attestation as att
from accelmig.wire import control as wc
from accelmig.wire import tls
from accelmig.wire.errors import (AccelmigError, AuthFailed, BadRequest, Conflict, FrameError,
                                  Forbidden, InternalError, NoSuchHost, NoSuchRecord, ProtocolError, RecordState,
                                  UnknownOp, VersionUnsupported)
from accelmig.wire.frames import encode_frame
from accelmig.wire.records import (ABORTABLE, IN_FLIGHT, RECORD_INLINE_SESSIONS, STEP_NAMES, PausePolicy,
                                   RecordStateName, Side, Timeline)
from accelmig.wire.values import describe, is_int, is_number, shown

LOG = logging.getLogger(__name__)

#: Bounds of a saved domain's retention (``park``), in seconds.
MIN_RETENTION = 1.0
MAX_RETENTION = 30 * 86400.0
#: How long an intent names the destination of a domain's next migration
#: (``accelmig migrate`` starts it at once): a stale one must not keep
#: refusing every other destination.
INTENT_TTL = 300.0
#: Identifiers (domain uuids and names, migration and session ids, host
#: names) are strings of at most this many characters; reasons of at most
#: MAX_REASON.
MAX_NAME = 256
MAX_REASON = 1024
#: Networks one host may register (each data-plane connection is matched
#: against all of them).
MAX_ADDRESSES = 256
#: ``wait_record`` calls one connection may have pending at once (hostd
#: waits once per ``accelmig migrate`` under way on its host).
MAX_WAITS = 1024

#: records by position in ``list_records``' pages, newest first: this minus the serial
_NEWEST = 10 ** 11

_NAME_ARGS = {"domain_uuid", "migration_id", "domain_name", "sid", "dest_host", "source_host", "since",
              "cursor"}
_FLAG_ARGS = {"postcopy", "open_only"}

ADMIN_METHODS = {"list_nodes", "list_sessions", "list_records", "record_sessions", "list_hosts", "list_devices", "metrics", "ping",
                 "abort", "park", "unpark", "register_intent", "wait_record"}


class ControlServer:
    def __init__(self, pool):
        self.pool = pool
        self._tasks: set[asyncio.Task] = set()

    async def handle_host(self, reader, writer, admitted=None) -> None:
        """A host's connection, counted from accept by ``admitted`` (a
        ``pool.admission.AcceptedConnection``: its TLS handshake done, its
        deadline running)."""
        await self._tracked(self._serve(reader, writer, admin=False, admitted=admitted))

    async def handle_admin(self, reader, writer) -> None:
        await self._tracked(self._serve(reader, writer, admin=True))

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

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     admin: bool, admitted=None) -> None:
        peer = writer.get_extra_info("peername") or "admin-socket"
        challenge = secrets.token_hex(16)
        host = None
        last_id = 0
        waits: set[asyncio.Task] = set()
        # A host's connection was counted from accept (pool.admission) and
        # stays counted as a stranger until its hello is accepted, within
        # what is left of the deadline its TLS handshake started (the hello's
        # wait below answers it: "no hello within").
        if admitted is not None:
            admitted.on_deadline = _answered_below
        try:
            try:
                header = await asyncio.wait_for(
                    wc.read_frame_async(reader, wc.HELLO_LIMITS),
                    admitted.remaining() if admitted is not None else self.pool.config.handshake_timeout)
            except asyncio.TimeoutError:
                raise ProtocolError(reason=f"no hello within "
                                           f"{self.pool.config.handshake_timeout:g} s") from None
            if header.get("op") != "hello":
                raise ProtocolError(reason="expected hello")
            offered = header.get("versions") or []
            if not isinstance(offered, list) or not all(is_int(v) for v in offered):
                raise BadRequest(reason="hello: versions must be a list of integers")
            if not set(offered) & set(wc.CONTROL_VERSIONS):
                raise VersionUnsupported(offered=offered, supported=list(wc.CONTROL_VERSIONS))
            name = header.get("host")
            if admin:
                host = None
            else:
                host = self.pool.hosts.get(name) if isinstance(name, str) else None
                if host is None:
                    raise AuthFailed(reason=f"no secret for host {name!r} (add it to the pool's hosts file)")
                self._check_certificate_names(writer, name, peer)
            writer.write(encode_frame({"op": "welcome", "version": 1, "challenge": challenge,
                                       "instance": self.pool.instance}))
            if admitted is not None:
                admitted.authenticated()
            while True:
                try:
                    header = await self._next_call(reader, waits, idle=admitted is not None)
                except asyncio.IncompleteReadError:
                    return
                if header is None:
                    # closed without an error frame: a client finds the connection
                    # gone at its next call and makes a new one
                    LOG.info("control plane: closing %s: nothing received for %g s (idle_timeout)", peer,
                             self.pool.config.idle_timeout)
                    return
                call_id = header.get("id")
                method = header.get("method")
                if not isinstance(method, str):      # a list is no method (and no dict key)
                    method = repr(method)[:100]
                args = header.get("args") if isinstance(header.get("args"), dict) else {}
                if header.get("op") != "call" or not isinstance(call_id, int) or call_id <= last_id:
                    raise ProtocolError(reason="calls need op 'call' and strictly increasing ids")
                last_id = call_id
                if host is not None:
                    if self.pool.hosts.get(host.name) is not host:      # a reload (SIGHUP) removed it
                        raise AuthFailed(reason=f"host {host.name} is no longer in the pool's hosts file")
                    expected = wc.request_mac(host.secret, challenge, call_id, str(header.get("method")), args)
                    if not hmac.compare_digest(expected, str(header.get("mac", ""))):
                        raise AuthFailed(reason=f"request MAC from host {host.name} does not verify")
                    host.last_seen = time.time()
                if method in CLUSTERED and self.pool.record_ledger is not None:
                    # etcd is written first, off the loop: other calls go on meanwhile
                    step = asyncio.ensure_future(self._answer_clustered(
                        writer, host, admin, challenge, call_id, method, args))
                    waits.add(step)
                    step.add_done_callback(waits.discard)
                    continue
                if method in wc.WAITING_METHODS:
                    if len(waits) >= MAX_WAITS:
                        error = BadRequest(reason=f"{method}: {len(waits)} waits already pending on this "
                                                  f"connection, the most one may hold")
                        self._answer(writer, host, challenge, call_id, {"ok": False, "error": error.to_wire()})
                        await writer.drain()
                        continue
                    # A long wait must not hold up this connection's other calls:
                    # answered when it is over (clients match answers by id).
                    wait = asyncio.ensure_future(self._answer_later(
                        writer, host, admin, challenge, call_id, method, args))
                    waits.add(wait)
                    wait.add_done_callback(waits.discard)
                    continue
                self._answer(writer, host, challenge, call_id, self._call(host, admin, method, args))
                await writer.drain()
        except (AccelmigError, FrameError) as exc:
            LOG.warning("control plane: closing %s: %s", peer, exc)
            try:
                writer.write(encode_frame({"op": "error", "error": exc.to_wire()}))
            except Exception:
                pass
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            for wait in waits:
                wait.cancel()
            if admitted is not None:
                admitted.closed()
                admitted.close_soon(writer.transport)   # (a peer that never reads keeps no descriptor)
            else:
                writer.close()

    async def _next_call(self, reader, waits: set, idle: bool) -> dict | None:
        """The connection's next call; None for a host's connection
        (``idle``) that sent nothing for ``idle_timeout`` while none of its
        waits was pending: it is closed (hostd calls every few seconds)."""
        if not idle:
            return await wc.read_frame_async(reader, wc.CALL_LIMITS)
        timeout = self.pool.config.idle_timeout
        frame = asyncio.ensure_future(wc.read_frame_async(reader, wc.CALL_LIMITS))
        try:
            while True:
                done, _ = await asyncio.wait({frame}, timeout=timeout)
                if done:
                    return frame.result()
                if not waits:
                    self.pool.metrics.idle_connections.inc()
                    return None
        finally:
            if not frame.done():
                frame.cancel()
            elif not frame.cancelled():
                frame.exception()        # (read: a serve cancelled meanwhile leaves no unread failure)

    def _check_certificate_names(self, writer, name: str, peer) -> None:
        """A host acts only as the name its client certificate gives (the
        CA's word), its secret a second factor: a stolen secret alone, or
        one host's certificate with another's secret, names nobody.  Plain
        TCP (``insecure``, said at start) has no certificate to ask."""
        if writer.get_extra_info("ssl_object") is None:
            LOG.info("host %s connected from %s: INSECURE plain TCP, its secret alone names it",
                     name, peer, extra={"host": name, "tls": False})
            return
        names = tls.certificate_names(writer.get_extra_info("peercert"))
        if name not in names:
            raise AuthFailed(reason=f"host {name!r}: the client certificate names "
                                    f"{', '.join(repr(n) for n in names[:4]) or 'no host'}, not this host")
        LOG.info("host %s connected from %s (mutual TLS, its certificate names it)", name, peer,
                 extra={"host": name, "tls": True})

    @staticmethod
    def _answer(writer, host, challenge: str, call_id: int, body: dict) -> None:
        out = {"op": "result", "id": call_id, **body}
        if host is not None:
            out["mac"] = wc.result_mac(host.secret, challenge, call_id, wc.result_body(out))
        writer.write(encode_frame(out))

    async def _answer_later(self, writer, host, admin, challenge, call_id, method, args) -> None:
        try:
            self._check_caller(host, admin, method)
            handler = getattr(self, f"wait_{method.removeprefix('wait_')}")
            check_args(method, handler, args)
            result = await handler(host.name if host is not None else wc.ADMIN_HOST, **args)
            body = {"ok": True, "result": result}
        except TypeError as exc:
            body = {"ok": False, "error": BadRequest(reason=f"{method}: {exc}").to_wire()}
        except AccelmigError as exc:
            body = {"ok": False, "error": exc.to_wire()}
        if not writer.is_closing():
            self._answer(writer, host, challenge, call_id, body)

    # -- a pool of several nodes: records follow etcd's ---------------------------------
    async def _answer_clustered(self, writer, host, admin, challenge, call_id, method, args) -> None:
        try:
            body = await self._clustered(host, admin, method, args)
        except AccelmigError as exc:
            body = {"ok": False, "error": exc.to_wire()}
        except Exception as exc:
            LOG.exception("control plane: %s failed", method)
            body = {"ok": False, "error": InternalError(reason=f"{type(exc).__name__}: {exc}").to_wire()}
        if not writer.is_closing():
            self._answer(writer, host, challenge, call_id, body)

    async def _clustered(self, host, admin: bool, method: str, args: dict) -> dict:
        """A record's step in a pool of several nodes: authorised here as
        ever, taken in etcd first (one transaction moving the record and
        every node's part), then by this node's own record, which first
        follows whatever etcd's took meanwhile.  A step etcd's record cannot
        take (another node aborted it) is refused here too: no node is ever
        ahead of etcd."""
        ledger, loop = self.pool.record_ledger, asyncio.get_running_loop()
        self._check_caller(host, admin, method)
        caller = host.name if host is not None else wc.ADMIN_HOST
        if method == "list_nodes":
            from accelmig.pool.cluster.registry import live_nodes
            nodes = await loop.run_in_executor(None, live_nodes, ledger.store)
            return {"ok": True, "result": {"cluster": True, "node": ledger.node, "instance": self.pool.instance,
                                           "nodes": [{"name": n.name, "instance": n.instance, "control": n.control}
                                                     for n in sorted(nodes.values(), key=lambda n: n.name)]}}
        if method == "open_migration":
            domain, mid = args.get("domain_uuid"), args.get("migration_id")
            if isinstance(domain, str) and isinstance(mid, str) and f"{domain}/{mid}" not in self.pool.records:
                # another node's migration under that id goes elsewhere: nothing opens here
                known = await loop.run_in_executor(None, ledger.read, domain, mid)
                if known is not None and known.dest_host != caller:
                    raise Conflict(reason=f"migration {mid} of domain {domain} goes to host "
                                          f"{known.dest_host} (as etcd has it), not {caller}")
            body = self._call(host, admin, method, args)
            if not body["ok"]:
                return body
            record = self.pool.records[f"{body['result']['domain_uuid']}/{body['result']['migration_id']}"]
            try:
                stored = await loop.run_in_executor(None, ledger.open, record)
            except AccelmigError as exc:
                # a record the other nodes cannot follow must not go on here
                self.pool.abort_record(record, f"not opened in etcd: {exc}")
                raise
            self.pool.follow_record(record, stored)
            return {"ok": True, "result": dict(record.describe(), cluster=_cluster_view(stored))}
        try:
            check_args(method, getattr(self, f"do_{method}"), args)
            inspect.signature(getattr(self, f"do_{method}")).bind(caller, **args)
        except TypeError as exc:
            raise BadRequest(reason=f"{method}: {exc}") from None
        try:
            try:
                record, steps = self._plan(caller, method, args)
            except Forbidden:
                # (a node that missed the source's switchover follows etcd's record
                # first: the vouching is there)
                domain, mid = args.get("domain_uuid"), args.get("migration_id")
                local = self.pool.records.get(f"{domain}/{mid}")
                if method not in ("complete", "commit") or local is None or local.vouched:
                    raise
                stored = await loop.run_in_executor(None, ledger.read, domain, mid)
                if stored is None or not stored.vouched:
                    raise
                self.pool.follow_record(local, stored)
                record, steps = self._plan(caller, method, args)
        except NoSuchRecord:
            # a record this node never opened (the open did not reach it): etcd's, if it has it
            domain, mid = args.get("domain_uuid"), args.get("migration_id")
            if mid is not None and f"{domain}/{mid}" in self.pool.records:
                raise
            stored = await loop.run_in_executor(
                None, (lambda: ledger.read(domain, mid)) if mid is not None else (lambda: ledger.latest_open(domain)))
            if stored is None or f"{stored.domain_uuid}/{stored.migration_id}" in self.pool.records:
                raise
            self.pool.adopt_record(stored)
            record, steps = self._plan(caller, method, args)
        stored = None
        for event, changes in steps:
            try:
                stored = await loop.run_in_executor(None, lambda: self._advance(record, event, changes))
            except RecordState:
                stored = await loop.run_in_executor(None, ledger.read, record.domain_uuid, record.migration_id)
                if stored is not None:
                    self.pool.follow_record(record, stored)
                raise
            self.pool.follow_record(record, stored)
        body = self._call(host, admin, method, args)
        if body["ok"] and stored is not None and isinstance(body["result"], dict):
            body["result"]["cluster"] = _cluster_view(stored)
        return body

    def _advance(self, record, event: str, changes: dict):
        """Blocking: ``event`` on etcd's record; one this node still has
        but etcd lost (its lease of a day ran out, a store wiped) is put
        back first."""
        ledger = self.pool.record_ledger
        try:
            return ledger.advance(record.domain_uuid, record.migration_id, event, **changes)
        except NoSuchRecord:
            LOG.warning("record %s is not in etcd: putting it back", record.key)
            ledger.open(record)
            return ledger.advance(record.domain_uuid, record.migration_id, event, **changes)

    def _plan(self, caller, method: str, args: dict):
        """The record a step acts on and the events etcd's record takes for
        it, after the same checks as the method's own (it checks again when
        it runs: etcd is written in between)."""
        find, domain, mid = self.pool.find_record, args.get("domain_uuid"), args.get("migration_id")
        if method == "switchover":
            postcopy = args.get("postcopy", False)
            states = set(ABORTABLE) | ({RecordStateName.COMMITTED, RecordStateName.COMPLETED} if postcopy else set())
            record = self._switchover_target(caller, domain, mid, states)
            self._require_source(record, caller, "switch over")
            vouches = {"vouched": True} if self._source_vouches(record, caller) else {}
            steps = [("switchover", {"source_host": record.source_host or caller, **vouches})] \
                if record.state in ABORTABLE else []
            return record, steps + ([("commit", {"postcopy": True, **vouches})] if postcopy else [])
        if method == "commit":
            record = find(domain, mid, dest=caller, states=IN_FLIGHT)
            self._require_dest(record, caller, "commit")
            self._require_vouched(record, caller, "commit")
            return record, [("commit", {})]
        if method == "complete":
            if args.get("cursor") is not None:
                return find(domain, mid), []          # a next page: no step
            record = find(domain, mid, dest=caller, states=IN_FLIGHT | {RecordStateName.COMPLETED})
            self._require_dest(record, caller, "complete")
            if record.state is not RecordStateName.COMPLETED:
                self._require_vouched(record, caller, "complete")
            return record, [("complete", {})]
        if method == "close":
            record = find(domain, mid, source=caller, states=IN_FLIGHT | {RecordStateName.COMPLETED})
            self._require_source(record, caller, "close")
            return record, [("close", {})]
        # abort
        record = find(domain, mid, states=ABORTABLE if mid is None else None)
        if caller != wc.ADMIN_HOST and caller not in (self._source_of(record), record.dest_host):
            raise Forbidden(who=f"host {caller}", what=f"abort {record.key}: it takes no part in it")
        reason = args.get("reason", "aborted by a host")
        return record, [("abort", {"abort_reason": f"{reason} (by {caller})"[:256]})]

    def _check_caller(self, host, admin: bool, method) -> None:
        if method not in wc.METHODS:
            raise UnknownOp(op=method)
        if admin and method not in ADMIN_METHODS:
            raise AuthFailed(reason=f"{method} is for hypervisor hosts, not the admin socket")
        if not admin and wc.METHODS[method] == "host" and host is None:
            raise AuthFailed(reason="host methods need an authenticated host")

    def _call(self, host, admin: bool, method, args: dict) -> dict:
        try:
            self._check_caller(host, admin, method)
            handler = getattr(self, f"do_{method}")
            caller = host.name if host is not None else wc.ADMIN_HOST
            check_args(method, handler, args)
            try:
                result = handler(caller, **args)
            except TypeError as exc:
                raise BadRequest(reason=f"{method}: {exc}") from None
            return {"ok": True, "result": result}
        except AccelmigError as exc:
            return {"ok": False, "error": exc.to_wire()}
        except Exception as exc:
            LOG.exception("control plane: %s failed", method)
            return {"ok": False, "error": InternalError(reason=f"{type(exc).__name__}: {exc}").to_wire()}

    # -- methods ---------------------------------------------------------------------
    def do_ping(self, caller):
        return {"instance": self.pool.instance, "caller": caller, "time": time.time()}

    def do_register_host(self, caller, addresses=(), identity=None):
        host = self.pool.hosts[caller]
        if not isinstance(addresses, (list, tuple)) or len(addresses) > MAX_ADDRESSES:
            raise BadRequest(reason=f"register_host: addresses must be a list of at most "
                                    f"{MAX_ADDRESSES} networks, not {describe(addresses)}")
        if identity is not None and not isinstance(identity, dict):
            raise BadRequest(reason=f"register_host: identity must be an object, not {describe(identity)}")
        wanted = parse_networks(addresses, f"register_host({caller})")
        # The longest prefix attributes a guest's connection to a host: a
        # host registering a network inside another's would take its guests.
        taken = {net: other.name for other in self.pool.hosts.values() if other is not host
                 for net in other.networks}
        kept, refused = [], []
        for net in wanted:
            clash = next((f"{n} of host {name}" for n, name in taken.items()
                          if n.version == net.version and n.overlaps(net)), None)
            if clash is None:
                kept.append(net)
            else:
                refused.append({"network": str(net), "overlaps": clash})
                LOG.warning("host %s: registration of %s refused: it overlaps %s", caller, net,
                            clash, extra={"host": caller})
        host.networks = host.static_networks + kept
        host.identity = dict(identity or {})
        host.registered_at = time.time()
        LOG.info("host %s registered: %s", caller, ", ".join(str(n) for n in host.networks),
                 extra={"host": caller})
        return dict(host.describe(), refused=refused)

    def _session(self, sid):
        session = self.pool.sessions.get(sid)
        if session is None or not session.live:
            raise NoSuchRecord(record=f"session {sid}")
        return session

    # -- who is who: a domain's host, a record's parties ----------------------------
    def _domain_host(self, domain_uuid) -> str | None:
        """Where the domain runs as far as its live sessions tell: the host
        they are bound to, or the destination they are moving to; None for a
        domain without any (nothing of it to take)."""
        hosts = set()
        for session in self.pool.domain_sessions(domain_uuid):
            moving = self.pool.records.get("/".join(session.pending_move)) if session.pending_move else None
            hosts.add(moving.dest_host if moving is not None else session.bound_host)
        hosts.discard(None)
        if len(hosts) > 1:
            return self.pool.domain_hosts.get(domain_uuid)
        return hosts.pop() if hosts else None

    def _intent(self, domain_uuid, now: float) -> dict | None:
        """The domain's intent while it is fresh (an older one is dropped)."""
        intent = self.pool.intents.get(domain_uuid)
        if intent is not None and now - intent["registered"] > INTENT_TTL:
            del self.pool.intents[domain_uuid]
            return None
        return intent

    def _named_destinations(self, domain_uuid, now: float) -> set[str]:
        """Where the domain's host (or the admin socket) said it goes: the
        destination of its fresh intent, and of every migration under way
        that opened with one (once completed, the destination is the
        domain's host and names the next one).  Empty where nobody named one."""
        named = {r.dest_host for r in self.pool.open_records()
                 if r.domain_uuid == domain_uuid and r.vouched and r.state in IN_FLIGHT}
        intent = self._intent(domain_uuid, now)
        if intent is not None and intent.get("dest_host") and \
                intent["by"] in (wc.ADMIN_HOST, self._domain_host(domain_uuid)):
            named.add(intent["dest_host"])
        return named

    def _source_of(self, record) -> str | None:
        """The record's source; where it is not known yet (the domain was new
        to the pool when the record opened), the one host the domain's
        sessions are bound to, if any."""
        if record.source_host is not None:
            return record.source_host
        bound = {s.bound_host for s in self.pool.domain_sessions(record.domain_uuid)} - {None}
        return bound.pop() if len(bound) == 1 else None

    def _require_source(self, record, caller, action: str) -> None:
        if record.dest_host == caller:
            raise Conflict(reason=f"host {caller} is the destination of {record.key}")
        source = self._source_of(record)
        if source not in (None, caller):
            raise Forbidden(who=f"host {caller}", what=f"{action} {record.key}: it comes from host {source}")

    def _require_dest(self, record, caller, action: str) -> None:
        if record.dest_host == caller:
            return
        source = self._source_of(record)
        if caller == source:
            raise Conflict(reason=f"{record.key} goes to {record.dest_host}, not {caller}")
        raise Forbidden(who=f"host {caller}", what=f"{action} {record.key}: it goes from host "
                                                   f"{source or '?'} to host {record.dest_host}")

    def _is_party(self, record, caller) -> bool:
        """``caller`` takes part in ``record``: its destination or its source."""
        return caller in (record.dest_host, record.source_host, self._source_of(record))

    def _source_vouches(self, record, caller) -> bool:
        """Whether the switchover ``caller`` takes of ``record`` vouches for
        its destination: ``caller`` is the host the domain's sessions are
        bound to (its word that its domain really is migrating; where the
        pool knows no such host, the domain has nothing to take yet and the
        sessions bound later must be that host's: ``_require_vouched``),
        nobody vouched for another migration of the domain, this is the only
        one under way, and the domain's token is not waiting unused for the
        real destination's open (then a record without it is not that one)."""
        if record.vouched or self._source_of(record) not in (None, caller):
            return False
        if self.pool.domain_tokens.unspent(record.domain_uuid):
            return False
        others = [r for r in self.pool.open_records() if r.domain_uuid == record.domain_uuid
                  and r is not record and r.state in IN_FLIGHT]
        return not others

    def _require_vouched(self, record, caller, action: str) -> None:
        """A record nobody vouched for (no token of the domain's, no intent
        naming its destination, no switchover by its source) takes nothing
        of the domain's sessions: it completes or commits only while the
        domain has none; nor does one vouched for by a source whose domain's
        sessions are bound to another host."""
        sessions = self.pool.domain_sessions(record.domain_uuid)
        if not sessions:
            return
        if not record.vouched:
            raise Forbidden(who=f"host {caller}", what=(
                f"{action} {record.key}: nobody vouched for it (it opened without the domain's migration "
                f"token or an intent naming {record.dest_host}, and its source has not switched it over)"))
        elsewhere = {s.bound_host for s in sessions} - {None, record.dest_host, record.source_host}
        if record.source_host is not None and elsewhere:
            raise Forbidden(who=f"host {caller}", what=(
                f"{action} {record.key}: the domain's sessions are bound to {', '.join(sorted(elsewhere))}, "
                f"not to its source {record.source_host}"))

    def _switchover_target(self, caller, domain_uuid, migration_id, states):
        """The record a source's switchover (which names no migration: its
        host does not know the destination) is about: the one vouched for,
        else the only one under way; several that nobody vouched for are a
        ``Conflict`` (a host opened a migration it has no part in)."""
        if migration_id:
            return self.pool.find_record(domain_uuid, migration_id, states=states)
        candidates = [r for r in self.pool.records.values() if r.domain_uuid == domain_uuid and r.state in states]
        vouched = [r for r in candidates if r.vouched]
        if vouched:
            return max(vouched, key=lambda r: r.times["opened"])
        if not candidates:
            raise NoSuchRecord(record=f"{domain_uuid}/* (no matching record)")
        others = [r for r in candidates if r.dest_host != caller] if len(candidates) > 1 else candidates
        if len(others) > 1:
            raise Conflict(reason=f"{len(others)} migrations of domain {domain_uuid} are open and nobody "
                                  f"vouched for any of them (to {', '.join(sorted(r.dest_host for r in others))}): "
                                  f"the source cannot tell which is its own")
        return (others or candidates)[0]

    def _check_arrival(self, caller, session, domain_uuid) -> None:
        """``caller`` attests ``session``, bound to another host, for
        ``domain_uuid``: only as the destination of that domain's migration
        from the session's host (a VM without the accelmig channel reports
        its sessions through guest-exec only there), or of the session's own
        move, and only of a migration its source vouched for.  Attesting
        changes no binding: a ticket still needs the session's own secret."""
        sid, bound = session.sid, session.bound_host
        if session.pending_move is not None:
            moving = self.pool.records.get("/".join(session.pending_move))
            if moving is not None and moving.dest_host == caller and session.domain_uuid == domain_uuid:
                return
        for record in self.pool.open_records():
            if record.domain_uuid != domain_uuid or record.dest_host != caller:
                continue
            source = self._source_of(record)
            if record.vouched and (source == bound or session.domain_uuid == domain_uuid):
                return
            if not record.vouched and (source in (None, bound) or session.domain_uuid == domain_uuid):
                # Nobody vouched for this destination yet: the session's
                # host does when it switches the migration over.
                raise RecordState(record=record.key, state=record.state.value,
                                  action=f"attest session {sid} (bound to host {bound}) before its "
                                         f"source switched the migration over")
        raise Conflict(reason=f"session {sid} is bound to host {bound}, not {caller}")

    # -- attestation -----------------------------------------------------------------
    def do_bind_challenge(self, caller, domain_uuid=None):
        """A fresh challenge for the caller's binding proofs
        (``wire.attestation``); with ``domain_uuid``, how many sessions
        claiming that domain wait to be attested (the destination of a
        migration asks its guest for proofs only when some do)."""
        now = time.time()
        out = {"challenge": self.pool.bind_challenges.issue(caller, now), "instance": self.pool.instance,
               "ttl": self.pool.bind_challenges.ttl}
        if domain_uuid is not None:
            out["unattested"] = sum(1 for s in list(self.pool.sessions.values())
                                    if s.live and s.domain_uuid is None and s.claimed_domain == domain_uuid)
        return out

    def _attested_here(self, session, caller, domain_uuid) -> bool:
        """Bound to ``caller`` in ``domain_uuid`` already (or moving there
        with a ticket): acknowledged without a new proof."""
        if session.domain_uuid != domain_uuid:
            return False
        if session.bound_host == caller and session.pending_move is None:
            return True
        moving = self.pool.records.get("/".join(session.pending_move)) if session.pending_move else None
        return moving is not None and moving.dest_host == caller

    def do_bind_sessions(self, caller, domain_uuid, sessions, challenge=None, domain_name=None):
        """Bind sessions to ``domain_uuid`` on the caller, each with its
        proof (``wire.attestation``: the session's own HMAC over a challenge
        the pool issued to the caller, the caller's name and the domain).
        ``sessions``: ``{sid: proof}``; a ``null`` proof only asks whether the
        session is bound here already.  ``bound``: the sessions bound to the
        caller in that domain now; ``prove``: those that need a proof;
        ``refused``: the others, each with its error."""
        if not isinstance(sessions, dict) or not 0 < len(sessions) <= att.MAX_BIND:
            raise BadRequest(reason=f"bind_sessions: sessions must be an object of 1 to {att.MAX_BIND} "
                                    f"{{sid: proof or null}}, not {describe(sessions)}")
        for sid, proof in sessions.items():
            if not 0 < len(sid) <= MAX_NAME or not (proof is None or isinstance(proof, str) and
                                                    len(proof) <= att.MAX_TOKEN):
                raise BadRequest(reason=f"bind_sessions: {shown(sid)}: a session id of 1 to {MAX_NAME} "
                                        f"characters and a proof (a hex string) or null")
        now = time.time()
        challenges = self.pool.bind_challenges
        if any(proof is not None for proof in sessions.values()) and not challenges.valid(caller, challenge, now):
            raise Forbidden(who=f"host {caller}", what=f"bind sessions under challenge {shown(challenge)}: the "
                                                       f"pool did not issue it to this host, or it expired "
                                                       f"(ask bind_challenge again)")
        bound, prove, refused = [], [], {}
        for sid, proof in sessions.items():
            session = self.pool.sessions.get(sid)
            if session is None or not session.live:
                refused[sid] = _brief(NoSuchRecord(record=f"session {sid}"))
            elif self._attested_here(session, caller, domain_uuid):
                bound.append(sid)             # (nothing to change: a proof or none)
            elif proof is None:
                prove.append(sid)
            elif challenges.used(caller, challenge, sid) or not att.check_bind_proof(
                    session.secret, proof, challenge=challenge, instance=self.pool.instance, host=caller,
                    domain=domain_uuid, sid=sid):
                refused[sid] = _brief(Forbidden(who=f"host {caller}", what=(
                    f"bind session {sid} to domain {domain_uuid}: its proof does not verify (not made with "
                    f"the session's secret for this challenge, host and domain, or used already)")))
            else:
                try:
                    self._bind(caller, session, domain_uuid, now)
                except AccelmigError as exc:
                    refused[sid] = _brief(exc)
                    continue
                challenges.use(caller, challenge, sid)
                bound.append(sid)
        if refused:
            LOG.warning("host %s: %d of %d session(s) not bound to domain %s (%s)", caller, len(refused),
                        len(sessions), domain_uuid, next(iter(refused.values()))["message"][:200],
                        extra={"host": caller, "domain": domain_uuid})
        return {"domain_uuid": domain_uuid, "bound": bound, "prove": prove, "refused": refused}

    def _bind(self, caller, session, domain_uuid, now: float) -> None:
        """``session`` (whose proof verified) in ``domain_uuid`` on ``caller``."""
        sid = session.sid
        if session.bound_host not in (None, caller):
            self._check_arrival(caller, session, domain_uuid)
        if session.domain_uuid not in (None, domain_uuid):
            raise Conflict(reason=f"session {sid} belongs to domain {session.domain_uuid}")
        incoming = any(r.domain_uuid == domain_uuid and r.dest_host == caller
                       for r in self.pool.open_records())
        session.domain_uuid = domain_uuid
        if session.bound_host is None:
            session.bound_host = caller
        if not incoming:
            self.pool.domain_hosts.setdefault(domain_uuid, caller)
        # a session opened while its domain migrates joins the migration
        for record in self.pool.open_records():
            if record.domain_uuid == domain_uuid:
                self.pool.hold_if_paused(record, [session], now)

    def do_unbind_session(self, caller, sid, domain_uuid):
        """The guest of ``domain_uuid`` says the session closed: it leaves
        that domain (and no other: a guest names whatever ids it likes)."""
        session = self.pool.sessions.get(sid)
        if session is not None:
            if session.bound_host not in (None, caller):
                raise Forbidden(who=f"host {caller}", what=f"unbind session {sid}: it is bound "
                                                           f"to host {session.bound_host}")
            if session.domain_uuid not in (None, domain_uuid):
                raise Forbidden(who=f"host {caller}", what=f"unbind session {sid} from domain {domain_uuid}: "
                                                           f"it is not in that domain")
            session.domain_uuid = None
        return {"sid": sid}

    def do_register_token(self, caller, domain_uuid, digest):
        """The domain's host says which migration token (its SHA-256) the
        running domain carries (``wire.attestation``).  ``state``: ``fresh``
        (it vouches for the next destination), ``in_use`` (a migration opened
        with it; only that destination may open again with it), ``spent``
        (write a new one).  Where no session of the domain is bound here
        (a node of a pool that holds none of them) nothing is registered."""
        att.check_hex(digest, "register_token: digest")
        home = self._domain_host(domain_uuid)
        if home is None:
            return {"domain_uuid": domain_uuid, "registered": False, "state": None}
        if home != caller:
            raise Forbidden(who=f"host {caller}", what=f"register the migration token of domain {domain_uuid}: "
                                                       f"it runs on host {home}")
        state = self.pool.domain_tokens.register(domain_uuid, digest, caller, self.pool.records)
        return {"domain_uuid": domain_uuid, "registered": True, "state": state}

    # -- migrations --------------------------------------------------------------------
    def do_register_intent(self, caller, domain_uuid, policy="none", dest_host=None,
                           migration_id=None, source_host=None):
        PausePolicy.parse(policy)
        if dest_host is not None and dest_host not in self.pool.hosts:
            raise NoSuchHost(host=dest_host)
        # The domain's host vouches for where it goes: nobody else names it.
        home = self._domain_host(domain_uuid)
        if caller != wc.ADMIN_HOST and home not in (None, caller):
            raise Forbidden(who=f"host {caller}", what=f"register an intent for domain {domain_uuid}: "
                                                       f"it runs on host {home}")
        now = time.time()
        for uuid, old in list(self.pool.intents.items()):      # bounded memory
            if now - old["registered"] > INTENT_TTL:
                del self.pool.intents[uuid]
        intent = {"domain_uuid": domain_uuid, "policy": policy, "dest_host": dest_host,
                  "migration_id": migration_id or secrets.token_hex(6),
                  "source_host": source_host or (caller if caller != wc.ADMIN_HOST else None),
                  "registered": now, "by": caller}
        self.pool.intents[domain_uuid] = intent
        return intent

    def do_open_migration(self, caller, domain_uuid, migration_id=None, domain_name=None,
                          policy=None, postcopy=False, token=None):
        """The caller, a migration's destination, opens its record.  It is
        vouched for when ``token`` is the migration token the domain's host
        wrote into the domain (its XML reached this destination with the
        migration) or a fresh intent of the domain's host names the caller;
        else anyone may open it, and it takes nothing (``open_record``)
        until its source vouches for it at switchover.  Once a destination
        was named or vouched for, nobody else may open the domain's
        migration, nor supersede the one under way."""
        if policy is not None:
            PausePolicy.parse(policy)
        digest = att.token_digest(att.check_hex(token, "open_migration: token")) if token is not None else None
        named = self._named_destinations(domain_uuid, time.time())
        home = self._domain_host(domain_uuid)
        if named and caller not in named and caller != home:
            raise Forbidden(who=f"host {caller}", what=(
                f"open a migration of domain {domain_uuid}: it goes to host {', '.join(sorted(named))}"
                f" (named by {'its host ' + home if home else 'the admin socket'})"))
        tokens = self.pool.domain_tokens
        by_token = tokens.vouches(domain_uuid, digest, caller, self.pool.records)
        if token is not None and not by_token:
            LOG.warning("host %s opens a migration of domain %s with a token that is not the domain's "
                        "(or vouched for another destination already): not vouched for", caller, domain_uuid,
                        extra={"host": caller, "domain": domain_uuid})
        record = self.pool.open_record(caller, domain_uuid, migration_id, domain_name, policy, postcopy,
                                       vouched=by_token or caller in named)
        if by_token:
            tokens.spend(domain_uuid, record.key)
        return record.describe()

    def do_switchover(self, caller, domain_uuid, migration_id=None, postcopy=False):
        """The source paused the guest for the last copy (its job really is
        an outgoing migration): the record vouched for, else the only one
        under way, whose destination the source's word then vouches for
        (``_source_vouches``).  With ``postcopy`` the source handed the guest
        over for good (libvirt's SUSPENDED_POSTCOPY on the source): the
        record is committed, whatever the destination's own event says
        (libvirt may report RESUMED_MIGRATED there for a post-copy migration)."""
        states = set(ABORTABLE)
        if postcopy:
            states |= {RecordStateName.COMMITTED, RecordStateName.COMPLETED}
        record = self._switchover_target(caller, domain_uuid, migration_id, states)
        self._require_source(record, caller, "switch over")
        now = time.time()
        if self._source_vouches(record, caller):
            LOG.info("record %s: its source %s vouches for %s", record.key, caller, record.dest_host,
                     extra={"domain": record.domain_uuid, "migration": record.migration_id})
            self.pool.vouch_record(record, now)
        if record.state in ABORTABLE:
            self.pool.switchover_record(record, caller)
        if postcopy:
            record.postcopy = True
            record.commit(now)
        return record.describe()

    def do_commit(self, caller, domain_uuid, migration_id=None):
        record = self.pool.find_record(domain_uuid, migration_id, dest=caller, states=IN_FLIGHT)
        self._require_dest(record, caller, "commit")
        self._require_vouched(record, caller, "commit")
        record.commit(time.time())
        return record.describe()

    def do_complete(self, caller, domain_uuid, migration_id=None, cursor=None, limit=None):
        """Freeze the domain's sessions and mint their tickets (the first
        call), and hand back a page of the live tickets of the sessions
        still moving: ``next`` for the following page (``cursor``, bound to
        this record and this host).  Every page of every repeat hands back
        the same live tickets."""
        limit = page_limit("complete", limit)
        if cursor is not None:
            # a next page: the record the cursor was made for, as it is now
            record = self.pool.find_record(domain_uuid, migration_id)
            start = self.pool.pager.position("complete", record.key, caller, cursor)
            if record.state not in (RecordStateName.COMPLETED, RecordStateName.CLOSED):
                raise RecordState(record=record.key, state=record.state.value, action="page its tickets")
        else:
            record = self.pool.find_record(domain_uuid, migration_id, dest=caller,
                                           states=IN_FLIGHT | {RecordStateName.COMPLETED})
            self._require_dest(record, caller, "complete")
            if record.state is not RecordStateName.COMPLETED:
                self._require_vouched(record, caller, "complete")
                self.pool.complete_record(record)
            start = 0
        items = ((index, (sid, ticket)) for index, sid, ticket in self.pool.record_tickets(record, start))
        page, following = take(items, limit, size=lambda item: len(item[0]) + len(item[1]) + 6)
        return {"record": record.describe(), "tickets": dict(page),
                "next": None if following is None else
                self.pool.pager.cursor("complete", record.key, caller, following),
                # the pool's clock, for the caller's offset estimate (the timeline)
                "now": time.time()}

    def do_note_timeline(self, caller, domain_uuid, migration_id, steps=None):
        """A record's party adds the steps it saw to the record's timeline,
        already on the pool's clock (``wire.records``: its side's steps, and
        for the destination its guest's claims).  Bounded: known steps only,
        each one a small object.  The steps taken."""
        record = self.pool.find_record(domain_uuid, migration_id)
        if caller == record.dest_host:
            side = Side.DEST
        elif caller == self._source_of(record):
            side = Side.SOURCE
        else:
            raise Forbidden(who=f"host {caller}", what=f"note the timeline of {record.key}: "
                                                       "it takes no part in it")
        if not isinstance(steps, dict) or len(steps) > len(STEP_NAMES):
            raise BadRequest(reason=f"note_timeline: steps must be an object of at most "
                                    f"{len(STEP_NAMES)} steps, not {describe(steps)}")
        try:
            timeline = Timeline.from_wire(steps)
        except ProtocolError as exc:
            raise BadRequest(reason=f"note_timeline: {exc.kwargs.get('reason', exc.message)}") from None
        taken = record.note_steps(side, timeline.steps, time.time())
        LOG.info("record %s: %s noted %s", record.key, caller, ", ".join(taken) or "nothing new",
                 extra={"domain": record.domain_uuid, "migration": record.migration_id})
        return {"taken": taken}

    def do_close(self, caller, domain_uuid, migration_id=None):
        record = self.pool.find_record(domain_uuid, migration_id, source=caller, states=
                                       IN_FLIGHT | {RecordStateName.COMPLETED})
        self._require_source(record, caller, "close")
        record.close(time.time())
        return record.describe()

    def do_abort(self, caller, domain_uuid, migration_id=None, reason="aborted by a host"):
        record = self.pool.find_record(domain_uuid, migration_id,
                                       states=ABORTABLE if migration_id is None else None)
        if caller != wc.ADMIN_HOST and caller not in (self._source_of(record), record.dest_host):
            raise Forbidden(who=f"host {caller}", what=f"abort {record.key}: it takes no part in it")
        self.pool.abort_record(record, f"{reason} (by {caller})")
        return record.describe()

    def do_renew(self, caller, records=()):
        if not isinstance(records, (list, tuple)):
            raise BadRequest(reason="renew: records are [domain_uuid, migration_id] pairs")
        now = time.time()
        renewed, unknown = [], []
        for item in records:
            if not isinstance(item, (list, tuple)) or len(item) != 2 or \
                    not all(isinstance(part, str) for part in item):
                raise BadRequest(reason="renew: records are [domain_uuid, migration_id] pairs")
            record = self.pool.records.get(f"{item[0]}/{item[1]}")
            if record is None or caller not in (record.source_host, record.dest_host):
                unknown.append(list(item))
                continue
            record.renew(now)
            renewed.append(record.describe())
        return {"renewed": renewed, "unknown": unknown}

    # -- saved domains -----------------------------------------------------------------
    def _require_domain_host(self, caller, domain_uuid, sessions, action: str) -> None:
        """Only the host a domain's sessions are bound to (or the admin
        socket) acts on its saved state."""
        others = sorted({s.bound_host for s in sessions} - {None, caller})
        if others and caller != wc.ADMIN_HOST:
            raise Forbidden(who=f"host {caller}", what=f"{action} domain {domain_uuid}: its sessions "
                                                       f"are bound to {', '.join(others)}")

    def do_park(self, caller, domain_uuid, retention=None):
        now = time.time()
        retention = self._retention(retention)
        sessions = self.pool.domain_sessions(domain_uuid)
        self._require_domain_host(caller, domain_uuid, sessions, "park")
        parked = []
        for session in sessions:
            session.park(now, retention)
            parked.append(session.sid)
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

    def do_unpark(self, caller, domain_uuid):
        now = time.time()
        # A restore elsewhere resumes nothing without a ticket (WRONG_HOST)
        # anyway; unparking early would only cut the retention short.
        sessions = self.pool.domain_sessions(domain_uuid)
        self._require_domain_host(caller, domain_uuid, sessions, "unpark")
        unparked = []
        for session in sessions:
            session.unpark(now, self.pool.config.grace)
            unparked.append(session.sid)
        return _listed("unparked", unparked)

    def _visible(self, session, caller) -> bool:
        """A host sees the sessions bound to it and those moving to it with a
        ticket; the admin socket sees every one."""
        if caller == wc.ADMIN_HOST:
            return True
        if session.pending_move is not None:
            moving = self.pool.records.get("/".join(session.pending_move))
            if moving is not None and moving.dest_host == caller:
                return True
        return session.bound_host == caller

    def do_list_sessions(self, caller, domain_uuid=None, cursor=None, limit=None):
        """A page of the pool's sessions (a domain's), in the order they
        opened: for a host, only its own (``_visible``) and, of a domain,
        those its migrations from here moved; of a domain, also how many of
        its sessions are bound elsewhere (``elsewhere``: a host finding a
        domain here that arrived while its hostd was away)."""
        limit = page_limit("list_sessions", limit)
        scope = "*" if domain_uuid is None else f"domain {domain_uuid}"
        start = self.pool.pager.position("list_sessions", scope, caller, cursor)
        chosen = [s for s in list(self.pool.sessions.values())
                  if s.serial >= start and (domain_uuid is None or s.domain_uuid == domain_uuid)]
        # (the source of a domain's migration still reads what it moved: ``accelmig migrate``
        # counts what its sessions sent meanwhile)
        moved = {sid for r in list(self.pool.records.values()) if r.domain_uuid == domain_uuid
                 and r.source_host == caller for sid in r.sessions} if domain_uuid is not None else set()
        items = ((s.serial, s.describe()) for s in chosen if self._visible(s, caller) or s.sid in moved)
        page, following = take(items, limit)
        out = {"instance": self.pool.instance, "sessions": page,
               "next": None if following is None else
               self.pool.pager.cursor("list_sessions", scope, caller, following)}
        if domain_uuid is not None and cursor is None:
            out["elsewhere"] = sum(1 for s in chosen if not self._visible(s, caller))
        return out

    def do_list_records(self, caller, open_only=False, domain_uuid=None, cursor=None, limit=None):
        """A page of the records (each one bounded: ``RecordView``), newest
        first: a caller after the latest (most are) finds it on the first
        page, even one that does not follow pages.  A host lists only the
        records it takes part in."""
        limit = page_limit("list_records", limit)
        scope = f"{bool(open_only)} {domain_uuid}"
        start = self.pool.pager.position("list_records", scope, caller, cursor)
        records = self.pool.open_records() if open_only else list(self.pool.records.values())
        mine = caller == wc.ADMIN_HOST or None
        # (a position grows as serials fall: the next page starts one past the last given)
        items = ((_NEWEST - r.serial, r.describe()) for r in sorted(records, key=lambda r: -r.serial)
                 if _NEWEST - r.serial >= start and (domain_uuid is None or r.domain_uuid == domain_uuid)
                 and (mine or self._is_party(r, caller)))
        page, following = take(items, limit)
        return {"records": page, "next": None if following is None else
                self.pool.pager.cursor("list_records", scope, caller, following)}

    def _require_party(self, record, caller, action: str) -> None:
        if caller != wc.ADMIN_HOST and not self._is_party(record, caller):
            raise Forbidden(who=f"host {caller}", what=f"{action} {record.key}: it takes no part in it")

    def do_record_sessions(self, caller, domain_uuid, migration_id, cursor=None, limit=None):
        """A page of a record's frozen sessions and their blackouts (None:
        not resumed yet): what a record view lists inline only while short.
        For its parties (and the admin socket) only."""
        limit = page_limit("record_sessions", limit)
        record = self.pool.find_record(domain_uuid, migration_id)
        self._require_party(record, caller, "list the sessions of")
        start = self.pool.pager.position("record_sessions", record.key, caller, cursor)
        items = ((index, {"sid": sid, "blackout": record.resumed.get(sid)})
                 for index, sid in enumerate(record.sessions) if index >= start)
        page, following = take(items, limit)
        return {"record": record.key, "session_count": len(record.sessions), "sessions": page,
                "next": None if following is None else
                self.pool.pager.cursor("record_sessions", record.key, caller, following)}

    async def wait_record(self, caller, domain_uuid, migration_id=None, until="rehomed", timeout=60.0):
        """The record once it is rehomed (``until="rehomed"``: completed or
        closed, with every session resumed; or aborted), rehomed with the
        destination's steps in its timeline (``until="timeline"``: its hostd
        noted them after the agent answered) or final (``until="final"``),
        or as it is after ``timeout`` seconds; for a party of the record (or
        the admin socket) only."""
        if until not in ("rehomed", "timeline", "final"):
            raise BadRequest(reason=f"wait_record: until {until!r} (rehomed, timeline or final)")
        if not is_number(timeout, 0, 600):
            raise BadRequest(reason="wait_record: timeout must be 0 to 600 seconds")

        def reached(record) -> bool:
            if until == "final":
                return record.final
            if until == "timeline" and record.state is not RecordStateName.ABORTED:
                return record.rehomed and "answered" in record.stamps
            # closed is not the end of a rehome: the source closes its side
            # as soon as QEMU is gone, the guest's sessions resume after that
            return record.state is RecordStateName.ABORTED or record.rehomed

        record = await self.pool.wait_record(domain_uuid, migration_id, reached, float(timeout))
        if record is None:
            return {"record": None, "reached": False}
        self._require_party(record, caller, "wait for")
        return {"record": record.describe(), "reached": reached(record)}

    def do_accel_domains(self, caller, since=None, cursor=None, limit=None):
        """Which domains hold sessions, marked or not (hosts cache it so their
        hook can be strict for a Nova instance while hostd is down), each
        with how many of its sessions wait to be attested (the host running
        it then asks its guest to prove them) — never the sessions' ids: a
        host learns those from its own guests.  ``since``: the version the
        caller has; an unchanged set answers in a few bytes, however many
        sessions there are.  Paged by domain: each page says the version as
        it is now, and a caller keeps the first page's (whatever changed
        while it paged shows as a new version at its next look)."""
        limit = page_limit("accel_domains", limit)
        domains = self.pool.accel_domains()
        version = hashlib.sha256(wc.canonical(domains)).hexdigest()[:32]
        if cursor is None and since == version:
            return {"version": version, "unchanged": True}
        start = self.pool.pager.position("accel_domains", "*", caller, cursor)
        items = ((index, (domain, domains[domain])) for index, domain in enumerate(sorted(domains))
                 if index >= start)
        page, following = take(items, limit, size=lambda item: len(item[0]) + 12)
        return {"version": version, "domains": dict(page), "next": None if following is None else
                self.pool.pager.cursor("accel_domains", "*", caller, following)}

    def do_list_hosts(self, caller):
        return {"hosts": [h.describe() for h in self.pool.hosts.values()]}

    def do_list_devices(self, caller):
        """The node's devices with what is in use (at most MAX_DEVICES of them)."""
        return {"instance": self.pool.instance, "devices": self.pool.devices.describe()}

    def do_list_nodes(self, caller):
        """A node alone (no etcd): no cluster; hostd talks to this node only.
        (A node of a cluster answers from etcd: ``_clustered``.)"""
        return {"cluster": False, "node": None, "instance": self.pool.instance, "nodes": []}

    def do_metrics(self, caller):
        return {"text": self.pool.metrics.text()}


def _answered_below() -> None:
    """A host's connection whose deadline passed: ``_serve``'s wait for its
    hello ends at the same moment and says so to the host."""


#: what a node of a cluster takes through etcd first (``_clustered``)
CLUSTERED = frozenset({"open_migration", "switchover", "commit", "complete", "close", "abort", "list_nodes"})


def _cluster_view(stored) -> dict:
    """What a step's answer says of etcd's record: its state, the nodes
    that take part and those lost (their sessions are gone with them)."""
    return {"state": stored.state.value, "nodes": dict(stored.nodes), "lost": list(stored.lost)}


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
