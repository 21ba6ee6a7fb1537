"""What the control plane says about migrations and sessions: the record's
states, the pause policies and their one rule, and typed views of the
records and sessions the pool describes.

The pool owns records and sessions; every other side (hostd, the CLIs, the
lab) reads them through ``RecordView.from_wire`` / ``SessionView.from_wire``
and compares states with ``RecordStateName``, never with retyped strings.

A record follows one migration of one domain::

    OPEN --switchover--> SWITCHED_OVER --complete--> COMPLETED --close--> CLOSED
      |                      |    \\                    ^
      |                      |     +--commit--> COMMITTED (post-copy: no way back)
      +------abort-----------+--> ABORTED

Standard library only.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from accelmig.wire.errors import BadRequest, ProtocolError
from accelmig.wire.values import REQUIRED, field, is_number


class RecordStateName(str, enum.Enum):
    OPEN = "open"
    SWITCHED_OVER = "switched_over"
    COMMITTED = "committed"
    COMPLETED = "completed"
    CLOSED = "closed"
    ABORTED = "aborted"


#: Before the guest ran on the destination: the migration can still be undone.
ABORTABLE = frozenset({RecordStateName.OPEN, RecordStateName.SWITCHED_OVER})
#: The guest has not been rehomed yet and a host still has work to do.
IN_FLIGHT = frozenset({RecordStateName.OPEN, RecordStateName.SWITCHED_OVER, RecordStateName.COMMITTED})
#: Nothing more happens to the record.
FINAL = frozenset({RecordStateName.CLOSED, RecordStateName.ABORTED})


class PausePolicy(str, enum.Enum):
    """When the pool stops executing a migrating domain's commands."""

    NONE = "none"              # never: correctness from the reply log alone
    SWITCHOVER = "switchover"  # from the source's switchover
    START = "start"            # from the moment the record opens (the baseline)

    @classmethod
    def parse(cls, value) -> "PausePolicy":
        try:
            return cls(value)
        except ValueError:
            raise BadRequest(reason=f"pause policy {value!r} (none, switchover or start)") from None


def pauses(policy: PausePolicy, state: RecordStateName) -> bool:
    """Whether a domain's sessions are held back while its record is in
    ``state`` under ``policy`` — the one place this rule is written."""
    if state not in ABORTABLE:
        return False          # the guest runs on the destination: its resume unpauses
    if policy is PausePolicy.START:
        return True
    return policy is PausePolicy.SWITCHOVER and state is RecordStateName.SWITCHED_OVER


#: A record view lists its sessions (``sessions``) and their blackouts
#: (``resumed``) inline while it has at most this many; past that it carries
#: only the counts (``session_count``, ``resumed_count``, ``blackout_max``)
#: and the per-session detail is paged (the control plane's
#: ``record_sessions``).  Why: a record is in many answers (``open_migration``,
#: ``switchover``, ``complete``'s every page, ``renew``, ``list_records``,
#: ``wait_record``, hostd's ``status``): none of them may grow with the
#: number of sessions of a domain (64 ids and blackouts are ~4 KiB).
RECORD_INLINE_SESSIONS = 64


def _field(data: dict, key: str, types, what: str, default=REQUIRED):
    """A field of a pool's answer: a wrong one is the pool's protocol error."""
    return field(data, key, types, what, default, error=ProtocolError)


