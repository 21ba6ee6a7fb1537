"""The ledger's side of a session: where it is bound, how it moves.

A session opens bound to the host whose network it came from; hosts bind it
to a domain with its own proof (issue 28, ``wire.attestation``); a resume
with a ticket moves its binding to the ticket's host.  These are the
methods of ``MigrationLedger`` (a mixin: one ledger, its files each one
concern) that the pool's data plane and the control plane's binding calls
use; the facts themselves are ``Parties``' and the ``TicketBook``'s.
"""

from __future__ import annotations

import logging

from accelmig.wire import attestation as att
from accelmig.wire.errors import AccelmigError, Conflict, Forbidden, NoSuchRecord, TicketRequired, WrongHost
from accelmig.wire.records import record_key
from accelmig.wire.values import shown

LOG = logging.getLogger("accelmig.pool")


class SessionMoves:
    # (MigrationLedger's: parties, tickets, records, sessions, metrics, clock, first_replies)

    # -- opening and binding ---------------------------------------------------------------
    def opened(self, session, peer_host: str | None, claimed_domain: str | None) -> None:
        """A session the data plane just opened (``Parties.opened``)."""
        self.parties.opened(session, peer_host, claimed_domain)

    def bind_challenge(self, caller, domain_uuid=None) -> dict:
        """A fresh challenge for the caller's binding proofs; with
        ``domain_uuid``, how many sessions claiming that domain wait to be
        attested (the destination of a migration asks its guest for proofs
        only when some do)."""
        challenges = self.parties.challenges
        out = {"challenge": challenges.issue(caller, self.clock()), "ttl": challenges.ttl}
        if domain_uuid is not None:
            out["unattested"] = sum(1 for s in list(self.sessions.values())
                                    if s.live and s.domain_uuid is None and s.claimed_domain == domain_uuid)
        return out

    def bind_sessions(self, caller, domain_uuid, proofs: dict, challenge, instance: str) -> dict:
        """Bind sessions to ``domain_uuid`` on the caller, each with its
        proof (``wire.attestation``: the session's own HMAC over a challenge
        the pool issued to the caller, the caller's name and the domain).
        ``proofs``: ``{sid: proof}`` (bounded by the caller); a ``None``
        proof only asks whether the session is bound here already.
        ``bound``: the sessions bound to the caller in that domain now;
        ``prove``: those that need a proof; ``refused``: the others, each
        with its error."""
        now = self.clock()
        challenges = self.parties.challenges
        if any(proof is not None for proof in proofs.values()) and not challenges.valid(caller, challenge, now):
            raise Forbidden(who=f"host {caller}", what=f"bind sessions under challenge {shown(challenge)}: "
                                                       f"the pool did not issue it to this host, or it expired "
                                                       f"(ask bind_challenge again)")
        bound, prove, refused = [], [], {}
        for sid, proof in proofs.items():
            session = self.sessions.get(sid)
            if session is None or not session.live:
                refused[sid] = NoSuchRecord(record=f"session {sid}")
            elif self.parties.attested_here(session, caller, domain_uuid):
                bound.append(sid)             # (nothing to change: a proof or none)
            elif proof is None:
                prove.append(sid)
            elif challenges.used(caller, challenge, sid) or not att.check_bind_proof(
                    session.secret, proof, challenge=challenge, instance=instance, host=caller,
                    domain=domain_uuid, sid=sid):
                refused[sid] = Forbidden(who=f"host {caller}", what=(
                    f"bind session {sid} to domain {domain_uuid}: its proof does not verify (not made with "
                    f"the session's secret for this challenge, host and domain, or used already)"))
            else:
                try:
                    self._bind(caller, session, domain_uuid, now)
                except AccelmigError as exc:
                    refused[sid] = exc
                    continue
                challenges.use(caller, challenge, sid)
                bound.append(sid)
        if refused:
            LOG.warning("host %s: %d of %d session(s) not bound to domain %s (%s)", caller, len(refused),
                        len(proofs), domain_uuid, next(iter(refused.values())).message[:200],
                        extra={"host": caller, "domain": domain_uuid})
        return {"domain_uuid": domain_uuid, "bound": bound, "prove": prove, "refused": refused}

    def _bind(self, caller, session, domain_uuid, now: float) -> None:
        """``session`` (whose proof verified) in ``domain_uuid`` on ``caller``."""
        parties = self.parties
        if session.bound_host not in (None, caller):
            parties.check_arrival(caller, session, domain_uuid)
        if session.domain_uuid not in (None, domain_uuid):
            raise Conflict(reason=f"session {session.sid} belongs to domain {session.domain_uuid}")
        incoming = any(r.domain_uuid == domain_uuid and r.dest_host == caller for r in self.open_records())
        parties.set_domain(session, domain_uuid)
        if session.bound_host is None:
            parties.set_bound(session, caller)
        if not incoming:
            parties.domain_hosts.setdefault(domain_uuid, caller)
        # a session opened while its domain migrates joins the migration
        for record in self.open_records():
            if record.domain_uuid == domain_uuid:
                self.hold_if_paused(record, [session], now)

    def unbind(self, caller, sid, domain_uuid) -> None:
        """The guest of ``domain_uuid`` says the session closed: it leaves
        that domain (and no other: a guest names whatever ids it likes)."""
        session = self.sessions.get(sid)
        if session is None:
            return
        if session.bound_host not in (None, caller):
            raise Forbidden(who=f"host {caller}", what=f"unbind session {sid}: it is bound "
                                                       f"to host {session.bound_host}")
        if session.domain_uuid not in (None, domain_uuid):
            raise Forbidden(who=f"host {caller}", what=f"unbind session {sid} from domain {domain_uuid}: "
                                                       f"it is not in that domain")
        self.parties.set_domain(session, None)

    def saved_domain(self, caller, domain_uuid, action: str) -> list:
        """The sessions of a domain its host (or the admin socket) parks or
        unparks: only the host they are bound to acts on its saved state."""
        sessions = self.parties.domain_sessions(domain_uuid)
        self.parties.require_domain_host(caller, domain_uuid, sessions, action)
        return sessions

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

    # -- a resume -----------------------------------------------------------------------
    def check_resume(self, session, ticket, peer_host: str | None, peer_address: str, retry: bool,
                     now: float) -> dict | None:
        """Whether a resume of ``session`` from ``peer_host`` may move it:
        with ``ticket``, its claims (``TicketInvalid`` for a bad one); without,
        None where it stays where it is bound, ``TicketRequired`` while it
        is moving, ``WrongHost`` from another host.  ``retry``: the driver
        retries the resume whose answer it lost (its ticket is used already)."""
        sid = session.sid
        if ticket:
            return self.tickets.check(ticket, sid, peer_host, now,
                                      retry_of=self.tickets.last_used(sid) if retry else None,
                                      by_address=session.by_address)
        if session.pending_move is not None:
            record = self.records.get(record_key(*session.pending_move))
            raise TicketRequired(sid=sid, host=record.dest_host if record else "?",
                                 migration=session.pending_move[1])
        if session.bound_host is not None and peer_host != session.bound_host and \
                (session.by_address or peer_host is not None):
            raise WrongHost(sid=sid, bound=session.bound_host, peer=peer_address, host=peer_host)
        return None

    def resumed(self, session, claims: dict | None, peer_host: str | None, now: float,
                injected: bool) -> float | None:
        """A resume of ``session`` was accepted (``claims``: its ticket's, if
        any): the ticket is used, the binding moves to its host, the record
        notes the resume; its blackout (None without a ticket).  ``injected``:
        ``now`` is a test's clock, not the wall clock."""
        self.tickets.use(session.sid, claims["n"] if claims else None, now)
        if claims is None:
            return None
        self.parties.set_moving(session, None)
        # where the address names no host, the ticket's host (whose hostd
        # delivered it into the guest) is where the session now is
        self.parties.set_bound(session, peer_host or (None if session.by_address else claims.get("dst")))
        record = self.records.get(record_key(claims["dom"], claims["mid"]))
        if record is None:
            return None
        times = record.times
        start = session.pause_started or times.get("switchover") or session.detached_at or \
            times.get("completed", now)
        blackout = max(0.0, now - start)
        record.stamp("resume_received", now)
        record.note_resumed(session.sid, blackout, now if injected else max(now, self.clock()))
        if "first_command" not in record.stamps:
            self.first_replies[session.sid] = record     # its next reply stamps the timeline
        self.metrics.blackout.observe(blackout)
        session.unpause(record.key)
        return blackout

    def first_reply(self, sid: str) -> None:
        """A migration's timeline: the first command completed after the
        resume (the pool calls it only while ``first_replies`` is not empty)."""
        record = self.first_replies.pop(sid, None)
        if record is not None:
            record.stamp("first_command", self.clock())

    def session_released(self, session, reason: str) -> None:
        """The session is gone: its live ticket dies with it, it leaves its
        domain (whose host is forgotten with its last session)."""
        self.tickets.drop_session(session.sid, f"ticket revoked: session {session.sid} was released "
                                               f"({reason})", self.clock())
        self.first_replies.pop(session.sid, None)
        self.parties.released(session)
