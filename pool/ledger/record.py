"""One migration of one domain, as the pool's ledger keeps it.

Its states and their diagram are the control plane's contract
(``accelmig.wire.records``); ``LedgerRecord.TABLE`` is the one table of how
they change (``accelmig.runtime.statemachine``), and etcd's copy of a record
in a pool of several nodes takes its steps by the same table
(``pool.cluster.records``).

``complete`` freezes the set of the domain's sessions (sessions opened during
pre-copy included); the ledger mints their tickets (``pool.ledger.tickets``).
``abort`` is refused once the guest has run on the destination (COMMITTED,
COMPLETED, CLOSED).  The record lives under a lease the hosts renew: an
expired lease aborts it before commit and completes it after (the ledger's
sweep).  ``view`` is what the control plane says of it: a
``wire.records.RecordView``, whose ``to_wire`` is the one serialiser.
"""

from __future__ import annotations

import enum
import time

from accelmig.runtime.statemachine import StateMachine
from accelmig.wire.errors import RecordState
from accelmig.wire.records import (FINAL, RECORD_INLINE_SESSIONS, STAMP_SLACK, STATE_TIMES, STEP_SIDES,
                                   PausePolicy, RecordStateName, RecordView, Side, Stamp, Timeline, record_key)

S = RecordStateName


class RecordEvent(str, enum.Enum):
    """What happens to a record (the control plane's methods of that name;
    etcd's steps are named by the same strings)."""

    SWITCHOVER = "switchover"     # the source paused the guest for the last copy
    COMMIT = "commit"             # post-copy started: the guest runs on the destination, no way back
    COMPLETE = "complete"         # the guest runs on the destination: sessions frozen, tickets minted
    CLOSE = "close"               # the source's QEMU stopped after a successful migration
    ABORT = "abort"


#: what a refusal says the host tried
_ACTIONS = {RecordEvent.SWITCHOVER: "switch over", RecordEvent.COMMIT: "commit",
            RecordEvent.COMPLETE: "complete", RecordEvent.CLOSE: "close", RecordEvent.ABORT: "abort"}