@dataclasses.dataclass(frozen=True)
class RecordView:
    """One migration record as the pool describes it."""

    domain_uuid: str
    migration_id: str
    state: RecordStateName
    dest_host: str
    source_host: str | None = None
    domain_name: str | None = None
    policy: PausePolicy = PausePolicy.NONE
    postcopy: bool = False
    sessions: tuple[str, ...] = ()                              # inline only (see below)
    resumed: dict = dataclasses.field(default_factory=dict)     # sid -> blackout seconds (inline only)
    times: dict = dataclasses.field(default_factory=dict)       # step -> wall-clock time
    timeline: "Timeline" = dataclasses.field(default_factory=lambda: Timeline({}))
    lease_in: float | None = None
    abort_reason: str | None = None
    #: every session frozen by ``complete``, and how many of them resumed;
    #: ``sessions``/``resumed`` list them only while ``inline`` (at most
    #: RECORD_INLINE_SESSIONS): the counts are what to decide on
    session_count: int = 0
    resumed_count: int = 0
    blackout_max: float | None = None
    #: the domain's host vouched for the destination (its migration token, its
    #: intent, or its switchover): only then does the record take its sessions
    vouched: bool = False
    inline: bool = True

    @property
    def key(self) -> str:
        return f"{self.domain_uuid}/{self.migration_id}"

    @property
    def final(self) -> bool:
        return self.state in FINAL

    @property
    def in_flight(self) -> bool:
        return self.state in IN_FLIGHT

    @property
    def unresumed(self) -> set[str]:
        """Sessions frozen by ``complete`` that have not resumed at the
        destination, as far as the view lists them (all of them while
        ``inline``; else page them with ``record_sessions``)."""
        return set(self.sessions) - set(self.resumed)

    @property
    def unresumed_count(self) -> int:
        """How many sessions frozen by ``complete`` have not resumed."""
        return max(0, self.session_count - self.resumed_count)

    @property
    def rehomed(self) -> bool:
        """Completed, with every frozen session resumed."""
        return self.state in (RecordStateName.COMPLETED, RecordStateName.CLOSED) and not self.unresumed_count

    def involves(self, host: str) -> bool:
        return host in (self.source_host, self.dest_host)

    @classmethod
    def from_wire(cls, data) -> "RecordView":
        what = "a migration record"
        if not isinstance(data, dict):
            raise ProtocolError(reason=f"{what} is a {type(data).__name__}, not an object")
        try:
            state = RecordStateName(_field(data, "state", str, what))
            policy = PausePolicy(_field(data, "policy", str, what, "none"))
        except ValueError as exc:
            raise ProtocolError(reason=f"{what}: {exc}") from None
        inline = "sessions" in data
        sessions = tuple(_field(data, "sessions", list, what, []))
        resumed = dict(_field(data, "resumed", dict, what, {}))
        session_count = _field(data, "session_count", int, what, len(sessions))
        resumed_count = _field(data, "resumed_count", int, what, len(resumed))
        if inline and len(sessions) != session_count:
            raise ProtocolError(reason=f"{what}: lists {len(sessions)} sessions inline of "
                                       f"{session_count} (all of them or none)")
        return cls(
            domain_uuid=_field(data, "domain_uuid", str, what),
            migration_id=_field(data, "migration_id", str, what),
            state=state,
            dest_host=_field(data, "dest_host", str, what),
            source_host=_field(data, "source_host", (str, type(None)), what, None),
            domain_name=_field(data, "domain_name", (str, type(None)), what, None),
            policy=policy,
            postcopy=bool(data.get("postcopy", False)),
            sessions=sessions,
            resumed=resumed,
            times=dict(_field(data, "times", dict, what, {})),
            timeline=Timeline.from_wire(_field(data, "timeline", dict, what, {})),
            lease_in=_field(data, "lease_in", (int, float, type(None)), what, None),
            abort_reason=_field(data, "abort_reason", (str, type(None)), what, None),
            session_count=session_count,
            resumed_count=resumed_count,
            blackout_max=_field(data, "blackout_max", (int, float, type(None)), what, None),
            vouched=bool(data.get("vouched", False)),
            inline=inline or session_count == 0,
        )

    def to_wire(self, inline: bool = True) -> dict:
        """As the pool says it; ``inline`` False leaves the per-session lists
        out even where the view has them (hostd's ``status``: counts only)."""
        out = dataclasses.asdict(self)
        out["state"], out["policy"], out["sessions"] = self.state.value, self.policy.value, list(self.sessions)
        out["timeline"] = self.timeline.to_wire()
        del out["inline"]
        if not (inline and self.inline):
            del out["sessions"], out["resumed"]
        return out


