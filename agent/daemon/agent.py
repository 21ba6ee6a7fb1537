"""The guest agent: the guest end of the host channel and the hub of the
guest's drivers.

One thread polls the channel port, the local socket and every registered
driver's connection; a rehome runs on a thread of its own (it waits for
drivers) while polling goes on.  The channel's state is a
``ChannelStateMachine`` (``accelmig.agent.daemon.channel``).

A ``rehome`` is applied once per migration id: delivered again (the host
reconnected, reconciled, or fell back to guest-exec), it gets the same
answer.  Sessions come and go with their drivers' connections: a driver
that dies is noticed when its socket closes.

Whatever a peer sends (the host, or any process of the guest on the local
socket), each field is checked for its type before it is used: a wrong one
is answered ``BAD_REQUEST`` (a ``result`` with a wrong id, which cannot be
answered, is dropped with its reason), and the rest of the same read is
still handled.  One local connection may register at most
``max_sessions_per_link`` sessions (256), all of them together at most
``max_sessions`` (4096).
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import math
import os
import select
import socket
import struct
import threading
import time

from accelmig.agent import dmi
from accelmig.agent.daemon.channel import ChannelState, ChannelStateMachine
from accelmig.agent.daemon.netconfig import NetworkConfigurator
from accelmig.agent.daemon.ports import PortClosed, open_port
from accelmig.runtime.sockets import OwnedUnixSocket
from accelmig.wire import attestation as att
from accelmig.wire import channel as ch
from accelmig.wire.errors import (AccelmigError, BadRequest, Forbidden, InternalError, LimitExceeded, Timeout,
                                  UnknownOp)
from accelmig.wire.identity import HostIdentity

LOG = logging.getLogger(__name__)
AGENT_VERSION = "0.1.0"

#: the longest session id a client may register (the pool's identifiers are at most 256 characters)
MAX_SID = 256
#: the longest ``endpoint`` a client may register with a session (a longer ``name`` is cut to it)
MAX_FIELD = 1024
MAX_EPOCH = 2**63 - 1


def _kind(value) -> str:
    """What a wrong value is, for an error message (never a container's repr:
    it may be nested deeply, or long)."""
    kind = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
    if isinstance(value, (bool, int, float)):
        text = repr(value)
        return f"{kind} ({text})" if len(text) <= 40 else kind
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    return kind


def _sid_of(message: dict, kind: str) -> str:
    sid = message.get("sid")
    if not isinstance(sid, str) or not 1 <= len(sid) <= MAX_SID:
        raise BadRequest(reason=f"{kind}: sid must be a string of 1 to {MAX_SID} characters, not {_kind(sid)}")
    return sid


def _optional_text(message: dict, key: str, kind: str, cut: bool = False):
    value = message.get(key)
    if value is not None and isinstance(value, str) and cut:
        return value[:MAX_FIELD]
    if value is not None and (not isinstance(value, str) or len(value) > MAX_FIELD):
        raise BadRequest(reason=f"{kind}: {key} must be a string of at most {MAX_FIELD} characters or null, "
                                f"not {_kind(value)}")
    return value


def _is_int(value) -> bool:
    """An integer (a JSON number without a fraction; not a boolean): the
    agent's own request ids (``resume``), an epoch."""
    return isinstance(value, int) and not isinstance(value, bool)


def _driver_reply(message: dict) -> dict:
    """A driver's answer to a ``resume``, in a shape the rehome can rely on:
    ``ok`` a boolean, ``result`` an object, ``error`` an error object."""
    ok = message.get("ok")
    if ok is True:
        result = message.get("result")
        if result is None or isinstance(result, dict):
            return {"ok": True, "result": result or {}}
        problem = f"its result is {_kind(result)}, not an object"
    elif ok is False:
        error = message.get("error")
        if isinstance(error, dict) and isinstance(error.get("code"), str) and \
                isinstance(error.get("message", ""), str):
            return {"ok": False, "error": error}
        problem = f"a failed answer whose error is {_kind(error)}, not an error object"
    else:
        problem = f"its ok is {_kind(ok)}, not a boolean"
    return {"ok": False, "error": {"code": "PROTOCOL_ERROR", "message": f"the driver answered garbage: {problem}"}}


class _Poller:
    """The agent's poll set: ``select.epoll`` where there is one (a wait
    costs the descriptors that are ready, not every one watched: a guest
    may run a thousand drivers), else ``select.poll``.  Its flags are
    poll's (epoll's have the same values)."""

    def __init__(self):
        self._epoll = select.epoll() if hasattr(select, "epoll") else None
        self._poll = None if self._epoll is not None else select.poll()
        self._events: dict[int, int] = {}

    def set(self, fd: int, events: int) -> None:
        if self._events.get(fd) == events:
            return
        if self._epoll is None:
            self._poll.register(fd, events)
        else:
            try:
                self._epoll.modify(fd, events) if fd in self._events else self._epoll.register(fd, events)
            except FileNotFoundError:       # closed and reused since: epoll had dropped it
                self._epoll.register(fd, events)
            except FileExistsError:
                self._epoll.modify(fd, events)
        self._events[fd] = events

    def add(self, fd: int, events: int) -> None:
        """A descriptor new to the set, whatever it knew by that number: a
        closed one's number comes back with the next socket (epoll dropped
        the closed one by itself; what was kept of it is forgotten here)."""
        self._events.pop(fd, None)
        if self._epoll is None:
            self._poll.register(fd, events)
        else:
            try:
                self._epoll.register(fd, events)
            except FileExistsError:
                self._epoll.modify(fd, events)
        self._events[fd] = events

    def remove(self, fd: int) -> None:
        if self._events.pop(fd, None) is None:
            return
        try:
            (self._epoll or self._poll).unregister(fd)
        except (OSError, KeyError, ValueError):     # closed already: epoll dropped it by itself
            pass

    def poll(self, timeout: float) -> list:
        if self._epoll is not None:
            return self._epoll.poll(timeout)
        return self._poll.poll(int(timeout * 1000))

    def close(self) -> None:
        if self._epoll is not None:
            self._epoll.close()


