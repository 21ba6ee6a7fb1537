"""The socket link between a session and the pool.

A session has one link at a time; a resume replaces the socket under it.
Each socket is numbered (``gen``): a reader or a sender still holding an
older socket finds its number stale and touches nothing.

What goes out: frames are sent without joining a large payload to its
header (no copy); small pipelined frames are *corked* — gathered for a
moment and sent as one batch by the flusher thread, or ahead of the next
frame that cannot wait.  With a pool that agreed to protocol 2, consecutive
corked launches go as one ``launches`` frame (``wire.batch``): a binary
record each, one header for the run.  What comes in: frames are read
(a read's payload straight into the caller's buffer when one waits for it)
and dispatched to the command window, with an acknowledgement when many
replies have piled up.

Who reads: on plain TCP (Linux), the socket has one ``Turn`` — whoever holds
it reads.  A caller that waits for its own reply takes it before it sends
and reads the reply itself, so the reply wakes one thread, not two (the
reader thread handing it over was a third of a small round trip).  Meanwhile
the reader thread watches the socket for a hang-up only (epoll: changing
the mask of a thread's ``epoll_wait`` needs no wake-up), and reads whatever
nobody waits for — pipelined replies, a pool's error frame, a close — while
no caller holds the turn.  A caller whose reply is slow hands the turn back
after ``OWN_REPLY_SLICE`` and waits as before.  Under TLS the reader thread
reads everything: records OpenSSL holds are invisible to epoll.

Locks: ``send_lock`` (one sender at a time) is always taken before the
session's ``cond``, which guards ``sock``, ``gen`` and the turn.
"""

from __future__ import annotations

import logging
import queue
import select
import socket
import ssl
import struct
import threading
import time
import weakref

from accelmig.wire import batch
from accelmig.wire import dataplane as dp
from accelmig.wire import tls
from accelmig.wire.dataplane import Op
from accelmig.wire.errors import (TERMINAL_SESSION_CODES, AccelmigError, AuthFailed, ProtocolError,
                                  Timeout, Unavailable, from_wire)
from accelmig.wire.frames import FrameReader, Limits, encode_frame, encode_prefix_and_header

LOG = logging.getLogger(__name__)

CORK_PAYLOAD = 16 << 10        # pipelined frames up to this payload are batched
CORK_BYTES = 256 << 10         # a batch goes out at this size at the latest
CORK_DELAY = 0.0002            # s a pipelined frame may wait for others to join it
CORK_WAIT = 0.002              # s at most, while launches keep joining the open batch
ACK_EVERY = 256                # replies the reader lets pile up before it acknowledges
OWN_REPLY_SLICE = 0.05         # s a caller reads for its own reply before it hands the turn back
_PLAIN_OK = {"op": "reply", "ok": True}

_EPOLL = hasattr(select, "epoll") and hasattr(select, "EPOLLRDHUP")
if _EPOLL:
    _WATCH_ALL = select.EPOLLIN | select.EPOLLRDHUP
    _WATCH_HANGUP = select.EPOLLRDHUP          # (errors and hang-ups are always reported)


