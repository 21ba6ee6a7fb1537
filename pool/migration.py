"""Migration records and resume tickets: the pool's side of a live migration.

A record follows one migration of one domain, keyed by (domain UUID,
migration id) — a domain can be renamed on the way (``--dname``) and a
return migration can overlap the previous one's cleanup.  Its states and
their diagram are the control plane's contract (``accelmig.wire.records``);
``MigrationRecord.TRANSITIONS`` is the one table of how they change.

``complete`` freezes the set of the domain's sessions (sessions opened during
pre-copy included) and mints one resume ticket per session, bound to the
migration and to the destination host.  ``abort`` is refused once the guest
has run on the destination (COMMITTED, COMPLETED, CLOSED).

The pool owns a record's lifetime: it lives under a lease the hosts renew.
An expired lease aborts a record before commit and completes it after.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import hashlib
import hmac
import json
import secrets
import time

from accelmig.wire.errors import RecordState, TicketInvalid
from accelmig.wire.records import (FINAL, RECORD_INLINE_SESSIONS, STAMP_SLACK, STEP_SIDES, PausePolicy,
                                   RecordStateName, Side, Stamp, Timeline)

S = RecordStateName


class MigrationRecord:
    #: event -> {state it may happen in: the state it leads to}
    TRANSITIONS = {
        "switchover": {S.OPEN: S.SWITCHED_OVER},
        "commit": {S.OPEN: S.COMMITTED, S.SWITCHED_OVER: S.COMMITTED},
        "complete": {S.OPEN: S.COMPLETED, S.SWITCHED_OVER: S.COMPLETED, S.COMMITTED: S.COMPLETED},
        "close": {S.COMPLETED: S.CLOSED},
        "abort": {S.OPEN: S.ABORTED, S.SWITCHED_OVER: S.ABORTED},
    }
    #: event -> the ``times`` entry it stamps
    STAMPS = {"switchover": "switchover", "commit": "committed", "complete": "completed",
              "close": "closed", "abort": "aborted"}
    #: event -> states in which it is a harmless repeat (hosts retry; events come twice)
    REPEATS = {
        "switchover": {S.SWITCHED_OVER},
        "commit": {S.COMMITTED, S.COMPLETED, S.CLOSED},
        "complete": {S.COMPLETED, S.CLOSED},
        "close": {S.CLOSED},
        "abort": {S.ABORTED},
    }

    def __init__(self, domain_uuid: str, migration_id: str, source_host: str | None,
                 dest_host: str, policy: PausePolicy, lease_ttl: float, now: float,
                 domain_name: str | None = None, postcopy: bool = False, serial: int = 0):
        self.domain_uuid = domain_uuid
        self.serial = serial                    # the pool's order of records (pages of list_records)
        self.migration_id = migration_id
        self.source_host = source_host
        self.dest_host = dest_host
        self.policy = policy
        self.domain_name = domain_name
        self.postcopy = postcopy
        self.state = S.OPEN
        self.lease_ttl = lease_ttl
        self.lease_expiry = now + lease_ttl
        self.times: dict[str, float] = {"opened": now}
        self.sessions: list[str] = []          # frozen at complete, sorted (pages index it)
        self.tickets: dict[str, str] = {}      # sid -> ticket nonce
        self.resumed: dict[str, float] = {}    # sid -> seconds from switchover/complete to resume
        self.blackout_max: float | None = None
        self.source_stopped = False
        # the domain's own host (or the admin socket) named this destination
        # before it opened: only a named host may then supersede it
        self.vouched = False
        self.abort_reason: str | None = None
        # the migration's timeline beyond ``times``: first stamp of each step
        self.stamps: dict[str, Stamp] = {}
        self.on_change = None                   # called after every transition and resume

    @property
    def key(self) -> str:
        return f"{self.domain_uuid}/{self.migration_id}"

    @property
    def final(self) -> bool:
        return self.state in FINAL

    def _step(self, event: str, now: float, action: str) -> bool:
        """Apply ``event``: True if the state changed, False for a repeat."""
        target = self.TRANSITIONS[event].get(self.state)
        if target is None:
            if self.state in self.REPEATS[event]:
                return False
            raise RecordState(record=self.key, state=self.state.value, action=action)
        self.state = target
        self.times[self.STAMPS[event]] = now
        self._changed()
        return True

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)

    def note_resumed(self, sid: str, blackout: float, now: float | None = None) -> None:
        """Session ``sid`` resumed at the destination, ``blackout`` s after it stopped."""
        self.resumed[sid] = round(blackout, 6)
        self.blackout_max = max(self.blackout_max or 0.0, self.resumed[sid])
        if now is not None:
            self.stamp("resume_answered", now)
            if len(self.resumed) >= len(self.sessions):
                self.stamp("rehomed", now)
        self._changed()

    #: the steps the pool stamps from ``times`` (its transitions)
    TIMES_STEPS = {"opened": "opened", "switchover": "switchover", "completed": "completed"}

    def stamp(self, step: str, now: float) -> None:
        """The pool saw ``step`` (its own clock); the first stamp stays."""
        self.stamps.setdefault(step, Stamp(now))

    def note_steps(self, side: Side, steps: dict[str, Stamp], now: float) -> list[str]:
        """Steps a host stamped and mapped onto the pool's clock: only the
        steps read on that host's clock or claimed by its guest (a host cannot
        rewrite the pool's own), within the record's life, first stamp
        staying.  The steps taken."""
        opened = self.times["opened"]
        taken = []
        for step, stamp in steps.items():
            if STEP_SIDES.get(step) not in (side, Side.GUEST) or stamp.side is not STEP_SIDES[step]:
                continue
            if side is Side.SOURCE and STEP_SIDES[step] is Side.GUEST:
                continue          # the guest runs on the destination: the source relays none of it
            if not opened - STAMP_SLACK <= stamp.t <= now + STAMP_SLACK or step in self.stamps:
                continue
            self.stamps[step] = stamp
            taken.append(step)
        if taken:
            self._changed()           # (``wait_record`` until the timeline is in)
        return taken

    @property
    def timeline(self) -> Timeline:
        steps = {step: Stamp(self.times[key]) for step, key in self.TIMES_STEPS.items() if key in self.times}
        steps.update(self.stamps)
        return Timeline(steps)

    def renew(self, now: float) -> None:
        if not self.final:
            self.lease_expiry = now + self.lease_ttl

    def switchover(self, now: float) -> bool:
        """Source paused the guest for the last copy."""
        return self._step("switchover", now, "switch over")

    def commit(self, now: float) -> bool:
        """Post-copy started: the guest runs on the destination, no way back."""
        return self._step("commit", now, "commit")

    def complete(self, now: float, sessions: list[str]) -> bool:
        if not self._step("complete", now, "complete"):
            return False
        self.sessions = sorted(sessions)
        if self.source_stopped:
            self._step("close", now, "close")
        return True

    def close(self, now: float) -> bool:
        """The source's QEMU stopped after a successful migration (it may come
        before the destination completes: then completing closes)."""
        self.source_stopped = True
        self.times.setdefault("source_stopped", now)
        if self.state is S.COMPLETED:
            return self._step("close", now, "close")
        return False

    def abort(self, now: float, reason: str) -> bool:
        if not self._step("abort", now, "abort"):
            return False
        self.abort_reason = reason
        return True

    @property
    def rehomed(self) -> bool:
        """Completed (or closed since), every frozen session resumed
        (``resumed`` only ever names frozen sessions: their tickets)."""
        return self.state in (S.COMPLETED, S.CLOSED) and len(self.resumed) >= len(self.sessions)

    def describe(self, now: float | None = None) -> dict:
        """The record as the control plane says it: bounded whatever the
        number of its sessions (``RECORD_INLINE_SESSIONS``: the lists inline
        only while they are short; ``record_sessions`` pages them)."""
        now = time.time() if now is None else now
        out = {
            "domain_uuid": self.domain_uuid, "migration_id": self.migration_id,
            "domain_name": self.domain_name, "source_host": self.source_host,
            "dest_host": self.dest_host, "policy": self.policy.value, "state": self.state.value,
            "session_count": len(self.sessions), "resumed_count": len(self.resumed),
            "blackout_max": self.blackout_max,
            "times": dict(self.times), "lease_in": round(self.lease_expiry - now, 3),
            "abort_reason": self.abort_reason, "postcopy": self.postcopy, "vouched": self.vouched,
            "timeline": self.timeline.to_wire(),
        }
        if len(self.sessions) <= RECORD_INLINE_SESSIONS:
            out["sessions"], out["resumed"] = list(self.sessions), dict(self.resumed)
        return out


@dataclasses.dataclass(frozen=True)
class Ticket:
    """One minted ticket: the token handed to the destination, and what it names."""

    token: str
    nonce: str
    sid: str
    record: str           # the record key it belongs to
    expires: float


class TicketAuthority:
    """Mints and checks resume tickets.

    A ticket is ``v1.<base64url JSON>.<HMAC-SHA256>`` over the pool's own
    secret (random per pool instance: tickets die with the sessions they
    authorise).  It names the session, the record, the destination host and
    an expiry; the pool additionally remembers each ticket's nonce, so a
    ticket is single-use and revocable.  A ticket authorises the move only:
    the driver still proves it owns the session.

    A ticket dies in exactly three ways: it is used by a resume, its
    migration is aborted, or a newer migration of the session supersedes it.
    Each death is remembered with its reason (bounded), so a refusal says
    what really happened.
    """

    #: how many dead tickets are remembered for their reason
    MEMORY = 10000

    def __init__(self, ttl: float = 300.0, secret: bytes | None = None):
        self.ttl = ttl
        self._secret = secret or secrets.token_bytes(32)
        self._live: dict[str, Ticket] = {}
        self._used: collections.OrderedDict[str, float] = collections.OrderedDict()   # nonce -> when
        self._dead: collections.OrderedDict[str, str] = collections.OrderedDict()     # nonce -> why

    def _mac(self, body: bytes) -> str:
        return hmac.new(self._secret, body, hashlib.sha256).hexdigest()

    def mint(self, sid: str, record: MigrationRecord, now: float) -> Ticket:
        nonce = secrets.token_hex(12)
        expires = round(now + self.ttl, 3)
        claims = {"sid": sid, "dom": record.domain_uuid, "mid": record.migration_id,
                  "dst": record.dest_host, "exp": expires, "n": nonce}
        body = base64.urlsafe_b64encode(json.dumps(claims, separators=(",", ":")).encode()).rstrip(b"=")
        ticket = Ticket(f"v1.{body.decode()}.{self._mac(body)}", nonce, sid, record.key, expires)
        self._live[nonce] = ticket
        return ticket

    def live(self, nonce: str | None, now: float) -> Ticket | None:
        """The ticket behind ``nonce`` while it can still be used."""
        ticket = self._live.get(nonce) if nonce else None
        if ticket is None or now > ticket.expires:
            return None
        return ticket

    def check(self, ticket, sid: str, peer_host: str | None, now: float,
              retry_of: str | None = None, by_address: bool = True) -> dict:
        """Claims of a valid ticket, or TicketInvalid.  Does not use it up.

        ``retry_of``: the nonce of the ticket the session's last resume used;
        presenting it again is the same driver retrying that resume (its
        answer was lost), not a replay.  ``by_address`` False: the session's
        addresses name no host (a Neutron tenant network: the same address on
        every host), so a resume from such an address is not checked against
        the ticket's host; one from a host's network still is."""
        if not isinstance(ticket, str) or ticket.count(".") != 2:
            raise TicketInvalid(reason="not an accelmig ticket")
        version, body, mac = ticket.split(".")
        if version != "v1":
            raise TicketInvalid(reason=f"ticket version {version!r}")
        if not hmac.compare_digest(self._mac(body.encode()), mac):
            raise TicketInvalid(reason="signature does not verify (forged, or minted by "
                                       "another pool instance)")
        try:
            claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        except ValueError:
            raise TicketInvalid(reason="unreadable claims") from None
        if claims.get("sid") != sid:
            raise TicketInvalid(reason=f"ticket is for session {claims.get('sid')}, not {sid}")
        nonce = claims.get("n")
        if nonce in self._used:
            if nonce == retry_of:
                return claims
            raise TicketInvalid(reason=f"ticket already used by a resume at "
                                       f"{_clock(self._used[nonce])}")
        if nonce not in self._live:
            raise TicketInvalid(reason=self._dead.get(nonce, "ticket revoked (its pool record is gone)"))
        if now > float(claims.get("exp", 0)):
            raise TicketInvalid(reason=f"ticket expired {now - float(claims['exp']):.1f} s ago")
        if claims.get("dst") != peer_host and (by_address or peer_host is not None):
            raise TicketInvalid(reason=f"ticket is for host {claims.get('dst')}, the resume "
                                       f"comes from host {peer_host}")
        return claims

    def use(self, nonce: str, now: float) -> None:
        self._live.pop(nonce, None)
        self._used[nonce] = now
        _bound(self._used, self.MEMORY)

    def revoke(self, nonce: str, reason: str) -> None:
        """Kill a live ticket; ``reason`` is what a later refusal of it says."""
        if self._live.pop(nonce, None) is not None:
            self._dead[nonce] = reason
            _bound(self._dead, self.MEMORY)


def _bound(memory: collections.OrderedDict, size: int) -> None:
    while len(memory) > size:
        memory.popitem(last=False)


def _clock(when: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when)) + f".{int(when * 1000) % 1000:03d}Z"
