"""The guest channel (hostd <-> accelmig-agent) and the agent's local socket
(accelmig-agent <-> drivers inside the guest).

**Guest channel**: virtio-serial port ``org.accelmig.agent.0``; messages are
newline-delimited JSON objects, each with a ``type`` and an ``id``.  The host
end disconnects and reconnects across every migration, so every (re)connect
of the host opens with a resynchronising handshake, as qemu-guest-agent's
``guest-sync-delimited`` does: the host sends the sentinel byte ``0xFF``
(never valid in UTF-8 JSON), which makes the agent drop any partial line,
then ``{"type": "sync", "id": N, "nonce": X}``; the agent answers a ``sync``
with the same nonce, preceded by a sentinel of its own, then a ``hello``.
Everything the host reads before that answer is stale and dropped.

host -> guest: ``sync``, ``identity`` (where the pool is from this host),
``tickets`` (a piece of a rehome's tickets, staged), ``rehome`` (identity +
a ticket per session + migration id; idempotent per migration id),
``prove`` (each registered driver's binding proof for the pool's
challenges: ``accelmig.wire.attestation``), ``status``, ``ping``.  Each is answered by a ``result`` with the request's
``id``.  guest -> host, unsolicited: ``hello`` (versions, guest identity,
registered sessions), ``session_opened``, ``session_closed``.

No line grows with the number of sessions (a line is at most MAX_LINE,
256 KiB, and a guest may hold thousands of sessions): a rehome whose
tickets do not fit in REHOME_LINE_BUDGET goes as ``tickets`` pieces of at
most TICKET_PIECE_BYTES, then the ``rehome`` with the last piece and
``ticket_count`` (``rehome_pieces``; the agent refuses a rehome that does
not add up, and the host sends it all again); the agent's answers list
sessions within ANSWER_BUDGET (``bounded_outcome``: the failed ones first,
then counts for the rest) and its ``status`` lists them a page at a time
(``after``: the last sid of the page before; ``next``); the hello lists
what fits in half a line, and the rest follow one ``session_opened`` each.

**Local socket** (``/run/accelmig/agent.sock``), the same line format:
drivers send ``register``/``unregister``/``where``; the agent sends
``resume`` (endpoint, ticket, migration id) and ``prove`` (host,
challenges: ``wire.attestation``) and the driver answers each with a
``result``.  Root's ``accelmig-agent`` sends ``rehome_local``,
``tickets`` and ``prove_local`` (what qemu-guest-agent's guest-exec relays).

**hostd's local API** (``/run/accelmig/hostd.sock``: the hook, the CLI):
the same line format, one request per connection.

Every line conversation is a ``LineSession`` (sans-IO: ids, the sync
handshake, answers told from events, answers decoded into results or typed
errors) under one of two transports: ``LineClient`` (blocking) here, and
hostd's asyncio channel (``accelmig.plugin.channel.AsyncGuestChannel``).

Standard library only.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import secrets
import socket
import threading
import time

from accelmig.wire.errors import BadRequest, ProtocolError, Timeout, Unavailable, from_wire
from accelmig.wire.identity import HostIdentity
from accelmig.wire.values import is_int

LOG = logging.getLogger(__name__)

CHANNEL_NAME = "org.accelmig.agent.0"
CHANNEL_PROTOCOL = 1
SENTINEL = b"\xff"
MAX_LINE = 256 * 1024      # no message grows past it with the number of sessions (see above)
DEFAULT_AGENT_SOCKET = "/run/accelmig/agent.sock"

#: what one ``rehome`` line may carry before its tickets go in pieces
REHOME_LINE_BUDGET = 64 * 1024
#: the tickets of one ``tickets`` piece, in bytes of JSON (a pool ticket is
#: ~350 bytes: ~140 a piece)
TICKET_PIECE_BYTES = 48 * 1024
#: the longest ticket a rehome may carry (a pool's is ~350 characters; its
#: claims are bounded identifiers)
MAX_TICKET = 4096
#: the sessions an answer of the agent lists (a rehome's outcome, a page of
#: its status), in bytes: half a line, so the rest of the answer always fits
ANSWER_BUDGET = MAX_LINE // 2
#: the most tickets one rehome may announce (the agent keeps at most 4096 sessions)
MAX_REHOME_TICKETS = 65536

HOST_TYPES = frozenset({"sync", "identity", "tickets", "rehome", "status", "ping", "prove"})
GUEST_EVENTS = frozenset({"hello", "session_opened", "session_closed"})
DRIVER_TYPES = frozenset({"register", "unregister", "where", "result", "tickets", "rehome_local", "status",
                          "prove_local"})


def encode(message: dict) -> bytes:
    """One message as a line (compact JSON, ASCII only: no 0xFF can appear)."""
    return json.dumps(message, separators=(",", ":"), ensure_ascii=True).encode("ascii") + b"\n"


class LineParser:
    """Incremental parser of newline-delimited JSON with resynchronisation.

    ``feed(data)`` returns the complete messages; a sentinel byte drops any
    partial line; a line that is not a JSON object, or longer than
    ``max_line``, is dropped with its reason in ``self.dropped`` (and a log
    line) and parsing goes on at the next newline.
    """

    def __init__(self, max_line: int = MAX_LINE, name: str = "channel"):
        self.max_line = max_line
        self.name = name
        self._buf = bytearray()
        self._skipping = False     # inside an oversized line: drop until newline
        self.dropped: list[str] = []
        self.resyncs = 0

    def reset(self) -> None:
        self._buf.clear()
        self._skipping = False

    def drop(self, reason: str) -> None:
        """Drop a line its reader found wrong after parsing (a field of the
        wrong type): counted and logged like the parser's own drops."""
        self._drop(reason)

    def _drop(self, reason: str) -> None:
        self.dropped.append(reason)
        del self.dropped[:-100]
        LOG.warning("%s: dropped input: %s", self.name, reason)

    def feed(self, data: bytes) -> list[dict]:
        messages: list[dict] = []
        while data:
            cut = data.find(SENTINEL)
            chunk, data = (data, b"") if cut < 0 else (data[:cut], data[cut + 1:])
            self._feed_chunk(chunk, messages)
            if cut >= 0:
                if self._buf or self._skipping:
                    self._drop(f"partial line of {len(self._buf)} bytes cut by a resync")
                self.reset()
                self.resyncs += 1
        return messages

    def _feed_chunk(self, chunk: bytes, messages: list) -> None:
        while chunk:
            newline = chunk.find(b"\n")
            if newline < 0:
                if self._skipping:
                    return
                self._buf += chunk
                if len(self._buf) > self.max_line:
                    self._drop(f"line longer than {self.max_line} bytes")
                    self._buf.clear()
                    self._skipping = True
                return
            line, chunk = chunk[:newline], chunk[newline + 1:]
            if self._skipping:
                self._skipping = False
                continue
            self._buf += line
            raw = bytes(self._buf)
            self._buf.clear()
            if len(raw) > self.max_line:
                self._drop(f"line longer than {self.max_line} bytes")
                continue
            if not raw.strip():
                continue
            try:
                message = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as exc:
                self._drop(f"not JSON ({exc.__class__.__name__}: {str(exc)[:60]}): {raw[:40]!r}")
                continue
            except RecursionError:
                # dropped like any bad line: the lines after it (a ping) still count
                self._drop(f"JSON nested too deeply: {raw[:40]!r}")
                continue
            if not isinstance(message, dict) or not isinstance(message.get("type"), str):
                self._drop(f"not a message object with a 'type': {raw[:40]!r}")
                continue
            messages.append(message)