def _turn_budget() -> int:
    """How many turns (an epoll descriptor each) a process may hold at once:
    a quarter of its descriptor limit, so that an application with many
    sessions under the usual limit of 1,024 still opens them all (past the
    budget a session's reader thread reads everything, as under TLS)."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 20
    except (ImportError, ValueError, OSError):
        return 0
    return max(0, soft // 4)


_TURNS = threading.BoundedSemaphore(_turn_budget()) if _EPOLL else None


# -- sockets ------------------------------------------------------------------------
def configure_socket(sock: socket.socket) -> None:
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


def send_all(sock: socket.socket, head: bytes, payload) -> None:
    """Send head + payload without joining them (no copy of the payload)."""
    if not payload:
        sock.sendall(head)
        return
    if isinstance(sock, ssl.SSLSocket):
        # no sendmsg on TLS; TLS copies into its records anyway
        sock.sendall(head)
        sock.sendall(memoryview(payload).cast("B"))
        return
    parts = [memoryview(head), memoryview(payload).cast("B")]
    while parts:
        sent = sock.sendmsg(parts)
        while parts and sent >= len(parts[0]):
            sent -= len(parts[0])
            parts.pop(0)
        if parts and sent:
            parts[0] = parts[0][sent:]


def shut(sock: socket.socket) -> None:
    # close() alone does not wake a thread blocked in recv() on the socket
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class Turn:
    """Who reads one plain socket now (the session's cond guards ``holder``):
    nobody, the reader thread (``READER``) or a caller waiting for its own
    reply (its thread's ident).  While a caller holds it, the reader
    thread's epoll watches for a hang-up only, so the caller's reply wakes
    the caller alone."""

    READER = "reader"

    def __init__(self, sock: socket.socket, frames: FrameReader):
        self.gen = 0                       # (set when the link installs the socket)
        self.sock, self.frames = sock, frames
        self.fd = sock.fileno()
        self.poller = select.epoll(1)
        try:
            self.poller.register(self.fd, _WATCH_ALL)
        except BaseException:
            self.poller.close()
            raise
        self.holder: object = None
        self.reader_waits = False          # the reader thread waits for the turn
        self.closed = False

    @classmethod
    def open(cls, sock: socket.socket, frames: FrameReader) -> "Turn | None":
        """A turn for a plain ``sock``, or None (no epoll here, a TLS socket,
        the process's budget of turns spent, no descriptor left): its reader
        thread then reads everything."""
        if not _EPOLL or isinstance(sock, ssl.SSLSocket) or not _TURNS.acquire(blocking=False):
            return None
        try:
            turn = cls(sock, frames)
        except OSError as exc:
            _TURNS.release()
            LOG.debug("no turn for a socket (%s): its reader thread reads everything", exc)
            return None
        try:
            # a caller's blocking recv gives up after the slice: it then
            # hands the turn back (BlockingIOError); sends are not affected
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                            struct.pack("ll", 0, int(OWN_REPLY_SLICE * 1e6)))
        except OSError as exc:
            turn.close()
            LOG.debug("no turn for a socket (%s): its reader thread reads everything", exc)
            return None
        return turn

    def close(self) -> None:
        """Once: the poller goes, and its place in the process's budget."""
        if not self.closed:
            self.closed = True
            self.poller.close()
            _TURNS.release()

    def take(self, who) -> None:
        """``who`` takes the free turn (cond held)."""
        self.holder = who
        if who is not Turn.READER:
            self.poller.modify(self.fd, _WATCH_HANGUP)

    def give_back(self, turn_free: threading.Condition) -> None:
        """The holder is done (cond held): the reader thread watches all again."""
        if self.holder is not Turn.READER:
            try:
                self.poller.modify(self.fd, _WATCH_ALL)
            except (OSError, ValueError):
                pass                           # the reader thread closed it: the socket is done
        self.holder = None
        if self.reader_waits:
            turn_free.notify()


def handshake_send(sock: socket.socket, header: dict) -> None:
    try:
        sock.sendall(encode_frame(header))
    except OSError as exc:
        raise Unavailable(what="the pool", reason=str(exc)) from None


def read_answer(sock: socket.socket, reader: FrameReader):
    """Block for the next frame (handshakes only); the frames after it are
    returned too, for the reader to dispatch."""
    while True:
        try:
            buffer = reader.get_buffer()
            n = sock.recv_into(buffer)
        except socket.timeout:
            raise Timeout(what="the pool's answer", timeout=sock.gettimeout() or 0) from None
        except ssl.SSLError as exc:
            raise AuthFailed(reason=tls.describe_ssl_error(exc, "the pool")) from None
        except OSError as exc:
            raise Unavailable(what="the pool", reason=str(exc)) from None
        if n == 0:
            hint = ""
            if reader.bytes_read == 0 and not isinstance(sock, ssl.SSLSocket):
                hint = " (a pool that serves TLS closes plain connections: this driver is insecure)"
            raise Unavailable(what="the pool", reason="connection closed during the handshake" + hint)
        if reader.bytes_read == 0 and not isinstance(sock, ssl.SSLSocket) and \
                tls.looks_like_tls(buffer[:min(n, 2)]):
            raise AuthFailed(reason="the pool answers in TLS and this driver is insecure (plain TCP): "
                                    "give it cafile= / ACCELMIG_CAFILE instead")
        frames = reader.feed(n)
        if frames:
            first = frames[0].header
            if first.get("op") == Op.ERROR.value:
                raise from_wire(first.get("error", {}))
            return first, frames[1:]


# -- the link ----------------------------------------------------------------------
class Link:
    """The connection of one session (``accelmig.agent.driver.session.Session``),
    whose condition, window, state and statistics it shares."""

    def __init__(self, session, tls_context: ssl.SSLContext | None = None):
        self.session = session
        self.tls_context = tls_context             # None: plain TCP (insecure, said explicitly)
        self.binding = b""                         # the last dial's channel binding
        # TLS resumption: the session (with the pool's ticket) of the last
        # connection, offered only to the endpoint it came from; a resumed
        # handshake skips the certificate chain and the pool's signature,
        # the most expensive part of a reconnect in a just-migrated guest
        self._tls_session: ssl.SSLSession | None = None
        self._tls_session_endpoint: str | None = None
        self.tls_resumed = False                   # the last dial resumed a TLS session
        self.limits = Limits()
        self.versions = dp.PROTOCOL_VERSIONS       # offered at hello
        self.version = 1                           # what the pool agreed to (the last dial)
        self.send_lock = threading.Lock()
        self.sock: socket.socket | None = None     # the session's cond guards sock and gen
        self.gen = 0
        self.acked_sent = 0                        # the highest acknowledgement sent
        # what the pool's welcome asked for (wire.dataplane.keepalive_interval):
        # seconds of sending nothing after which a keepalive goes; None: never
        self.keepalive_every: float | None = None
        self.last_sent = 0.0                       # when anything last went out (monotonic)
        self.attempt_sock: socket.socket | None = None   # a connect in progress
        # sockets a reader thread is in: only that thread closes them, so no
        # new socket gets their descriptor while the thread may still read it
        # (TLS reads through OpenSSL on the raw descriptor: it would steal the
        # next connection's handshake)
        self._reading: set = set()
        self._reading_lock = threading.Lock()
        self._cork: list[bytes] = []               # pipelined frames not yet sent (send lock)
        self._cork_bytes = 0
        # corked launches not yet closed into a batch frame (send lock):
        # their records, the first one's seq, the next seq, epoch and ack
        self._launches: list[bytes] = []
        self._launch_from = self._launch_next = self._launch_epoch = self._launch_ack = 0
        self._launch_bytes = 0
        self._cork_pending = threading.Event()
        self._flusher_started = False              # (with the first corked frame; the send lock guards it)
        self._readers_lock = threading.Lock()
        self._idle_readers = 0                     # reader threads waiting for a next socket
        self._reader_jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.turn: Turn | None = None              # the plain socket's turn to read (cond)
        # the reader thread waits here for a caller to give the turn back (a
        # condition of its own on cond's lock: replies dispatched meanwhile,
        # which notify cond, do not wake it)
        self.turn_free = threading.Condition(session.lock)

    # -- opening ------------------------------------------------------------------
    def dial(self, endpoint: str, timeout: float, then: dict | None = None):
        """Connect to the pool and agree on the protocol: (sock, reader,
        welcome, the frames that came after it).  ``then``: a frame that
        needs nothing of the welcome (an ``open``; a resume needs its
        challenge), sent with the hello: one round trip less."""
        host, port = dp.parse_endpoint(endpoint)
        try:
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        except OSError as exc:
            raise Unavailable(what=f"the pool at {endpoint}", reason=str(exc)) from None
        self.attempt_sock = sock
        try:
            sock.settimeout(timeout)
            sock.connect((host, port))
        except OSError as exc:
            sock.close()
            raise Unavailable(what=f"the pool at {endpoint}", reason=str(exc)) from None
        finally:
            self.attempt_sock = None
        configure_socket(sock)
        binding = b""
        if self.tls_context is not None:
            sock, binding = self._start_tls(sock, host, endpoint)
        reader = FrameReader(self.limits, payload_sink=self._payload_sink)
        try:
            hello = encode_frame({"op": Op.HELLO.value, "versions": list(self.versions)})
            try:
                sock.sendall(hello + (encode_frame(then) if then is not None else b""))
            except OSError as exc:
                raise Unavailable(what="the pool", reason=str(exc)) from None
            welcome, leftovers = read_answer(sock, reader)
        except BaseException:
            sock.close()
            raise
        if welcome.get("op") != Op.WELCOME.value or (leftovers and then is None):
            sock.close()
            raise ProtocolError(reason=f"expected welcome, got {welcome.get('op')!r}")
        version = welcome.get("version", 1)      # (a pool of protocol 1 may leave it out)
        if version not in self.versions:
            sock.close()
            raise ProtocolError(reason=f"the pool chose protocol version {str(version)[:20]!r}, "
                                       f"not one this driver offered {list(self.versions)}")
        self.version = version
        self.binding = binding
        self.keepalive_every = dp.keepalive_interval(welcome)
        if self.tls_context is not None:
            self._keep_tls_session(sock, endpoint)
        return sock, reader, welcome, leftovers

    def _keep_tls_session(self, sock: ssl.SSLSocket, endpoint: str) -> None:
        """Keep this connection's TLS session for the next dial to
        ``endpoint``.  Under TLS 1.3 the pool's tickets come after the
        handshake, ahead of the welcome: read now, they are in."""
        session = sock.session
        if session is not None and session.has_ticket:
            self._tls_session, self._tls_session_endpoint = session, endpoint

    def _start_tls(self, sock: socket.socket, host: str, endpoint: str):
        """TLS over the connected ``sock``, the pool's certificate verified
        for ``host`` (an IP endpoint: an IP SAN); (TLS socket, binding)."""
        self.attempt_sock = sock
        # Resumption proves the peer knows the ticket's key (the pool's own,
        # a verified pool's at the first handshake); a ticket the pool no
        # longer takes (restarted, expired) falls back to a full handshake.
        session = self._tls_session if self._tls_session_endpoint == endpoint else None
        try:
            tsock = self.tls_context.wrap_socket(sock, server_hostname=host, session=session)
        except socket.timeout:
            sock.close()
            raise Timeout(what=f"the TLS handshake with {endpoint}", timeout=sock.gettimeout() or 0) from None
        except ssl.SSLError as exc:        # verification included
            sock.close()
            raise AuthFailed(reason=tls.describe_ssl_error(exc, f"the pool at {endpoint}")) from None
        except OSError as exc:
            sock.close()
            raise Unavailable(what=f"the pool at {endpoint}", reason=f"TLS handshake: {exc}") from None
        finally:
            self.attempt_sock = None
        self.tls_resumed = tsock.session_reused
        if session is not None and not self.tls_resumed:
            LOG.info("the pool at %s did not resume the TLS session: full handshake", endpoint)
        return tsock, tls.channel_binding(tsock)

    def cut_attempt(self) -> None:
        """Cut a connect in progress (a background reconnect in the way of an
        explicit resume)."""
        attempt = self.attempt_sock
        if attempt is not None:
            shut(attempt)

    def install(self, sock: socket.socket, reader: FrameReader, leftovers) -> None:
        """Make ``sock`` the link: dispatch the frames that came with the
        handshake's answer, then start its reader."""
        session = self.session
        sock.settimeout(None)
        turn = Turn.open(sock, reader)
        error = None
        with session.cond:
            self.gen += 1
            gen = self.gen
            self.sock = sock
            self.turn = turn
            if turn is not None:
                turn.gen = gen
            try:
                for frame in leftovers:
                    self._dispatch_locked(frame.header, frame.payload)
            except AccelmigError as exc:
                error = exc
                self.turn = None
        if error is not None:
            if turn is not None:
                turn.close()           # (no reader thread will)
            self.lost(gen, error)      # as the reader would have: the session may resume
            return
        with self._reading_lock:
            self._reading.add(sock)
        self.last_sent = time.monotonic()
        if self.keepalive_every is not None:
            KEEPALIVES.watch(self)
        self._start_reader((sock, reader, gen, turn))

    # A socket's reader runs on a thread that, once its socket is done, waits
    # for the session's next one (a resume's) instead of ending: a resume
    # costs no thread made and ended (a thousand sessions resuming at once
    # are a thousand of them).  At most one waits; all go when the session ends.
    def _start_reader(self, job) -> None:
        with self._readers_lock:
            if self._idle_readers:
                self._idle_readers -= 1
                self._reader_jobs.put(job)
                return
        threading.Thread(target=self._reader, args=(job,), name=f"accelmig-{self.session.sid}-rx",
                         daemon=True).start()

    def _reader(self, job) -> None:
        while job is not None:
            self._read_loop(*job)
            with self._readers_lock:
                if self.session.states.ended or self._idle_readers:
                    return
                self._idle_readers += 1
            job = self._reader_jobs.get()

    def end_readers(self) -> None:
        """The session ended: a reader waiting for a next socket goes."""
        with self._readers_lock:
            idle, self._idle_readers = self._idle_readers, 0
        for _ in range(idle):
            self._reader_jobs.put(None)

    def release(self, sock) -> None:
        """Shut ``sock`` down; close it too unless its reader will."""
        with self._reading_lock:
            reading = sock in self._reading
        if not reading:
            shut(sock)
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)      # wakes the reader, which closes it
        except OSError:
            pass

    def detach_locked(self) -> socket.socket | None:
        """Take the socket away (the caller holds the session's cond and shuts
        it): its reader's frames are ignored from now on."""
        self.gen += 1
        sock, self.sock = self.sock, None
        return sock

    def lost(self, gen: int, error) -> None:
        """The socket of generation ``gen`` failed (the reader, a sender)."""
        session = self.session
        with session.cond:
            if gen != self.gen:
                return
            session.link_lost_locked(error)
            sock, self.sock = self.sock, None
            session.cond.notify_all()
        if sock is not None:
            self.release(sock)

    # -- sending ------------------------------------------------------------------
    def send_command(self, sock: socket.socket, gen: int, head: bytes, payload, pipelined: bool) -> None:
        """Send one command frame (the caller holds the send lock).  A failure
        loses the link; the command stays in the window for the resume."""
        nbytes = len(payload)
        try:
            if pipelined and nbytes <= CORK_PAYLOAD:
                # Corked: the flusher (or the next waiting command) sends a
                # batch in one system call.
                first = not self._cork and not self._launches
                if self._launches:
                    self._close_launches()        # (order: the launches before it)
                self._cork.append(head + payload if nbytes else head)
                self._cork_bytes += len(head) + nbytes
                self._corked(sock, first)
            else:
                if self._cork or self._launches:
                    self._flush_cork_locked(sock)
                send_all(sock, head, payload)
                self.last_sent = time.monotonic()
        except OSError as exc:
            self.drop_cork()
            self.lost(gen, exc)

    @property
    def batching(self) -> bool:
        """The pool agreed to launch batches at the last dial (``wire.batch``)."""
        return self.version >= batch.BATCH_VERSION

    def cork_launch(self, sock: socket.socket, gen: int, seq: int, epoch: int, ack: int,
                    record: bytes) -> None:
        """Cork one launch as a record of the open batch (protocol 2; the
        caller holds the send lock).  A run of consecutive launches goes as
        one ``launches`` frame; anything else corked or sent closes it."""
        try:
            first = not self._cork and not self._launches
            # (a full batch went when it filled, below)
            if self._launches and (seq != self._launch_next or epoch != self._launch_epoch
                                   or self._launch_bytes + len(record) > batch.MAX_PAYLOAD):
                self._close_launches()
            launches = self._launches
            if not launches:
                self._launch_from, self._launch_epoch, self._launch_bytes = seq, epoch, 0
            launches.append(record)
            self._launch_next, self._launch_ack = seq + 1, ack
            self._launch_bytes += len(record)
            self._cork_bytes += len(record)
            if len(launches) >= batch.DRIVER_LAUNCHES:
                # a full batch goes now: the pool's run (and its device
                # process's call) is as long as it may be, and the flusher
                # is left the tail of a burst
                self._flush_cork_locked(sock)
                return
            self._corked(sock, first)
        except OSError as exc:
            self.drop_cork()
            self.lost(gen, exc)

    def _corked(self, sock, first: bool) -> None:
        """After something was corked: send at CORK_BYTES, else make sure the
        flusher sends it soon."""
        if self._cork_bytes >= CORK_BYTES:
            self._flush_cork_locked(sock)
        elif first:
            if not self._flusher_started:
                self._flusher_started = True
                threading.Thread(target=self.run_flusher, name=f"accelmig-{self.session.sid}-tx",
                                 daemon=True).start()
            self._cork_pending.set()

    def _close_launches(self) -> None:
        """The open batch of launches as one frame at the end of the cork."""
        records, self._launches = self._launches, []
        payload = b"".join(records)
        header = batch.batch_header(self._launch_epoch, self._launch_ack, self._launch_from,
                                    self._launch_next - 1)
        self._cork.append(encode_prefix_and_header(header, len(payload)) + payload)

    def drop_cork(self) -> None:
        """Forget the corked frames (send lock): they are in the window, and a
        resume re-sends them."""
        self._cork.clear()
        self._launches = []
        self._cork_bytes = 0

    def _flush_cork_locked(self, sock) -> None:
        if self._launches:
            self._close_launches()
        data = b"".join(self._cork)
        self.drop_cork()
        sock.sendall(data)
        self.last_sent = time.monotonic()

    def run_flusher(self) -> None:
        """Sends corked pipelined frames soon after they were queued (a thread
        for the session's life)."""
        session = self.session
        while not session.states.ended:
            self._cork_pending.wait()        # (set by a first corked frame, and at the end)
            self._cork_pending.clear()
            if session.states.ended:
                return
            # Let a burst gather (one system call, one batch for many):
            # until no launch joined the open batch for CORK_DELAY, a full
            # batch having gone at once (cork_launch), at most CORK_WAIT.
            waited, joined = 0.0, self._launch_next
            while True:
                time.sleep(CORK_DELAY)
                waited += CORK_DELAY
                if self._launch_next == joined or waited >= CORK_WAIT:
                    break
                joined = self._launch_next
            with self.send_lock:
                with session.cond:
                    sock, gen = self.sock, self.gen
                if (not self._cork and not self._launches) or sock is None:
                    continue
                try:
                    self._flush_cork_locked(sock)
                except OSError as exc:
                    self.drop_cork()
                    self.lost(gen, exc)

    def wake_flusher(self) -> None:
        self._cork_pending.set()

    def try_ack(self, sock, gen: int, upto: int) -> None:
        """Send an ack frame unless a sender holds the lock (its command will
        carry the acknowledgement anyway) or the link has changed."""
        if not self.send_lock.acquire(blocking=False):
            return
        try:
            with self.session.cond:
                if gen != self.gen or not self.session.states.connected:
                    return
            sock.sendall(encode_frame({"op": Op.ACK.value, "ack": upto}))
            self.acked_sent = max(self.acked_sent, upto)
            self.last_sent = time.monotonic()
        except OSError:
            pass
        finally:
            self.send_lock.release()

    def keepalive_due(self, now: float) -> float | None:
        """(The keepalive thread) an acknowledgement of what was seen when
        nothing went out for ``keepalive_every``; when to look again (None:
        the session ended, never again)."""
        session = self.session
        if session.states.ended:
            return None
        every = self.keepalive_every
        if every is None:
            return now + 60.0
        due = self.last_sent + every
        if now < due:
            return due
        with session.cond:
            sock, gen, upto = self.sock, self.gen, session.window.last_seen
        if sock is not None:
            self.try_ack(sock, gen, upto)      # (a sender busy with the lock sends anyway)
        return now + every

    # -- receiving ----------------------------------------------------------------
    def _payload_sink(self, header: dict, size: int):
        """Where a frame's payload lands: the buffer a ``read_into`` waits
        with, when the sizes agree, or a new one."""
        seq = header.get("seq")
        with self.session.cond:
            sink = self.session.window.waiting_sink(seq) if isinstance(seq, int) else None
        if sink is not None and len(sink) == size:
            return sink
        return bytearray(size)

    def _read_loop(self, sock: socket.socket, reader: FrameReader, gen: int, turn: Turn | None) -> None:
        try:
            if turn is None:
                self._read_frames(sock, reader, gen)
            else:
                self._read_turns(turn)
        finally:
            with self._reading_lock:
                self._reading.discard(sock)
            if turn is not None:
                turn.close()
            shut(sock)

    def _read_frames(self, sock: socket.socket, reader: FrameReader, gen: int) -> None:
        """The reader thread of a TLS socket: it reads every frame."""
        error: Exception | None = None
        try:
            while True:
                n = sock.recv_into(reader.get_buffer())
                if n == 0:
                    error = Unavailable(what="the pool", reason="connection closed")
                    break
                if not self._dispatch_frames(reader.feed(n), gen):
                    return
                self._after_read(sock, gen)
        except (OSError, AccelmigError) as exc:
            error = exc
        self.lost(gen, error)

    def _read_turns(self, turn: Turn) -> None:
        """The reader thread of a plain socket: read when it is readable and
        no caller holds the turn; a caller that does dispatches what comes."""
        cond = self.session.cond
        sock, reader, gen = turn.sock, turn.frames, turn.gen
        error: Exception | None = None
        try:
            while True:
                turn.poller.poll()
                with cond:
                    turn.reader_waits = True
                    while turn.holder is not None:
                        self.turn_free.wait()
                    turn.reader_waits = False
                    if gen != self.gen:
                        return        # (no caller reads it any more: the socket may close)
                    turn.take(Turn.READER)
                try:      # (the frame reader's state is the turn's too: fed before it is given back)
                    try:
                        # not blocking: a caller may have taken what woke us
                        n = sock.recv_into(reader.get_buffer(), 0, socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        continue
                    if n == 0:
                        error = Unavailable(what="the pool", reason="connection closed")
                        break
                    if not self._dispatch_frames(reader.feed(n), gen):
                        return
                finally:
                    with cond:
                        turn.give_back(self.turn_free)
                self._after_read(sock, gen)
        except (OSError, AccelmigError) as exc:
            error = exc
        self.lost(gen, error)

    def _dispatch_frames(self, frames, gen: int) -> bool:
        """Dispatch frames read from the socket of ``gen``; False if it is no
        longer the link's (they are ignored)."""
        cond = self.session.cond
        for frame in frames:
            with cond:
                if gen != self.gen:
                    return False
                self._dispatch_locked(frame.header, frame.payload)
        return True

    def take_turn_locked(self) -> Turn | None:
        """The caller (cond held) takes the current socket's turn to read its
        own reply, if it is free; None: wait as before.

        Not before the session's housekeeper runs: what a read finds (replies
        to acknowledge, a lost link) may start it, and a thread a caller
        starts is the caller's, not the session's (its network namespace
        among the rest: the housekeeper reconnects).  Until then the reader
        thread reads, and starts it."""
        turn = self.turn
        if turn is None or turn.holder is not None or turn.gen != self.gen \
                or not self.session.housekeeper_started:
            return None
        turn.take(threading.get_ident())
        return turn

    def read_own_reply_locked(self, turn: Turn, cmd) -> bool:
        """Read the socket (cond held on entry and on return, released
        meanwhile) until ``cmd`` has its reply, dispatching every frame that
        comes; give the turn back.  False: the reply was slow (nothing came
        for ``OWN_REPLY_SLICE``), so wait for it as before."""
        cond = self.session.cond
        sock, reader, gen = turn.sock, turn.frames, turn.gen
        prompt = True
        cond.release()
        try:
            while cmd.reply is None:
                try:
                    n = sock.recv_into(reader.get_buffer())
                except BlockingIOError:
                    prompt = False
                    break
                if n == 0:
                    raise Unavailable(what="the pool", reason="connection closed")
                if not self._dispatch_frames(reader.feed(n), gen):
                    break
                self.session.stats["replies_read_by_caller"] += 1
                self._after_read(sock, gen)
        except (OSError, AccelmigError) as exc:
            with cond:
                turn.give_back(self.turn_free)
            self.lost(gen, exc)
            cond.acquire()
            return True
        cond.acquire()
        turn.give_back(self.turn_free)
        return prompt

    def _dispatch_locked(self, header: dict, payload) -> None:
        """Match a frame from the pool to the command window (the caller holds
        the session's cond)."""
        session = self.session
        window, stats = session.window, session.stats
        op = header.get("op")
        if op == Op.DONE.value:
            first, last = header.get("from"), header.get("to")
            if not isinstance(first, int) or not isinstance(last, int) or last < first:
                raise ProtocolError(reason=f"bad done frame {header!r}")
            for seq in range(first, last + 1):
                try:
                    cmd = window.complete(seq, _PLAIN_OK)
                except ValueError as exc:
                    raise ProtocolError(reason=str(exc)) from None
                if cmd is None:
                    stats["duplicate_replies"] += 1
                else:
                    stats["replies"] += 1
            session.cond.notify_all()
        elif op == Op.REPLY.value:
            seq = header.get("seq")
            try:
                cmd = window.complete(seq, header, payload)
            except ValueError as exc:
                raise ProtocolError(reason=str(exc)) from None
            if cmd is None:
                stats["duplicate_replies"] += 1
                return
            stats["replies"] += 1
            if not header.get("ok", False) and not cmd.waited:
                # nobody waits for it: the next call that waits raises it
                err = from_wire(header.get("error", {}))
                err.details.setdefault("seq", seq)
                err.details.setdefault("op", cmd.header.get("op"))
                session.pipeline_errors.append(err)
            session.cond.notify_all()
        elif op == Op.ERROR.value:
            err = from_wire(header.get("error", {}))
            if err.code in TERMINAL_SESSION_CODES:
                session.fail_locked(err)
            raise err
        else:
            raise ProtocolError(reason=f"unexpected {op!r} from the pool")

    def _after_read(self, sock, gen: int) -> None:
        """After frames were dispatched, by whichever thread read them."""
        self._maybe_ack(sock, gen)
        self.session.replies_arrived()

    def _maybe_ack(self, sock, gen) -> None:
        """Acknowledge from the reader when many replies piled up (best effort:
        commands also carry the acknowledgement)."""
        with self.session.cond:
            upto = self.session.window.last_seen
            due = upto - self.acked_sent >= ACK_EVERY
        if due:
            self.try_ack(sock, gen, upto)


class KeepaliveClock:
    """One thread for every link of the process whose pool asked for
    keepalives (``Link.keepalive_due``): it sleeps until the next link is
    due, and a link that sent anything meanwhile is not.  One thread for
    all of them: a guest with a thousand idle sessions pays a wake-up per
    interval, not a thread per session; an open starts none but the first."""

    def __init__(self):
        self._links: weakref.WeakSet = weakref.WeakSet()
        self._cond = threading.Condition()
        self._started = False

    def watch(self, link: Link) -> None:
        with self._cond:
            self._links.add(link)
            if not self._started:
                self._started = True
                threading.Thread(target=self._run, name="accelmig-keepalive", daemon=True).start()
            self._cond.notify()           # (a link due sooner than the thread's wake-up)

    def _run(self) -> None:
        while True:
            with self._cond:
                links = list(self._links)
            now = time.monotonic()
            wake = now + 60.0
            for link in links:
                try:
                    due = link.keepalive_due(now)
                except Exception:         # pragma: no cover - one link must not end everyone's keepalives
                    LOG.exception("keepalive of session %s failed", link.session.sid)
                    due = now + 60.0
                if due is None:
                    with self._cond:
                        self._links.discard(link)
                else:
                    wake = min(wake, due)
            with self._cond:
                self._cond.wait(max(0.01, wake - time.monotonic()))


KEEPALIVES = KeepaliveClock()
