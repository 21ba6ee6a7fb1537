"""The guest's drivers as the agent sees them: each driver's connection
(``DriverLink``, a state machine: OPEN, OVERFLOWED, DROPPED), what the
agent asked one (``DriverAsk``: a ``resume``, a ``prove``), and the registry
of every link and the sessions each registered (``DriverRegistry``, with
its two limits).  What the drivers may ask on the local socket is
``driverapi``'s.

Who a driver is comes from the kernel (``SO_PEERCRED``), never from what
it says.  Threads: the poll thread accepts, reads and drops links; a
rehome's or a prove's thread asks drivers.  A link's lock serialises its
state and its outgoing buffer, the registry's lock its two tables.
"""

from __future__ import annotations

import enum
import itertools
import logging
import socket
import struct
import threading
import time

from accelmig.runtime.statemachine import StateMachine
from accelmig.wire import channel as ch
from accelmig.wire.errors import AccelmigError, Forbidden, LimitExceeded, ProtocolError, Unavailable
from accelmig.wire.values import describe

# the agent's logger, as before the split: operators' filters keep working
LOG = logging.getLogger("accelmig.agent.daemon.agent")

#: the longest session id a client may register (the pool's identifiers are at most 256 characters)
MAX_SID = 256


def driver_reply(message: dict) -> dict:
    """A driver's answer, in a shape its asker can rely on: ``ok`` a
    boolean, ``result`` an object, ``error`` an error object (garbage is a
    ``PROTOCOL_ERROR`` of the agent's own)."""
    ok = message.get("ok")
    if ok is True:
        result = message.get("result")
        if result is None or isinstance(result, dict):
            return {"ok": True, "result": result or {}}
        problem = f"its result is {describe(result)}, not an object"
    elif ok is False:
        error = message.get("error")
        if isinstance(error, dict) and isinstance(error.get("code"), str) and \
                isinstance(error.get("message", ""), str):
            return {"ok": False, "error": error}
        problem = f"a failed answer whose error is {describe(error)}, not an error object"
    else:
        problem = f"its ok is {describe(ok)}, not a boolean"
    return {"ok": False, "error": ProtocolError(reason=f"the driver answered garbage: {problem}").to_wire()}


class DriverAsk:
    """A request the agent sent one driver (a ``resume``, a ``prove``) and
    its answer.  Settled once: by the driver's ``result``, by the link's
    drop, or by a send that failed, whichever comes first (they race)."""

    __slots__ = ("sid", "sent", "done", "reply", "event", "on_done", "_first")

    def __init__(self, sid: str, on_done=None):
        self.sid = sid
        self.sent = time.monotonic()
        self.done: float | None = None
        self.reply: dict | None = None
        self.event = threading.Event()
        self.on_done = on_done          # called once settled (a rehome's window frees a place)
        self._first = threading.Lock()

    @property
    def answered(self) -> bool:
        return self.event.is_set()

    def settle(self, reply: dict) -> None:
        if not self._first.acquire(blocking=False):
            return
        self.reply = reply
        self.done = time.monotonic()
        self.event.set()
        if self.on_done is not None:
            self.on_done(self)

    def fail(self, error: AccelmigError) -> None:
        self.settle({"ok": False, "error": error.to_wire()})


class DriverState(enum.Enum):
    OPEN = "open"
    OVERFLOWED = "overflowed"   # it let too much pile up unread: the poll thread drops it
    DROPPED = "dropped"         # gone: its socket closed, or dropped for not reading


class DriverEvent(enum.Enum):
    OVERFLOW = "overflow"       # a send found its backlog over the bound
    DROP = "drop"               # the agent lets it go