def result(request_id, ok: bool = True, result=None, error=None) -> dict:
    out = {"type": "result", "id": request_id, "ok": ok}
    if ok:
        out["result"] = result if result is not None else {}
    else:
        out["error"] = error
    return out


def _migration_id(message, kind: str) -> str:
    if not isinstance(message, dict):
        raise BadRequest(reason=f"{kind}: the document must be a JSON object")
    migration_id = message.get("migration_id")
    if not isinstance(migration_id, str) or not 0 < len(migration_id) <= 256:
        raise BadRequest(reason=f"{kind}: migration_id must be a non-empty string of at most 256 characters")
    return migration_id


def _tickets(message: dict, kind: str) -> dict:
    tickets = message.get("tickets") or {}
    if not isinstance(tickets, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and 0 < len(k) <= 256 and len(v) <= MAX_TICKET
            for k, v in tickets.items()):
        raise BadRequest(reason=f"{kind}: tickets must map session ids (at most 256 characters) to "
                                f"ticket strings (at most {MAX_TICKET})")
    return tickets


def parse_rehome(message: dict) -> tuple[str, HostIdentity, dict]:
    """(migration id, identity, {sid: ticket}) of a rehome, or BadRequest.
    The tickets are those of this message (``parse_rehome_count`` says how
    many the whole rehome has, with its staged pieces)."""
    migration_id = _migration_id(message, "rehome")
    identity = HostIdentity.from_wire(message.get("identity"))
    return migration_id, identity, _tickets(message, "rehome")


def parse_rehome_count(message: dict) -> int | None:
    """``ticket_count`` of a rehome whose tickets came in pieces (None: all
    of them are in the message)."""
    count = message.get("ticket_count")
    if count is None:
        return None
    if not is_int(count, 0, MAX_REHOME_TICKETS):
        raise BadRequest(reason=f"rehome: ticket_count must be an integer from 0 to {MAX_REHOME_TICKETS}")
    return count


