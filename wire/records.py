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

from accelmig.wire.errors import BadRequest, ProtocolError


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


def _field(data: dict, key: str, types, what: str, default=dataclasses.MISSING):
    if key not in data:
        if default is dataclasses.MISSING:
            raise ProtocolError(reason=f"{what} without {key!r}")
        return default
    value = data[key]
    if not isinstance(value, types):
        raise ProtocolError(reason=f"{what}: {key!r} is a {type(value).__name__}")
    return value


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
    lease_in: float | None = None
    abort_reason: str | None = None
    #: every session frozen by ``complete``, and how many of them resumed;
    #: ``sessions``/``resumed`` list them only while ``inline`` (at most
    #: RECORD_INLINE_SESSIONS): the counts are what to decide on
    session_count: int = 0
    resumed_count: int = 0
    blackout_max: float | None = None
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
            lease_in=_field(data, "lease_in", (int, float, type(None)), what, None),
            abort_reason=_field(data, "abort_reason", (str, type(None)), what, None),
            session_count=session_count,
            resumed_count=resumed_count,
            blackout_max=_field(data, "blackout_max", (int, float, type(None)), what, None),
            inline=inline or session_count == 0,
        )

    def to_wire(self, inline: bool = True) -> dict:
        """As the pool says it; ``inline`` False leaves the per-session lists
        out even where the view has them (hostd's ``status``: counts only)."""
        out = dataclasses.asdict(self)
        out["state"], out["policy"], out["sessions"] = self.state.value, self.policy.value, list(self.sessions)
        del out["inline"]
        if not (inline and self.inline):
            del out["sessions"], out["resumed"]
        return out


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