# -- the timeline ------------------------------------------------------------------------
#
# One migration's steps on one clock: the pool's (the record's owner keeps
# the timeline).  Each side reads its own clock; the side that collects a
# stamp maps it onto its own clock with an offset estimated NTP-style from a
# request/answer round trip it makes anyway, and keeps the uncertainty:
#
#   hostd (dest) -> pool:  ``complete``'s round trip; its answer says the
#                          pool's ``now``
#   guest -> hostd (dest): the ``rehome`` round trip on the channel; the
#                          agent's answer says when it received the rehome and
#                          when it answered, on the guest's clock
#
# A guest's stamps are claims: bounded in number (the known steps only),
# clamped into the round trip in which they could have happened, and shown,
# never used to decide anything.

class Side(str, enum.Enum):
    """Whose clock a timeline step was read on."""

    POOL = "pool"
    SOURCE = "source"      # the source host's hostd
    DEST = "dest"          # the destination host's hostd
    GUEST = "guest"        # the guest's agent or a driver in it: claims


#: (step, whose clock stamps it, what it means), in the order a migration
#: takes them.  Per-session steps keep the first session's stamp (the
#: blackout ends with the first resumed session; ``rehomed`` with the last).
TIMELINE_STEPS = (
    ("opened", Side.POOL, "record opened (the hook's migrate begin on the destination)"),
    ("suspended_seen", Side.SOURCE, "source hostd saw SUSPENDED_MIGRATED"),
    ("switchover", Side.POOL, "the pool switched the record over"),
    ("resumed_seen", Side.DEST, "destination hostd saw RESUMED_MIGRATED"),
    ("completed", Side.POOL, "complete: sessions frozen, tickets minted"),
    ("identity", Side.DEST, "the destination's identity ready"),
    ("delivering", Side.DEST, "the rehome handed to the channel (or guest-exec)"),
    ("agent_received", Side.GUEST, "the guest agent read the rehome"),
    ("nic_readdressed", Side.GUEST, "the guest's fabric NIC re-addressed"),
    ("driver_connected", Side.GUEST, "a driver's new connection to the pool is up"),
    ("resume_received", Side.POOL, "the pool read a driver's resume"),
    ("resume_answered", Side.POOL, "the pool accepted and answered the resume"),
    ("first_command", Side.POOL, "the first command after the resume completed at the pool"),
    ("rehomed", Side.POOL, "the last session of the domain resumed"),
    ("answered", Side.DEST, "destination hostd got the agent's rehome outcome"),
)
#: (earlier, later): steps the later of which the earlier one causes, so a
#: timeline on one clock has them in this order (within their
#: uncertainties).  The source's switchover and the destination's RESUMED
#: are not in it: libvirt's events reach the two hosts independently.
CAUSAL_ORDER = (
    ("opened", "suspended_seen"), ("suspended_seen", "switchover"), ("opened", "resumed_seen"),
    ("resumed_seen", "completed"), ("completed", "identity"), ("identity", "delivering"),
    ("delivering", "agent_received"), ("agent_received", "nic_readdressed"),
    ("nic_readdressed", "driver_connected"), ("agent_received", "driver_connected"),
    ("driver_connected", "resume_received"), ("resume_received", "resume_answered"),
    ("resume_answered", "first_command"), ("resume_answered", "rehomed"), ("rehomed", "answered"),
)
STEP_NAMES = tuple(name for name, _side, _what in TIMELINE_STEPS)
STEP_SIDES = {name: side for name, side, _what in TIMELINE_STEPS}
STEP_MEANING = {name: what for name, _side, what in TIMELINE_STEPS}
#: a stamp's uncertainty is at most this (s): past it the stamp says nothing
MAX_UNCERTAINTY = 60.0
#: a host's stamps lie within this much (s) of the record's life on the pool's clock
STAMP_SLACK = 3600.0