def parse_tickets(message: dict) -> tuple[str, dict]:
    """(migration id, {sid: ticket}) of a ``tickets`` piece, or BadRequest."""
    return _migration_id(message, "tickets"), _tickets(message, "tickets")


def rehome_pieces(document: dict, *, line_budget: int = REHOME_LINE_BUDGET,
                  piece_bytes: int = TICKET_PIECE_BYTES) -> tuple[list[dict], dict]:
    """A rehome document as the lines that carry it: (the ``tickets``
    pieces to send first, each ``{"migration_id", "tickets"}``; the
    ``rehome`` itself).  A document that fits in ``line_budget`` goes
    whole; else its tickets go in pieces of at most ``piece_bytes`` and the
    rehome carries the last one and ``ticket_count``."""
    if len(json.dumps(document, separators=(",", ":"))) + 40 <= line_budget:    # (+ type, id)
        return [], document
    tickets = document.get("tickets") or {}
    pieces, piece, size = [], {}, 0
    for sid in sorted(tickets):
        cost = len(sid) + len(tickets[sid]) + 6
        if piece and size + cost > piece_bytes:
            pieces.append(piece)
            piece, size = {}, 0
        piece[sid] = tickets[sid]
        size += cost
    mid = document.get("migration_id")
    # a document whose tickets were partly staged already says how many it has in all
    count = document["ticket_count"] if isinstance(document.get("ticket_count"), int) else len(tickets)
    return ([{"migration_id": mid, "tickets": p} for p in pieces],
            dict(document, tickets=piece, ticket_count=count))


def bounded_outcome(result: dict, budget: int = ANSWER_BUDGET) -> dict:
    """A rehome's outcome as an answer may carry it: every session's
    outcome while they fit in ``budget`` bytes, else the failed ones first,
    then as many that resumed as fit, and ``sessions_omitted``;
    ``session_count`` and ``resumed_count`` always (``ok`` is the whole
    rehome's, whatever is listed)."""
    sessions = result.get("sessions") or {}
    out = dict(result, session_count=len(sessions),
               resumed_count=sum(1 for o in sessions.values() if o.get("ok")))
    sizes = {sid: len(json.dumps(o, separators=(",", ":"))) + len(sid) + 6 for sid, o in sessions.items()}
    if sum(sizes.values()) <= budget:
        return out
    kept, used = {}, 0
    for sid in sorted(sessions, key=lambda sid: bool(sessions[sid].get("ok"))):
        if used + sizes[sid] > budget:
            continue
        kept[sid] = sessions[sid]
        used += sizes[sid]
    out["sessions"] = kept
    out["sessions_omitted"] = len(sessions) - len(kept)
    return out


def timed_outcome(result: dict, received: float) -> dict:
    """A rehome's outcome with this answer's own ``clock``: when the agent
    read the rehome and when it answered, on the guest's clock.  With the
    host's own send and receive times this round trip carries the guest's
    stamps (``times``) onto the host's clock (``wire.records.ClockOffset``);
    a repeated rehome gets a fresh clock, its stored ``times`` stay the
    first attempt's."""
    return dict(result, clock={"received": received, "answered": time.time()})


def answer_of(message: dict):
    """The result of an answer, or its error raised as the typed exception."""
    if message.get("ok"):
        return message.get("result")
    error = message.get("error")
    if not isinstance(error, dict) or not isinstance(error.get("code"), str):
        # a peer answering garbage gets a clear error, not an AttributeError
        raise ProtocolError(reason=f"a failed answer without a valid error: {str(error)[:80]!r}")
    raise from_wire(error)


