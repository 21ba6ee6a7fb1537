"""Resume tickets: one table, the only place a ticket's fate is kept.

A ticket is ``v1.<base64url JSON>.<HMAC-SHA256>`` over the pool's own
secret (random per pool instance: tickets die with the sessions they
authorise).  It names the session, the record, the destination host and an
expiry; the book keeps each ticket by its nonce, so a ticket is single-use
and revocable.  A ticket authorises the move only: the driver still proves
it owns the session.

A ticket is LIVE until it dies in exactly one of three ways: a resume uses
it (USED), or it is revoked (REVOKED: its migration was aborted, a newer
migration of its session superseded it, or its session was released).  Its
death is kept with when and why (bounded: ``MEMORY`` dead tickets), so a
refusal says what really happened.  Indexes: a session's one live ticket
(``mint_for`` hands it back again rather than minting another), a record's
tickets (an abort revokes them), and the ticket a session's last resume
used (the driver that retries that resume presents it again).

The driver no longer remembers tickets: whether a move already happened is
its migration id (``agent.driver.session``); whether a ticket was used is
here alone.
"""

from __future__ import annotations

import base64
import collections
import enum
import hashlib
import hmac
import json
import secrets
import time

from accelmig.runtime.statemachine import StateMachine
from accelmig.wire.errors import TicketInvalid


class TicketState(enum.Enum):
    LIVE = "live"
    USED = "used"
    REVOKED = "revoked"


class TicketEvent(enum.Enum):
    USE = "use"
    REVOKE = "revoke"


class Ticket(StateMachine):
    """One minted ticket: its token, what it names, and its fate."""

    __slots__ = ("token", "nonce", "sid", "record", "dest", "expires", "when", "why", "state")
    INITIAL = TicketState.LIVE
    FINAL = frozenset({TicketState.USED, TicketState.REVOKED})
    TABLE = {TicketEvent.USE: {TicketState.LIVE: TicketState.USED},
             TicketEvent.REVOKE: {TicketState.LIVE: TicketState.REVOKED}}
    # a retried resume uses its ticket again (the first use's time stays);
    # an abort or a release finds tickets already dead
    REPEATS = {TicketEvent.USE: frozenset({TicketState.USED}),
               TicketEvent.REVOKE: frozenset({TicketState.USED, TicketState.REVOKED})}

    def __init__(self, token: str, nonce: str, sid: str, record: str, dest: str, expires: float):
        self.token, self.nonce, self.sid, self.record, self.dest, self.expires = \
            token, nonce, sid, record, dest, expires
        self.when: float | None = None        # when it died
        self.why: str | None = None           # why it was revoked
        super().__init__()

    def on_transition(self, old, new, event, now: float | None = None, why: str | None = None) -> None:
        self.when, self.why = now, why

    def live_at(self, now: float) -> bool:
        return self.state is TicketState.LIVE and now <= self.expires


