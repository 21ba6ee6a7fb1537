"""accelmig's user-space driver: what an application imports to compute on
a pooled accelerator.  Standard library only (numpy is welcome, not needed).

::

    from accelmig.agent.driver import connect, f32, i32

    with connect("10.88.0.1:7070", token) as dev:
        prog = dev.build(SOURCE)
        x = dev.upload(numpy_array)
        y = dev.alloc(x.size)
        prog.launch("saxpy", n, None, f32(2.0), x, y)
        result = dev.read(y)

The driver is stateful on purpose: it holds the session (its id and its
secret, which never leaves the guest), the handles, and every command not
yet answered.  That state lives in guest memory and moves with the VM, so
after a live migration ``resume()`` continues the session on a new
connection — from a new host — without losing or repeating any command.

Launches, small writes, allocations and copies are pipelined (no round trip
each); reads, ``finish``, builds and large writes wait for their reply.  A
pipelined command that fails raises at the next call that waits.  Writes of
``ZERO_COPY_WRITE`` bytes or more are sent from the caller's memory and wait
for their reply (nothing is copied); smaller writes are copied and pipelined.

Connection state machine::

    CONNECTING -> CONNECTED <-> DISCONNECTED -> RESUMING -> CONNECTED
                      |              |                \\-> FAILED (diverged, lost, expired)
                      +--close()-----+--> CLOSED
"""

from __future__ import annotations

import enum
import logging
import os
import socket
import threading
import time

from accelmig.agent.window import CommandWindow, PendingCommand
from accelmig.wire import dataplane as dp
from accelmig.wire.dataplane import Op
from accelmig.wire.errors import (TERMINAL_SESSION_CODES, AccelmigError, BadRequest, Closed,
                                  Disconnected, FrameError, FrameTooLarge, ProtocolError, Timeout,
                                  Unavailable, WindowFull, from_wire)
from accelmig.wire.frames import FrameReader, Limits, encode_frame, encode_prefix_and_header

LOG = logging.getLogger(__name__)

ZERO_COPY_WRITE = 1 << 20
CORK_PAYLOAD = 16 << 10        # pipelined frames up to this payload are batched
CORK_BYTES = 256 << 10         # a batch goes out at this size at the latest
CORK_DELAY = 0.0002            # s a pipelined frame may wait for others to join it
_PLAIN_OK = {"op": "reply", "ok": True}
DEFAULT_TIMEOUT = 60.0

__all__ = ["connect", "Device", "Buffer", "Program", "Scalar", "LocalMemory", "LinkState",
           "i8", "u8", "i16", "u16", "i32", "u32", "i64", "u64", "f32", "f64"]


# -- kernel argument types -----------------------------------------------------------
class Scalar:
    """A typed kernel scalar: ``i32(3)``, ``f32(0.5)``.  Plain Python numbers
    are refused as kernel arguments: their C type would be a guess."""

    __slots__ = ("type_name", "value")

    def __init__(self, type_name: str, value):
        if type_name not in dp.SCALAR_TYPES:
            raise BadRequest(reason=f"unknown scalar type {type_name!r}")
        self.type_name = type_name
        self.value = value

    def to_wire(self) -> dict:
        return dp.encode_scalar(self.type_name, self.value)

    def __repr__(self) -> str:
        return f"{self.type_name}({self.value!r})"


def _scalar_maker(name):
    def make(value) -> Scalar:
        return Scalar(name, value)
    make.__name__ = name
    make.__doc__ = f"A {name} kernel argument."
    return make


i8, u8, i16, u16, i32, u32, i64, u64, f32, f64 = (
    _scalar_maker(n) for n in ("i8", "u8", "i16", "u16", "i32", "u32", "i64", "u64", "f32", "f64"))

_NUMPY_TO_TYPE = {v: k for k, v in dp.NUMPY_NAMES.items()}


