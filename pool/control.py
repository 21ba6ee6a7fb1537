"""The pool's control plane: authenticated hosts (and the local admin socket).

Transport and signatures are in ``accelmig.wire.control``; this module checks
them and carries out each method on the pool.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time

from accelmig.pool.config import parse_networks
from accelmig.wire.records import IN_FLIGHT, PausePolicy, RecordStateName
from accelmig.wire import control as wc
from accelmig.wire.errors import (AccelmigError, AuthFailed, BadRequest, Conflict, FrameError,
                                  Forbidden, InternalError, NoSuchHost, NoSuchRecord, ProtocolError, UnknownOp,
                                  VersionUnsupported)
from accelmig.wire.frames import encode_frame

LOG = logging.getLogger(__name__)

#: Bounds of a saved domain's retention (``park``), in seconds.
MIN_RETENTION = 1.0
MAX_RETENTION = 30 * 86400.0

ADMIN_METHODS = {"list_sessions", "list_records", "list_hosts", "metrics", "ping", "abort",
                 "park", "unpark", "register_intent", "wait_record"}


class ControlServer:
    def __init__(self, pool):
        self.pool = pool
        self._tasks: set[asyncio.Task] = set()

    async def handle_host(self, reader, writer) -> None:
        await self._tracked(self._serve(reader, writer, admin=False))

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
                     admin: bool) -> None:
        peer = writer.get_extra_info("peername") or "admin-socket"
        challenge = secrets.token_hex(16)
        host = None
        last_id = 0
        waits: set[asyncio.Task] = set()
        try:
            try:
                header = await asyncio.wait_for(wc.read_frame_async(reader, wc.HELLO_LIMITS),
                                                self.pool.config.handshake_timeout)
            except asyncio.TimeoutError:
                raise ProtocolError(reason=f"no hello within "
                                           f"{self.pool.config.handshake_timeout:g} s") from None
            if header.get("op") != "hello":
                raise ProtocolError(reason="expected hello")
            offered = header.get("versions") or []
            if not set(offered) & set(wc.CONTROL_VERSIONS):
                raise VersionUnsupported(offered=offered, supported=list(wc.CONTROL_VERSIONS))
            name = header.get("host")
            if admin:
                host = None
            else:
                host = self.pool.hosts.get(name) if isinstance(name, str) else None
                if host is None:
                    raise AuthFailed(reason=f"no secret for host {name!r} (add it to the pool's hosts file)")
            writer.write(encode_frame({"op": "welcome", "version": 1, "challenge": challenge,
                                       "instance": self.pool.instance}))
            while True:
                try:
                    header = await wc.read_frame_async(reader, wc.CALL_LIMITS)
                except asyncio.IncompleteReadError:
                    return
                call_id = header.get("id")
                method = header.get("method")
                args = header.get("args") if isinstance(header.get("args"), dict) else {}
                if header.get("op") != "call" or not isinstance(call_id, int) or call_id <= last_id:
                    raise ProtocolError(reason="calls need op 'call' and strictly increasing ids")
                last_id = call_id
                if host is not None:
                    if self.pool.hosts.get(host.name) is not host:      # a reload (SIGHUP) removed it
                        raise AuthFailed(reason=f"host {host.name} is no longer in the pool's hosts file")
                    expected = wc.request_mac(host.secret, challenge, call_id, str(method), args)
                    if not hmac.compare_digest(expected, str(header.get("mac", ""))):
                        raise AuthFailed(reason=f"request MAC from host {host.name} does not verify")
                    host.last_seen = time.time()
                if method in wc.WAITING_METHODS:
                    # A long wait must not hold up this connection's other calls:
                    # answered when it is over (clients match answers by id).
                    waits.add(asyncio.ensure_future(self._answer_later(
                        writer, host, admin, challenge, call_id, method, args)))
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
            writer.close()

    @staticmethod
    def _answer(writer, host, challenge: str, call_id: int, body: dict) -> None:
        out = {"op": "result", "id": call_id, **body}
        if host is not None:
            out["mac"] = wc.result_mac(host.secret, challenge, call_id, wc.result_body(out))
        writer.write(encode_frame(out))

    async def _answer_later(self, writer, host, admin, challenge, call_id, method, args) -> None:
        try:
            self._check_caller(host, admin, method)
            result = await getattr(self, f"wait_{method.removeprefix('wait_')}")(**args)
            body = {"ok": True, "result": result}
        except TypeError as exc:
            body = {"ok": False, "error": BadRequest(reason=f"{method}: {exc}").to_wire()}
        except AccelmigError as exc:
            body = {"ok": False, "error": exc.to_wire()}
        if not writer.is_closing():
            self._answer(writer, host, challenge, call_id, body)

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

    def do_bind_session(self, caller, sid, domain_uuid, domain_name=None):
        session = self._session(sid)
        # The destination of an in-flight migration of this domain may attest
        # too (a VM without the accelmig channel reports its sessions through
        # guest-exec only there).  Binding moves nothing: a ticket still needs
        # the session's own secret.
        incoming = any(r.domain_uuid == domain_uuid and r.dest_host == caller
                       for r in self.pool.open_records())
        if session.bound_host not in (None, caller) and session.pending_move is None and not incoming:
            raise Conflict(reason=f"session {sid} is bound to host {session.bound_host}, "
                                  f"not {caller}")
        if session.domain_uuid not in (None, domain_uuid):
            raise Conflict(reason=f"session {sid} belongs to domain {session.domain_uuid}")
        session.domain_uuid = domain_uuid
        if session.bound_host is None:
            session.bound_host = caller
        if not incoming:
            self.pool.domain_hosts.setdefault(domain_uuid, caller)
        # a session opened while its domain migrates joins the migration
        now = time.time()
        for record in self.pool.open_records():
            if record.domain_uuid == domain_uuid:
                self.pool.hold_if_paused(record, [session], now)
        return {"sid": sid, "domain_uuid": domain_uuid, "bound_host": session.bound_host}

    def do_unbind_session(self, caller, sid):
        session = self.pool.sessions.get(sid)
        if session is not None:
            if session.bound_host not in (None, caller):
                raise Forbidden(who=f"host {caller}", what=f"unbind session {sid}: it is bound "
                                                           f"to host {session.bound_host}")
            session.domain_uuid = None
        return {"sid": sid}

    def do_register_intent(self, caller, domain_uuid, policy="none", dest_host=None,
                           migration_id=None, source_host=None):
        PausePolicy.parse(policy)
        if dest_host is not None and dest_host not in self.pool.hosts:
            raise NoSuchHost(host=dest_host)
        intent = {"domain_uuid": domain_uuid, "policy": policy, "dest_host": dest_host,
                  "migration_id": migration_id or secrets.token_hex(6),
                  "source_host": source_host or (caller if caller != wc.ADMIN_HOST else None),
                  "registered": time.time()}
        self.pool.intents[domain_uuid] = intent
        return intent

    def do_open_migration(self, caller, domain_uuid, migration_id=None, domain_name=None,
                          policy=None, postcopy=False):
        if policy is not None:
            PausePolicy.parse(policy)
        record = self.pool.open_record(caller, domain_uuid, migration_id, domain_name, policy,
                                       bool(postcopy))
        return record.describe()

    def do_switchover(self, caller, domain_uuid, migration_id=None, postcopy=False):
        """The source paused the guest for the last copy.  With ``postcopy``
        the source handed the guest over for good (libvirt's
        SUSPENDED_POSTCOPY on the source): the record is committed, whatever
        the destination's own event says (libvirt may report RESUMED_MIGRATED
        there for a post-copy migration)."""
        states = {RecordStateName.OPEN, RecordStateName.SWITCHED_OVER}
        if postcopy:
            states |= {RecordStateName.COMMITTED, RecordStateName.COMPLETED}
        record = self.pool.find_record(domain_uuid, migration_id, states=states)
        if record.dest_host == caller:
            raise Conflict(reason=f"host {caller} is the destination of {record.key}")
        if record.source_host not in (None, caller):
            raise Conflict(reason=f"{record.key} comes from {record.source_host}, not {caller}")
        if record.state in (RecordStateName.OPEN, RecordStateName.SWITCHED_OVER):
            self.pool.switchover_record(record, caller)
        if postcopy:
            record.postcopy = True
            record.commit(time.time())
        return record.describe()

    def do_commit(self, caller, domain_uuid, migration_id=None):
        record = self.pool.find_record(domain_uuid, migration_id, dest=caller, states=IN_FLIGHT)
        self._require_dest(record, caller)
        record.commit(time.time())
        return record.describe()

    def do_complete(self, caller, domain_uuid, migration_id=None):
        record = self.pool.find_record(domain_uuid, migration_id, dest=caller,
                                       states=IN_FLIGHT | {RecordStateName.COMPLETED})
        self._require_dest(record, caller)
        tickets = self.pool.complete_record(record)
        return {"record": record.describe(), "tickets": tickets}

    def do_close(self, caller, domain_uuid, migration_id=None):
        record = self.pool.find_record(domain_uuid, migration_id, source=caller, states={
            RecordStateName.OPEN, RecordStateName.SWITCHED_OVER, RecordStateName.COMMITTED,
            RecordStateName.COMPLETED})
        if record.source_host not in (None, caller):
            raise Conflict(reason=f"{record.key} comes from {record.source_host}, not {caller}")
        record.close(time.time())
        return record.describe()

    def do_abort(self, caller, domain_uuid, migration_id=None, reason="aborted by a host"):
        record = self.pool.find_record(domain_uuid, migration_id, states={
            RecordStateName.OPEN, RecordStateName.SWITCHED_OVER} if migration_id is None else None)
        if caller != wc.ADMIN_HOST and caller not in (record.source_host, record.dest_host):
            raise Conflict(reason=f"host {caller} takes no part in {record.key}")
        self.pool.abort_record(record, f"{reason} (by {caller})")
        return record.describe()

    def do_renew(self, caller, records=()):
        now = time.time()
        renewed, unknown = [], []
        for item in records:
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise BadRequest(reason="renew: records are [domain_uuid, migration_id] pairs")
            record = self.pool.records.get(f"{item[0]}/{item[1]}")
            if record is None or caller not in (record.source_host, record.dest_host):
                unknown.append(list(item))
                continue
            record.renew(now)
            renewed.append(record.describe())
        return {"renewed": renewed, "unknown": unknown}

    def do_park(self, caller, domain_uuid, retention=None):
        now = time.time()
        retention = self._retention(retention)
        sessions = self.pool.domain_sessions(domain_uuid)
        others = sorted({s.bound_host for s in sessions} - {None, caller})
        if others and caller != wc.ADMIN_HOST:
            raise Forbidden(who=f"host {caller}", what=f"park domain {domain_uuid}: its sessions "
                                                       f"are bound to {', '.join(others)}")
        parked = []
        for session in sessions:
            session.park(now, retention)
            parked.append(session.sid)
        LOG.info("domain %s saved: %d session(s) parked for %.0f s", domain_uuid, len(parked),
                 retention, extra={"domain": domain_uuid})
        return {"parked": parked, "retention": retention}

    def _retention(self, value) -> float:
        """A saved domain's retention: finite, from 1 s to 30 days (the
        pool's own default if none is given)."""
        if value is None:
            return float(self.pool.config.park_retention)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not MIN_RETENTION <= value <= MAX_RETENTION:
            raise BadRequest(reason=f"retention must be seconds from {MIN_RETENTION:g} to "
                                    f"{MAX_RETENTION:g}, not {value!r}")
        return float(value)

    def do_unpark(self, caller, domain_uuid):
        now = time.time()
        # Any host may: a saved image may be restored on another host than
        # the one that saved it (the sessions' secrets still decide).
        sessions = self.pool.domain_sessions(domain_uuid)
        unparked = []
        for session in sessions:
            session.unpark(now, self.pool.config.grace)
            unparked.append(session.sid)
        return {"unparked": unparked}

    def do_list_sessions(self, caller, domain_uuid=None):
        return {"instance": self.pool.instance, "sessions": self.pool.describe_sessions(domain_uuid)}

    def do_list_records(self, caller, open_only=False, domain_uuid=None):
        records = self.pool.open_records() if open_only else list(self.pool.records.values())
        return {"records": [r.describe() for r in records
                            if domain_uuid is None or r.domain_uuid == domain_uuid]}

    async def wait_record(self, domain_uuid, migration_id=None, until="rehomed", timeout=60.0):
        """The record once it is rehomed (``until="rehomed"``: completed or
        closed, with every session resumed; or aborted) or final
        (``until="final"``), or as it is after ``timeout`` seconds."""
        if until not in ("rehomed", "final"):
            raise BadRequest(reason=f"wait_record: until {until!r} (rehomed or final)")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 <= timeout <= 600:
            raise BadRequest(reason="wait_record: timeout must be 0 to 600 seconds")

        def reached(record) -> bool:
            if until == "final":
                return record.final
            # closed is not the end of a rehome: the source closes its side
            # as soon as QEMU is gone, the guest's sessions resume after that
            return record.state is RecordStateName.ABORTED or (record.state in (
                RecordStateName.COMPLETED, RecordStateName.CLOSED) and set(record.sessions) <= set(record.resumed))

        record = await self.pool.wait_record(domain_uuid, migration_id, reached, float(timeout))
        if record is None:
            return {"record": None, "reached": False}
        return {"record": record.describe(), "reached": reached(record)}

    def do_list_hosts(self, caller):
        return {"hosts": [h.describe() for h in self.pool.hosts.values()]}

    def do_metrics(self, caller):
        return {"text": self.pool.metrics.text()}

    @staticmethod
    def _require_dest(record, caller):
        if record.dest_host != caller:
            raise Conflict(reason=f"{record.key} goes to {record.dest_host}, not {caller}")
