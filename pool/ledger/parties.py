"""Who is who in a migration: the ledger's facts about hosts and domains,
and every rule that names a party.

- a session's binding (``bound_host``, ``domain_uuid``, ``pending_move``:
  attributes of the pool's ``Session``, read by the data plane, written
  here alone) and a domain -> sessions index (no scan of every session);
- ``domain_hosts``: the host a domain was last bound or completed on, the
  tie-break when its sessions disagree and a new record's source; forgotten
  with the domain's last session;
- ``Intents``: where a domain's host (or the admin socket) said its next
  migration goes, for ``INTENT_TTL`` seconds, at most ``MAX_INTENTS`` per
  caller;
- issue 28's attestation: the challenges issued to hosts for binding proofs
  and each domain's migration token (``pool.attestation``);
- the rules: a domain's host, a record's source, who may act on a record,
  vouching, the arrival of a session bound elsewhere.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from accelmig.pool.attestation import BindChallenges, DomainTokens
from accelmig.wire.control import ADMIN_HOST
from accelmig.wire.errors import BadRequest, Conflict, Forbidden, NoSuchRecord, RecordState
from accelmig.wire.records import IN_FLIGHT, record_key

#: How long an intent names the destination of a domain's next migration
#: (``accelmig migrate`` starts it at once): a stale one must not keep
#: refusing every other destination.
INTENT_TTL = 300.0
#: Fresh intents one caller may hold: a host registers one per migration it
#: starts (a handful at once); a host that registers intents for domains
#: that hold no sessions (anyone may name those) must not grow the pool's
#: memory for INTENT_TTL.
MAX_INTENTS = 256


@dataclasses.dataclass
class Intent:
    domain_uuid: str
    policy: str
    dest_host: str | None
    migration_id: str
    source_host: str | None
    registered: float
    by: str                      # the caller that registered it

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)


class Intents:
    """The domains' fresh intents, bounded in age and in number per caller."""

    def __init__(self, ttl: float = INTENT_TTL, per_caller: int = MAX_INTENTS):
        self.ttl, self.per_caller = ttl, per_caller
        self._intents: dict[str, Intent] = {}

    def fresh(self, domain_uuid: str, now: float) -> Intent | None:
        """The domain's intent while it is fresh (an older one is dropped)."""
        intent = self._intents.get(domain_uuid)
        if intent is not None and now - intent.registered > self.ttl:
            del self._intents[domain_uuid]
            return None
        return intent

    def register(self, intent: Intent, now: float) -> None:
        for domain in [d for d, old in self._intents.items() if now - old.registered > self.ttl]:
            del self._intents[domain]
        held = sum(1 for d, old in self._intents.items() if old.by == intent.by and d != intent.domain_uuid)
        if held >= self.per_caller:
            raise BadRequest(reason=f"register_intent: {intent.by} holds {held} fresh intents already, the most "
                                    f"one caller may (each lasts {self.ttl:g} s)")
        self._intents[intent.domain_uuid] = intent

    def take(self, domain_uuid: str, dest: str, now: float) -> Intent | None:
        """The fresh intent a new record of the domain to ``dest`` opens by
        (one naming no destination or that one), used up."""
        intent = self.fresh(domain_uuid, now)
        if intent is None or intent.dest_host not in (None, dest):
            return None
        del self._intents[domain_uuid]
        return intent

    def __len__(self) -> int:
        return len(self._intents)


