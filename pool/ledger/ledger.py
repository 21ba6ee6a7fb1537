"""The migration ledger: the one owner of every migration fact.

Records (``record``), tickets (``tickets``), intents, domains' hosts,
bindings and vouching (``parties``), migration ids and the "rehomed"
verdict are the ledger's; in a pool of several nodes it follows etcd's
records (``cluster``).  ``ControlServer`` authenticates a call, bounds its
arguments and pages the answer; every rule that names a party is here.

``caller`` is the authenticated host's name or ``wire.control.ADMIN_HOST``.
Methods that take no ``now`` read ``clock`` (a test moves it).  One asyncio
loop owns the ledger, as it owns the ``Pool``: no method interleaves with
another.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from accelmig.pool.ledger.parties import Intent, Parties
from accelmig.pool.ledger.record import LedgerRecord
from accelmig.pool.ledger.sessions import SessionMoves
from accelmig.pool.ledger.steps import RecordSteps
from accelmig.pool.ledger.tickets import TicketBook
from accelmig.wire import attestation as att
from accelmig.wire.control import ADMIN_HOST
from accelmig.wire.errors import Forbidden, NoSuchHost, NoSuchRecord
from accelmig.wire.records import (ABORTABLE, FINAL, IN_FLIGHT, PausePolicy, RecordStateName, Side, Timeline,
                                   record_key)

LOG = logging.getLogger("accelmig.pool")
S = RecordStateName
#: a final record is forgotten this long (s) after its last event
FORGET_AFTER = 3600.0
#: what ``wait`` waits until
UNTIL = ("rehomed", "timeline", "final")


class MigrationLedger(RecordSteps, SessionMoves):
    def __init__(self, config, sessions: dict, metrics, hosts=lambda: {}):
        self.config = config
        self.sessions = sessions              # the pool's sid -> Session (read, never changed here)
        self.metrics = metrics
        self.hosts = hosts                    # -> the pool's hosts now (a reload replaces them)
        self.clock = time.time
        self.records: dict[str, LedgerRecord] = {}
        self._open: dict[str, LedgerRecord] = {}     # the records not final yet (kept by record_changed)
        self._serial = 0
        self.parties = Parties(self.records, self.open_records)
        self.tickets = TicketBook(config.ticket_ttl)
        # sid -> the record whose timeline its next reply stamps (``first_command``);
        # at most one entry per live session, dropped with the session
        self.first_replies: dict[str, LedgerRecord] = {}
        self._waiters: list[asyncio.Future] = []
        self.follower = None          # ledger.cluster.EtcdFollower: set when this node joins a cluster

    def follow(self, follower) -> None:
        """In a pool of several nodes: records follow etcd's from now on
        (``cluster.EtcdFollower``)."""
        follower.ledger = self
        self.follower = follower

    @staticmethod
    def new_migration_id() -> str:
        """THE minter of migration ids (intents and opens that name none)."""
        return secrets.token_hex(6)

    # -- reading -------------------------------------------------------------------------
    def find(self, domain_uuid: str, migration_id: str | None = None, *, source: str | None = None,
             dest: str | None = None, states=None) -> LedgerRecord:
        if migration_id:
            record = self.records.get(record_key(domain_uuid, migration_id))
            if record is None:
                raise NoSuchRecord(record=record_key(domain_uuid, migration_id))
            return record
        candidates = [r for r in self.records.values() if r.domain_uuid == domain_uuid
                      and (states is None or r.state in states)
                      and (source is None or r.source_host in (source, None))
                      and (dest is None or r.dest_host == dest)]
        if not candidates:
            raise NoSuchRecord(record=f"{domain_uuid}/* (no matching record)")
        return max(candidates, key=lambda r: r.opened)

    def open_records(self) -> list[LedgerRecord]:
        return [r for r in self._open.values() if r.state not in FINAL]

    def listed(self, caller, open_only: bool, domain_uuid: str | None) -> list[LedgerRecord]:
        """The records ``caller`` may read (a host: those it takes part in), newest first."""
        records = self.open_records() if open_only else list(self.records.values())
        return [r for r in sorted(records, key=lambda r: -r.serial)
                if (domain_uuid is None or r.domain_uuid == domain_uuid)
                and (caller == ADMIN_HOST or self.parties.is_party(r, caller))]

    def moved_by(self, caller, domain_uuid: str) -> set[str]:
        """The sessions the domain's migrations from ``caller`` moved (its
        source still reads them: ``accelmig migrate`` counts what they sent)."""
        return {sid for r in list(self.records.values()) if r.domain_uuid == domain_uuid
                and r.source_host == caller for sid in r.sessions}

    async def wait(self, caller, domain_uuid: str, migration_id: str | None, until: str,
                   timeout: float) -> tuple[LedgerRecord | None, bool]:
        """The record (that migration's, or the domain's latest) once it is
        rehomed (``until="rehomed"``: the verdict; or aborted), rehomed with
        the destination's steps in its timeline (``"timeline"``) or final
        (``"final"``), or as it is after ``timeout`` seconds; and whether it
        got there.  For a party of the record (or the admin socket) only."""
        def reached(record) -> bool:
            if until == "final":
                return record.final
            if until == "timeline" and record.state is not S.ABORTED:
                return record.rehomed and "answered" in record.stamps
            # closed is not the end of a rehome: the source closes its side
            # as soon as QEMU is gone, the guest's sessions resume after that
            return record.state is S.ABORTED or record.rehomed

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                record = self.find(domain_uuid, migration_id)
            except NoSuchRecord:
                record = None
            remaining = deadline - loop.time()
            if (record is not None and reached(record)) or remaining <= 0:
                break
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, remaining)
            except asyncio.TimeoutError:
                pass
        if record is None:
            return None, False
        self.parties.require_party(record, caller, "wait for")
        return record, reached(record)

    def record_changed(self, record: LedgerRecord) -> None:
        """Wake whoever waits on records (``wait``)."""
        if record.final:
            self._open.pop(record.key, None)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # -- intents and tokens -------------------------------------------------------------
    def register_intent(self, caller, domain_uuid, policy="none", dest_host=None, migration_id=None,
                        source_host=None) -> Intent:
        PausePolicy.parse(policy)
        if dest_host is not None and dest_host not in self.hosts():
            raise NoSuchHost(host=dest_host)
        # The domain's host vouches for where it goes: nobody else names it.
        home = self.parties.domain_host(domain_uuid)
        if caller != ADMIN_HOST and home not in (None, caller):
            raise Forbidden(who=f"host {caller}", what=f"register an intent for domain {domain_uuid}: "
                                                       f"it runs on host {home}")
        now = self.clock()
        intent = Intent(domain_uuid, policy, dest_host, migration_id or self.new_migration_id(),
                        source_host or (caller if caller != ADMIN_HOST else None), now, caller)
        self.parties.intents.register(intent, now)
        return intent

    def register_token(self, caller, domain_uuid, digest) -> dict:
        """The domain's host says which migration token (its SHA-256) the
        running domain carries (``wire.attestation``): ``fresh``, ``in_use``
        or ``spent`` (``pool.attestation.DomainTokens``).  Where no session
        of the domain is bound here (a node of a pool that holds none of
        them) nothing is registered."""
        att.check_hex(digest, "register_token: digest")
        home = self.parties.domain_host(domain_uuid)
        if home is None:
            return {"domain_uuid": domain_uuid, "registered": False, "state": None}
        if home != caller:
            raise Forbidden(who=f"host {caller}", what=f"register the migration token of domain {domain_uuid}: "
                                                       f"it runs on host {home}")
        state = self.parties.tokens.register(domain_uuid, digest, caller, self.records)
        return {"domain_uuid": domain_uuid, "registered": True, "state": state}

    # -- a record's steps, as hosts ask for them ----------------------------------------------
    def open(self, caller, domain_uuid, migration_id=None, domain_name=None, policy=None, postcopy=False,
             token=None) -> LedgerRecord:
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
        now = self.clock()
        parties = self.parties
        named = parties.named_destinations(domain_uuid, now)
        home = parties.domain_host(domain_uuid)
        if named and caller not in named and caller != home:
            raise Forbidden(who=f"host {caller}", what=(
                f"open a migration of domain {domain_uuid}: it goes to host {', '.join(sorted(named))}"
                f" (named by {'its host ' + home if home else 'the admin socket'})"))
        by_token = parties.tokens.vouches(domain_uuid, digest, caller, self.records)
        if token is not None and not by_token:
            LOG.warning("host %s opens a migration of domain %s with a token that is not the domain's "
                        "(or vouched for another destination already): not vouched for", caller, domain_uuid,
                        extra={"host": caller, "domain": domain_uuid})
        record = self.open_record(caller, domain_uuid, migration_id, domain_name, policy, postcopy, now=now,
                                  vouched=by_token or caller in named)
        if by_token:
            parties.tokens.spend(domain_uuid, record.key)
        return record

    def switch_target(self, caller, domain_uuid, migration_id, postcopy: bool) -> LedgerRecord:
        """The record a source's ``switchover`` is about, the source checked."""
        states = set(ABORTABLE) | ({S.COMMITTED, S.COMPLETED} if postcopy else set())
        if migration_id:
            record = self.find(domain_uuid, migration_id, states=states)
        else:
            record = self.parties.switchover_target(caller, domain_uuid, [
                r for r in self.records.values() if r.domain_uuid == domain_uuid and r.state in states])
        self.parties.require_source(record, caller, "switch over")
        return record

    def switchover(self, caller, domain_uuid, migration_id=None, postcopy=False) -> LedgerRecord:
        """The source paused the guest for the last copy (its job really is
        an outgoing migration): the record vouched for, else the only one
        under way, whose destination the source's word then vouches for
        (``Parties.source_vouches``).  With ``postcopy`` the source handed
        the guest over for good (libvirt's SUSPENDED_POSTCOPY on the
        source): the record is committed, whatever the destination's own
        event says (libvirt may report RESUMED_MIGRATED there)."""
        record = self.switch_target(caller, domain_uuid, migration_id, postcopy)
        now = self.clock()
        if self.parties.source_vouches(record, caller):
            LOG.info("record %s: its source %s vouches for %s", record.key, caller, record.dest_host,
                     extra={"domain": record.domain_uuid, "migration": record.migration_id})
            self.vouch_record(record, now)
        if record.state in ABORTABLE:
            self.switchover_record(record, caller, now)
        if postcopy:
            record.postcopy = True
            record.commit(now)
        return record

    def dest_target(self, caller, domain_uuid, migration_id, action: str) -> LedgerRecord:
        """The record the destination's ``commit`` or ``complete`` is about,
        the destination and the vouching checked."""
        states = IN_FLIGHT | ({S.COMPLETED} if action == "complete" else set())
        record = self.find(domain_uuid, migration_id, dest=caller, states=states)
        self.parties.require_dest(record, caller, action)
        if record.state is not S.COMPLETED:
            self.parties.require_vouched(record, caller, action)
        return record

    def commit(self, caller, domain_uuid, migration_id=None) -> LedgerRecord:
        record = self.dest_target(caller, domain_uuid, migration_id, "commit")
        record.commit(self.clock())
        return record

    def complete(self, caller, domain_uuid, migration_id=None) -> LedgerRecord:
        """Freeze the domain's sessions and mint their tickets (the first
        call; a repeat changes nothing): ``ticket_page`` hands them out."""
        record = self.dest_target(caller, domain_uuid, migration_id, "complete")
        if record.state is not S.COMPLETED:
            self.complete_record(record)
        return record

    def close_target(self, caller, domain_uuid, migration_id) -> LedgerRecord:
        record = self.find(domain_uuid, migration_id, source=caller, states=IN_FLIGHT | {S.COMPLETED})
        self.parties.require_source(record, caller, "close")
        return record

    def close(self, caller, domain_uuid, migration_id=None) -> LedgerRecord:
        record = self.close_target(caller, domain_uuid, migration_id)
        record.close(self.clock())
        return record

    def abort_target(self, caller, domain_uuid, migration_id) -> LedgerRecord:
        record = self.find(domain_uuid, migration_id, states=ABORTABLE if migration_id is None else None)
        if caller != ADMIN_HOST and caller not in (self.parties.source_of(record), record.dest_host):
            raise Forbidden(who=f"host {caller}", what=f"abort {record.key}: it takes no part in it")
        return record

    def abort(self, caller, domain_uuid, migration_id=None, reason="aborted by a host") -> LedgerRecord:
        record = self.abort_target(caller, domain_uuid, migration_id)
        self.abort_record(record, f"{reason} (by {caller})")
        return record

    def renew(self, caller, keys) -> tuple[list[LedgerRecord], list[list[str]]]:
        """``keys``: ``(domain_uuid, migration_id)`` pairs: those ``caller``
        takes part in are renewed, the others unknown."""
        now = self.clock()
        renewed, unknown = [], []
        for domain, mid in keys:
            record = self.records.get(record_key(domain, mid))
            if record is None or caller not in (record.source_host, record.dest_host):
                unknown.append([domain, mid])
                continue
            record.renew(now)
            renewed.append(record)
        return renewed, unknown

    def timeline_side(self, caller, domain_uuid, migration_id) -> tuple[LedgerRecord, Side]:
        """The record whose timeline ``caller`` notes, and its side in it: a
        host that takes no part is refused before its steps are even read."""
        record = self.find(domain_uuid, migration_id)
        if caller == record.dest_host:
            return record, Side.DEST
        if caller == self.parties.source_of(record):
            return record, Side.SOURCE
        raise Forbidden(who=f"host {caller}", what=f"note the timeline of {record.key}: "
                                                   "it takes no part in it")

    def note_timeline(self, caller, domain_uuid, migration_id, timeline: Timeline) -> list[str]:
        """A record's party adds the steps it saw (already on the pool's
        clock) to its timeline: its side's steps, and for the destination its
        guest's claims.  The steps taken."""
        record, side = self.timeline_side(caller, domain_uuid, migration_id)
        taken = record.note_steps(side, timeline.steps, self.clock())
        LOG.info("record %s: %s noted %s", record.key, caller, ", ".join(taken) or "nothing new",
                 extra={"domain": record.domain_uuid, "migration": record.migration_id})
        return taken

    # -- the lease and forgetting --------------------------------------------------------------
    def sweep(self, now: float) -> None:
        for record in list(self.records.values()):
            if record.final or now < record.lease_expiry:
                continue
            if record.state in ABORTABLE:
                if self.follower is not None:
                    self.follower.expire(record, now)
                    continue
                self.abort_record(record, "lease expired: no host renewed it", now)
            elif record.state is S.COMMITTED:
                LOG.warning("record %s: lease expired after commit: completing", record.key)
                self.complete_record(record, now)
                record.close(now)
            elif record.state is S.COMPLETED:
                record.close(now)
        if len(self.parties.tokens):
            self.parties.tokens.keep(self.parties.domains())
        # forget final records after a while (bounded memory)
        for key, record in list(self.records.items()):
            if record.final and now - max(record.times.values()) > FORGET_AFTER:
                del self.records[key]
                self.tickets.forget_record(key)