class LocalMemory:
    """A ``__local`` kernel argument of ``nbytes`` bytes."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int):
        self.nbytes = int(nbytes)


def _as_bytes_view(data) -> memoryview:
    try:
        view = memoryview(data)
    except TypeError:
        raise BadRequest(reason=f"{type(data).__name__} is not bytes-like "
                                "(bytes, bytearray, memoryview or a numpy array)") from None
    if not view.c_contiguous:
        raise BadRequest(reason="data must be C-contiguous (numpy: np.ascontiguousarray)")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _dims(value, what: str) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, int):
        return [value]
    try:
        dims = [int(v) for v in value]
    except TypeError:
        raise BadRequest(reason=f"{what} must be an int or a tuple of 1-3 ints") from None
    return dims


# -- device objects -------------------------------------------------------------------
class Buffer:
    """Device memory owned by a session.  ``handle`` is chosen by the driver."""

    def __init__(self, device: "Device", handle: int, size: int):
        self.device = device
        self.handle = handle
        self.size = size
        self.freed = False

    def write(self, data, offset: int = 0) -> None:
        self.device.write(self, data, offset)

    def read(self, nbytes: int | None = None, offset: int = 0) -> bytes:
        return self.device.read(self, nbytes, offset)

    def free(self) -> None:
        self.device.free(self)

    def __repr__(self) -> str:
        return f"<Buffer {self.handle} {self.size} bytes>"


class Program:
    """A built program; ``kernels`` lists its kernel names."""

    def __init__(self, device: "Device", handle: int, kernels: list[str], log: str = ""):
        self.device = device
        self.handle = handle
        self.kernels = list(kernels)
        self.build_log = log

    def launch(self, kernel_name: str, global_size, local_size=None, *args) -> None:
        """Enqueue ``kernel_name`` over ``global_size`` (pipelined)."""
        self.device.launch(self, kernel_name, global_size, local_size, *args)

    def binary(self) -> bytes:
        """The device binary (to build the same program elsewhere with ``build_binary``)."""
        return self.device.program_binary(self)

    def free(self) -> None:
        self.device.free_program(self)

    def __repr__(self) -> str:
        return f"<Program {self.handle} {self.kernels}>"


class LinkState(enum.Enum):
    CONNECTING = "connecting"
    CONNECTED = "connected"
    DISCONNECTED = "disconnected"
    RESUMING = "resuming"
    FAILED = "failed"
    CLOSED = "closed"


def _configure_socket(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    # A connection whose path vanished (the guest moved to another subnet)
    # fails silently; let the kernel give up on it within ~15 s.
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", 15000)):
        if hasattr(socket, name):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
            except OSError:
                pass


def _send_all(sock: socket.socket, head: bytes, payload) -> None:
    """Send head + payload without joining them (no copy of the payload)."""
    if not payload:
        sock.sendall(head)
        return
    parts = [memoryview(head), memoryview(payload).cast("B")]
    while parts:
        sent = sock.sendmsg(parts)
        while parts and sent >= len(parts[0]):
            sent -= len(parts[0])
            parts.pop(0)
        if parts and sent:
            parts[0] = parts[0][sent:]


class Device:
    """A session on a pooled accelerator.  Thread-safe.

    Parameters: ``endpoint`` ``"HOST:PORT"``; ``token`` the tenant token;
    ``timeout`` how long a call may wait for a reply, and how long a call
    made while disconnected waits for the connection to come back;
    ``window_commands``/``window_bytes`` bound the commands kept for replay
    (a full window blocks the caller); ``auto_reconnect`` retries the last
    endpoint with backoff when the connection drops (accepted by the pool
    only at the current epoch, from the host the session is bound to);
    ``agent`` registers the session with the guest agent so it can be
    rehomed after a migration (``None``: the default socket if it exists).
    """

    def __init__(self, endpoint: str, token: str, *, timeout: float = DEFAULT_TIMEOUT,
                 window_commands: int = 4096, window_bytes: int = 512 << 20,
                 auto_reconnect: bool = True, agent: str | bool | None = None,
                 name: str | None = None, connect_timeout: float = 10.0):
        dp.parse_endpoint(endpoint)
        self.endpoint = endpoint
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.auto_reconnect = auto_reconnect
        self.name = name or f"pid{os.getpid()}"
        self._secret = os.urandom(32)
        self._cond = threading.Condition(threading.Lock())
        self._send_lock = threading.Lock()
        self._resume_lock = threading.Lock()
        self._window = CommandWindow(window_commands, window_bytes)
        self._state = LinkState.CONNECTING
        self._failure: AccelmigError | None = None
        self._sock: socket.socket | None = None
        self._gen = 0
        self._pipeline_errors: list[AccelmigError] = []
        self._next_handle = 1
        self._acked_sent = 0
        self._last_activity = time.monotonic()
        self._attempt_sock: socket.socket | None = None
        self._last_error: object = None
        self._target: tuple[str, str | None] | None = None   # an unfinished explicit resume
        self._used_tickets: set[str] = set()
        self._cork: list[bytes] = []          # pipelined frames not yet sent (send lock)
        self._cork_bytes = 0
        self._cork_pending = threading.Event()
        self._preempt = threading.Event()
        self.sid: str | None = None
        self.epoch = 0
        self.bound_host: str | None = None
        self.pool_instance: str | None = None
        self.stats = {"resumes": 0, "resent_commands": 0, "resent_bytes": 0, "replies": 0,
                      "duplicate_replies": 0, "reconnect_attempts": 0, "last_resume_s": None}
        self._limits = Limits()
        sock, reader, welcome = self._open_link(endpoint, self.connect_timeout)
        try:
            _handshake_send(sock, {"op": Op.OPEN.value, "token": token, "secret": self._secret.hex(),
                                   "client": {"name": self.name, "pid": os.getpid()}})
            answer, leftovers = self._read_answer(sock, reader)
        except BaseException:
            sock.close()
            raise
        if answer.get("op") != Op.OPENED.value:
            sock.close()
            raise ProtocolError(reason=f"expected opened, got {answer.get('op')!r}")
        self.sid = answer["sid"]
        self.epoch = answer["epoch"]
        self.bound_host = answer.get("bound_host")
        self._install_link(sock, reader, leftovers)
        with self._cond:
            self._state = LinkState.CONNECTED
        self._housekeeper = threading.Thread(target=self._housekeep, name=f"accelmig-{self.sid}-hk",
                                             daemon=True)
        self._housekeeper.start()
        threading.Thread(target=self._flusher, name=f"accelmig-{self.sid}-tx", daemon=True).start()
        LOG.info("session %s opened at %s", self.sid, endpoint)
        self._agent = None
        if agent is not False:
            from accelmig.agent.registry import AgentRegistration
            self._agent = AgentRegistration.start(self, agent)

    # -- link management ------------------------------------------------------------
    def _open_link(self, endpoint: str, timeout: float):
        host, port = dp.parse_endpoint(endpoint)
        try:
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            self._attempt_sock = sock
            sock.settimeout(timeout)
            sock.connect((host, port))
        except OSError as exc:
            sock.close()
            raise Unavailable(what=f"the pool at {endpoint}", reason=str(exc)) from None
        finally:
            self._attempt_sock = None
        _configure_socket(sock)
        reader = FrameReader(self._limits, payload_sink=self._payload_sink)
        try:
            _handshake_send(sock, {"op": Op.HELLO.value, "versions": list(dp.PROTOCOL_VERSIONS)})
            welcome, leftovers = self._read_answer(sock, reader)
        except BaseException:
            sock.close()
            raise
        if welcome.get("op") != Op.WELCOME.value or leftovers:
            sock.close()
            raise ProtocolError(reason=f"expected welcome, got {welcome.get('op')!r}")
        self.pool_instance = welcome.get("instance")
        self._challenge = welcome.get("challenge", "")
        self._max_payload = int(welcome.get("max_payload") or self._limits.max_payload)
        return sock, reader, welcome

    def _read_answer(self, sock, reader):
        """Block for the next frame (handshakes only); frames after it are kept."""
        while True:
            try:
                n = sock.recv_into(reader.get_buffer())
            except socket.timeout:
                raise Timeout(what="the pool's answer", timeout=sock.gettimeout() or 0) from None
            except OSError as exc:
                raise Unavailable(what="the pool", reason=str(exc)) from None
            if n == 0:
                raise Unavailable(what="the pool", reason="connection closed during the handshake")
            frames = reader.feed(n)
            if frames:
                first = frames[0].header
                if first.get("op") == Op.ERROR.value:
                    raise from_wire(first.get("error", {}))
                return first, frames[1:]

    def _install_link(self, sock, reader, leftovers) -> None:
        sock.settimeout(None)
        with self._cond:
            self._gen += 1
            gen = self._gen
            self._sock = sock
            for frame in leftovers:
                self._on_frame_locked(frame.header, frame.payload)
        threading.Thread(target=self._read_loop, args=(sock, reader, gen),
                         name=f"accelmig-{self.sid}-rx{gen}", daemon=True).start()

    def _payload_sink(self, header: dict, size: int):
        seq = header.get("seq")
        with self._cond:
            sink = self._window.waiting_sink(seq) if isinstance(seq, int) else None
        if sink is not None and len(sink) == size:
            return sink
        return bytearray(size)

    def _read_loop(self, sock: socket.socket, reader: FrameReader, gen: int) -> None:
        error: Exception | None = None
        try:
            while True:
                n = sock.recv_into(reader.get_buffer())
                if n == 0:
                    error = Unavailable(what="the pool", reason="connection closed")
                    break
                for frame in reader.feed(n):
                    with self._cond:
                        if gen != self._gen:
                            return
                        self._on_frame_locked(frame.header, frame.payload)
                self._maybe_ack(sock, gen)
        except (OSError, FrameError) as exc:
            error = exc
        except AccelmigError as exc:
            error = exc
        self._link_lost(gen, error)

    def _on_frame_locked(self, header: dict, payload) -> None:
        op = header.get("op")
        if op == Op.DONE.value:
            first, last = header.get("from"), header.get("to")
            if not isinstance(first, int) or not isinstance(last, int) or last < first:
                raise ProtocolError(reason=f"bad done frame {header!r}")
            for seq in range(first, last + 1):
                try:
                    cmd = self._window.complete(seq, _PLAIN_OK)
                except ValueError as exc:
                    raise ProtocolError(reason=str(exc)) from None
                if cmd is None:
                    self.stats["duplicate_replies"] += 1
                else:
                    self.stats["replies"] += 1
            self._cond.notify_all()
        elif op == Op.REPLY.value:
            seq = header.get("seq")
            try:
                cmd = self._window.complete(seq, header, payload)
            except ValueError as exc:
                raise ProtocolError(reason=str(exc)) from None
            if cmd is None:
                self.stats["duplicate_replies"] += 1
                return
            self.stats["replies"] += 1
            if not header.get("ok", False) and not cmd.waited:
                err = from_wire(header.get("error", {}))
                err.details.setdefault("seq", seq)
                err.details.setdefault("op", cmd.header.get("op"))
                self._pipeline_errors.append(err)
            self._cond.notify_all()
        elif op == Op.ERROR.value:
            err = from_wire(header.get("error", {}))
            if err.code in TERMINAL_SESSION_CODES:
                self._fail_locked(err)
            raise err
        else:
            raise ProtocolError(reason=f"unexpected {op!r} from the pool")

    def _maybe_ack(self, sock, gen) -> None:
        """Acknowledge from the reader when many replies piled up (best effort:
        commands also carry the acknowledgement)."""
        with self._cond:
            due = self._window.last_seen - self._acked_sent >= 256
            upto = self._window.last_seen
        if due:
            self._try_ack(sock, gen, upto)

    def _try_ack(self, sock, gen: int, upto: int) -> None:
        """Send an ack frame unless a sender holds the lock (its command will
        carry the acknowledgement anyway) or the link has changed."""
        if not self._send_lock.acquire(blocking=False):
            return
        try:
            with self._cond:
                if gen != self._gen or self._state is not LinkState.CONNECTED:
                    return
            sock.sendall(encode_frame({"op": Op.ACK.value, "ack": upto}))
            self._acked_sent = max(self._acked_sent, upto)
        except OSError:
            pass
        finally:
            self._send_lock.release()

    def _link_lost(self, gen: int, error) -> None:
        with self._cond:
            if gen != self._gen:
                return
            if self._state in (LinkState.CONNECTED, LinkState.RESUMING):
                # RESUMING: the new link died while the resume re-sent; the
                # resume must not then declare it connected.
                self._state = LinkState.DISCONNECTED
                self._last_error = error
                LOG.warning("session %s: connection lost (%s)", self.sid, error)
            sock, self._sock = self._sock, None
            self._cond.notify_all()
        if sock is not None:
            _shut(sock)

    def _fail_locked(self, err: AccelmigError) -> None:
        if self._state in (LinkState.CLOSED, LinkState.FAILED):
            return
        self._state = LinkState.FAILED
        self._failure = err
        LOG.error("session %s failed: %s", self.sid, err)
        self._cond.notify_all()

    # -- resume -------------------------------------------------------------------------
    @property
    def state(self) -> LinkState:
        return self._state

    @property
    def last_seen(self) -> int:
        return self._window.last_seen

    def resume(self, endpoint: str | None = None, ticket: str | None = None) -> dict:
        """Continue this session on a new connection (thread-safe).

        ``endpoint``: where the pool is now (default: the last endpoint);
        ``ticket``: the resume ticket of a migration, when the session moved
        to another host.  Returns what happened (epoch, replayed replies,
        re-sent commands, seconds); raises the pool's refusal otherwise.
        """
        self._preempt.set()
        attempt = self._attempt_sock
        if attempt is not None:
            _shut(attempt)      # cut a background reconnect that is in the way
        with self._resume_lock:
            self._preempt.clear()
            target = endpoint or self.endpoint
            if ticket and ticket in self._used_tickets:
                # This move already happened (a background retry made it, or
                # the rehome was delivered twice): the session is bound there.
                if self._state is LinkState.CONNECTED and target == self.endpoint:
                    return {"sid": self.sid, "epoch": self.epoch, "endpoint": target,
                            "replayed": 0, "resent": 0, "seconds": 0.0, "ticket": True,
                            "already": True}
                ticket = None
            try:
                return self._resume(target, ticket)
            except AccelmigError as exc:
                if exc.retriable or isinstance(exc, Unavailable):
                    # Keep trying in the background where we were told to go:
                    # the answer may have been lost, or the path not be up yet.
                    self._target = (target, ticket)
                raise

    def _resume(self, endpoint: str, ticket: str | None, timeout: float | None = None) -> dict:
        started = time.monotonic()
        with self._cond:
            if self._state in (LinkState.CLOSED, LinkState.FAILED):
                raise self._failure or Closed(what=f"session {self.sid}")
            self._state = LinkState.RESUMING
            self._gen += 1           # the old reader's frames are ignored from now on
            old, self._sock = self._sock, None
        if old is not None:
            _shut(old)
        try:
            sock, reader, _welcome = self._open_link(endpoint, timeout or self.connect_timeout)
            try:
                with self._cond:
                    last_seen = self._window.last_seen
                    next_seq = self._window.next_seq
                    epoch = self.epoch
                request = {"op": Op.RESUME.value, "sid": self.sid, "epoch": epoch,
                           "last_seen": last_seen, "next_seq": next_seq,
                           "proof": dp.ownership_proof(self._secret, self._challenge, self.sid, epoch)}
                if ticket:
                    request["ticket"] = ticket
                _handshake_send(sock, request)
                answer, leftovers = self._read_answer(sock, reader)
                if answer.get("op") != Op.RESUMED.value:
                    raise ProtocolError(reason=f"expected resumed, got {answer.get('op')!r}")
            except BaseException:
                sock.close()
                raise
        except BaseException as exc:
            # Whatever failed, never leave the state at RESUMING.
            with self._cond:
                if isinstance(exc, AccelmigError) and exc.code in TERMINAL_SESSION_CODES:
                    self._fail_locked(exc)
                elif self._state is LinkState.RESUMING:
                    self._state = LinkState.DISCONNECTED
                    self._last_error = exc
                self._cond.notify_all()
            raise
        # Accepted: switch to the new link, then re-send what the pool lacks.
        self._target = None
        if ticket:
            self._used_tickets.add(ticket)
        with self._send_lock:
            self._cork.clear()          # corked commands are in the window: re-sent below
            self._cork_bytes = 0
            with self._cond:
                self.epoch = answer["epoch"]
                self.endpoint = endpoint
                self.bound_host = answer.get("bound_host")
            self._install_link(sock, reader, leftovers)
            with self._cond:
                resend = self._window.resend_from(answer["expect"])
                ack = self._window.last_seen
            resent_bytes = 0
            try:
                for cmd in resend:
                    cmd.header["epoch"] = self.epoch
                    cmd.header["ack"] = ack
                    cmd.resent += 1
                    _send_all(sock, encode_prefix_and_header(cmd.header, len(cmd.payload)), cmd.payload)
                    resent_bytes += len(cmd.payload)
            except OSError as exc:
                LOG.warning("session %s: connection lost while re-sending: %s", self.sid, exc)
            with self._cond:
                if self._state is LinkState.RESUMING:
                    self._state = LinkState.CONNECTED
                self._acked_sent = ack
                self._cond.notify_all()
        elapsed = time.monotonic() - started
        self.stats["resumes"] += 1
        self.stats["resent_commands"] += len(resend)
        self.stats["resent_bytes"] += resent_bytes
        self.stats["last_resume_s"] = elapsed
        result = {"sid": self.sid, "epoch": self.epoch, "endpoint": endpoint,
                  "replayed": answer.get("replay", 0), "resent": len(resend),
                  "seconds": round(elapsed, 6), "ticket": bool(ticket)}
        LOG.info("session %s resumed at %s: epoch %d, %d replayed, %d re-sent, %.1f ms", self.sid,
                 endpoint, self.epoch, result["replayed"], len(resend), elapsed * 1000)
        return result

    def _housekeep(self) -> None:
        """Periodic acknowledgement when idle; reconnection with backoff."""
        backoff = 0.05
        while True:
            time.sleep(0.1 if self._state is not LinkState.DISCONNECTED else backoff)
            state = self._state
            if state in (LinkState.CLOSED, LinkState.FAILED):
                return
            if state is LinkState.CONNECTED:
                backoff = 0.05
                self._idle_ack()
            elif state is LinkState.DISCONNECTED and self.auto_reconnect and not self._preempt.is_set():
                if not self._resume_lock.acquire(blocking=False):
                    continue
                try:
                    if self._state is LinkState.DISCONNECTED:
                        self.stats["reconnect_attempts"] += 1
                        endpoint, ticket = self._target or (self.endpoint, None)
                        self._resume(endpoint, ticket, timeout=min(2.0, self.connect_timeout))
                except AccelmigError as exc:
                    backoff = min(backoff * 2, 2.0)
                    LOG.debug("session %s: reconnect to %s failed: %s", self.sid, self.endpoint, exc)
                finally:
                    self._resume_lock.release()

    def _idle_ack(self) -> None:
        with self._cond:
            upto = self._window.last_seen
            sock, gen = self._sock, self._gen
        if upto > self._acked_sent and sock is not None:
            self._try_ack(sock, gen, upto)

    # -- submitting commands -------------------------------------------------------------
    def _wait_ready_locked(self, nbytes: int, deadline: float) -> None:
        while True:
            if self._state is LinkState.FAILED:
                raise self._failure
            if self._state is LinkState.CLOSED:
                raise Closed(what=f"session {self.sid}")
            if self._state is LinkState.CONNECTED and self._window.has_room(nbytes):
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if self._state is LinkState.CONNECTED:
                    raise WindowFull(timeout=self.timeout, count=len(self._window.pending),
                                     bytes=self._window.bytes)
                raise Disconnected(timeout=self.timeout, reason=f"state {self._state.value}, "
                                   f"last error: {self._last_error}")
            self._cond.wait(remaining)

    def _submit(self, op: Op, fields: dict, payload=b"", *, wait: bool, sink=None,
                timeout: float | None = None):
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        nbytes = len(payload)
        if nbytes > self._max_payload:
            # The pool would close the connection on it, again at every resume.
            raise FrameTooLarge(part=f"{op.value} payload", size=nbytes, limit=self._max_payload)
        while True:
            with self._cond:
                self._wait_ready_locked(nbytes, deadline)
            with self._send_lock:
                with self._cond:
                    if self._state is not LinkState.CONNECTED or self._sock is None \
                            or not self._window.has_room(nbytes):
                        continue   # lost it between the two locks: wait again
                    header = {"op": op.value, "epoch": self.epoch, "ack": self._window.last_seen}
                    header.update(fields)
                    cmd = self._window.add(header, payload, waited=wait, sink=sink)
                    sock, gen = self._sock, self._gen
                    self._acked_sent = max(self._acked_sent, header["ack"])
                head = encode_prefix_and_header(header, nbytes)
                try:
                    if not wait and nbytes <= CORK_PAYLOAD:
                        # Pipelined: cork it; the flusher (or the next waiting
                        # command) sends a batch in one system call.
                        first = not self._cork
                        self._cork.append(head + payload if nbytes else head)
                        self._cork_bytes += len(head) + nbytes
                        if self._cork_bytes >= CORK_BYTES:
                            self._flush_cork_locked(sock)
                        elif first:
                            self._cork_pending.set()
                    else:
                        if self._cork:
                            self._flush_cork_locked(sock)
                        _send_all(sock, head, payload)
                except OSError as exc:
                    # The command stays in the window: the resume re-sends it.
                    self._cork.clear()
                    self._cork_bytes = 0
                    self._link_lost(gen, exc)
            break
        if not wait:
            return cmd
        return self._wait_reply(cmd, deadline)

    def _flush_cork_locked(self, sock) -> None:
        """Send the corked frames (the caller holds the send lock)."""
        data = b"".join(self._cork)
        self._cork.clear()
        self._cork_bytes = 0
        sock.sendall(data)

    def _flusher(self) -> None:
        """Sends corked pipelined frames soon after they were queued."""
        while self._state not in (LinkState.CLOSED, LinkState.FAILED):
            if not self._cork_pending.wait(0.5):
                continue
            self._cork_pending.clear()
            time.sleep(CORK_DELAY)      # let a burst gather: one system call for many
            with self._send_lock:
                with self._cond:
                    sock, gen = self._sock, self._gen
                if not self._cork or sock is None:
                    continue
                try:
                    self._flush_cork_locked(sock)
                except OSError as exc:
                    self._cork.clear()
                    self._cork_bytes = 0
                    self._link_lost(gen, exc)

    def _wait_reply(self, cmd: PendingCommand, deadline: float):
        with self._cond:
            while cmd.reply is None:
                if self._state is LinkState.FAILED:
                    raise self._failure
                if self._state is LinkState.CLOSED:
                    raise Closed(what=f"session {self.sid}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    what = f"{cmd.header['op']} (seq {cmd.seq}; it stays in flight"
                    if self._state is not LinkState.CONNECTED:
                        what += f"; {self._state.value}, last error: {self._last_error}"
                    raise Timeout(what=what + ")", timeout=self.timeout)
                self._cond.wait(remaining)
            if not cmd.reply.get("ok", False):
                raise from_wire(cmd.reply.get("error", {}))
            errors, self._pipeline_errors = self._pipeline_errors, []
        if errors:
            first = errors[0]
            if len(errors) > 1:
                first.details["more_errors"] = len(errors) - 1
            raise first
        return cmd

    def _handle(self) -> int:
        with self._cond:
            handle = self._next_handle
            self._next_handle += 1
            return handle

    def _own(self, obj, kind):
        if obj.device is not self:
            raise BadRequest(reason=f"that {kind} belongs to another session")

    # -- the API -----------------------------------------------------------------------
    def info(self) -> dict:
        """The pool's device: name, vendor, memory sizes, limits."""
        return self._submit(Op.INFO, {}, wait=True).reply.get("device", {})

    def build(self, source: str, options: str = "") -> Program:
        """Build OpenCL C ``source``; BuildFailed (with ``.build_log``) on error."""
        handle = self._handle()
        cmd = self._submit(Op.BUILD, {"prog": handle, "options": options}, source.encode("utf-8"), wait=True)
        return Program(self, handle, cmd.reply.get("kernels", []), cmd.reply.get("log", ""))

    def build_binary(self, binary: bytes, options: str = "") -> Program:
        """Build a program from a device binary (FPGA bitstreams, cached binaries)."""
        handle = self._handle()
        cmd = self._submit(Op.BUILD_BINARY, {"prog": handle, "options": options}, bytes(binary), wait=True)
        return Program(self, handle, cmd.reply.get("kernels", []), cmd.reply.get("log", ""))

    def program_binary(self, program: Program) -> bytes:
        self._own(program, "program")
        cmd = self._submit(Op.PROGRAM_BINARY, {"prog": program.handle}, wait=True)
        return bytes(cmd.reply_payload)

    def free_program(self, program: Program) -> None:
        self._own(program, "program")
        self._submit(Op.FREE_PROGRAM, {"prog": program.handle}, wait=False)

    def alloc(self, nbytes: int) -> Buffer:
        """Allocate ``nbytes`` of device memory (pipelined; quota errors raise
        at the next waiting call)."""
        if not isinstance(nbytes, int) or nbytes < 0:
            raise BadRequest(reason="alloc: nbytes must be a non-negative int")
        handle = self._handle()
        self._submit(Op.ALLOC, {"buf": handle, "size": nbytes}, wait=False)
        return Buffer(self, handle, nbytes)

    def upload(self, data) -> Buffer:
        """A new buffer holding ``data`` (bytes, memoryview or numpy array)."""
        view = _as_bytes_view(data)
        buf = self.alloc(view.nbytes)
        self.write(buf, view)
        return buf

    def write(self, buffer: Buffer, data, offset: int = 0) -> None:
        self._own(buffer, "buffer")
        view = _as_bytes_view(data)
        if view.nbytes >= ZERO_COPY_WRITE:
            # Sent from the caller's memory; waiting keeps that memory stable
            # for as long as a replay might need it.
            self._submit(Op.WRITE, {"buf": buffer.handle, "offset": offset}, view, wait=True)
        else:
            self._submit(Op.WRITE, {"buf": buffer.handle, "offset": offset}, bytes(view), wait=False)

    def read(self, buffer: Buffer, nbytes: int | None = None, offset: int = 0) -> bytes:
        """``nbytes`` (default: the rest of the buffer) from ``offset``."""
        self._own(buffer, "buffer")
        if nbytes is None:
            nbytes = buffer.size - offset
        cmd = self._submit(Op.READ, {"buf": buffer.handle, "offset": offset, "size": nbytes}, wait=True)
        payload = cmd.reply_payload
        return payload if isinstance(payload, bytes) else bytes(payload)

    def read_into(self, buffer: Buffer, out, offset: int = 0) -> None:
        """Read ``len(out)`` bytes straight into ``out`` (a writable buffer, e.g.
        a numpy array): no intermediate copy for large reads."""
        self._own(buffer, "buffer")
        view = _as_bytes_view(out)
        if view.readonly:
            raise BadRequest(reason="read_into needs a writable buffer")
        cmd = self._submit(Op.READ, {"buf": buffer.handle, "offset": offset, "size": view.nbytes},
                           wait=True, sink=view)
        if cmd.reply_payload is not view and cmd.reply_payload is not None:
            got = memoryview(cmd.reply_payload).cast("B")
            if got.obj is not view.obj:
                view[:] = got

    def copy(self, src: Buffer, dst: Buffer, nbytes: int | None = None, src_offset: int = 0,
             dst_offset: int = 0) -> None:
        self._own(src, "buffer")
        self._own(dst, "buffer")
        if nbytes is None:
            nbytes = min(src.size - src_offset, dst.size - dst_offset)
        self._submit(Op.COPY, {"src": src.handle, "dst": dst.handle, "src_offset": src_offset,
                               "dst_offset": dst_offset, "size": nbytes}, wait=False)

    def free(self, buffer: Buffer) -> None:
        self._own(buffer, "buffer")
        if not buffer.freed:
            buffer.freed = True
            self._submit(Op.FREE, {"buf": buffer.handle}, wait=False)

    def launch(self, program: Program, kernel_name: str, global_size, local_size=None, *args) -> None:
        self._own(program, "program")
        wire_args = []
        for index, arg in enumerate(args):
            if isinstance(arg, Buffer):
                self._own(arg, "buffer")
                wire_args.append({"buf": arg.handle})
            elif isinstance(arg, Scalar):
                wire_args.append(arg.to_wire())
            elif isinstance(arg, LocalMemory):
                wire_args.append({"local": arg.nbytes})
            elif hasattr(arg, "dtype") and getattr(arg, "shape", None) == ():
                name = _NUMPY_TO_TYPE.get(str(arg.dtype))
                if name is None:
                    raise BadRequest(reason=f"argument {index}: numpy {arg.dtype} is not a kernel scalar type")
                wire_args.append(dp.encode_scalar(name, arg.item()))
            else:
                raise BadRequest(reason=f"argument {index}: {type(arg).__name__} {arg!r} is not a Buffer, "
                                        "a typed scalar (i32(3), f32(0.5), a numpy scalar) or LocalMemory")
        fields = {"prog": program.handle, "kernel": kernel_name, "gsize": _dims(global_size, "global_size"),
                  "args": wire_args}
        lsize = _dims(local_size, "local_size")
        if lsize is not None:
            fields["lsize"] = lsize
        self._submit(Op.LAUNCH, fields, wait=False)

    def finish(self) -> None:
        """Wait until every command so far has completed on the device."""
        self._submit(Op.FINISH, {}, wait=True)

    def close(self) -> None:
        """End the session: the pool frees its device memory."""
        with self._cond:
            state = self._state
        if state is LinkState.CONNECTED:
            try:
                self._submit(Op.RELEASE, {}, wait=True, timeout=min(self.timeout, 10.0))
            except AccelmigError as exc:
                LOG.warning("session %s: release failed: %s", self.sid, exc)
        with self._cond:
            if self._state is not LinkState.FAILED:
                self._state = LinkState.CLOSED
            self._gen += 1
            sock, self._sock = self._sock, None
            self._cond.notify_all()
        if sock is not None:
            _shut(sock)
        if self._agent is not None:
            self._agent.stop()

    def describe(self) -> dict:
        with self._cond:
            return {"sid": self.sid, "epoch": self.epoch, "state": self._state.value,
                    "endpoint": self.endpoint, "bound_host": self.bound_host,
                    "last_seen": self._window.last_seen, "next_seq": self._window.next_seq,
                    "pending": len(self._window.pending), "window_bytes": self._window.bytes,
                    **self.stats}

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Device {self.sid} {self._state.value} at {self.endpoint}>"