class Parties:
    def __init__(self, records: dict, open_records: Callable[[], list]):
        self.records = records                  # the ledger's: key -> LedgerRecord
        self.open_records = open_records
        self.intents = Intents()
        self.domain_hosts: dict[str, str] = {}
        self._domains: dict[str, dict[str, object]] = {}   # domain -> sid -> live Session bound to it
        # what hosts show before they bind a session or are vouched for as a
        # migration's destination (pool.attestation)
        self.challenges = BindChallenges()
        self.tokens = DomainTokens()

    # -- a session's binding: written here alone ------------------------------------------
    @staticmethod
    def opened(session, peer_host: str | None, claimed_domain: str | None) -> None:
        """A new session: bound to the host whose network it came from (by
        address), none on a network that names no host (a Neutron tenant
        network: then hosts' attestation binds it)."""
        session.bound_host = peer_host
        session.by_address = peer_host is not None
        session.claimed_domain = claimed_domain

    def set_domain(self, session, domain_uuid: str | None) -> None:
        old = session.domain_uuid
        if old == domain_uuid:
            return
        session.domain_uuid = domain_uuid
        if old is not None:
            self._leave(old, session.sid)
        if domain_uuid is not None:
            self._domains.setdefault(domain_uuid, {})[session.sid] = session

    @staticmethod
    def set_bound(session, host: str | None) -> None:
        session.bound_host = host

    @staticmethod
    def set_moving(session, record=None) -> None:
        """``session`` waits for a ticket of ``record`` (None: it moves no more)."""
        session.pending_move = None if record is None else (record.domain_uuid, record.migration_id)

    def released(self, session) -> None:
        if session.domain_uuid is not None:
            self._leave(session.domain_uuid, session.sid)

    def _leave(self, domain_uuid: str, sid: str) -> None:
        members = self._domains.get(domain_uuid)
        if members is not None:
            members.pop(sid, None)
            if not members:
                # the domain's last session: nothing of it is here to take any more
                del self._domains[domain_uuid]
                self.domain_hosts.pop(domain_uuid, None)

    def domain_sessions(self, domain_uuid) -> list:
        return [s for s in self._domains.get(domain_uuid, {}).values() if s.live]

    def domains(self) -> set[str]:
        """Every domain that holds a live session bound to it."""
        return set(self._domains)

    # -- who is who: a domain's host, a record's parties ---------------------------------
    def moving_to(self, session) -> str | None:
        """The destination of the migration ``session`` waits for a ticket of."""
        moving = self.records.get(record_key(*session.pending_move)) if session.pending_move else None
        return moving.dest_host if moving is not None else None

    def domain_host(self, domain_uuid) -> str | None:
        """Where the domain runs as far as its live sessions tell: the host
        they are bound to, or the destination they are moving to; None for a
        domain without any (nothing of it to take)."""
        hosts = {self.moving_to(s) or s.bound_host for s in self.domain_sessions(domain_uuid)}
        hosts.discard(None)
        if len(hosts) > 1:
            return self.domain_hosts.get(domain_uuid)
        return hosts.pop() if hosts else None

    def named_destinations(self, domain_uuid, now: float) -> set[str]:
        """Where the domain's host (or the admin socket) said it goes: the
        destination of its fresh intent, and of every migration under way
        that opened with one (once completed, the destination is the
        domain's host and names the next one).  Empty where nobody named one."""
        named = {r.dest_host for r in self.open_records()
                 if r.domain_uuid == domain_uuid and r.vouched and r.state in IN_FLIGHT}
        intent = self.intents.fresh(domain_uuid, now)
        if intent is not None and intent.dest_host and intent.by in (ADMIN_HOST, self.domain_host(domain_uuid)):
            named.add(intent.dest_host)
        return named

    def source_of(self, record) -> str | None:
        """The record's source; where it is not known yet (the domain was new
        to the pool when the record opened), the one host the domain's
        sessions are bound to, if any."""
        if record.source_host is not None:
            return record.source_host
        bound = {s.bound_host for s in self.domain_sessions(record.domain_uuid)} - {None}
        return bound.pop() if len(bound) == 1 else None

    def require_source(self, record, caller, action: str) -> None:
        if record.dest_host == caller:
            raise Conflict(reason=f"host {caller} is the destination of {record.key}")
        source = self.source_of(record)
        if source not in (None, caller):
            raise Forbidden(who=f"host {caller}", what=f"{action} {record.key}: it comes from host {source}")

    def require_dest(self, record, caller, action: str) -> None:
        if record.dest_host == caller:
            return
        source = self.source_of(record)
        if caller == source:
            raise Conflict(reason=f"{record.key} goes to {record.dest_host}, not {caller}")
        raise Forbidden(who=f"host {caller}", what=f"{action} {record.key}: it goes from host "
                                                   f"{source or '?'} to host {record.dest_host}")

    def is_party(self, record, caller) -> bool:
        """``caller`` takes part in ``record``: its destination or its source."""
        return caller in (record.dest_host, record.source_host, self.source_of(record))

    def require_party(self, record, caller, action: str) -> None:
        if caller != ADMIN_HOST and not self.is_party(record, caller):
            raise Forbidden(who=f"host {caller}", what=f"{action} {record.key}: it takes no part in it")

    def require_domain_host(self, caller, domain_uuid, sessions, action: str) -> None:
        """Only the host a domain's sessions are bound to (or the admin
        socket) acts on its saved state."""
        others = sorted({s.bound_host for s in sessions} - {None, caller})
        if others and caller != ADMIN_HOST:
            raise Forbidden(who=f"host {caller}", what=f"{action} domain {domain_uuid}: its sessions "
                                                       f"are bound to {', '.join(others)}")

    def visible(self, session, caller) -> bool:
        """A host sees the sessions bound to it and those moving to it with a
        ticket; the admin socket sees every one."""
        return caller == ADMIN_HOST or self.moving_to(session) == caller or session.bound_host == caller

    def attested_here(self, session, caller, domain_uuid) -> bool:
        """Bound to ``caller`` in ``domain_uuid`` already (or moving there
        with a ticket): acknowledged without a new proof."""
        if session.domain_uuid != domain_uuid:
            return False
        if session.bound_host == caller and session.pending_move is None:
            return True
        return self.moving_to(session) == caller

    # -- vouching ----------------------------------------------------------------------
    def source_vouches(self, record, caller) -> bool:
        """Whether the switchover ``caller`` takes of ``record`` vouches for
        its destination: ``caller`` is the host the domain's sessions are
        bound to (its word that its domain really is migrating; where the
        pool knows no such host, the domain has nothing to take yet and the
        sessions bound later must be that host's: ``require_vouched``),
        nobody vouched for another migration of the domain, this is the only
        one under way, and the domain's token is not waiting unused for the
        real destination's open (then a record without it is not that one)."""
        if record.vouched or self.source_of(record) not in (None, caller):
            return False
        if self.tokens.unspent(record.domain_uuid):
            return False
        return not [r for r in self.open_records() if r.domain_uuid == record.domain_uuid
                    and r is not record and r.state in IN_FLIGHT]

    def require_vouched(self, record, caller, action: str) -> None:
        """A record nobody vouched for (no token of the domain's, no intent
        naming its destination, no switchover by its source) takes nothing
        of the domain's sessions: it completes or commits only while the
        domain has none; nor does one vouched for by a source whose domain's
        sessions are bound to another host."""
        sessions = self.domain_sessions(record.domain_uuid)
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

    def switchover_target(self, caller, domain_uuid, candidates: list):
        """The record a source's switchover (which names no migration: its
        host does not know the destination) is about, of ``candidates`` (the
        domain's records in a state it may switch over in): the one vouched
        for, else the only one under way; several that nobody vouched for
        are a ``Conflict`` (a host opened a migration it has no part in)."""
        vouched = [r for r in candidates if r.vouched]
        if vouched:
            return max(vouched, key=lambda r: r.opened)
        if not candidates:
            raise NoSuchRecord(record=f"{domain_uuid}/* (no matching record)")
        others = [r for r in candidates if r.dest_host != caller] if len(candidates) > 1 else candidates
        if len(others) > 1:
            raise Conflict(reason=f"{len(others)} migrations of domain {domain_uuid} are open and nobody "
                                  f"vouched for any of them (to {', '.join(sorted(r.dest_host for r in others))}): "
                                  f"the source cannot tell which is its own")
        return (others or candidates)[0]

    def check_arrival(self, caller, session, domain_uuid) -> None:
        """``caller`` attests ``session``, bound to another host, for
        ``domain_uuid``: only as the destination of that domain's migration
        from the session's host (a VM without the accelmig channel reports
        its sessions through guest-exec only there), or of the session's own
        move, and only of a migration its source vouched for.  Attesting
        changes no binding: a ticket still needs the session's own secret."""
        sid, bound = session.sid, session.bound_host
        if self.moving_to(session) == caller and session.domain_uuid == domain_uuid:
            return
        for record in self.open_records():
            if record.domain_uuid != domain_uuid or record.dest_host != caller:
                continue
            source = self.source_of(record)
            if record.vouched and (source == bound or session.domain_uuid == domain_uuid):
                return
            if not record.vouched and (source in (None, bound) or session.domain_uuid == domain_uuid):
                # Nobody vouched for this destination yet: the session's
                # host does when it switches the migration over.
                raise RecordState(record=record.key, state=record.state.value,
                                  action=f"attest session {sid} (bound to host {bound}) before its "
                                         f"source switched the migration over")
        raise Conflict(reason=f"session {sid} is bound to host {bound}, not {caller}")