def _finite(value, what: str) -> float:
    if not is_number(value):
        raise ProtocolError(reason=f"{what} is not a finite number: {str(value)[:40]!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class Stamp:
    """One step on the pool's clock: ``t`` (s since the epoch, pool's
    realtime) within ``err`` s; ``side``: whose clock read it."""

    t: float
    err: float = 0.0
    side: Side = Side.POOL

    def to_wire(self) -> dict:
        return {"t": round(self.t, 6), "err": round(self.err, 6), "side": self.side.value}

    @classmethod
    def from_wire(cls, data, what: str) -> "Stamp":
        if not isinstance(data, dict):
            raise ProtocolError(reason=f"{what} is a {type(data).__name__}, not an object")
        err = _finite(data.get("err", 0.0), f"{what}: err")
        if not 0.0 <= err <= MAX_UNCERTAINTY:
            raise ProtocolError(reason=f"{what}: uncertainty {err} s out of 0..{MAX_UNCERTAINTY:.0f}")
        try:
            side = Side(data.get("side", "pool"))
        except ValueError:
            raise ProtocolError(reason=f"{what}: side {str(data.get('side'))[:20]!r}") from None
        return cls(_finite(data.get("t"), f"{what}: t"), err, side)


@dataclasses.dataclass(frozen=True)
class ClockOffset:
    """How far a remote clock is ahead of ours (``offset`` s, within
    ``err`` s), from one request/answer round trip (NTP's estimate): we sent
    at ``sent``, the remote read it at ``remote_received`` and answered at
    ``remote_answered`` (its clock), we read the answer at ``received``."""

    offset: float
    err: float
    sent: float = -math.inf        # the round trip on our clock: a remote
    received: float = math.inf     # stamp of it happened in between

    @classmethod
    def from_round_trip(cls, sent: float, remote_received, remote_answered, received: float) -> "ClockOffset":
        """The remote stamps are claims: not numbers, or answering before
        receiving, raise ProtocolError; a remote that claims to have worked
        longer than the round trip lasted is taken as answering at once."""
        remote_received = _finite(remote_received, "the remote's receive time")
        remote_answered = _finite(remote_answered, "the remote's answer time")
        if remote_answered < remote_received:
            raise ProtocolError(reason="the remote answered before it received")
        trip = max(0.0, received - sent)
        busy = min(remote_answered - remote_received, trip)
        midpoint_remote = (remote_received + remote_answered) / 2
        return cls(offset=midpoint_remote - (sent + received) / 2, err=(trip - busy) / 2,
                   sent=sent, received=received)

    def to_local(self, remote_t) -> tuple[float, float]:
        """A remote stamp on our clock, and its uncertainty; clamped into the
        round trip it came from (nothing of it happened before we asked or
        after we heard back)."""
        local = _finite(remote_t, "a remote stamp") - self.offset
        return min(max(local, self.sent), self.received), self.err

    def to_remote(self, local_t: float) -> tuple[float, float]:
        """One of our stamps on the remote's clock, and its uncertainty."""
        return local_t + self.offset, self.err

    def onto(self, then: "ClockOffset | None", remote_t, side: Side) -> Stamp:
        """A stamp of this remote carried onto our clock, then (``then``: our
        clock against the collector's) onto the collector's; the
        uncertainties add up.  ProtocolError for a stamp that is no number."""
        local, err = self.to_local(remote_t)
        if then is not None:
            local, more = then.to_remote(local)
            err += more
        return Stamp(local, min(MAX_UNCERTAINTY, err), side)


@dataclasses.dataclass(frozen=True)
class Timeline:
    """A migration's steps on the pool's clock (``Stamp`` per step name)."""

    steps: dict

    @classmethod
    def from_wire(cls, data) -> "Timeline":
        """Only the known steps (``TIMELINE_STEPS``): anything else is a
        ProtocolError, so a timeline is bounded by construction."""
        if not isinstance(data, dict):
            raise ProtocolError(reason=f"a timeline is a {type(data).__name__}, not an object")
        steps = {}
        for name, value in data.items():
            if name not in STEP_SIDES:
                raise ProtocolError(reason=f"a timeline: unknown step {str(name)[:40]!r}")
            steps[name] = Stamp.from_wire(value, f"timeline step {name}")
        return cls(steps)

    def to_wire(self) -> dict:
        return {name: self.steps[name].to_wire() for name in STEP_NAMES if name in self.steps}

    def __contains__(self, name) -> bool:
        return name in self.steps

    def __getitem__(self, name) -> Stamp:
        return self.steps[name]

    @property
    def origin(self) -> float | None:
        """Where the table's times count from: the switchover (the guest
        stopped on the source), else the first step."""
        if "switchover" in self.steps:
            return self.steps["switchover"].t
        return min((s.t for s in self.steps.values()), default=None)

    def rows(self) -> list[dict]:
        """The steps in migration order: ``at_ms`` since the origin, ``step_ms``
        since the step before, ``err_ms``."""
        origin, before, out = self.origin, None, []
        for name in STEP_NAMES:
            stamp = self.steps.get(name)
            if stamp is None:
                continue
            out.append({"step": name, "side": stamp.side.value, "meaning": STEP_MEANING[name],
                        "at_ms": round((stamp.t - origin) * 1000, 3),
                        "step_ms": None if before is None else round((stamp.t - before) * 1000, 3),
                        "err_ms": round(stamp.err * 1000, 3)})
            before = stamp.t
        return out

    def out_of_order(self) -> list[tuple[str, str]]:
        """The pairs of ``CAUSAL_ORDER`` both stamped whose later step lies
        before the earlier one by more than their uncertainties allow."""
        return [(a, b) for a, b in CAUSAL_ORDER if a in self.steps and b in self.steps
                and self.steps[b].t + self.steps[b].err + self.steps[a].err < self.steps[a].t]

    def table(self) -> str:
        """The rows as text (``accelmig migrate``)."""
        lines = [f"{'STEP':17} {'CLOCK':6} {'AT':>10} {'+PREV':>9} {'±':>7}  WHAT"]
        for row in self.rows():
            step = "" if row["step_ms"] is None else f"{row['step_ms']:+.1f}"
            lines.append(f"{row['step']:17} {row['side']:6} {row['at_ms']:>8.1f}ms {step:>9} "
                         f"{row['err_ms']:>5.1f}ms  {row['meaning']}")
        return "\n".join(lines)


def latest(records) -> RecordView | None:
    """The most recently opened of ``records`` (None for none)."""
    return max(records, key=lambda r: r.times.get("opened", 0.0), default=None)


@dataclasses.dataclass(frozen=True)
class SessionView:
    """One session as the pool describes it (``list_sessions``)."""

    sid: str
    tenant: str
    state: str                       # attached, detached, parked, released
    epoch: int
    bound_host: str | None = None
    domain_uuid: str | None = None
    parked: bool = False
    pending_move: tuple[str, ...] = ()
    counters: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def from_wire(cls, data) -> "SessionView":
        what = "a session"
        if not isinstance(data, dict):
            raise ProtocolError(reason=f"{what} is a {type(data).__name__}, not an object")
        return cls(
            sid=_field(data, "sid", str, what),
            tenant=_field(data, "tenant", str, what),
            state=_field(data, "state", str, what),
            epoch=_field(data, "epoch", int, what),
            bound_host=_field(data, "bound_host", (str, type(None)), what, None),
            domain_uuid=_field(data, "domain_uuid", (str, type(None)), what, None),
            parked=bool(data.get("parked", False)),
            pending_move=tuple(_field(data, "pending_move", list, what, [])),
            counters=dict(_field(data, "counters", dict, what, {})),
        )