def _handshake_send(sock: socket.socket, header: dict) -> None:
    try:
        sock.sendall(encode_frame(header))
    except OSError as exc:
        raise Unavailable(what="the pool", reason=str(exc)) from None


def _shut(sock: socket.socket) -> None:
    # close() alone does not wake a thread blocked in recv() on the socket
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


def connect(endpoint: str | None = None, token: str | None = None, **options) -> Device:
    """Open a session on the pool at ``endpoint`` (``"HOST:PORT"``).

    Without ``endpoint``, the guest agent is asked where the pool is (the
    host told it), then ``$ACCELMIG_ENDPOINT``; without ``token``,
    ``$ACCELMIG_TOKEN``.  Options: see ``Device``.
    """
    if endpoint is None:
        from accelmig.agent.registry import endpoint_from_agent
        endpoint = endpoint_from_agent(options.get("agent")) or os.environ.get("ACCELMIG_ENDPOINT")
        if not endpoint:
            raise Unavailable(what="the pool's endpoint",
                              reason="no endpoint given, no guest agent knows one, ACCELMIG_ENDPOINT unset")
    if token is None:
        token = os.environ.get("ACCELMIG_TOKEN")
        if not token:
            raise BadRequest(reason="no tenant token given and ACCELMIG_TOKEN unset")
    return Device(endpoint, token, **options)
