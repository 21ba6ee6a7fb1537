"""The pool's state: tenants, sessions, hosts, migration records and tickets,
and every operation on them.

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
import uuid

from accelmig.pool.attestation import BindChallenges, DomainTokens
from accelmig.pool.buffers import PayloadBuffers
from accelmig.pool.config import HostSpec, PoolConfig, TenantSpec
from accelmig.pool.devices.inventory import DeviceSet
from accelmig.pool.hosts import HostState, host_for_address
from accelmig.pool.metrics import PoolMetrics
from accelmig.pool.migration import MigrationRecord, TicketAuthority
from accelmig.pool.paging import Pager
from accelmig.pool.sequencing import StoredReply
from accelmig.pool.session import Session, SessionState, Tenant
from accelmig.wire import dataplane as dp
from accelmig.wire.devices import parse_selector
from accelmig.wire.errors import (AccelmigError, AuthFailed, BadRequest, Conflict, ErrorCode, LimitExceeded,
                                  NoSuchRecord,
                                  SessionDiverged,
                                  SessionExpired, SessionLost, TicketRequired, WrongHost, from_wire)
from accelmig.wire.records import FINAL, PausePolicy, RecordStateName, pauses
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
        self.hosts = {name: HostState(spec) for name, spec in (hosts or {}).items()}
        self.sessions: dict[str, Session] = {}
        self.tombstones: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.records: dict[str, MigrationRecord] = {}
        self._open: dict[str, MigrationRecord] = {}   # the records not final yet (kept by record_changed)
        self._record_serial = 0
        self.pager = Pager()                           # cursors of the control plane's pages
        self.intents: dict[str, dict] = {}
        self.domain_hosts: dict[str, str] = {}
        # what hosts show before they bind a session or are vouched for as a
        # migration's destination (pool.attestation)
        self.bind_challenges = BindChallenges()
        self.domain_tokens = DomainTokens()
        self.tickets = TicketAuthority(config.ticket_ttl)
        self.session_tickets: dict[str, str] = {}     # sid -> live ticket nonce
        # sid -> the record whose timeline its next reply stamps (``first_command``);
        # at most one entry per live session, dropped with the session
        self._first_reply: dict[str, MigrationRecord] = {}
        self.metrics = PoolMetrics()
        for state in SessionState:
            # read whenever metrics are collected: never stale between sweeps
            self.metrics.sessions.labels(state.value).set_function(
                lambda state=state: sum(1 for s in list(self.sessions.values()) if s.state is state))
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
        self.record_ledger = None   # pool.cluster.records.RecordLedger: likewise (records follow etcd's)
        self._record_waiters: list[asyncio.Future] = []
        self._counter = 0
        self.started = time.time()

    @property
    def backend(self):
        """The first device's backend (for callers from one-device days)."""
        return self.devices.devices[0].backend

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
        for record in list(self.records.values()):
            if record.final or now < record.lease_expiry:
                continue
            if record.state in (RecordStateName.OPEN, RecordStateName.SWITCHED_OVER):
                if self.record_ledger is not None:
                    self._expire_in_cluster(record, now)
                    continue
                self._abort_record(record, now, "lease expired: no host renewed it")
            elif record.state is RecordStateName.COMMITTED:
                LOG.warning("record %s: lease expired after commit: completing", record.key)
                self._complete_record(record, now)
                record.close(now)
            elif record.state is RecordStateName.COMPLETED:
                record.close(now)
        for device in self.devices:
            device.backend.trim_idle(self.config.upload_arena_keep)
        if len(self.domain_tokens):
            self.domain_tokens.keep({s.domain_uuid for s in list(self.sessions.values())
                                     if s.live and s.domain_uuid is not None})
        # forget final records after a while (bounded memory)
        for key, record in list(self.records.items()):
            if record.final and now - max(record.times.values()) > 3600:
                del self.records[key]

    # -- hosts -----------------------------------------------------------------------
    def host_for_address(self, address: str) -> str | None:
        return host_for_address(self.hosts.values(), address)

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
        kept = {}
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
        session.bound_host = conn.peer_host
        session.by_address = conn.peer_host is not None
        session.claimed_domain = claimed
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
            ticket = header.get("ticket")
            claims = None
            if ticket:
                claims = self.tickets.check(ticket, sid, conn.peer_host, now,
                                            retry_of=session.last_resume.get("ticket") if retry else None,
                                            by_address=session.by_address)
            elif session.pending_move is not None:
                record = self.records.get("/".join(session.pending_move))
                raise TicketRequired(sid=sid, host=record.dest_host if record else "?",
                                     migration=session.pending_move[1])
            elif session.bound_host is not None and conn.peer_host != session.bound_host and \
                    (session.by_address or conn.peer_host is not None):
                raise WrongHost(sid=sid, bound=session.bound_host, peer=conn.peer[0], host=conn.peer_host)
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
        session.note_resume(epoch, last_seen, claims["n"] if claims else None)
        session.counters.resumes += 1
        session.counters.replayed += len(replay)
        blackout = None
        if claims is not None:
            self.tickets.use(claims["n"], now)
            self.session_tickets.pop(sid, None)
            session.pending_move = None
            # where the address names no host, the ticket's host (whose hostd
            # delivered it into the guest) is where the session now is
            session.bound_host = conn.peer_host or (None if session.by_address else claims.get("dst"))
            record = self.records.get(f"{claims['dom']}/{claims['mid']}")
            if record is not None:
                start = (session.pause_started or record.times.get("switchover")
                         or session.detached_at or record.times.get("completed", now))
                blackout = max(0.0, now - start)
                record.stamp("resume_received", now)
                record.note_resumed(sid, blackout, now if injected else max(now, time.time()))
                if "first_command" not in record.stamps:
                    self._first_reply[sid] = record     # its next reply stamps the timeline
                self.metrics.blackout.observe(blackout)
                session.unpause(record.key)
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
        """A migration's timeline: the first command completed after the resume."""
        if self._first_reply:
            record = self._first_reply.pop(session.sid, None)
            if record is not None:
                record.stamp("first_command", time.time())

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
        self.session_tickets.pop(session.sid, None)
        self._first_reply.pop(session.sid, None)
        self.tombstones[session.sid] = reason
        while len(self.tombstones) > 100000:
            self.tombstones.popitem(last=False)

    # -- migration records (the control plane calls these) -----------------------
    def domain_sessions(self, domain_uuid: str) -> list[Session]:
        return [s for s in self.sessions.values() if s.live and s.domain_uuid == domain_uuid]

    def accel_domains(self) -> dict[str, int]:
        """Every domain that holds live sessions, by its attested UUID or,
        not attested yet, the UUID its guest claimed: domain -> how many of
        its sessions wait to be attested (claimed, bound to no domain yet).
        Hosts learn from it which of their domains are accelerator VMs,
        marked or not (a Nova instance carries nothing of accelmig), and
        which of those their guests should prove sessions of; never the
        sessions' ids (a host learns those from its own guests)."""
        out: dict[str, int] = {}
        for session in list(self.sessions.values()):
            domain = session.domain_uuid or session.claimed_domain
            if session.live and domain is not None:
                out[domain] = out.get(domain, 0) + (session.domain_uuid is None)
        return out

    def find_record(self, domain_uuid: str, migration_id: str | None = None, *,
                    source: str | None = None, dest: str | None = None,
                    states=None) -> MigrationRecord:
        if migration_id:
            record = self.records.get(f"{domain_uuid}/{migration_id}")
            if record is None:
                raise NoSuchRecord(record=f"{domain_uuid}/{migration_id}")
            return record
        candidates = [r for r in self.records.values() if r.domain_uuid == domain_uuid
                      and (states is None or r.state in states)
                      and (source is None or r.source_host in (source, None))
                      and (dest is None or r.dest_host == dest)]
        if not candidates:
            raise NoSuchRecord(record=f"{domain_uuid}/* (no matching record)")
        return max(candidates, key=lambda r: r.times["opened"])

    def open_record(self, dest: str, domain_uuid: str, migration_id: str | None,
                    domain_name: str | None, policy: str | None, postcopy: bool,
                    now: float | None = None, vouched: bool = False) -> MigrationRecord:
        """``vouched``: the domain's host (its token, its intent) vouched for
        ``dest``.  A record nobody vouched for supersedes nothing and pauses
        nothing (the control plane lets it complete or commit nothing of the
        domain's sessions either) until its source vouches at switchover."""
        now = time.time() if now is None else now
        for record in self.records.values():
            if record.domain_uuid == domain_uuid and record.dest_host == dest and \
                    record.state is RecordStateName.OPEN and migration_id in (None, record.migration_id):
                record.renew(now)
                if vouched and not record.vouched:
                    self.vouch_record(record, now)
                return record  # the hook notes twice (migrate, prepare): one record
        intent = self.intents.get(domain_uuid)
        if intent is not None and intent.get("dest_host") not in (None, dest):
            intent = None
        if intent is not None:
            del self.intents[domain_uuid]
        mid = migration_id or (intent or {}).get("migration_id") or uuid.uuid4().hex[:12]
        source = self.domain_hosts.get(domain_uuid) or (intent or {}).get("source_host")
        if source is None:
            bound = {s.bound_host for s in self.domain_sessions(domain_uuid)} - {None}
            source = bound.pop() if len(bound) == 1 else None
        policy = PausePolicy.parse(policy or (intent or {}).get("policy") or "none")
        for record in list(self.records.values()) if vouched else ():
            if record.domain_uuid == domain_uuid and record.state in (
                    RecordStateName.OPEN, RecordStateName.SWITCHED_OVER):
                # A domain migrates once at a time: an older unfinished record
                # is stale (only a vouched migration says so: anyone may open one)
                self._abort_record(record, now, f"superseded by migration {mid}")
        if f"{domain_uuid}/{mid}" in self.records:
            raise Conflict(reason=f"migration id {mid} was used for this domain already")
        self._record_serial += 1
        record = MigrationRecord(domain_uuid, mid, source, dest, policy, self.config.lease_ttl, now,
                                 domain_name=domain_name, postcopy=postcopy, serial=self._record_serial)
        record.vouched = vouched
        record.on_change = self.record_changed
        self.records[record.key] = record
        self._open[record.key] = record
        self.record_changed(record)
        self.hold_if_paused(record, self.domain_sessions(domain_uuid), now)
        LOG.info("record %s opened: %s -> %s, policy %s%s", record.key, source, dest, policy.value,
                 "" if vouched else " (nobody vouched for it yet)",
                 extra={"domain": domain_uuid, "migration": mid})
        return record

    def vouch_record(self, record: MigrationRecord, now: float | None = None) -> None:
        """The domain's host vouched for ``record``'s destination: from now
        on its policy pauses the domain's sessions."""
        if record.vouched:
            return
        record.vouched = True
        self.hold_if_paused(record, self.domain_sessions(record.domain_uuid), time.time() if now is None else now)

    def switchover_record(self, record: MigrationRecord, source: str,
                          now: float | None = None) -> None:
        now = time.time() if now is None else now
        if record.source_host is None:
            record.source_host = source
        if record.switchover(now):
            self.hold_if_paused(record, self.domain_sessions(record.domain_uuid), now)
        record.renew(now)

    @staticmethod
    def hold_if_paused(record: MigrationRecord, sessions, now: float) -> None:
        """Pause ``sessions`` if the record's policy says so in its state (the
        rule itself: ``accelmig.wire.records.pauses``) and the domain's host
        vouched for it: anyone may open a record, not pause a domain."""
        if record.vouched and pauses(record.policy, record.state):
            for session in sessions:
                session.pause(record.key, now)

    def _complete_record(self, record: MigrationRecord, now: float) -> dict[str, str]:
        sessions = self.domain_sessions(record.domain_uuid)
        if not record.complete(now, [s.sid for s in sessions]):
            return {}
        tickets = {}
        for session in sessions:
            session.pending_move = (record.domain_uuid, record.migration_id)
            tickets[session.sid] = self._ticket_for(session.sid, record, now)
        self.domain_hosts[record.domain_uuid] = record.dest_host
        self.metrics.migrations.labels("completed").inc()
        LOG.info("record %s completed: %d session(s) frozen, tickets minted for %s",
                 record.key, len(sessions), record.dest_host,
                 extra={"domain": record.domain_uuid, "migration": record.migration_id})
        return tickets

    def complete_record(self, record: MigrationRecord, now: float | None = None) -> dict[str, str]:
        """The tickets of every session of ``record`` that has not resumed yet.

        Idempotent per migration id: completing again (a second hostd,
        reconciliation racing the event, a retry after a lost answer or a
        failed delivery) hands back the same live tickets, so a ticket already
        on its way to the guest stays valid; only an expired one is replaced."""
        now = time.time() if now is None else now
        if record.state not in (RecordStateName.COMPLETED, RecordStateName.CLOSED):
            return self._complete_record(record, now)
        return {sid: ticket for _, sid, ticket in self.record_tickets(record, 0, now)}

    def record_tickets(self, record: MigrationRecord, start: int, now: float | None = None):
        """``(index, sid, ticket)`` of the sessions of a completed ``record``
        still moving, from index ``start`` of its frozen, sorted sessions:
        the same live tickets at every call (``complete``'s pages)."""
        now = time.time() if now is None else now
        key = (record.domain_uuid, record.migration_id)
        for index in range(max(0, start), len(record.sessions)):
            sid = record.sessions[index]
            session = self.sessions.get(sid)
            if session is not None and session.pending_move == key:
                yield index, sid, self._ticket_for(sid, record, now)

    def _ticket_for(self, sid: str, record: MigrationRecord, now: float) -> str:
        """The session's one live ticket for ``record``: the one it has, or a
        new one.  A ticket of an older migration is revoked (superseded); an
        expired one is replaced."""
        held = self.session_tickets.get(sid)
        live = self.tickets.live(held, now)
        if live is not None and live.record == record.key:
            return live.token
        if held is not None:
            self.tickets.revoke(held, f"ticket superseded by migration {record.migration_id} "
                                      f"of the same session")
        ticket = self.tickets.mint(sid, record, now)
        self.session_tickets[sid] = ticket.nonce
        record.tickets[sid] = ticket.nonce
        return ticket.token

    def _abort_record(self, record: MigrationRecord, now: float, reason: str) -> None:
        if not record.abort(now, reason):
            return
        for sid, nonce in record.tickets.items():
            self.tickets.revoke(nonce, f"ticket revoked: migration {record.migration_id} was "
                                       f"aborted ({reason})")
        for session in self.sessions.values():
            session.unpause(record.key)
            if session.pending_move == (record.domain_uuid, record.migration_id):
                session.pending_move = None
        self.metrics.migrations.labels("aborted").inc()
        LOG.warning("record %s aborted: %s", record.key, reason,
                    extra={"domain": record.domain_uuid, "migration": record.migration_id})
        if self.record_ledger is not None:
            self._abort_in_etcd(record, reason)

    def _expire_in_cluster(self, record: MigrationRecord, now: float) -> None:
        """No host renewed this node's record: abort it in etcd first (off
        the loop), then here.  Where etcd's has gone on meanwhile (another
        node completed it: its hosts renewed there) this node follows
        instead and keeps its record until the host's next call."""
        ledger, loop = self.record_ledger, self.loop
        record.lease_expiry = now + record.lease_ttl      # one attempt at a time, not one per sweep
        if loop is None or loop.is_closed():
            return

        def expire():
            try:
                return ledger.advance(record.domain_uuid, record.migration_id, "abort",
                                      abort_reason="lease expired: no host renewed it")
            except AccelmigError as exc:
                try:
                    return ledger.read(record.domain_uuid, record.migration_id)
                except AccelmigError:
                    LOG.warning("record %s: lease expired, etcd unreachable (%s): aborting here",
                                record.key, exc)
                    return None

        def settle(future) -> None:
            stored = future.result()
            if stored is None:
                self._abort_record(record, time.time(), "lease expired: no host renewed it")
            else:
                self.follow_record(record, stored)
        loop.run_in_executor(None, expire).add_done_callback(lambda f: self.post(lambda: settle(f)))

    def _abort_in_etcd(self, record: MigrationRecord, reason: str) -> None:
        """An abort this node decided alone (its lease ran out, a newer
        migration superseded it) releases every node's part too; off the
        loop.  Where etcd already has it (the usual case: a host's abort is
        written there first) it is a repeat that writes nothing."""
        ledger, loop = self.record_ledger, self.loop
        if loop is None or loop.is_closed():
            return

        def write():
            try:
                ledger.advance(record.domain_uuid, record.migration_id, "abort", abort_reason=reason[:256])
            except AccelmigError as exc:
                LOG.warning("record %s: the abort is not in etcd: %s", record.key, exc,
                            extra={"domain": record.domain_uuid, "migration": record.migration_id})
        loop.run_in_executor(None, write)

    def adopt_record(self, stored) -> MigrationRecord:
        """A record etcd holds (``stored``) that this node never opened (the
        destination's open did not reach it): this node's own, from etcd's
        parties, then following etcd's state."""
        now = time.time()
        self._record_serial += 1
        record = MigrationRecord(stored.domain_uuid, stored.migration_id, stored.source_host, stored.dest_host,
                                 stored.policy, self.config.lease_ttl, now, postcopy=stored.postcopy,
                                 serial=self._record_serial)
        record.vouched = stored.vouched         # (the node that vouched for it authorised it)
        record.on_change = self.record_changed
        self.records[record.key] = record
        self._open[record.key] = record
        self.hold_if_paused(record, self.domain_sessions(record.domain_uuid), now)
        LOG.info("record %s taken from etcd: %s -> %s, %s there", record.key, record.source_host,
                 record.dest_host, stored.state.value,
                 extra={"domain": record.domain_uuid, "migration": record.migration_id})
        self.follow_record(record, stored)
        self.record_changed(record)
        return record

    def follow_record(self, record: MigrationRecord, stored) -> None:
        """This node's ``record`` takes the steps etcd's (``stored``: a
        ``pool.cluster.records.StoredRecord``) has taken: another node took
        them, or this one was unreachable then.  Completing is never
        followed: it mints this node's tickets, only when the destination
        asks this node."""
        now = time.time()
        S = RecordStateName
        if stored.state is S.ABORTED:
            if record.state in (S.OPEN, S.SWITCHED_OVER):
                self._abort_record(record, now, f"aborted in etcd: {stored.abort_reason or 'no reason given'}")
            elif not record.final:        # (etcd is written first: only a node's lone decision gets here)
                LOG.error("record %s is %s here but aborted in etcd (%s): its sessions keep their tickets",
                          record.key, record.state.value, stored.abort_reason,
                          extra={"domain": record.domain_uuid, "migration": record.migration_id})
            return
        if record.source_host is None and stored.source_host is not None:
            record.source_host = stored.source_host
        if stored.vouched and not record.vouched:
            self.vouch_record(record, now)
        if record.state is S.OPEN and stored.state is not S.OPEN:
            self.switchover_record(record, record.source_host, now)
        if stored.state is S.COMMITTED or stored.postcopy:
            if record.state in (S.OPEN, S.SWITCHED_OVER):
                record.postcopy = True
                record.commit(now)
        if stored.source_stopped or stored.state is S.CLOSED:
            if not record.final:
                record.close(now)

    def abort_record(self, record: MigrationRecord, reason: str, now: float | None = None) -> None:
        self._abort_record(record, time.time() if now is None else now, reason)

    def record_changed(self, record: MigrationRecord) -> None:
        """Wake whoever waits on records (``wait_record``)."""
        if record.final:
            self._open.pop(record.key, None)
        waiters, self._record_waiters = self._record_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait_record(self, domain_uuid: str, migration_id: str | None, reached,
                          timeout: float) -> MigrationRecord | None:
        """The record (that migration's, or the domain's latest) once
        ``reached(record)``, or as it is after ``timeout`` seconds (None: no
        such record appeared)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                record = self.find_record(domain_uuid, migration_id)
            except NoSuchRecord:
                record = None
            remaining = deadline - loop.time()
            if (record is not None and reached(record)) or remaining <= 0:
                return record
            waiter = loop.create_future()
            self._record_waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, remaining)
            except asyncio.TimeoutError:
                pass

    def open_records(self) -> list[MigrationRecord]:
        return [r for r in self._open.values() if r.state not in FINAL]