class LedgerRecord(StateMachine):
    INITIAL = S.OPEN
    FINAL = FINAL
    TABLE = {
        RecordEvent.SWITCHOVER: {S.OPEN: S.SWITCHED_OVER},
        RecordEvent.COMMIT: {S.OPEN: S.COMMITTED, S.SWITCHED_OVER: S.COMMITTED},
        RecordEvent.COMPLETE: {S.OPEN: S.COMPLETED, S.SWITCHED_OVER: S.COMPLETED, S.COMMITTED: S.COMPLETED},
        RecordEvent.CLOSE: {S.COMPLETED: S.CLOSED},
        RecordEvent.ABORT: {S.OPEN: S.ABORTED, S.SWITCHED_OVER: S.ABORTED},
    }
    #: harmless repeats: hosts retry, events come twice
    REPEATS = {
        RecordEvent.SWITCHOVER: frozenset({S.SWITCHED_OVER}),
        RecordEvent.COMMIT: frozenset({S.COMMITTED, S.COMPLETED, S.CLOSED}),
        RecordEvent.COMPLETE: frozenset({S.COMPLETED, S.CLOSED}),
        RecordEvent.CLOSE: frozenset({S.CLOSED}),
        RecordEvent.ABORT: frozenset({S.ABORTED}),
    }

    def __init__(self, domain_uuid: str, migration_id: str, source_host: str | None,
                 dest_host: str, policy: PausePolicy, lease_ttl: float, now: float,
                 domain_name: str | None = None, postcopy: bool = False, serial: int = 0):
        self.domain_uuid = domain_uuid
        self.migration_id = migration_id
        self.key = record_key(domain_uuid, migration_id)
        self.serial = serial                    # the ledger's order of records (pages of list_records)
        self.source_host, self.dest_host, self.domain_name = source_host, dest_host, domain_name
        self.policy, self.postcopy, self.lease_ttl = policy, postcopy, lease_ttl
        self.lease_expiry = now + lease_ttl
        self.entered: dict[S, float] = {S.OPEN: now}   # when it entered each state (on_transition)
        self.source_stopped: float | None = None       # when the source's QEMU stopped
        self.sessions: list[str] = []          # frozen at complete, sorted (pages index it)
        self.resumed: dict[str, float] = {}    # sid -> seconds from switchover/complete to resume
        self.blackout_max: float | None = None
        # the domain's host vouched for the destination (its migration token,
        # its intent, or its switchover): only then does it take its sessions
        self.vouched = False
        self.abort_reason: str | None = None
        # the timeline's steps beyond the states entered: the first stamp of each
        self.stamps: dict[str, Stamp] = {}
        self.on_change = None                   # called after every transition and resume
        super().__init__()

    # -- the machine -----------------------------------------------------------------
    def refuse(self, event: RecordEvent) -> None:
        """A host asked for a step the record cannot take: its request, not a bug."""
        raise RecordState(record=self.key, state=self.state.value, action=_ACTIONS[event])

    def on_transition(self, old, new, event, now: float = 0.0, **_context) -> None:
        self.entered.setdefault(new, now)
        self._changed()

    def _step(self, event: RecordEvent, now: float) -> bool:
        """Take ``event``: True if the state changed, False for a repeat."""
        return self.fire(event, now=now) is not None

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)

    @property
    def final(self) -> bool:
        return self.state in FINAL

    @property
    def rehomed(self) -> bool:
        """THE verdict: completed (or closed since), every frozen session
        resumed (``resumed`` only ever names frozen sessions: their tickets)."""
        return self.state in (S.COMPLETED, S.CLOSED) and len(self.resumed) >= len(self.sessions)

    @property
    def opened(self) -> float:
        return self.entered[S.OPEN]

    @property
    def times(self) -> dict[str, float]:
        """When it entered each state, by the names of ``wire.records.STATE_TIMES``,
        and when its source stopped."""
        out = {STATE_TIMES[state]: when for state, when in self.entered.items()}
        if self.source_stopped is not None:
            out["source_stopped"] = self.source_stopped
        return out

    def switchover(self, now: float) -> bool:
        return self._step(RecordEvent.SWITCHOVER, now)

    def commit(self, now: float) -> bool:
        return self._step(RecordEvent.COMMIT, now)

    def complete(self, now: float, sessions: list[str]) -> bool:
        """Freeze ``sessions``; a source that stopped already closes it too."""
        if not self._step(RecordEvent.COMPLETE, now):
            return False
        self.sessions = sorted(sessions)
        if self.source_stopped is not None:
            self._step(RecordEvent.CLOSE, now)
        return True

    def close(self, now: float) -> bool:
        """The source's QEMU stopped after a successful migration (it may come
        before the destination completes: then completing closes).  Not a
        state of its own before COMPLETED: a flag, so it is no transition."""
        if self.source_stopped is None:
            self.source_stopped = now
        if self.state is S.COMPLETED:
            return self._step(RecordEvent.CLOSE, now)
        return False

    def abort(self, now: float, reason: str) -> bool:
        if not self._step(RecordEvent.ABORT, now):
            return False
        self.abort_reason = reason
        return True

    def renew(self, now: float) -> None:
        if not self.final:
            self.lease_expiry = now + self.lease_ttl

    # -- resumes and the timeline --------------------------------------------------------
    def note_resumed(self, sid: str, blackout: float, now: float | None = None) -> None:
        """Session ``sid`` resumed at the destination, ``blackout`` s after it stopped."""
        self.resumed[sid] = round(blackout, 6)
        self.blackout_max = max(self.blackout_max or 0.0, self.resumed[sid])
        if now is not None:
            self.stamp("resume_answered", now)
            if len(self.resumed) >= len(self.sessions):
                self.stamp("rehomed", now)
        self._changed()

    def stamp(self, step: str, now: float) -> None:
        """The pool saw ``step`` (its own clock); the first stamp stays."""
        self.stamps.setdefault(step, Stamp(now))

    def note_steps(self, side: Side, steps: dict[str, Stamp], now: float) -> list[str]:
        """Steps a host stamped and mapped onto the pool's clock: only the
        steps read on that host's clock or claimed by its guest (a host cannot
        rewrite the pool's own), within the record's life, first stamp
        staying.  The steps taken."""
        taken = []
        for step, stamp in steps.items():
            if STEP_SIDES.get(step) not in (side, Side.GUEST) or stamp.side is not STEP_SIDES[step]:
                continue
            if side is Side.SOURCE and STEP_SIDES[step] is Side.GUEST:
                continue          # the guest runs on the destination: the source relays none of it
            if not self.opened - STAMP_SLACK <= stamp.t <= now + STAMP_SLACK or step in self.stamps:
                continue
            self.stamps[step] = stamp
            taken.append(step)
        if taken:
            self._changed()           # (``wait`` until the timeline is in)
        return taken

    @property
    def timeline(self) -> Timeline:
        """The states entered that are steps of the timeline (opened,
        switchover, completed), then every other step stamped."""
        steps = {STATE_TIMES[state]: Stamp(when) for state, when in self.entered.items()
                 if STATE_TIMES[state] in STEP_SIDES}
        steps.update(self.stamps)
        return Timeline(steps)

    def view(self, now: float | None = None) -> RecordView:
        """The record as the control plane says it: bounded whatever the
        number of its sessions (``RECORD_INLINE_SESSIONS``: the lists inline
        only while they are short; ``record_sessions`` pages them)."""
        now = time.time() if now is None else now
        inline = len(self.sessions) <= RECORD_INLINE_SESSIONS
        return RecordView(
            domain_uuid=self.domain_uuid, migration_id=self.migration_id, state=self.state,
            dest_host=self.dest_host, source_host=self.source_host, domain_name=self.domain_name,
            policy=self.policy, postcopy=self.postcopy,
            sessions=tuple(self.sessions) if inline else (), resumed=dict(self.resumed) if inline else {},
            times=self.times, timeline=self.timeline, lease_in=round(self.lease_expiry - now, 3),
            abort_reason=self.abort_reason, session_count=len(self.sessions), resumed_count=len(self.resumed),
            blackout_max=self.blackout_max, vouched=self.vouched, rehomed=self.rehomed, inline=inline)

    def to_wire(self, now: float | None = None) -> dict:
        """``view(now).to_wire()``: what every answer about a record carries."""
        return self.view(now).to_wire()

    def __repr__(self) -> str:
        return f"<LedgerRecord {self.key} {self.state.name}>"
