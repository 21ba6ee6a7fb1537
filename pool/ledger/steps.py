"""A record's steps themselves, once the rules that name a party were
checked (``MigrationLedger``'s host-facing methods, ``parties``): opening
(one record per migration, a newer vouched one superseding an older),
vouching, switching over, completing (the session set frozen, one live
ticket each), aborting (its tickets revoked, its sessions unpaused), and
the pause rule applied to a domain's sessions.  The lease's expiry takes
them too (``MigrationLedger.sweep``), and so does a node following etcd
(``cluster``).  A mixin of ``MigrationLedger`` (one ledger, its files one
concern each).
"""

from __future__ import annotations

import logging

from accelmig.pool.ledger.record import LedgerRecord
from accelmig.wire.errors import Conflict
from accelmig.wire.records import ABORTABLE, PausePolicy, RecordStateName, pauses, record_key

LOG = logging.getLogger("accelmig.pool")
S = RecordStateName


class RecordSteps:
    # (MigrationLedger's: records, _open, _serial, parties, tickets, sessions, metrics, config, clock,
    # follower, record_changed, new_migration_id)

    def open_record(self, dest: str, domain_uuid: str, migration_id: str | None, domain_name: str | None,
                    policy: str | None, postcopy: bool, now: float | None = None,
                    vouched: bool = False) -> LedgerRecord:
        """``vouched``: the domain's host (its token, its intent) vouched for
        ``dest``.  A record nobody vouched for supersedes nothing and pauses
        nothing (the ledger lets it complete or commit nothing of the
        domain's sessions either) until its source vouches at switchover."""
        now = self.clock() if now is None else now
        for record in self.records.values():
            if record.domain_uuid == domain_uuid and record.dest_host == dest and \
                    record.state is S.OPEN and migration_id in (None, record.migration_id):
                record.renew(now)
                if vouched and not record.vouched:
                    self.vouch_record(record, now)
                return record  # the hook notes twice (migrate, prepare): one record
        intent = self.parties.intents.take(domain_uuid, dest, now)
        mid = migration_id or (intent.migration_id if intent else None) or self.new_migration_id()
        source = self.parties.domain_hosts.get(domain_uuid) or (intent.source_host if intent else None)
        if source is None:
            bound = {s.bound_host for s in self.parties.domain_sessions(domain_uuid)} - {None}
            source = bound.pop() if len(bound) == 1 else None
        policy = PausePolicy.parse(policy or (intent.policy if intent else None) or "none")
        for record in list(self.records.values()) if vouched else ():
            if record.domain_uuid == domain_uuid and record.state in ABORTABLE:
                # A domain migrates once at a time: an older unfinished record
                # is stale (only a vouched migration says so: anyone may open one)
                self.abort_record(record, f"superseded by migration {mid}", now)
        if record_key(domain_uuid, mid) in self.records:
            raise Conflict(reason=f"migration id {mid} was used for this domain already")
        return self._add(LedgerRecord(domain_uuid, mid, source, dest, policy, self.config.lease_ttl, now,
                                      domain_name=domain_name, postcopy=postcopy), vouched, now)

    def _add(self, record: LedgerRecord, vouched: bool, now: float, how: str = "opened") -> LedgerRecord:
        """``record`` in the table, in the ledger's order, its sessions held
        if its policy says so."""
        self._serial += 1
        record.serial = self._serial
        record.vouched = vouched
        record.on_change = self.record_changed
        self.records[record.key] = self._open[record.key] = record
        self.record_changed(record)
        self.hold_if_paused(record, self.parties.domain_sessions(record.domain_uuid), now)
        LOG.info("record %s %s: %s -> %s, policy %s%s", record.key, how, record.source_host, record.dest_host,
                 record.policy.value, "" if vouched else " (nobody vouched for it yet)",
                 extra={"domain": record.domain_uuid, "migration": record.migration_id})
        return record

    def vouch_record(self, record: LedgerRecord, now: float | None = None) -> None:
        """The domain's host vouched for ``record``'s destination: from now
        on its policy pauses the domain's sessions."""
        if record.vouched:
            return
        record.vouched = True
        self.hold_if_paused(record, self.parties.domain_sessions(record.domain_uuid),
                            self.clock() if now is None else now)

    def switchover_record(self, record: LedgerRecord, source: str, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        if record.source_host is None:
            record.source_host = source
        if record.switchover(now):
            self.hold_if_paused(record, self.parties.domain_sessions(record.domain_uuid), now)
        record.renew(now)

    @staticmethod
    def hold_if_paused(record: LedgerRecord, sessions, now: float) -> None:
        """Pause ``sessions`` if the record's policy says so in its state (the
        rule itself: ``accelmig.wire.records.pauses``) and the domain's host
        vouched for it: anyone may open a record, not pause a domain."""
        if record.vouched and pauses(record.policy, record.state):
            for session in sessions:
                session.pause(record.key, now)

    def complete_record(self, record: LedgerRecord, now: float | None = None) -> dict[str, str]:
        """The tickets of every session of ``record`` that has not resumed yet.

        Idempotent per migration id: completing again (a second hostd,
        reconciliation racing the event, a retry after a lost answer or a
        failed delivery) hands back the same live tickets, so a ticket already
        on its way to the guest stays valid; only an expired one is replaced."""
        now = self.clock() if now is None else now
        if record.state not in (S.COMPLETED, S.CLOSED):
            sessions = self.parties.domain_sessions(record.domain_uuid)
            if not record.complete(now, [s.sid for s in sessions]):
                return {}
            for session in sessions:
                self.parties.set_moving(session, record)
            self.parties.domain_hosts[record.domain_uuid] = record.dest_host
            self.metrics.migrations.labels("completed").inc()
            LOG.info("record %s completed: %d session(s) frozen, tickets minted for %s",
                     record.key, len(sessions), record.dest_host,
                     extra={"domain": record.domain_uuid, "migration": record.migration_id})
        return {sid: ticket for _, sid, ticket in self.ticket_page(record, 0, now)}

    def ticket_page(self, record: LedgerRecord, start: int, now: float | None = None):
        """``(index, sid, ticket)`` of the sessions of a completed ``record``
        still moving, from index ``start`` of its frozen, sorted sessions:
        the same live tickets at every call (``complete``'s pages)."""
        now = self.clock() if now is None else now
        key = (record.domain_uuid, record.migration_id)
        for index in range(max(0, start), len(record.sessions)):
            sid = record.sessions[index]
            session = self.sessions.get(sid)
            if session is not None and session.pending_move == key:
                yield index, sid, self.tickets.mint_for(sid, record, now)

    def abort_record(self, record: LedgerRecord, reason: str, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        if not record.abort(now, reason):
            return
        self.tickets.revoke_record(record.key, f"ticket revoked: migration {record.migration_id} was "
                                               f"aborted ({reason})", now)
        for session in list(self.sessions.values()):     # (a session unbound since is still paused)
            session.unpause(record.key)
            if session.pending_move == (record.domain_uuid, record.migration_id):
                self.parties.set_moving(session, None)
        self.metrics.migrations.labels("aborted").inc()
        LOG.warning("record %s aborted: %s", record.key, reason,
                    extra={"domain": record.domain_uuid, "migration": record.migration_id})
        if self.follower is not None:
            self.follower.aborted(record, reason)