def _driver_connected(times) -> float | None:
    """When a driver says its new connection was up (its ``times``), if it
    says it as a number: a claim for the timeline, never used otherwise."""
    value = times.get("connected") if isinstance(times, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _settle(slot: dict, reply: dict) -> None:
    """A resume asked of a driver is over: its answer (or why there is none)."""
    if slot["event"].is_set():
        return
    slot["reply"] = reply
    slot["done"] = time.monotonic()
    slot["event"].set()
    if slot.get("finished") is not None:
        slot["finished"](slot)


class DriverLink:
    """One driver's connection to the agent; its registered sessions.

    What the agent sends it goes through a bounded outgoing buffer that the
    poll thread writes when the socket is writable: a driver that does not
    read never blocks the agent's one loop (the host's ping, every other
    driver).  One that lets more than ``max_backlog`` bytes pile up is
    dropped, like a driver that went away."""

    #: far above any burst of answers a reading driver leaves unread
    MAX_BACKLOG = 1 << 20

    def __init__(self, sock: socket.socket, wake=None, max_backlog: int = MAX_BACKLOG):
        self.sock = sock
        self.out = bytearray()
        self.max_backlog = max_backlog
        self.overflowed = False
        self._wake = wake or (lambda: None)     # tells the poll thread to watch POLLOUT
        self.parser = ch.LineParser(name="driver")
        self.sessions: dict[str, dict] = {}
        self.pending: dict[int, dict] = {}       # request id -> {"event", "reply"}
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

    def send(self, message: dict) -> None:
        """Queue ``message`` from any thread and write what the socket takes
        now; never blocks.  ``ConnectionError`` (an ``OSError``, as for a
        driver that went away) once the backlog is over its bound: the poll
        thread then drops the link."""
        data = ch.encode(message)
        with self.lock:
            if not self.overflowed and len(self.out) + len(data) > self.max_backlog:
                self.overflowed = True
                self.out.clear()        # nobody will read it
            if self.overflowed:
                self._wake()
                raise ConnectionError(f"driver {self.who} does not read: over "
                                      f"{self.max_backlog} bytes of messages unsent")
            was_idle = not self.out
            self.out += data
            self._flush_locked()
            if was_idle and self.out:
                self._wake()

    @property
    def backlogged(self) -> bool:
        return bool(self.out)

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


class Rehome:
    """One migration's rehome in this guest.  Its lock serialises deliveries of
    the same migration (the channel and guest-exec may race, hostd retries)."""

    def __init__(self, migration_id: str):
        self.migration_id = migration_id
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.result: dict | None = None
        self.attempts = 0


class Agent:
    #: sessions one local connection may register (a driver registers one per connection)
    MAX_SESSIONS_PER_LINK = 256
    #: sessions all local connections together may register
    MAX_SESSIONS = 4096
    #: drivers a rehome asks to resume at once (see ``_do_rehome``)
    RESUME_WINDOW = 16
    #: ``prove`` requests answered at once (each waits for its drivers), and how
    #: long one waits for them
    MAX_PROVING = 2
    PROVE_TIMEOUT = 10.0
    #: the longest reason a refused proof is given with (an answer stays within a line)
    PROVE_REASON = 120

    def __init__(self, port_path: str, socket_path: str = ch.DEFAULT_AGENT_SOCKET, *,
                 state_dir: str = "/run/accelmig", identity: HostIdentity | None = None,
                 rehome_timeout: float = 30.0, network: NetworkConfigurator | None = None,
                 max_sessions_per_link: int = MAX_SESSIONS_PER_LINK, max_sessions: int = MAX_SESSIONS,
                 dmi_path: str = dmi.PRODUCT_UUID, resume_window: int = RESUME_WINDOW):
        self.port_path = port_path
        self.resume_window = max(1, resume_window)
        self.max_sessions_per_link = max_sessions_per_link
        self.max_sessions = max_sessions
        self.socket_path = socket_path
        self.state_dir = state_dir
        self.rehome_timeout = rehome_timeout
        self.network = network or NetworkConfigurator()
        # read once, as root: the drivers of other users may not read it (dmi)
        self.domain = dmi.system_uuid(dmi_path)
        self.port = None
        self.listener: socket.socket | None = None
        self.channel = ChannelStateMachine()
        self.parser = ch.LineParser(name="channel")
        self.drivers: dict[int, DriverLink] = {}
        # sid -> the link that registered it (under _lock): a register is
        # checked without a look at every other driver
        self._holders: dict[str, DriverLink] = {}
        self.rehomes: collections.OrderedDict[str, Rehome] = collections.OrderedDict()
        # The tickets of a rehome too big for one line come first, in pieces
        # (``tickets``): staged here for that one migration id (a piece of
        # another migration drops them), at most ``max_sessions`` of them.
        self._staged: tuple[str, dict[str, str]] | None = None
        self.identity = identity or self._load_identity()
        self.static_identity = identity is not None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._proving = threading.BoundedSemaphore(self.MAX_PROVING)
        self._port_lock = threading.Lock()
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)     # a wake-up never blocks its sender
        # the poll set, kept between waits: descriptor -> "port", "listener",
        # "wake" or the DriverLink (the poll thread alone changes it)
        self._poller = None
        self._fd_kind: dict[int, object] = {}
        self._port_fd: int | None = None
        self._touched: set = set()               # links whose POLLOUT must be looked at
        self._touch_lock = threading.Lock()
        self.started = time.time()
        self.stats = collections.Counter()

    # -- state ------------------------------------------------------------------------
    @property
    def state(self) -> ChannelState:
        """The host channel's state."""
        return self.channel.state

    @property
    def identity_file(self) -> str:
        return os.path.join(self.state_dir, "identity.json")

    def _load_identity(self) -> HostIdentity | None:
        try:
            with open(self.identity_file) as handle:
                return HostIdentity.from_wire(json.load(handle))
        except (OSError, ValueError, AccelmigError):
            return None

    def _store_identity(self, identity: HostIdentity) -> None:
        self.identity = identity
        try:
            os.makedirs(self.state_dir, exist_ok=True)
            tmp = self.identity_file + ".tmp"
            with open(tmp, "w") as handle:
                json.dump(identity.to_wire(), handle)
            os.replace(tmp, self.identity_file)
        except OSError as exc:
            LOG.warning("cannot keep the identity in %s: %s", self.identity_file, exc)

    def sessions(self, uid: int | None = None) -> list[dict]:
        """Every registered session, or only those of ``uid``'s processes."""
        with self._lock:
            return [dict(info, sid=sid) for link in self.drivers.values()
                    if uid is None or link.peer_uid == uid
                    for sid, info in link.sessions.items()]

    def guest_identity(self) -> dict:
        out = {"hostname": socket.gethostname(), "pid": os.getpid()}
        for key, path in (("boot_id", "/proc/sys/kernel/random/boot_id"), ("machine_id", "/etc/machine-id")):
            try:
                with open(path) as handle:
                    out[key] = handle.read().strip()
            except OSError:
                pass
        return out

    def status(self, uid: int | None = None, after=None) -> dict:
        """All of it for the host and for root (``uid`` None or 0); another
        user of the guest sees only its own sessions, and of the rehomes
        only that they happened.  The sessions a page at a time (sorted by
        sid, those after ``after``; ``next`` names the last one listed when
        more follow): the answer is a line, and a guest may hold thousands
        of sessions with kilobytes of fields each; ``session_count`` and
        ``next`` come with a page that is not all of them.  A rehome's result here
        is its summary (``bounded_outcome`` with no sessions listed)."""
        everything = uid in (None, 0)
        if after is not None and (not isinstance(after, str) or len(after) > MAX_SID):
            raise BadRequest(reason=f"status: after must be a session id (a string of at most {MAX_SID} "
                                    f"characters), not {_kind(after)}")
        mine = sorted(self.sessions(None if everything else uid), key=lambda info: info["sid"])
        listed, used, following = [], 0, None
        for info in mine:
            if after is not None and info["sid"] <= after:
                continue
            cost = len(json.dumps(info)) + 2
            if listed and used + cost > ch.ANSWER_BUDGET:
                following = listed[-1]["sid"]
                break
            listed.append(info)
            used += cost
        return {"agent_version": AGENT_VERSION, "protocol": ch.CHANNEL_PROTOCOL,
                "channel": self.state.value, "identity": self.identity.to_wire() if self.identity else None,
                "sessions": listed,
                # (only when the page is not all of them: ``next`` for the page after)
                **({"session_count": len(mine), "next": following} if following or after else {}),
                "uptime": round(time.time() - self.started, 3),
                "rehomes": [{"migration_id": r.migration_id, "done": r.done.is_set(),
                             **({"result": ch.bounded_outcome(r.result, 0)}
                                if everything and r.result is not None else {})}
                            for r in self.rehomes.values()],
                "stats": dict(self.stats),
                **({"dropped": self.parser.dropped[-10:]} if everything else {})}

    # -- lifecycle --------------------------------------------------------------------
    def open(self) -> None:
        # any application in the guest may register its sessions
        self._owned = OwnedUnixSocket(self.socket_path, mode=0o666, what="accelmig-agent")
        self.listener = self._owned.open()      # first: a second agent stops here
        try:
            self.port = open_port(self.port_path)
        except BaseException:
            self._owned.close()
            self.listener = None
            raise
        LOG.info("agent %s: channel %s, drivers at %s", AGENT_VERSION, self.port_path, self.socket_path)

    def _wake(self) -> None:
        """Make the poll thread look again (from any thread, a signal handler)."""
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:     # the pipe is full: it wakes up anyway
            pass

    def stop(self) -> None:
        self._stop.set()
        self._wake()

    def reload(self) -> None:
        """SIGHUP (safe in a signal handler): answered on the poll thread."""
        self._reload.set()
        self._wake()

    def _reloaded(self) -> None:
        # Every setting comes from the command line and the identity file is
        # the agent's own state: there is nothing to read again, and saying
        # so beats dying (SIGHUP's default) or pretending.
        self._reload.clear()
        LOG.info("reload: nothing to reload (accelmig-agent takes its settings from its command "
                 "line; restart it to change them)")

    def close(self) -> None:
        for link in list(self.drivers.values()):
            link.sock.close()
        self.drivers.clear()
        self._holders.clear()
        if self._poller is not None:
            self._poller.close()
        self._poller, self._port_fd = None, None
        self._fd_kind.clear()
        if self.listener is not None:
            self._owned.close()
            self.listener = None
        if self.port is not None:
            self.port.close()

    def run(self) -> None:
        if self.port is None:
            self.open()
        try:
            while not self._stop.is_set():
                self._poll_once()
        finally:
            self.close()

    def _poll_once(self) -> None:
        """One wait for the channel, the listener, the wake-up pipe and every
        driver.  The poll set is kept from one wait to the next (a driver is
        added when accepted, removed when dropped; its POLLOUT follows its
        backlog): a look costs the same with a thousand drivers as with one."""
        poller = self._poller
        if poller is None:
            poller = self._poller = _Poller()
            for fd, kind in ((self.listener.fileno(), "listener"), (self._wake_r, "wake")):
                poller.add(fd, select.POLLIN)
                self._fd_kind[fd] = kind
        # the channel: its descriptor changes (a unix port's connection) or
        # is not to be watched for a while (a device with no host end)
        port_fd = self.port.fileno()
        events = self.port.poll_events() if port_fd is not None else 0
        old = self._port_fd
        if old is not None and (old != port_fd or not events) and self._fd_kind.get(old) == "port":
            poller.remove(old)
            del self._fd_kind[old]
        self._port_fd = None
        if port_fd is not None and events:
            if old == port_fd and self._fd_kind.get(port_fd) == "port":
                poller.set(port_fd, events)
            else:
                poller.add(port_fd, events)
            self._fd_kind[port_fd] = "port"
            self._port_fd = port_fd
        with self._touch_lock:
            touched, self._touched = self._touched, set()
        for link in touched:                 # a send from any thread left a backlog, or overflowed
            fd = link.sock.fileno()
            if fd < 0 or self._fd_kind.get(fd) is not link:
                continue
            if link.overflowed:
                LOG.warning("driver %s dropped: it does not read what the agent sends", link.who)
                self._drop_driver(link)
                continue
            poller.set(fd, select.POLLIN | (select.POLLOUT if link.backlogged else 0))
        wait = self.port.next_look_in()
        for fd, revents in poller.poll(wait if wait is not None else 1.0):
            kind = self._fd_kind.get(fd)
            try:
                if kind == "port":
                    self._on_port(revents)
                elif kind == "listener":
                    self._accept_driver()
                elif kind == "wake":
                    os.read(self._wake_r, 64)
                    if self._reload.is_set():
                        self._reloaded()
                elif isinstance(kind, DriverLink):
                    self._on_driver(kind, revents)
            except Exception:   # the agent must outlive anything one peer does
                LOG.exception("agent: handling %s failed", kind if isinstance(kind, str) else "a driver")

    def _touch(self, link: "DriverLink") -> None:
        """``link`` has a backlog to write (or overflowed): from any thread."""
        with self._touch_lock:
            self._touched.add(link)
        self._wake()

    # -- the channel ------------------------------------------------------------------
    def _on_port(self, revents: int) -> None:
        data = self.port.read(revents)
        if data is None:
            self.channel.host_gone()
            self.parser.reset()
            return
        if not data:
            return
        self.channel.host_wrote()
        for message in self.parser.feed(data):
            try:
                self._on_host_message(message)
            except Exception as exc:     # a bug costs only its message: the rest of the read is handled
                LOG.exception("channel: handling a %s failed", message.get("type"))
                self.send_host(ch.result(message.get("id"), ok=False, error=InternalError(
                    reason=f"{type(exc).__name__} handling a {message.get('type')}").to_wire()))

    def send_host(self, message: dict, resync: bool = False) -> bool:
        data = ch.encode(message)
        if resync:
            data = ch.SENTINEL + data
        with self._port_lock:
            try:
                self.port.write(data)
                return True
            except PortClosed as exc:
                LOG.info("channel: could not send %s: %s", message.get("type"), exc)
                return False

    def _on_host_message(self, message: dict) -> None:
        kind, request_id = message.get("type"), message.get("id")
        # (a host inventing types does not grow the counters without end)
        self.stats[f"host_{kind}" if kind in ch.HOST_TYPES else "host_unknown"] += 1
        try:
            if kind == "sync":
                self.channel.host_synced()
                self.send_host({"type": "sync", "id": request_id, "nonce": message.get("nonce")},
                               resync=True)
                for line in self.hello_messages():
                    self.send_host(line)
            elif kind == "ping":
                self.send_host(ch.result(request_id, result={"pong": True, "time": time.time()}))
            elif kind == "status":
                self.send_host(ch.result(request_id, result=self.status(after=message.get("after"))))
            elif kind == "tickets":
                self.send_host(ch.result(request_id, result=self.stage_tickets(message)))
            elif kind == "identity":
                identity = HostIdentity.from_wire(message.get("identity"))
                # The host assigns the fabric NIC's address (host-bound
                # fabrics): apply it before anyone connects through it.
                network = self.network.apply(identity.guest_nic) if identity.guest_nic else []
                self._store_identity(identity)
                LOG.info("identity from host %s: pool at %s%s", identity.host_id, identity.pool_endpoint,
                         f"; network: {'; '.join(network)}" if network else "")
                self.send_host(ch.result(request_id, result={"accepted": True, "network": network}))
            elif kind == "rehome":
                threading.Thread(target=self._rehome_and_answer, args=(message, time.time()),
                                 name=f"rehome-{request_id}", daemon=True).start()
            elif kind == "prove":
                att.parse_prove(message, MAX_SID)          # a bad request is answered at once
                threading.Thread(target=self._answer_on, args=(self.send_host, request_id, self.prove, message),
                                 name=f"prove-{request_id}", daemon=True).start()
            else:
                raise UnknownOp(op=kind)
        except AccelmigError as exc:
            LOG.warning("channel: %s refused: %s", kind, exc)
            self.send_host(ch.result(request_id, ok=False, error=exc.to_wire()))

    def hello(self) -> dict:
        return self.hello_messages()[0]

    #: the sessions a hello lists, in bytes: past it, the rest follow one
    #: session_opened each (local users may register many sessions with long
    #: fields; one line over the host's MAX_LINE would be dropped whole, and
    #: the host's sync with this guest would time out)
    HELLO_SESSIONS_BUDGET = ch.MAX_LINE // 2

    def hello_messages(self) -> list[dict]:
        """The hello, then a session_opened for each session it had no room for."""
        listed, rest, size = [], [], 0
        for session in self.sessions():
            size += len(json.dumps(session)) + 2
            (listed if size <= self.HELLO_SESSIONS_BUDGET else rest).append(session)
        hello = {"type": "hello", "id": next(self._ids), "agent_version": AGENT_VERSION,
                 "protocol": ch.CHANNEL_PROTOCOL, "guest": self.guest_identity(),
                 "sessions": listed,
                 "identity": self.identity.to_wire() if self.identity else None}
        return [hello] + [{"type": "session_opened", "id": next(self._ids), **session} for session in rest]

    def _rehome_and_answer(self, message: dict, received: float) -> None:
        try:
            outcome = ch.result(message.get("id"), result=ch.timed_outcome(
                ch.bounded_outcome(self.rehome(message, received)), received))
        except AccelmigError as exc:
            outcome = ch.result(message.get("id"), ok=False, error=exc.to_wire())
        except Exception as exc:  # never leave the host without an answer
            LOG.exception("rehome failed")
            outcome = ch.result(message.get("id"), ok=False,
                                error=InternalError(reason=f"{type(exc).__name__}: {exc}").to_wire())
        self.send_host(outcome)

    # -- binding proofs ------------------------------------------------------------------
    @staticmethod
    def _answer_on(send, request_id, work, request) -> None:
        """``work(request)``'s outcome as the answer to ``request_id``, sent
        with ``send`` (the channel's, or a local client's): never no answer."""
        try:
            answer = ch.result(request_id, result=work(request))
        except AccelmigError as exc:
            answer = ch.result(request_id, ok=False, error=exc.to_wire())
        except Exception as exc:
            LOG.exception("%s failed", getattr(work, "__name__", "a request"))
            answer = ch.result(request_id, ok=False,
                               error=InternalError(reason=f"{type(exc).__name__}: {exc}").to_wire())
        try:
            send(answer)
        except OSError:
            pass

    def prove(self, request: dict) -> dict:
        """Each driver's binding proof of the sessions ``request`` names (every
        session, a page at a time, when it names none) for the pool's
        challenges (``wire.attestation``): ``{"proofs": {sid: proof},
        "refused": {sid: reason}, "next": the last sid listed when more
        follow}``.  The drivers are asked all at once; one that does not
        answer within PROVE_TIMEOUT is refused.  The agent proves nothing
        itself: only the driver holds a session's secret."""
        host, challenges, sids, after = att.parse_prove(request, MAX_SID)
        if not self._proving.acquire(timeout=self.PROVE_TIMEOUT):
            raise Timeout(what=f"a prove for host {host} (others still waiting for their drivers)",
                          timeout=self.PROVE_TIMEOUT)
        try:
            with self._lock:
                held = dict(self._holders)
            following = None
            if sids is None:
                order = sorted(sid for sid in held if after is None or sid > after)
                if len(order) > att.MAX_PROVE:
                    order, following = order[:att.MAX_PROVE], order[att.MAX_PROVE - 1]
                sids = order
            refused: dict[str, str] = {}
            asked = []
            for sid in dict.fromkeys(sids):
                link = held.get(sid)
                if link is None:
                    refused[sid] = "no driver in this guest holds that session"
                    continue
                request_id = next(self._ids)
                slot = {"event": threading.Event(), "reply": None}
                link.pending[request_id] = slot
                try:
                    link.send({"type": "prove", "id": request_id, "sid": sid, "host": host,
                               "challenges": challenges})
                except OSError as exc:
                    link.pending.pop(request_id, None)
                    refused[sid] = f"its driver is unreachable: {exc}"[:self.PROVE_REASON]
                    continue
                asked.append((sid, slot))
            deadline = time.monotonic() + self.PROVE_TIMEOUT
            proofs: dict[str, str] = {}
            for sid, slot in asked:
                if not slot["event"].wait(max(0.0, deadline - time.monotonic())):
                    refused[sid] = f"its driver did not answer within {self.PROVE_TIMEOUT:.0f} s"
                    continue
                reply = slot["reply"] or {}
                result = reply.get("result") if reply.get("ok") else None
                proof = result.get("proof") if isinstance(result, dict) else None
                if isinstance(proof, str) and 0 < len(proof) <= att.MAX_TOKEN:
                    proofs[sid] = proof
                else:
                    error = reply.get("error") if isinstance(reply.get("error"), dict) else {}
                    refused[sid] = str(error.get("message") or "its driver answered no proof")[:self.PROVE_REASON]
            self.stats["proofs"] += len(proofs)
            LOG.info("prove for host %s: %d proof(s), %d refused", host, len(proofs), len(refused))
            return {"host": host, "proofs": proofs, "refused": refused, "next": following}
        finally:
            self._proving.release()

    # -- rehome ------------------------------------------------------------------------
    def stage_tickets(self, message: dict) -> dict:
        """A piece of the tickets of a rehome too big for one line: kept for
        the ``rehome`` of the same migration id that follows."""
        migration_id, tickets = ch.parse_tickets(message)
        with self._lock:
            staged = self._staged[1] if self._staged and self._staged[0] == migration_id else {}
            if len(staged) + len(tickets) > self.max_sessions:
                self._staged = None
                raise LimitExceeded(f"tickets of rehome {migration_id}: more than {self.max_sessions}, "
                                    f"the most sessions this agent keeps")
            staged.update(tickets)
            self._staged = (migration_id, staged)
            return {"migration_id": migration_id, "staged": len(staged)}

    def _all_tickets(self, migration_id: str, tickets: dict, count: int | None) -> dict:
        """The rehome's tickets: its own, and the pieces staged before it
        when it says it has ``count`` in all; BadRequest when they do not
        add up (a piece lost: the host sends them all again)."""
        if count is None:
            return tickets
        with self._lock:
            staged = self._staged[1] if self._staged and self._staged[0] == migration_id else {}
            self._staged = None
        merged = dict(staged, **tickets)
        if len(merged) != count:
            raise BadRequest(reason=f"rehome {migration_id}: {count} tickets announced, {len(merged)} "
                                    f"arrived (a piece was lost: send them all again)")
        return merged

    def rehome(self, message: dict, received: float | None = None) -> dict:
        """Apply a rehome and return its outcome (every session's: the
        answers bound it, ``ch.bounded_outcome``).

        Once per migration id: delivered again after it succeeded, it gets the
        same answer.  Delivered again after some sessions (or the network)
        failed, it retries just those, with the tickets it brings now, and
        keeps the outcomes that were already good."""
        migration_id, identity, tickets = ch.parse_rehome(message)
        tickets = self._all_tickets(migration_id, tickets, ch.parse_rehome_count(message))
        with self._lock:
            entry = self.rehomes.get(migration_id)
            if entry is None:
                entry = self.rehomes[migration_id] = Rehome(migration_id)
                while len(self.rehomes) > 64:
                    self.rehomes.popitem(last=False)
        if not entry.lock.acquire(timeout=self.rehome_timeout + 10):
            raise Timeout(what=f"rehome {migration_id} (still running)", timeout=self.rehome_timeout)
        try:
            previous = entry.result
            if previous is not None and previous["ok"]:
                self.stats["rehome_repeated"] += 1
                return previous
            if previous is not None:
                self.stats["rehome_retried"] += 1
            entry.attempts += 1
            try:
                entry.result = self._do_rehome(migration_id, identity, tickets, previous,
                                               time.time() if received is None else received)
            except AccelmigError as exc:
                entry.result = {"migration_id": migration_id, "ok": False, "error": exc.to_wire(),
                                "sessions": dict((previous or {}).get("sessions") or {}), "network": []}
            entry.result["attempts"] = entry.attempts
            entry.done.set()
            return entry.result
        finally:
            entry.lock.release()

    def _do_rehome(self, migration_id: str, identity: HostIdentity, tickets: dict,
                   previous: dict | None = None, received: float | None = None) -> dict:
        """``previous``: the outcome of an earlier attempt of this migration;
        what succeeded then is not done again.  ``received``: when the
        rehome was read (this guest's clock: the timeline's ``times``)."""
        started = time.monotonic()
        times = {"agent_received": time.time() if received is None else received}
        done = {sid: outcome for sid, outcome in ((previous or {}).get("sessions") or {}).items()
                if outcome.get("ok")}
        # Nothing is written (the log's lines, the identity's file) until the
        # drivers have resumed: right after a move under TCG every kernel path
        # a write takes (the console's tty and serial driver, the file
        # system's) is translated anew, and on a guest of one vCPU a write
        # made while they resume still lies on the blackout's path.
        said = [("rehome %s%s: host %s, pool at %s, %d ticket(s)", migration_id,
                 f" (attempt {previous.get('attempts', 1) + 1}, {len(done)} session(s) already resumed)"
                 if previous else "", identity.host_id, identity.pool_endpoint, len(tickets))]
        network, network_error = [], None
        if previous is not None and previous.get("network_error") is None:
            network = list(previous.get("network") or [])
        elif identity.guest_nic is not None:
            try:
                network = self.network.apply(identity.guest_nic)
                times["nic_readdressed"] = time.time()
                said.append(("rehome %s: network: %s", migration_id, "; ".join(network) or "unchanged"))
            except AccelmigError as exc:
                network_error = exc.to_wire()
                for line in said:
                    LOG.info(*line)
                said.clear()
                LOG.error("rehome %s: guest network not applied: %s", migration_id, exc)
        network_s = time.monotonic() - started
        self.identity = identity         # (the drivers' ``where`` answers it from now on; the file below)
        with self._lock:
            by_process: dict = {}
            for link in self.drivers.values():
                for sid in link.sessions:
                    if sid not in done:
                        by_process.setdefault(link.peer_pid, []).append((link, sid))
        # one process's drivers after another's, in turn: the processes of the
        # guest resume side by side (a process resumes its sessions one at a
        # time at best: they share its one interpreter)
        targets = collections.deque(item for turn in itertools.zip_longest(*by_process.values())
                                    for item in turn if item is not None)
        # At most ``resume_window`` drivers resume at once: a guest's resumes
        # all come from its one address, and the pool admits only a few
        # connections per address before they authenticate (32 by default);
        # a thousand at once would be refused, and retried, by the hundred.
        deadline = time.monotonic() + self.rehome_timeout
        asked = []
        window = threading.RLock()
        all_settled = threading.Event()
        in_flight, pumping = [0], [False]

        def pump() -> None:
            # (under ``window``) fill the window; run by whichever thread freed a place
            pumping[0] = True
            try:
                while targets and in_flight[0] < self.resume_window and time.monotonic() < deadline:
                    link, sid = targets.popleft()
                    request_id = next(self._ids)
                    slot = {"event": threading.Event(), "reply": None, "sent": time.monotonic(),
                            "finished": settled}
                    asked.append((sid, slot))
                    in_flight[0] += 1
                    link.pending[request_id] = slot
                    try:
                        link.send({"type": "resume", "id": request_id, "sid": sid,
                                   "endpoint": identity.pool_endpoint, "ticket": tickets.get(sid),
                                   "migration_id": migration_id})
                    except OSError as exc:
                        link.pending.pop(request_id, None)
                        _settle(slot, {"ok": False, "error": {"code": "UNAVAILABLE",
                                                              "message": f"driver unreachable: {exc}"}})
            finally:
                pumping[0] = False
            if not in_flight[0]:
                all_settled.set()

        def settled(_slot) -> None:
            # a driver answered (or went away): its place goes to the next one
            with window:
                in_flight[0] -= 1
                if not pumping[0]:           # (else: this thread's pump goes on by itself)
                    pump()

        with window:
            pump()
        all_settled.wait(max(0.0, deadline - time.monotonic()))
        # the drivers have answered (the pool has their resumes): what waited is written now
        for line in said:
            LOG.info(*line)
        self._store_identity(identity)
        with window:
            unasked = list(targets)
            targets.clear()                 # a late answer asks nobody else
        sessions = dict(done)
        for sid, slot in asked:
            if not slot["event"].is_set():
                sessions[sid] = {"ok": False, "error": {"code": "TIMEOUT", "message":
                                 f"the driver did not resume within {self.rehome_timeout:.0f} s"}}
                continue
            reply = slot["reply"] or {}
            outcome = {"ok": bool(reply.get("ok")), "seconds": round(slot.get("done", 0) - slot["sent"], 6)}
            if reply.get("ok"):
                outcome.update(reply.get("result") or {})
                outcome["ok"] = True        # the driver's result does not say otherwise
                connected = _driver_connected(outcome.pop("times", None))
                if connected is not None:
                    times["driver_connected"] = min(connected, times.get("driver_connected", connected))
            else:
                outcome["error"] = reply.get("error")
            sessions[sid] = outcome
        for _link, sid in unasked:          # never asked: the rehome's time ran out first
            sessions[sid] = {"ok": False, "error": {"code": "TIMEOUT", "message":
                             f"not asked to resume within the rehome's {self.rehome_timeout:.0f} s"}}
        for sid in tickets:
            sessions.setdefault(sid, {"ok": False, "error": {
                "code": "NO_SUCH_OBJECT", "message": "no driver in this guest holds that session"}})
        result = {"migration_id": migration_id, "ok": network_error is None and all(
                      s["ok"] for s in sessions.values()),
                  "host_id": identity.host_id, "network": network, "network_error": network_error,
                  "network_seconds": round(network_s, 6), "sessions": sessions, "times": times,
                  "seconds": round(time.monotonic() - started, 6)}
        LOG.info("rehome %s done in %.1f ms: %d/%d session(s) resumed", migration_id,
                 result["seconds"] * 1000, sum(s["ok"] for s in sessions.values()), len(sessions))
        return result

    # -- drivers ------------------------------------------------------------------------
    def _accept_driver(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        link = DriverLink(sock)
        link._wake = lambda: self._touch(link)
        with self._lock:
            self.drivers[sock.fileno()] = link
        if self._poller is not None:
            self._poller.add(sock.fileno(), select.POLLIN)
        self._fd_kind[sock.fileno()] = link

    def _drop_driver(self, link: DriverLink) -> None:
        with self._lock:
            if self.drivers.get(link.sock.fileno()) is not link:
                return                    # dropped already (a closed socket's fileno is -1)
            del self.drivers[link.sock.fileno()]
            for sid in link.sessions:
                if self._holders.get(sid) is link:
                    del self._holders[sid]
        if self._fd_kind.get(link.sock.fileno()) is link:
            del self._fd_kind[link.sock.fileno()]
            if self._poller is not None:
                self._poller.remove(link.sock.fileno())
        for slot in list(link.pending.values()):     # (a rehome's thread may add one meanwhile)
            _settle(slot, {"ok": False, "error": {"code": "UNAVAILABLE", "message": "the driver went away"}})
        for sid in link.sessions:
            LOG.info("session %s closed (its driver, pid %s, went away)", sid, link.peer_pid)
            self.send_host({"type": "session_closed", "id": next(self._ids), "sid": sid,
                            "reason": "driver gone"})
        link.sock.close()

    def _on_driver(self, link: DriverLink, revents: int = select.POLLIN) -> None:
        if revents & select.POLLOUT:
            try:
                link.flush()
            except OSError:
                self._drop_driver(link)
                return
            if not link.backlogged and self._poller is not None:
                # written out: stop watching POLLOUT (a send that queues again touches it)
                self._poller.set(link.sock.fileno(), select.POLLIN)
            if not revents & (select.POLLIN | select.POLLHUP | select.POLLERR):
                return
        try:
            data = link.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop_driver(link)
            return
        for message in link.parser.feed(data):
            try:
                self._on_driver_message(link, message)
            except AccelmigError as exc:
                try:
                    link.send(ch.result(message.get("id"), ok=False, error=exc.to_wire()))
                except OSError:
                    pass
            except OSError as exc:       # the driver went away, or does not read
                (LOG.warning if link.overflowed else LOG.info)("driver %s dropped: %s", link.who, exc)
                self._drop_driver(link)
                return
            except Exception as exc:     # a bug costs only its message: the rest of the read is handled
                LOG.exception("driver %s: handling a %s failed", link.who, message.get("type"))
                try:
                    link.send(ch.result(message.get("id"), ok=False, error=InternalError(
                        reason=f"{type(exc).__name__} handling a {message.get('type')}").to_wire()))
                except OSError:
                    pass

    def _on_driver_message(self, link: DriverLink, message: dict) -> None:
        kind, request_id = message.get("type"), message.get("id")
        if kind == "register":
            # every field is checked before any is used or kept (any process of the guest may send this)
            sid = _sid_of(message, "register")
            # (the name is a label only: a long one is cut, not refused)
            info = {"endpoint": _optional_text(message, "endpoint", "register"),
                    "name": _optional_text(message, "name", "register", cut=True)}
            epoch = message.get("epoch")
            if epoch is not None and (not _is_int(epoch) or not 0 <= epoch <= MAX_EPOCH):
                raise BadRequest(reason=f"register: epoch must be an integer from 0 to 2**63-1 or null, "
                                        f"not {_kind(epoch)}")
            info["epoch"] = epoch
            info["pid"] = link.peer_pid          # the kernel's word, not the message's
            info["uid"] = link.peer_uid
            with self._lock:
                holder = self._holders.get(sid)
                moves = holder is not None and holder is not link and \
                    (holder.peer_pid, holder.peer_uid) == (link.peer_pid, link.peer_uid)
                if holder is not None and holder is not link and not moves:
                    # Tickets for a session go to the process that registered it:
                    # nobody else may take it over (another user least of all).
                    raise Forbidden(who=link.who, what=f"register session {sid}: it is registered "
                                                       f"by {holder.who}")
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
            self.send_host({"type": "session_opened", "id": next(self._ids), "sid": sid, **info})
            link.send(ch.result(request_id, result={"registered": sid}))
        elif kind == "unregister":
            sid = _sid_of(message, "unregister")
            with self._lock:
                known = link.sessions.pop(sid, None)
                if known is not None and self._holders.get(sid) is link:
                    del self._holders[sid]
            if known is not None:
                self.send_host({"type": "session_closed", "id": next(self._ids), "sid": sid,
                                "reason": "closed"})
            link.send(ch.result(request_id, result={"unregistered": sid}))
        elif kind == "where":
            identity = self.identity
            link.send(ch.result(request_id, result={
                "endpoint": identity.pool_endpoint if identity else None,
                "identity": identity.to_wire() if identity else None,
                "domain": self.domain}))
        elif kind == "result":
            if not _is_int(request_id):
                # an answer to nothing the agent asked: nothing to answer either
                link.parser.drop(f"a result from {link.who} whose id is {_kind(request_id)}, "
                                 f"not the id of a request of the agent's")
                return
            slot = link.pending.pop(request_id, None)
            if slot is not None:
                _settle(slot, _driver_reply(message))
        elif kind == "tickets":
            # the pieces of a big rehome_local (accelmig-agent rehome --stdin): root only, as it
            if not link.privileged:
                raise Forbidden(who=link.who, what="stage the tickets of a rehome (root only)")
            link.send(ch.result(request_id, result=self.stage_tickets(message)))
        elif kind == "rehome_local":
            # accelmig-agent rehome --stdin, relayed from qemu-guest-agent's
            # guest-exec (which runs as root).  It re-addresses the NIC, moves
            # the default route and hands out tickets: root only.
            if not link.privileged:
                raise Forbidden(who=link.who, what="rehome this guest (root only)")
            document = message.get("document")
            if not isinstance(document, dict):
                raise BadRequest(reason=f"rehome_local: document must be a rehome document (an object), "
                                        f"not {_kind(document)}")
            threading.Thread(target=self._local_rehome, args=(link, message), daemon=True).start()
        elif kind == "status":
            link.send(ch.result(request_id, result=self.status(
                link.peer_uid if link.peer_uid is not None else -1, after=message.get("after"))))
        elif kind == "prove_local":
            # accelmig-agent prove --stdin, relayed from qemu-guest-agent's guest-exec:
            # the sessions' proofs go to the host that asked, as the channel's prove's
            if not link.privileged:
                raise Forbidden(who=link.who, what="ask this guest's drivers to prove their sessions (root only)")
            request = message.get("request")
            att.parse_prove(request, MAX_SID)
            threading.Thread(target=self._answer_on, args=(link.send, request_id, self.prove, request),
                             name=f"prove-{request_id}", daemon=True).start()
        else:
            raise UnknownOp(op=kind)

    def _local_rehome(self, link: DriverLink, message: dict) -> None:
        try:
            received = time.time()
            answer = ch.result(message.get("id"), result=ch.timed_outcome(
                ch.bounded_outcome(self.rehome(message.get("document"), received)), received))
        except AccelmigError as exc:
            answer = ch.result(message.get("id"), ok=False, error=exc.to_wire())
        except Exception as exc:  # never leave the caller without an answer (nor die on stderr)
            LOG.exception("local rehome failed")
            answer = ch.result(message.get("id"), ok=False,
                               error=InternalError(reason=f"{type(exc).__name__}: {exc}").to_wire())
        try:
            link.send(answer)
        except OSError:
            pass