class DriverLink(StateMachine):
    """One driver's connection to the agent; its registered sessions.

    What the agent sends it goes through a bounded outgoing buffer that the
    poll thread writes when the socket is writable: a driver that does not
    read never blocks the agent's one loop (the host's ping, every other
    driver).  One that lets more than ``max_backlog`` bytes pile up
    overflows and is dropped, like a driver that went away.  Its state
    changes under ``lock``."""

    INITIAL = DriverState.OPEN
    TABLE = {
        DriverEvent.OVERFLOW: {DriverState.OPEN: DriverState.OVERFLOWED},
        DriverEvent.DROP: {DriverState.OPEN: DriverState.DROPPED, DriverState.OVERFLOWED: DriverState.DROPPED},
    }
    REPEATS = {DriverEvent.DROP: frozenset({DriverState.DROPPED})}     # EOF and a failed write both drop
    FINAL = frozenset({DriverState.DROPPED})

    #: far above any burst of answers a reading driver leaves unread
    MAX_BACKLOG = 1 << 20

    def __init__(self, sock: socket.socket, wake=None, max_backlog: int = MAX_BACKLOG):
        super().__init__()
        self.sock = sock
        self.fd = sock.fileno()                 # (kept: a closed socket's fileno is -1)
        self.out = bytearray()
        self.max_backlog = max_backlog
        self._wake = wake or (lambda: None)     # tells the poll thread to look at this link
        self.parser = ch.LineParser(name="driver")
        self.sessions: dict[str, dict] = {}
        self.pending: dict[int, DriverAsk] = {}  # request id -> what the agent asked
        self.lock = threading.Lock()
        # Who is on the other end, as the kernel says (SO_PEERCRED): never
        # what the peer claims.  Without it the peer is treated as nobody.
        self.peer_pid: int | None = None
        self.peer_uid: int | None = None
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            self.peer_pid, self.peer_uid, _gid = struct.unpack("3i", creds)
        except OSError:
            pass

    @property
    def privileged(self) -> bool:
        return self.peer_uid == 0

    @property
    def who(self) -> str:
        return f"pid {self.peer_pid} (uid {self.peer_uid})"

    @property
    def backlogged(self) -> bool:
        return bool(self.out)

    def send(self, message: dict) -> None:
        """Queue ``message`` from any thread and write what the socket takes
        now; never blocks.  ``ConnectionError`` (an ``OSError``, as for a
        driver that went away) once the backlog is over its bound (the poll
        thread then drops the link) or the link is dropped."""
        data = ch.encode(message)
        with self.lock:
            if self.state is DriverState.OPEN and len(self.out) + len(data) > self.max_backlog:
                self.fire(DriverEvent.OVERFLOW)
                self.out.clear()        # nobody will read it
            if self.state is DriverState.OVERFLOWED:
                self._wake()
                raise ConnectionError(f"driver {self.who} does not read: over "
                                      f"{self.max_backlog} bytes of messages unsent")
            if self.state is DriverState.DROPPED:
                raise ConnectionError(f"driver {self.who} went away")
            was_idle = not self.out
            self.out += data
            self._flush_locked()
            if was_idle and self.out:
                self._wake()

    def flush(self) -> None:
        """The socket is writable (the poll thread): write what is queued."""
        with self.lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        while self.out:
            try:
                sent = self.sock.send(self.out)
            except BlockingIOError:
                return
            del self.out[:sent]

    def ask(self, request_id: int, message: dict, ask: DriverAsk) -> DriverAsk:
        """Send ``message`` as request ``request_id``; the driver's answer
        (or the link's drop) settles ``ask``, and a send that fails at once
        settles it ``UNAVAILABLE``."""
        self.pending[request_id] = ask
        try:
            self.send(dict(message, id=request_id))
        except OSError as exc:
            self.pending.pop(request_id, None)
            ask.fail(Unavailable(what="the driver", reason=f"it cannot be reached: {exc}"))
        return ask

    def drop(self) -> bool:
        """Let the link go; False when it was gone already.  What the agent
        asked it is settled ``UNAVAILABLE`` (an ask made meanwhile finds the
        link dropped when it sends)."""
        with self.lock:
            if self.fire(DriverEvent.DROP) is None:
                return False
            asked = list(self.pending.values())
        for ask in asked:
            ask.fail(Unavailable(what="the driver", reason="it went away"))
        return True


