"""Every connection of both planes, counted from the moment it is accepted.

A listener accepts plain TCP.  Its first protocol is ``AcceptedConnection``:
before a byte is read it asks ``Admission`` whether this connection may be
had; under TLS it makes the TLS layer when the peer's first bytes come (a
silent connection holds no TLS state) and runs the handshake itself; then
the plane's own protocol (``pool.dataplane.DataConnection``; the control
plane's stream protocol) has the connection.  asyncio's ``create_server(ssl=...)``
would run the handshake before the pool saw the connection at all: a
stranger's silent connections were never counted, and each cost asyncio's
256 KiB TLS read buffer (issue 28, item 7).

Bounds, all counted from accept, both planes together:

- per peer address, at most ``max_unauthenticated_per_peer`` connections
  that have not authenticated; one more is closed at once, before any
  handshake;
- at most ``max_unauthenticated`` not authenticated in all, and at most
  ``max_connections`` connections of any kind (``ConnectionLimits``: derived
  from the process's descriptor limit).  Past either, a newcomer is not
  refused: it **evicts** the oldest unauthenticated connection of the
  address that holds the most of them (sshd's MaxStartups early drop, made
  deterministic: the flood pays, not a tenant that connects during it).
  Only when nothing unauthenticated is left to evict is the newcomer
  refused;
- one deadline, ``handshake_timeout`` from accept, covers the TLS handshake
  and the plane's own hello and authentication;
- until it authenticates, a connection's TLS layer reads at most one TLS
  record at a time (``StrangerTLS``).

An accepted connection's life is ``AcceptedConnection.TABLE``:
ACCEPTED (counted; TLS or the plane's hello under way) -> AUTHENTICATED
(counted in the total only) -> CLOSED; or ACCEPTED -> CLOSED at once when
admission refuses it (never counted).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import resource
from asyncio import sslproto

from accelmig.runtime.statemachine import StateMachine
from accelmig.wire.errors import AccelmigError, ConfigInvalid, Unavailable
from accelmig.wire.frames import encode_frame

LOG = logging.getLogger("accelmig.pool")

#: Bytes one read of a connection's TLS layer may take before the peer
#: authenticated: one TLS record (16 KiB of data and its overhead).
#: asyncio's own is 256 KiB, allocated when the connection is accepted.
STRANGER_TLS_READ = 17 * 1024

#: Seconds a connection the pool closes may take to send what it still has
#: and its TLS close_notify; then it is aborted.  asyncio waits 30 s for a
#: peer's close_notify, and a plain transport for a peer that never reads
#: forever: a closed connection must give its descriptor back on time.
CLOSE_GRACE = 2.0

#: Descriptors kept for everything that is not a connection: listeners, the
#: admin socket and its clients, each tenant's device process (its socket
#: and upload arena), log files, etcd, metrics.  A quarter of the limit, at
#: least this many.
MIN_RESERVED_DESCRIPTORS = 64

#: Fewer connections than this in all, after the reserve, is no pool.
MIN_CONNECTIONS = 16


class ConnectionLimits:
    """How many connections the pool may hold, from the process's descriptor
    limit (``RLIMIT_NOFILE``; its soft limit is raised to the hard one first:
    a server's connections are descriptors) and the configuration.

    ``max_connections``: configured (a positive number), or 0 for the
    descriptor limit less the reserve.  A configured number that cannot fit
    under the descriptor limit is a ``ConfigInvalid``, not a pool that
    fails at its first flood."""

    def __init__(self, config, descriptors: int | None = None):
        self.descriptors = _descriptor_limit() if descriptors is None else descriptors
        self.reserved = max(MIN_RESERVED_DESCRIPTORS, self.descriptors // 4)
        room = self.descriptors - self.reserved
        if config.max_connections:
            if config.max_connections > room:
                raise ConfigInvalid(source="max_connections", reason=(
                    f"{config.max_connections} connections cannot fit under the descriptor limit of "
                    f"{self.descriptors} ({self.reserved} kept for the pool's own files): at most {room}; "
                    f"raise the limit (LimitNOFILE=, ulimit -n) or lower max_connections"))
            self.max_connections = config.max_connections
        else:
            self.max_connections = room
        if self.max_connections < MIN_CONNECTIONS:
            raise ConfigInvalid(source="max_connections", reason=(
                f"the descriptor limit of {self.descriptors} leaves room for {self.max_connections} "
                f"connections ({self.reserved} kept for the pool's own files), fewer than "
                f"{MIN_CONNECTIONS}: raise it (LimitNOFILE=, ulimit -n)"))
        # Half of all connections at most may be strangers: the other half is
        # for sessions even while a flood holds its whole share.
        self.max_unauthenticated = min(config.max_unauthenticated, self.max_connections // 2)
        self.per_peer = min(config.max_unauthenticated_per_peer, self.max_unauthenticated)

    def describe(self) -> str:
        return (f"at most {self.max_connections} connections ({self.descriptors} descriptors, "
                f"{self.reserved} kept for the pool's own files), {self.max_unauthenticated} of them "
                f"not authenticated yet, {self.per_peer} per address")


def _descriptor_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return soft


class Admission:
    """The count of every accepted connection: who is admitted, who is
    evicted to make room, who is refused.  On the pool's loop only."""

    def __init__(self, limits: ConnectionLimits, metrics=None):
        self.limits = limits
        self.metrics = metrics
        self.total = 0
        # not authenticated yet: per address, in accept order (oldest first)
        self._strangers: dict[str, collections.OrderedDict] = {}
        self._stranger_count = 0

    @property
    def unauthenticated(self) -> int:
        return self._stranger_count

    def unauthenticated_from(self, address: str) -> int:
        return len(self._strangers.get(address, ()))

    def admit(self, conn: "AcceptedConnection") -> AccelmigError | None:
        """Count ``conn`` (just accepted, not authenticated), evicting a
        stranger to make room where the totals are reached; the error to
        close it with when it may not be had."""
        limits, address = self.limits, conn.address
        mine = self._strangers.get(address)
        if mine is not None and len(mine) >= limits.per_peer:
            return self._refuse(address, f"{len(mine)} connections from {address} have not "
                                         f"authenticated yet (at most {limits.per_peer})")
        while self._stranger_count >= limits.max_unauthenticated or self.total >= limits.max_connections:
            victim = self._victim()
            if victim is None:
                return self._refuse(address, f"{self.total} connections already, the most this pool holds "
                                             f"({limits.max_connections}), and every one has authenticated")
            victim.evict(f"the pool holds {self.total} connections ({self._stranger_count} not "
                         f"authenticated): the oldest stranger of {victim.address}, the address with "
                         f"the most, makes room")
        self._strangers.setdefault(address, collections.OrderedDict())[conn] = None
        self._stranger_count += 1
        self.total += 1
        return None

    def abort_strangers(self) -> None:
        """The pool stops: every connection not authenticated yet goes now
        (an authenticated one is closed by its plane)."""
        for mine in list(self._strangers.values()):
            for conn in list(mine):
                conn.abort()

    def _victim(self) -> "AcceptedConnection | None":
        if not self._strangers:
            return None
        crowded = max(self._strangers.values(), key=len)
        return next(iter(crowded))

    def _refuse(self, address: str, reason: str) -> AccelmigError:
        if self.metrics is not None:
            self.metrics.refused_connections.inc()
        LOG.warning("refusing a connection from %s: %s", address, reason,
                    extra={"peer": address, "admission": "refused"})
        return Unavailable(what="the pool", reason=reason)

    def authenticated(self, conn: "AcceptedConnection") -> None:
        self._forget_stranger(conn)

    def closed(self, conn: "AcceptedConnection", was_stranger: bool) -> None:
        if was_stranger:
            self._forget_stranger(conn)
        self.total -= 1

    def _forget_stranger(self, conn: "AcceptedConnection") -> None:
        mine = self._strangers.get(conn.address)
        if mine is not None and conn in mine:
            del mine[conn]
            self._stranger_count -= 1
            if not mine:
                del self._strangers[conn.address]


class StrangerTLS(sslproto.SSLProtocol):
    """asyncio's TLS layer, reading at most one TLS record at a time until
    its peer authenticates (``authenticated``), then as asyncio does.
    asyncio allocates ``max_size`` bytes (256 KiB) per connection up front;
    its ``get_buffer`` grows the buffer to ``max_size`` when asked for more,
    so raising it later costs nothing before it is needed.  Written by hand
    because asyncio has no parameter for it."""

    max_size = STRANGER_TLS_READ

    def authenticated(self) -> None:
        self.max_size = sslproto.SSLProtocol.max_size


class Phase(enum.Enum):
    ACCEPTED = "accepted"              # counted; TLS handshake or the plane's hello under way
    AUTHENTICATED = "authenticated"    # a session (data) or a host (control): counted in the total only
    CLOSED = "closed"


class AdmissionEvent(enum.Enum):
    REFUSED = "refused"                # admission said no: closed before it was counted
    AUTHENTICATED = "authenticated"    # the plane's report
    CLOSED = "closed"                  # the plane's report, a failed handshake, the deadline, an eviction


class AcceptedConnection(StateMachine, asyncio.Protocol):
    """A listener's first protocol for each connection: admission, the TLS
    handshake under the connection's deadline, then the plane's protocol
    (``make_app(self)``) takes the transport.  The plane reports
    ``authenticated`` and ``closed``; ``remaining`` is what is left of the
    deadline for its own hello; ``on_deadline`` (the plane's) answers a
    connection whose deadline passed, else it is aborted."""

    INITIAL = Phase.ACCEPTED
    FINAL = frozenset({Phase.CLOSED})
    TABLE = {
        AdmissionEvent.REFUSED: {Phase.ACCEPTED: Phase.CLOSED},
        AdmissionEvent.AUTHENTICATED: {Phase.ACCEPTED: Phase.AUTHENTICATED},
        AdmissionEvent.CLOSED: {Phase.ACCEPTED: Phase.CLOSED, Phase.AUTHENTICATED: Phase.CLOSED},
    }
    # The plane and this class both report what they see (a plane closes a
    # connection this one evicted; a connection closes before its plane's
    # report that it authenticated): each counted once.
    REPEATS = {AdmissionEvent.AUTHENTICATED: frozenset({Phase.AUTHENTICATED, Phase.CLOSED}),
               AdmissionEvent.CLOSED: frozenset({Phase.CLOSED})}

    def __init__(self, admission: Admission, make_app, *, plane: str, tls_context=None,
                 timeout: float = 10.0, metrics=None):
        super().__init__()
        self.admission = admission
        self.make_app = make_app
        self.plane = plane
        self.tls_context = tls_context
        self.timeout = timeout
        self.metrics = metrics
        self.address = "?"
        self.peer: tuple = ("?", 0)
        self.transport = None          # the TCP transport (under TLS: beneath it)
        self.tls: StrangerTLS | None = None
        self.app = None
        self.on_deadline = None
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- accept ----------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        transport.pause_reading()        # nothing is read before it is admitted
        self._loop = asyncio.get_running_loop()
        self.transport = transport
        peer = transport.get_extra_info("peername") or ("?", 0)
        self.peer = tuple(peer[:2]) if isinstance(peer, tuple) else (str(peer), 0)
        self.address = str(self.peer[0])
        refused = self.admission.admit(self)
        if refused is not None:
            self.fire(AdmissionEvent.REFUSED)        # (never counted)
            if self.tls_context is None:       # a plain peer can read why; a TLS one costs no handshake
                transport.write(encode_frame({"op": "error", "error": refused.to_wire()}))
                transport.close()
            else:
                transport.abort()
            return
        self._deadline = self._loop.time() + self.timeout
        self._timer = self._loop.call_at(self._deadline, self._deadline_passed)
        if self.tls_context is None:
            self.app = self.make_app(self)
            transport.set_protocol(self.app)
            self.app.connection_made(transport)
        # under TLS, nothing more until the peer's first bytes (data_received):
        # a silent connection costs no TLS state and no protocol of its plane
        transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        """The peer's first bytes (its ClientHello): the TLS layer and the
        plane's protocol are made now and take the connection, these bytes
        first."""
        if self.tls is not None or self.state is not Phase.ACCEPTED:
            return
        self.app = self.make_app(self)
        waiter = self._loop.create_future()
        waiter.add_done_callback(self._handshake_over)
        self.tls = StrangerTLS(self._loop, self.app, self.tls_context, waiter, server_side=True,
                               call_connection_made=True, ssl_handshake_timeout=self.remaining(),
                               ssl_shutdown_timeout=CLOSE_GRACE)
        self.transport.set_protocol(self.tls)
        self.tls.connection_made(self.transport)
        view = memoryview(data)
        while view and self.tls is not None:       # (a record at a time; a failed handshake ends it)
            buffer = self.tls.get_buffer(len(view))
            n = min(len(buffer), len(view))
            buffer[:n] = view[:n]
            view = view[n:]
            self.tls.buffer_updated(n)

    def eof_received(self):
        return False          # (before any byte: close)

    def connection_lost(self, exc) -> None:      # (only before a protocol took the transport)
        self.closed()

    def _handshake_over(self, waiter: asyncio.Future) -> None:
        """The TLS handshake ended: the plane's protocol has the connection,
        or it failed (asyncio then tells the plane nothing)."""
        failed = waiter.cancelled() or waiter.exception() is not None or \
            self.tls is None or self.tls._app_transport is None
        if failed and self.state is Phase.ACCEPTED:
            self.transport.abort()
            self.closed()

    def _deadline_passed(self) -> None:
        self._timer = None
        if self.state is not Phase.ACCEPTED:
            return
        if self.on_deadline is not None:     # the plane's protocol has it: the plane says why
            self.on_deadline()
            return
        LOG.info("%s plane: closing a connection from %s: no TLS handshake within %g s",
                 self.plane, self.address, self.timeout, extra={"peer": self.address})
        self.abort()

    def remaining(self) -> float:
        """Seconds left of the connection's deadline (at least a little)."""
        return max(0.001, self._deadline - self._loop.time())

    # -- what the plane reports -------------------------------------------------------
    def authenticated(self) -> None:
        if self.fire(AdmissionEvent.AUTHENTICATED) is None:
            return
        self.admission.authenticated(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.tls is not None:
            self.tls.authenticated()

    def closed(self) -> None:
        stranger = self.state is Phase.ACCEPTED
        if self.fire(AdmissionEvent.CLOSED) is None:
            return
        self.admission.closed(self, stranger)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        # no cycle through the plane's protocol: a flood's connections are
        # freed when they close, not at the next garbage collection
        self.app = self.tls = self.on_deadline = None

    def evict(self, reason: str) -> None:
        """Admission makes room: this stranger goes at once."""
        LOG.info("%s plane: evicting a connection from %s: %s", self.plane, self.address, reason,
                    extra={"peer": self.address, "admission": "evicted"})
        if self.metrics is not None:
            self.metrics.evicted_connections.inc()
        self.abort()

    def abort(self) -> None:
        self.closed()
        if self.transport is not None:
            self.transport.abort()

    def close_soon(self, transport) -> None:
        """Close ``transport`` (the plane's), and abort it if it is still
        there after ``CLOSE_GRACE``: a peer that never reads nor answers
        close_notify keeps no descriptor."""
        transport.close()
        if self._loop is not None:
            self._loop.call_later(CLOSE_GRACE, self._abort_if_open, transport)

    def _abort_if_open(self, transport) -> None:
        transport.abort()              # (nothing, where it closed meanwhile)
        self.transport.abort()         # the TCP transport beneath a TLS one