class TicketBook:
    #: how many dead tickets are remembered for their fate
    MEMORY = 10000

    def __init__(self, ttl: float = 300.0, secret: bytes | None = None):
        self.ttl = ttl
        self._secret = secret or secrets.token_bytes(32)
        self._tickets: dict[str, Ticket] = {}                 # nonce -> ticket
        self._dead: collections.deque[str] = collections.deque()   # nonces of dead tickets, oldest first
        self._live_of: dict[str, str] = {}                    # sid -> its one live ticket's nonce
        self._of_record: dict[str, set[str]] = {}             # record key -> its tickets' nonces
        self._last_used: dict[str, str] = {}                  # sid -> the nonce its last resume used

    def _mac(self, body: bytes) -> str:
        return hmac.new(self._secret, body, hashlib.sha256).hexdigest()

    # -- minting ----------------------------------------------------------------------
    def mint_for(self, sid: str, record, now: float) -> str:
        """The session's one live ticket for ``record``: the one it has, or a
        new one.  A ticket of an older migration is revoked (superseded); an
        expired one is replaced."""
        held = self.held_by(sid)
        if held is not None:
            if held.live_at(now) and held.record == record.key:
                return held.token
            self._revoke(held, f"ticket superseded by migration {record.migration_id} of the same session", now)
        nonce = secrets.token_hex(12)
        expires = round(now + self.ttl, 3)
        claims = {"sid": sid, "dom": record.domain_uuid, "mid": record.migration_id,
                  "dst": record.dest_host, "exp": expires, "n": nonce}
        body = base64.urlsafe_b64encode(json.dumps(claims, separators=(",", ":")).encode()).rstrip(b"=")
        ticket = Ticket(f"v1.{body.decode()}.{self._mac(body)}", nonce, sid, record.key, record.dest_host, expires)
        self._tickets[nonce] = ticket
        self._live_of[sid] = nonce
        self._of_record.setdefault(record.key, set()).add(nonce)
        return ticket.token

    # -- reading ----------------------------------------------------------------------
    def held_by(self, sid: str) -> Ticket | None:
        """The session's live ticket (expired or not), if it holds one."""
        nonce = self._live_of.get(sid)
        return self._tickets.get(nonce) if nonce is not None else None

    def live(self, nonce: str | None, now: float) -> Ticket | None:
        """The ticket behind ``nonce`` while it can still be used."""
        ticket = self._tickets.get(nonce) if nonce else None
        return ticket if ticket is not None and ticket.live_at(now) else None

    def last_used(self, sid: str) -> str | None:
        """The nonce of the ticket the session's last resume used (None: that
        resume used none)."""
        return self._last_used.get(sid)

    def check(self, token, sid: str, peer_host: str | None, now: float,
              retry_of: str | None = None, by_address: bool = True) -> dict:
        """Claims of a valid ticket, or TicketInvalid.  Does not use it up.

        ``retry_of``: the nonce of the ticket the session's last resume used;
        presenting it again is the same driver retrying that resume (its
        answer was lost), not a replay.  ``by_address`` False: the session's
        addresses name no host (a Neutron tenant network: the same address on
        every host), so a resume from such an address is not checked against
        the ticket's host; one from a host's network still is."""
        if not isinstance(token, str) or token.count(".") != 2:
            raise TicketInvalid(reason="not an accelmig ticket")
        version, body, mac = token.split(".")
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
        ticket = self._tickets.get(nonce) if isinstance(nonce, str) else None
        if ticket is None:
            raise TicketInvalid(reason="ticket revoked (its pool record is gone)")
        if ticket.state is TicketState.USED:
            if nonce == retry_of:
                return claims
            raise TicketInvalid(reason=f"ticket already used by a resume at {_clock(ticket.when)}")
        if ticket.state is TicketState.REVOKED:
            raise TicketInvalid(reason=ticket.why)
        if now > ticket.expires:
            raise TicketInvalid(reason=f"ticket expired {now - ticket.expires:.1f} s ago")
        if ticket.dest != peer_host and (by_address or peer_host is not None):
            raise TicketInvalid(reason=f"ticket is for host {ticket.dest}, the resume "
                                       f"comes from host {peer_host}")
        return claims

    # -- deaths -----------------------------------------------------------------------
    def use(self, sid: str, nonce: str | None, now: float) -> None:
        """A resume of ``sid`` was accepted, with the ticket ``nonce`` (None:
        without one)."""
        if nonce is None:
            self._last_used.pop(sid, None)
            return
        ticket = self._tickets.get(nonce)
        if ticket is not None and ticket.fire(TicketEvent.USE, now=now) is not None:
            self._died(ticket)
        self._last_used[sid] = nonce

    def revoke_record(self, key: str, reason: str, now: float | None = None) -> None:
        """Every live ticket of record ``key`` (its migration was aborted)."""
        for nonce in sorted(self._of_record.get(key, ())):
            ticket = self._tickets.get(nonce)
            if ticket is not None:
                self._revoke(ticket, reason, now)

    def drop_session(self, sid: str, reason: str, now: float | None = None) -> None:
        """The session was released: its live ticket dies with it."""
        held = self.held_by(sid)
        if held is not None:
            self._revoke(held, reason, now)
        self._live_of.pop(sid, None)
        self._last_used.pop(sid, None)

    def forget_record(self, key: str) -> None:
        """The ledger forgot the record: so does the index (its dead tickets
        age out of ``MEMORY``)."""
        self._of_record.pop(key, None)

    def _revoke(self, ticket: Ticket, reason: str, now: float | None) -> None:
        if ticket.fire(TicketEvent.REVOKE, now=time.time() if now is None else now, why=reason) is not None:
            self._died(ticket)

    def _died(self, ticket: Ticket) -> None:
        if self._live_of.get(ticket.sid) == ticket.nonce:
            del self._live_of[ticket.sid]
        self._dead.append(ticket.nonce)
        while len(self._dead) > self.MEMORY:
            old = self._tickets.pop(self._dead.popleft(), None)
            if old is not None:
                nonces = self._of_record.get(old.record)
                if nonces is not None:
                    nonces.discard(old.nonce)

    def __len__(self) -> int:
        return len(self._tickets)


def _clock(when: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when)) + f".{int(when * 1000) % 1000:03d}Z"