class DriverRegistry:
    """Every driver's link (by descriptor) and every registered session's
    holder (by sid).  Tells the host when a session opens or closes
    (``send_host``, event ids from ``ids``); ``unwatch(link)`` takes a
    dropped link out of the agent's poll set."""

    def __init__(self, send_host, ids, unwatch, max_sessions_per_link: int, max_sessions: int):
        self.send_host = send_host
        self.ids = ids
        self.unwatch = unwatch
        self.max_sessions_per_link = max_sessions_per_link
        self.max_sessions = max_sessions
        self.links: dict[int, DriverLink] = {}
        # sid -> the link that registered it: a register is checked without
        # a look at every other driver
        self._holders: dict[str, DriverLink] = {}
        self.lock = threading.Lock()

    def sessions(self, uid: int | None = None) -> list[dict]:
        """Every registered session, or only those of ``uid``'s processes."""
        with self.lock:
            return [dict(info, sid=sid) for link in self.links.values()
                    if uid is None or link.peer_uid == uid
                    for sid, info in link.sessions.items()]

    def holders(self) -> dict[str, DriverLink]:
        with self.lock:
            return dict(self._holders)

    def targets(self, skip) -> list[tuple[DriverLink, str]]:
        """Every registered session not in ``skip``, as (link, sid): one
        process's after another's, in turn (a process resumes its sessions
        one at a time at best: they share its one interpreter)."""
        with self.lock:
            by_process: dict = {}
            for link in self.links.values():
                for sid in link.sessions:
                    if sid not in skip:
                        by_process.setdefault(link.peer_pid, []).append((link, sid))
        return [item for turn in itertools.zip_longest(*by_process.values()) for item in turn if item is not None]

    def ask(self, link: DriverLink, message: dict, on_done=None) -> DriverAsk:
        return link.ask(next(self.ids), message, DriverAsk(message["sid"], on_done))

    def register(self, link: DriverLink, sid: str, info: dict) -> None:
        """``sid`` is ``link``'s (checked fields in ``info``): refused when
        another process holds it or a limit is reached."""
        with self.lock:
            holder = self._holders.get(sid)
            moves = holder is not None and holder is not link and \
                (holder.peer_pid, holder.peer_uid) == (link.peer_pid, link.peer_uid)
            if holder is not None and holder is not link and not moves:
                # Tickets for a session go to the process that registered it:
                # nobody else may take it over (another user least of all).
                raise Forbidden(who=link.who, what=f"register session {sid}: it is registered by {holder.who}")
            if holder is not link:       # one more on this connection (a move keeps the total)
                if len(link.sessions) >= self.max_sessions_per_link:
                    raise LimitExceeded(
                        f"register session {sid}: this connection already holds {len(link.sessions)} "
                        f"sessions, the most one connection may ({self.max_sessions_per_link}); "
                        f"unregister one first")
                total = len(self._holders)
                if not moves and total >= self.max_sessions:
                    raise LimitExceeded(
                        f"register session {sid}: the agent already holds {total} sessions, the most "
                        f"it keeps for all its clients together ({self.max_sessions})")
            if moves:                    # the same process on a new connection
                holder.sessions.pop(sid, None)
            link.sessions[sid] = info
            self._holders[sid] = link
        LOG.info("session %s opened by pid %s (%s)", sid, info["pid"], info.get("name"))
        self.send_host({"type": "session_opened", "id": next(self.ids), "sid": sid, **info})

    def unregister(self, link: DriverLink, sid: str) -> None:
        with self.lock:
            known = link.sessions.pop(sid, None)
            if known is not None and self._holders.get(sid) is link:
                del self._holders[sid]
        if known is not None:
            self.send_host({"type": "session_closed", "id": next(self.ids), "sid": sid, "reason": "closed"})

    def accept(self, listener: socket.socket, touch) -> DriverLink | None:
        """A new driver's connection; ``touch(link)`` from any thread when
        it has a backlog to write or overflowed."""
        try:
            sock, _ = listener.accept()
        except BlockingIOError:
            return None
        sock.setblocking(False)
        link = DriverLink(sock)
        link._wake = lambda: touch(link)
        with self.lock:
            self.links[link.fd] = link
        return link

    def drop(self, link: DriverLink) -> None:
        """``link`` went away, or is let go: its sessions close."""
        if not link.drop():
            return
        with self.lock:
            if self.links.get(link.fd) is link:
                del self.links[link.fd]
            for sid in link.sessions:
                if self._holders.get(sid) is link:
                    del self._holders[sid]
        self.unwatch(link)
        for sid in link.sessions:
            LOG.info("session %s closed (its driver, pid %s, went away)", sid, link.peer_pid)
            self.send_host({"type": "session_closed", "id": next(self.ids), "sid": sid, "reason": "driver gone"})
        link.sock.close()

    def close(self) -> None:
        with self.lock:
            links, self.links = list(self.links.values()), {}
            self._holders.clear()
        for link in links:
            link.sock.close()