class LineSession:
    """One end of a line conversation, without I/O: numbers requests, tells
    answers (``result`` with a request's id) from unsolicited messages,
    and, where the peer may hold stale lines (the guest channel across a
    migration), gates everything behind the sync handshake.

    ``feed(data)`` returns ``(kind, id, message)`` with kind ``answer``,
    ``event`` or ``synced``."""

    def __init__(self, name: str, *, gated: bool = False, first_id: int = 1, max_line: int = MAX_LINE):
        self.parser = LineParser(max_line=max_line, name=name)
        self.gated = gated
        self._ids = itertools.count(first_id)
        self.wanted_nonce: str | None = None
        self.synced_nonce: str | None = None

    def next_id(self) -> int:
        return next(self._ids)

    def request(self, kind: str, **fields) -> tuple[int, bytes]:
        request_id = self.next_id()
        return request_id, encode({"type": kind, "id": request_id, **fields})

    def sync(self) -> tuple[int, bytes]:
        """A fresh handshake: the sentinel (the peer drops its partial line)
        and a ``sync`` whose nonce alone ends the gate."""
        self.gated = True
        self.wanted_nonce, self.synced_nonce = secrets.token_hex(8), None
        request_id = self.next_id()
        return request_id, SENTINEL + encode({"type": "sync", "id": request_id, "nonce": self.wanted_nonce})

    def resend_sync(self, request_id: int) -> bytes:
        return SENTINEL + encode({"type": "sync", "id": request_id, "nonce": self.wanted_nonce})

    @property
    def synced(self) -> bool:
        return not self.gated or (self.synced_nonce is not None and self.synced_nonce == self.wanted_nonce)

    def feed(self, data: bytes) -> list[tuple[str, object, dict]]:
        out = []
        for message in self.parser.feed(data):
            kind = message.get("type")
            if self.gated and kind == "sync":
                if self.wanted_nonce is not None and message.get("nonce") == self.wanted_nonce:
                    self.synced_nonce = self.wanted_nonce
                    out.append(("synced", message.get("id"), message))
                continue                 # a stale sync answer from an earlier connection
            if not self.synced:
                continue                 # before our sync answer: stale
            out.append(("answer" if kind == "result" else "event", message.get("id"), message))
        return out


def connect_unix(path: str, timeout: float | None) -> socket.socket:
    """Connect to a unix socket, also one whose path exceeds ``sun_path``'s
    108 bytes (libvirt's per-domain channel sockets seen from another mount
    namespace do): through ``/proc/self/fd`` of its directory."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        if len(os.fsencode(path)) < 100:
            sock.connect(path)
            return sock
        dirfd = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY)
        try:
            sock.connect(f"/proc/self/fd/{dirfd}/{os.path.basename(path)}")
        finally:
            os.close(dirfd)
        return sock
    except BaseException:
        sock.close()
        raise


class LineClient:
    """A blocking line conversation on a unix socket: the driver's link to
    the agent, ``accelmig-agent status``, hostd's local API (the hook, the
    CLI), the lab's boot-test responder.  ``call`` waits for its own answer
    within a deadline and keeps what else arrives: unsolicited messages for
    ``recv``, older answers (of calls that timed out) dropped by id.

    ``what`` names the peer in errors (``Unavailable``, ``Timeout``)."""

    def __init__(self, path: str, *, timeout: float | None = 5.0, what: str | None = None,
                 name: str = "line-client"):
        self.path = str(path)
        self.timeout = timeout
        self.what = what or self.path
        self.session = LineSession(name)
        self._pending: list[dict] = []
        self._send_lock = threading.Lock()
        try:
            self.sock = connect_unix(self.path, timeout)
        except OSError as exc:
            raise Unavailable(what=self.what, reason=exc.strerror or str(exc)) from None

    def send(self, message: dict) -> None:
        """One message as it is (an answer to the peer's request, a note)."""
        self._write(encode(message))

    def _write(self, data: bytes) -> None:
        try:
            with self._send_lock:
                self.sock.sendall(data)
        except OSError as exc:
            raise Unavailable(what=self.what, reason=exc.strerror or str(exc)) from None

    def next_id(self) -> int:
        return self.session.next_id()

    def _read(self, deadline: float | None) -> list[tuple[str, object, dict]]:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise socket.timeout()
            self.sock.settimeout(remaining)
        else:
            self.sock.settimeout(None)
        data = self.sock.recv(65536)
        if not data:
            raise Unavailable(what=self.what, reason="the connection closed")
        return self.session.feed(data)

    def recv(self, timeout: float | None = None) -> dict | None:
        """The next unsolicited message (or an answer nobody waits for);
        None once the peer closed.  ``socket.timeout`` after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._pending:
            try:
                items = self._read(deadline)
            except Unavailable:
                return None
            self._pending += [message for _, _, message in items]
        return self._pending.pop(0)

    def call(self, kind: str, timeout: float | None = None, **fields):
        """Send a request and wait for its answer: its result, or its error
        raised as the typed exception."""
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        request_id, line = self.session.request(kind, **fields)
        self._write(line)
        while True:
            try:
                items = self._read(deadline)
            except socket.timeout:
                raise Timeout(what=f"{self.what}'s answer to {kind}", timeout=timeout) from None
            except OSError as exc:
                raise Unavailable(what=self.what, reason=exc.strerror or str(exc)) from None
            mine = None
            for item_kind, item_id, message in items:
                if item_kind == "answer" and item_id == request_id and mine is None:
                    mine = message
                elif item_kind == "event":
                    self._pending.append(message)      # kept for recv, in order
            if mine is not None:
                return answer_of(mine)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
