"""The pool's state: tenants, sessions and hosts, admission and reload, reply
delivery; every migration fact is its ``ledger``'s (``pool.ledger``).

One asyncio event loop owns all of it (``PoolServer`` runs that loop's
listeners), so every operation is atomic with respect to every other: a
resume, a control-plane call and a frame from a driver never interleave
half-way.  Device work runs on per-session worker threads and reports back
to the loop through ``post``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time

from accelmig.pool.buffers import PayloadBuffers
from accelmig.pool.config import HostSpec, PoolConfig, TenantSpec
from accelmig.pool.devices.inventory import DeviceSet
from accelmig.pool.hosts import HostState, HostTable
from accelmig.pool.ledger import MigrationLedger
from accelmig.pool.metrics import PoolMetrics
from accelmig.pool.sequencing import StoredReply
from accelmig.pool.session import Session, SessionState, Tenant
from accelmig.wire import dataplane as dp
from accelmig.wire.devices import parse_selector
from accelmig.wire.errors import (AccelmigError, AuthFailed, BadRequest, ErrorCode, LimitExceeded,
                                  SessionDiverged, SessionExpired, SessionLost, from_wire)
from accelmig.wire.values import is_int

LOG = logging.getLogger("accelmig.pool")


class Pool:
    def __init__(self, config: PoolConfig, devices, tenants: dict[str, TenantSpec],
                 hosts: dict[str, HostSpec] | None = None):
        """``devices``: the node's ``DeviceSet`` (or one backend: one device)."""
        self.config = config
        self.devices = devices if isinstance(devices, DeviceSet) else DeviceSet.of_backend(devices)
        # An instance id that changes with every start: a driver presenting a
        # session of another instance learns the pool restarted (SESSION_LOST).
        self.instance = secrets.token_hex(4)
        # The data-plane versions this pool agrees to at hello: every one the
        # code speaks; a harness narrows it to stand for an older pool.
        self.data_versions = dp.PROTOCOL_VERSIONS
        self.tenants = {t.token: Tenant(t.name, t.token, t.quota, t.max_sessions, t.quota_by_type)
                        for t in tenants.values()}
        self.hosts = HostTable.of(hosts or {})
        self.sessions: dict[str, Session] = {}
        self.tombstones: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.metrics = PoolMetrics()
        # every migration fact: records, tickets, intents, bindings, vouching
        self.ledger = MigrationLedger(config, self.sessions, self.metrics, hosts=lambda: self.hosts)
        for name in dict.fromkeys(state.wire for state in SessionState):
            # read whenever metrics are collected: never stale between sweeps
            self.metrics.sessions.labels(name).set_function(
                lambda name=name: sum(1 for s in list(self.sessions.values()) if s.state.wire == name))
        for device in self.devices:
            self.metrics.device_in_use.labels(device.id, device.type).set_function(
                lambda device=device: device.bytes_in_use)
            self.metrics.device_sessions.labels(device.id, device.type).set_function(
                lambda device=device: device.sessions)
        self.buffers = PayloadBuffers()
        self.connections: set = set()            # DataConnections, for a clean stop
        # Every connection of both planes, counted from accept
        # (pool.admission.Admission): set by the server that listens
        self.admission = None
        self.loop: asyncio.AbstractEventLoop | None = None   # set by the server that runs it
        self.placement = None       # pool.cluster.placement.Placement: set when this node joins a cluster
        self.quota_ledger = None    # pool.cluster.quotas.QuotaLedger: likewise (every Tenant holds it)
        self._counter = 0
        self.started = time.time()

    def live_session_count(self) -> int:
        """Sessions not released (attached, detached or parked): the node's
        load in a cluster.  Each device counts its own as they open and
        release, so this costs a sum over the devices, not a scan of every
        session (an open must not grow with the pool's population)."""
        return sum(device.sessions for device in self.devices)

    def post(self, fn) -> None:
        """From a worker thread: run ``fn`` on the loop."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn)
            except RuntimeError:  # loop closing
                pass

    def sweep(self, now: float) -> None:
        for session in list(self.sessions.values()):
            lost = session.context.lost()
            if lost is not None:
                # its device process is gone, and its device state with it:
                # ended now, not when its driver next calls (an idle one never would)
                self._end_killed(session, lost)
                continue
            if session.state in (SessionState.DETACHED, SessionState.PARKED) and \
                    session.deadline is not None and now >= session.deadline:
                kind = "parked retention" if session.state is SessionState.PARKED else "grace period"
                LOG.info("session %s expired after its %s", session.sid, kind,
                         extra={"sid": session.sid, "tenant": session.tenant.name})
                self._release(session, "expired")
        self.ledger.sweep(now)
        for device in self.devices:
            device.backend.trim_idle(self.config.upload_arena_keep)

    # -- hosts -----------------------------------------------------------------------
    def host_for_address(self, address: str) -> str | None:
        return self.hosts.for_address(address)

    # -- reload (SIGHUP) -----------------------------------------------------------
    def reload(self, tenants: dict[str, TenantSpec], hosts: dict[str, HostSpec]) -> dict:
        """Take a reloaded tenants file and hosts file, both already parsed
        and valid; no session is touched.

        - A tenant is known by its name: a kept tenant keeps its ``Tenant``
          (what its sessions hold, and their memory use) with the new token
          and quota.  A changed token opens sessions from now on; the old
          one no longer does.  A lowered quota refuses new allocations, never
          frees what is held.
        - A removed tenant opens no new session; its sessions keep running
          (and may resume: a resume proves the session's own secret, not the
          tenant's token) until they are released or expire.
        - A kept host keeps its ``HostState`` (registration, networks it
          registered) with the new secret and static networks; its open
          control connections verify their next call with the new secret.
        - A removed host's control connections are refused at their next
          call; sessions bound to it keep running.

        Returns what changed, by name, for the log."""
        out = {"tenants": {"added": [], "removed": [], "changed": []},
               "hosts": {"added": [], "removed": [], "changed": []}, "kept_sessions": {}}
        by_name = {t.name: t for t in self.tenants.values()}
        fresh: dict[str, Tenant] = {}
        for spec in tenants.values():
            tenant = by_name.pop(spec.name, None)
            if tenant is None:
                tenant = Tenant(spec.name, spec.token, spec.quota, spec.max_sessions, spec.quota_by_type)
                tenant.ledger = self.quota_ledger
                out["tenants"]["added"].append(spec.name)
            elif (tenant.token, tenant.quota, tenant.max_sessions, tenant.quota_by_type) != \
                    (spec.token, spec.quota, spec.max_sessions, spec.quota_by_type):
                tenant.token, tenant.quota, tenant.max_sessions = spec.token, spec.quota, spec.max_sessions
                tenant.quota_by_type = dict(spec.quota_by_type)
                out["tenants"]["changed"].append(spec.name)
            fresh[spec.token] = tenant
        for name in by_name:
            out["tenants"]["removed"].append(name)
            out["kept_sessions"][name] = sum(1 for s in self.sessions.values()
                                             if s.tenant.name == name and s.live)
        self.tenants = fresh
        kept = HostTable()
        for name, spec in hosts.items():
            host = self.hosts.get(name)
            if host is None:
                host = HostState(spec)
                out["hosts"]["added"].append(name)
            elif host.update(spec):
                out["hosts"]["changed"].append(name)
            kept[name] = host
        out["hosts"]["removed"] = sorted(set(self.hosts) - set(kept))
        self.hosts = kept
        return out

    # -- sessions ------------------------------------------------------------------
    def _new_sid(self) -> str:
        self._counter += 1
        return f"s-{self.instance}-{self._counter}-{secrets.token_hex(3)}"

    def open_session(self, conn, header: dict) -> Session:
        tenant = self.tenants.get(header.get("token")) if isinstance(header.get("token"), str) else None
        if tenant is None:
            raise AuthFailed(reason="unknown tenant token")
        secret_hex = header.get("secret")
        try:
            secret = bytes.fromhex(secret_hex)
        except (TypeError, ValueError):
            secret = b""
        if len(secret) < 16:
            raise BadRequest(reason="open: 'secret' must be 16+ random bytes in hex")
        claimed = dp.domain_claim(header.get("domain"))
        selector = parse_selector(header.get("device"))
        # Before anything is made: each session costs a worker thread and a
        # device context, whatever its quota.
        limit = tenant.max_sessions or self.config.max_sessions_per_tenant
        held = tenant.live_sessions
        if held >= limit:         # (the connection's close logs it, once)
            source = "its max_sessions" if tenant.max_sessions else "max_sessions_per_tenant"
            raise LimitExceeded(tenant=tenant.name, reason=(
                f"{held} live sessions (attached, detached or parked) already, the most it may "
                f"hold ({source} = {limit}); close or release one first"))
        # The device for the session's whole life (NO_SUCH_DEVICE names what exists).
        device = self.devices.place(selector)
        # its upload arena (made with the tenant's device process): never more than its quota
        context = device.backend.new_context(tenant.name, upload_arena=min(self.config.upload_arena,
                                                                           tenant.quota))
        session = Session(self._new_sid(), tenant, secret, context, self.post,
                          device=device, serial=self._counter, metrics=self.metrics, buffers=self.buffers,
                          max_reply_bytes=self.config.max_reply_bytes,
                          max_queued_bytes=self.config.max_reply_bytes,
                          max_objects=self.config.max_objects_per_session,
                          max_source_bytes=self.config.max_source_bytes)
        self.ledger.opened(session, conn.peer_host, claimed)
        session.attach(conn)
        session.on_reply = self._deliver
        session.on_ok_run = self._deliver_ok_run
        session.on_flow = self._flow
        self.sessions[session.sid] = session
        LOG.info("session %s opened by tenant %s from %s on device %s%s", session.sid, tenant.name,
                 conn.peer[0], device.id, "" if self.config.tls_cert else " (INSECURE plain TCP)",
                 extra={"sid": session.sid, "tenant": tenant.name, "host": conn.peer_host,
                        "device": device.id, "selector": str(selector) if selector else None,
                        "tls": bool(self.config.tls_cert)})
        return session

    def _lookup(self, sid) -> Session:
        session = self.sessions.get(sid) if isinstance(sid, str) else None
        if session is not None and session.live:
            return session
        if not isinstance(sid, str) or not sid.startswith(f"s-{self.instance}-"):
            raise SessionLost(sid=sid, instance=self.instance)
        raise SessionExpired(sid=sid, details={"reason": self.tombstones.get(sid, "unknown")})

    def resume_session(self, conn, header: dict,
                       now: float | None = None) -> tuple[Session, list[StoredReply]]:
        """All checks first; the session changes only when every one passed."""
        injected = now is not None
        now = time.time() if now is None else now
        sid = header.get("sid")
        try:
            session = self._lookup(sid)
            epoch = header.get("epoch")
            last_seen = header.get("last_seen")
            if not (is_int(epoch) and is_int(last_seen)):
                raise BadRequest(reason="resume: epoch and last_seen must be integers")
            if not dp.check_ownership_proof(session.secret, conn.challenge, sid, epoch,
                                            header.get("proof"), getattr(conn, "binding", b"")):
                raise AuthFailed(reason=f"resume of {sid}: the ownership proof does not verify")
            retry = session.is_resume_retry(epoch, last_seen)
            if epoch != session.epoch and not retry:
                raise SessionDiverged(sid=sid, reason=(
                    f"the resuming copy is at epoch {epoch}, the session at epoch {session.epoch}"),
                    details={"epoch": epoch, "current": session.epoch})
            # with a ticket it moves, without one it stays where it is bound (the ledger's word)
            claims = self.ledger.check_resume(session, header.get("ticket"), conn.peer_host, conn.peer[0],
                                              retry, now)
            next_seq = header.get("next_seq")
            if next_seq is not None and not is_int(next_seq):
                raise BadRequest(reason="resume: next_seq must be an integer")
            replay = session.log.check_resume(last_seen, next_seq)
        except Exception as exc:
            code = getattr(getattr(exc, "code", None), "value", "error")
            self.metrics.resumes.labels(code).inc()
            LOG.warning("resume of %s from %s refused: %s", sid, conn.peer[0], exc,
                        extra={"sid": sid, "host": conn.peer_host})
            raise
        # -- every check passed: take the session over ---------------------------
        old = session.connection
        session.epoch += 1
        if old is not None and old is not conn:
            old.fence(session.epoch)
        session.acknowledge(last_seen)
        session.attach(conn)
        session.note_resume(epoch, last_seen)
        session.counters.resumes += 1
        session.counters.replayed += len(replay)
        blackout = self.ledger.resumed(session, claims, conn.peer_host, now, injected)
        self.metrics.resumes.labels("ok").inc()
        tls_resumed = bool(getattr(conn, "tls_resumed", False))
        LOG.info("session %s resumed at epoch %d from %s (host %s), %d replies replayed, next seq %d%s",
                 sid, session.epoch, conn.peer[0], conn.peer_host, len(replay), session.log.next_seq,
                 ", TLS session resumed" if tls_resumed else
                 "" if self.config.tls_cert else " (INSECURE plain TCP)",
                 extra={"sid": sid, "epoch": session.epoch, "ticket": claims is not None,
                        "blackout_s": blackout, "tls_resumed": tls_resumed,
                        "tls": bool(self.config.tls_cert)})
        return session, replay

    def connection_lost(self, session: Session, conn, now: float | None = None) -> None:
        if not session.live:
            return
        now = time.time() if now is None else now
        session.detach(now, self.config.grace)
        LOG.info("session %s detached (%s); kept %.0f s", session.sid, session.state.value,
                 (session.deadline or 0) - now, extra={"sid": session.sid})

    def _first_reply_after_move(self, session: Session) -> None:
        """A migration's timeline: the first command completed after the
        resume (on every reply: an empty dict's check, nothing more)."""
        if self.ledger.first_replies:
            self.ledger.first_reply(session.sid)

    def _deliver_ok_run(self, session: Session, first: int, last: int) -> None:
        """Plain successes first..last (a launch run's): ``_deliver`` of each."""
        self._first_reply_after_move(session)
        conn = session.connection
        if conn is not None:
            conn.send_ok_run(first, last)

    def _deliver(self, session: Session, reply: StoredReply) -> None:
        self._first_reply_after_move(session)
        conn = session.connection
        if conn is not None:
            conn.send_reply(reply)
        if reply.header.get("op") == "reply" and reply.header.get("released"):
            self._release(session, "released by the driver")
        elif (reply.header.get("error") or {}).get("code") == ErrorCode.KILLED.value and session.live:
            self._end_killed(session, from_wire(reply.header["error"]))

    def _end_killed(self, session: Session, error: AccelmigError) -> None:
        """The tenant's device process is gone, and the session's device
        state with it: end the session (its driver fails, terminally)."""
        if not session.live:
            return
        LOG.warning("session %s ended: %s", session.sid, error.message,
                    extra={"sid": session.sid, "tenant": session.tenant.name})
        conn = session.connection
        self._release(session, f"killed: {error.message}")
        if conn is not None:
            conn.fail(error)

    def _flow(self, session: Session) -> None:
        if session.connection is not None:
            session.connection.flow_changed()

    def _release(self, session: Session, reason: str) -> None:
        session.release(reason)
        self.sessions.pop(session.sid, None)
        self.ledger.session_released(session, reason)
        self.tombstones[session.sid] = reason
        while len(self.tombstones) > 100000:
            self.tombstones.popitem(last=False)

    # -- saved domains (the ledger says which sessions) -----------------------------
    def park(self, sessions, retention: float) -> list[str]:
        now = time.time()
        for session in sessions:
            session.park(now, retention)
        return [s.sid for s in sessions]

    def unpark(self, sessions) -> list[str]:
        # A restore elsewhere resumes nothing without a ticket (WRONG_HOST)
        # anyway; unparking early would only cut the retention short.
        now = time.time()
        for session in sessions:
            session.unpark(now, self.config.grace)
        return [s.sid for s in sessions]
