"""One domain as this host sees it: its phase, and the one table of how
phases change.

Everything that moves a domain from one phase to another is a ``Trigger``:
a libvirt lifecycle event (``TRIGGERS`` maps them), or something hostd
itself established (the hook's note opened a record, the source confirmed
an outgoing migration, the pool's record says every session resumed,
reconciliation found a guest that arrived while hostd was away).
``WatchPhase.TABLE`` says, per trigger, in which phases it applies, the
phase it leads to and the ``Step`` hostd then takes (the house's one
state-machine idiom, ``accelmig.runtime.statemachine``).  A trigger that
does not apply in the current phase changes nothing.  ``DomainWatch.fire``
is the only way a phase changes, and only under the watch's lock.

``WatchTable`` holds the watches: only accelmig domains get one, a domain
found foreign is remembered by UUID (no ``XMLDesc`` for its later events:
a Nova compute node has many), and a domain that is gone is forgotten.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import time

from accelmig.plugin.hostd.delivery import NoDelivery
from accelmig.plugin.hostd.events import DomainEvent
from accelmig.runtime.statemachine import StateMachine, To, first_match
from accelmig.wire import channel as ch


class Phase(enum.Enum):
    IDLE = "idle"            # known; not (yet) serving sessions here
    RUNNING = "running"      # running here; channel synced, sessions attested
    OUTGOING = "outgoing"    # source: switched over; the channel is left alone
    INCOMING = "incoming"    # destination: record open, guest not running yet
    REHOMING = "rehoming"    # destination: guest runs here, not every session moved yet
    SAVED = "saved"          # saved to disk; sessions parked
    GONE = "gone"            # migrated away, stopped or undefined


class Trigger(enum.Enum):
    # libvirt's events (TRIGGERS)
    BOOTED = "booted"
    ARRIVING = "arriving"                      # STARTED_MIGRATED: the incoming QEMU exists
    RESUMED_HERE = "resumed_here"              # RESUMED_MIGRATED
    RESUMED_POSTCOPY = "resumed_postcopy"
    PAUSED_FOR_MIGRATION = "paused_for_migration"
    PAUSED_FOR_POSTCOPY = "paused_for_postcopy"
    MIGRATED_AWAY = "migrated_away"            # STOPPED_MIGRATED
    STOPPED = "stopped"
    SAVED = "saved"
    RESTORED = "restored"                      # a restore or a snapshot revert
    UNDEFINED = "undefined"
    # hostd's own
    HOOK_INCOMING = "hook_incoming"            # migrate begin: the record is open
    SWITCHED_OVER = "switched_over"            # the source's job really is an outgoing migration
    SWITCHED_OVER_POSTCOPY = "switched_over_postcopy"
    REHOMED = "rehomed"                        # every session resumed here
    REHOME_ENDED = "rehome_ended"              # the record ended before they all did
    FOUND_ARRIVED = "found_arrived"            # reconciliation: it arrived while hostd was away
    FOUND_ARRIVING = "found_arriving"          # reconciliation: still paused, arriving
    FOUND_RUNNING = "found_running"            # reconciliation: runs here, nothing pending


class Step(enum.Enum):
    """What hostd does when a transition fires (HostDaemon has one coroutine each)."""

    NOTHING = "nothing"
    ATTEST = "attest"                          # connect, tell the guest where the pool is, bind sessions
    PRECONNECT = "preconnect"                  # destination: be connected when the guest resumes
    CHECK_OUTGOING = "check_outgoing"          # source: is this pause an outgoing migration?
    CHECK_OUTGOING_POSTCOPY = "check_outgoing_postcopy"
    SWITCH_OVER = "switch_over"                # tell the pool; stop using the channel
    SWITCH_OVER_POSTCOPY = "switch_over_postcopy"
    REHOME = "rehome"                          # complete, deliver tickets and identity, retry
    REHOME_POSTCOPY = "rehome_postcopy"        # commit first: there is no way back
    ABORT_STAYED = "abort_stayed"              # source: the guest resumed here, the migration failed
    CLOSE = "close"                            # source: the guest left: close the record
    ABORT_ARRIVAL = "abort_arrival"            # destination: the arrival failed
    PARK = "park"
    UNPARK = "unpark"                          # a restored copy: resume its drivers here
    FORGET = "forget"                          # stopped or undefined: close the channel


ANY = frozenset(Phase)
ARRIVING = frozenset({Phase.INCOMING, Phase.REHOMING})
HERE = frozenset({Phase.IDLE, Phase.RUNNING})

def _rows(*rows) -> dict:
    """``first_match`` over ``(phases, next phase or None to stay, step)``."""
    return first_match(*((phases, To(target, step)) for phases, target, step in rows))


class WatchPhase(StateMachine):
    """A domain's phase and the one table of how it changes: per trigger,
    the phases it applies in, the phase it leads to (None: stays) and the
    ``Step`` hostd then takes; the first row that applies wins.  A trigger
    that does not apply in the current phase changes nothing."""

    INITIAL = Phase.IDLE
    UNLISTED = "ignore"
    TABLE = {
        Trigger.BOOTED: _rows((ANY, Phase.RUNNING, Step.ATTEST)),
        Trigger.ARRIVING: _rows((ANY, Phase.INCOMING, Step.PRECONNECT)),
        Trigger.HOOK_INCOMING: _rows((ANY, Phase.INCOMING, Step.NOTHING)),
        Trigger.RESUMED_HERE: _rows((frozenset({Phase.OUTGOING}), Phase.RUNNING, Step.ABORT_STAYED),
                                    (ANY, Phase.REHOMING, Step.REHOME)),
        Trigger.RESUMED_POSTCOPY: _rows((ANY, Phase.REHOMING, Step.REHOME_POSTCOPY)),
        Trigger.PAUSED_FOR_MIGRATION: _rows((HERE, None, Step.CHECK_OUTGOING)),
        Trigger.PAUSED_FOR_POSTCOPY: _rows((HERE | {Phase.OUTGOING}, None, Step.CHECK_OUTGOING_POSTCOPY)),
        Trigger.SWITCHED_OVER: _rows((HERE, Phase.OUTGOING, Step.SWITCH_OVER)),
        Trigger.SWITCHED_OVER_POSTCOPY: _rows((HERE | {Phase.OUTGOING}, Phase.OUTGOING, Step.SWITCH_OVER_POSTCOPY)),
        Trigger.MIGRATED_AWAY: _rows((ANY, Phase.GONE, Step.CLOSE)),
        # Whatever the reason libvirt gives (FAILED, CRASHED, DESTROYED), a domain
        # that stops while still arriving is a failed migration.
        Trigger.STOPPED: _rows((ARRIVING, Phase.GONE, Step.ABORT_ARRIVAL),
                               (ANY, Phase.GONE, Step.FORGET)),
        Trigger.SAVED: _rows((ANY, Phase.SAVED, Step.PARK)),
        Trigger.RESTORED: _rows((ANY, Phase.RUNNING, Step.UNPARK)),
        Trigger.UNDEFINED: _rows((ANY, Phase.GONE, Step.FORGET)),
        # the pool's record says every session resumed here (never the guest's word alone)
        Trigger.REHOMED: _rows((frozenset({Phase.REHOMING}), Phase.RUNNING, Step.NOTHING)),
        Trigger.REHOME_ENDED: _rows((frozenset({Phase.REHOMING}), Phase.RUNNING, Step.NOTHING)),
        Trigger.FOUND_ARRIVED: _rows((ANY - {Phase.REHOMING}, Phase.REHOMING, Step.REHOME)),
        Trigger.FOUND_ARRIVING: _rows((ANY, Phase.INCOMING, Step.NOTHING)),
        Trigger.FOUND_RUNNING: _rows((HERE, Phase.RUNNING, Step.ATTEST)),
    }


#: libvirt's events that move a domain; any other event changes nothing
TRIGGERS: dict[DomainEvent, Trigger] = {
    DomainEvent.STARTED_BOOTED: Trigger.BOOTED,
    DomainEvent.STARTED_WAKEUP: Trigger.BOOTED,
    DomainEvent.STARTED_RECREATED: Trigger.BOOTED,
    DomainEvent.RESUMED_UNPAUSED: Trigger.BOOTED,
    DomainEvent.STARTED_MIGRATED: Trigger.ARRIVING,
    DomainEvent.RESUMED_MIGRATED: Trigger.RESUMED_HERE,
    DomainEvent.RESUMED_POSTCOPY: Trigger.RESUMED_POSTCOPY,
    DomainEvent.SUSPENDED_MIGRATED: Trigger.PAUSED_FOR_MIGRATION,
    DomainEvent.SUSPENDED_POSTCOPY: Trigger.PAUSED_FOR_POSTCOPY,
    DomainEvent.STOPPED_MIGRATED: Trigger.MIGRATED_AWAY,
    DomainEvent.STOPPED_SAVED: Trigger.SAVED,
    DomainEvent.STOPPED_SHUTDOWN: Trigger.STOPPED,
    DomainEvent.STOPPED_DESTROYED: Trigger.STOPPED,
    DomainEvent.STOPPED_CRASHED: Trigger.STOPPED,
    DomainEvent.STOPPED_FAILED: Trigger.STOPPED,
    DomainEvent.STOPPED_FROM_SNAPSHOT: Trigger.STOPPED,
    DomainEvent.STOPPED_RECREATED: Trigger.STOPPED,
    DomainEvent.STARTED_RESTORED: Trigger.RESTORED,
    DomainEvent.STARTED_FROM_SNAPSHOT: Trigger.RESTORED,
    DomainEvent.RESUMED_FROM_SNAPSHOT: Trigger.RESTORED,
    DomainEvent.UNDEFINED_REMOVED: Trigger.UNDEFINED,
}


class DomainWatch:
    """One accelmig domain on this host."""

    def __init__(self, uuid: str, name: str):
        self.uuid = uuid
        self.name = name
        self.machine = WatchPhase()
        # One event (or reconciliation, a retry, the hook's note) at a time:
        # the phase, ``record`` and what a step does change only under it
        self.lock = asyncio.Lock()
        self.record = None                       # the RecordView this host takes part in
        self.delivery = NoDelivery()             # how rehomes reach the guest: set from the live XML
        self.channel_path: str | None = None
        self.sessions: set[str] = set()          # attested here
        # what the guest reported and is not attested yet: sid -> new (needs a proof)
        self.unattested: dict[str, bool] = {}
        self.attest_dropped = False               # (said once: reports past MAX_PENDING dropped)
        self.attesting: asyncio.Task | None = None
        # the migration token in the live XML, and whether the pool has it as this host's
        self.token: str | None = None
        self.token_registered = False
        self.token_busy = False
        self.token_retry_at = 0.0                 # (monotonic) not tried again before
        self.fabric_mac: str | None = None
        # False for a domain nobody marked (a Nova instance, found by its
        # sessions): its NICs are another system's, never re-addressed
        self.marked = True
        self.last_rehome: dict | None = None
        self.rehome_retry: dict | None = None    # a rehome waiting to be tried again, and why
        self.retry_task: asyncio.Task | None = None
        self.history: collections.deque = collections.deque(maxlen=20)
        # the identity made ready for an incoming guest before it runs (``prestage``)
        self.staged_identity = None
        # event name -> when hostd read it from libvirt (its own clock): the timeline
        self.event_seen: dict[str, float] = {}

    @property
    def phase(self) -> Phase:
        return self.machine.state

    def fire(self, trigger: Trigger) -> Step | None:
        """Apply ``trigger``: the step to take, or None when it does not
        apply now.  Only under the watch's lock: a phase changed beside a
        step under way is the race the lock exists to remove."""
        if not self.lock.locked():
            raise RuntimeError(f"domain {self.name}: {trigger.name} fired outside its watch's lock (a bug)")
        old = self.machine.state
        outcome = self.machine.fire(trigger)
        if outcome is None:
            return None
        if outcome.state is not None:       # (a row that names its phase again is shown too)
            self.history.append((round(time.time(), 3), trigger.value, old.value, outcome.state.value))
        return outcome.then

    def note(self, what: str) -> None:
        """Something worth showing in ``status`` that moved no phase (a hook note)."""
        self.history.append((round(time.time(), 3), what, self.phase.value, self.phase.value))

    #: what ``status`` says of one domain stays small whatever its number of
    #: sessions (the local API answers in one line): at most this many of
    #: its session ids, and of its last rehome the counts and a few failures
    STATUS_SESSIONS = 16
    STATUS_OUTCOME_BYTES = 2048

    def describe(self) -> dict:
        channel = getattr(self.delivery, "channel", None)
        last = self.last_rehome
        if last is not None and isinstance(last.get("result"), dict):
            last = dict(last, result=ch.bounded_outcome(last["result"], self.STATUS_OUTCOME_BYTES))
        sessions = sorted(self.sessions)
        return {"uuid": self.uuid, "name": self.name, "phase": self.phase.value,
                "delivery": getattr(self.delivery, "name", None), "marked": self.marked,
                "channel": {"path": self.channel_path, "connected": channel is not None,
                            "synced": bool(channel is not None and channel.hello)},
                "sessions": sessions[:self.STATUS_SESSIONS], "session_count": len(sessions),
                # the migration token in the running domain, and whether the pool has it as this host's
                "migration_token": {"present": self.token is not None, "registered": self.token_registered},
                "record": self.record.to_wire(inline=False) if self.record is not None else None,
                "last_rehome": last, "rehome_retry": self.rehome_retry,
                "history": [{"at": at, "trigger": t, "from": a, "to": b} for at, t, a, b in self.history]}


class WatchTable:
    """The watches of this host's accelmig domains, and the UUIDs of the
    foreign ones (bounded: the oldest are forgotten first)."""

    FOREIGN_MEMORY = 4096
    JOB_MEMORY = 256

    def __init__(self):
        self.watches: dict[str, DomainWatch] = {}
        self._foreign: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._jobs: collections.OrderedDict[str, dict] = collections.OrderedDict()

    def get(self, uuid: str) -> DomainWatch | None:
        return self.watches.get(uuid)

    def add(self, uuid: str, name: str) -> DomainWatch:
        watch = self.watches.get(uuid)
        if watch is None:
            watch = self.watches[uuid] = DomainWatch(uuid, name)
        watch.name = name
        self._foreign.pop(uuid, None)
        return watch

    def is_foreign(self, uuid: str) -> bool:
        return uuid in self._foreign

    def mark_foreign(self, uuid: str) -> None:
        self.watches.pop(uuid, None)
        self._foreign[uuid] = None
        self._foreign.move_to_end(uuid)
        while len(self._foreign) > self.FOREIGN_MEMORY:
            self._foreign.popitem(last=False)

    def forget_foreign(self, uuid: str) -> None:
        """Its XML changed: look at it again at its next event."""
        self._foreign.pop(uuid, None)

    def evict(self, watch: DomainWatch) -> None:
        if self.watches.get(watch.uuid) is watch and watch.phase is Phase.GONE and \
                (watch.retry_task is None or watch.retry_task.done()):
            del self.watches[watch.uuid]

    def note_job(self, uuid: str, stats: dict) -> None:
        """A completed job's stats (downtime), kept after the domain left."""
        self._jobs[uuid] = stats
        self._jobs.move_to_end(uuid)
        while len(self._jobs) > self.JOB_MEMORY:
            self._jobs.popitem(last=False)

    def job(self, uuid: str) -> dict | None:
        return self._jobs.get(uuid)

    def __iter__(self):
        return iter(list(self.watches.values()))

    def __len__(self) -> int:
        return len(self.watches)

    @property
    def foreign_count(self) -> int:
        return len(self._foreign)
