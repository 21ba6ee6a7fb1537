"""A session on the pool: its connection's state machine, the command path,
resume with tickets, and housekeeping.

The session's state lives in guest memory and moves with the VM: its id and
secret (which never leaves the guest), its epoch, the command window.  After
a live migration ``resume()`` continues it on a new connection — from a new
host — without losing or repeating any command.

Connection states (``LinkStateMachine``: every change is one of its ``LinkEvent``s)::

    CONNECTING --opened--> CONNECTED --link lost--> DISCONNECTED
                             |    ^                   |    ^
                      resume |    | accepted   resume |    | refused, unreachable,
                             v    |                   v    | or the new link died
                            RESUMING <----------------+    |
                             |    \\------------------------+
                             +--> FAILED (refused for good: diverged, lost, expired)

    FAILED: from every open state (a terminal error from the pool).
    CLOSED: ``close()``, from every open state but CONNECTING.
    CONNECTING -> DISCONNECTED: the first link died before the open finished.

Threads: the application's (commands, ``resume``; a caller that waits reads its
own reply on plain TCP, ``link.Turn``), the link's reader and
flusher, and the housekeeper (idle acknowledgements; reconnection with
backoff while auto-reconnect is on).  An explicit ``resume`` preempts a
background reconnect: it cuts the connect in its way and takes the resume
lock first.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time

from accelmig.agent.driver.link import Link, handshake_send, read_answer, send_all
from accelmig.agent.driver.window import CommandWindow, PendingCommand
from accelmig.runtime.statemachine import StateMachine
from accelmig.wire import batch
from accelmig.wire import dataplane as dp
from accelmig.wire.dataplane import Op
from accelmig.wire.devices import parse_selector
from accelmig.wire.errors import (TERMINAL_SESSION_CODES, AccelmigError, Closed, Disconnected,
                                  FrameTooLarge, ProtocolError, Timeout, Unavailable, WindowFull,
                                  from_wire)
from accelmig.wire.frames import encode_prefix_and_header

LOG = logging.getLogger(__name__)

RECONNECT_BACKOFF = (0.05, 2.0)    # s: the first and the longest wait between reconnects
HOUSEKEEPING_TICK = 0.1            # s between idle acknowledgements


class LinkState(enum.Enum):
    CONNECTING = "connecting"
    CONNECTED = "connected"
    DISCONNECTED = "disconnected"
    RESUMING = "resuming"
    FAILED = "failed"
    CLOSED = "closed"


class LinkEvent(enum.Enum):
    OPENED = "opened"          # the pool opened the session
    LOST = "lost"              # the link died (the first one before the open finished, too)
    RESUME = "resume"          # a resume starts (explicit, or the housekeeper's reconnect)
    ACCEPTED = "accepted"      # the pool accepted the resume
    FAIL = "fail"              # the pool ended the session for good (a terminal error)
    CLOSE = "close"            # close()


_OPEN = (LinkState.CONNECTING, LinkState.CONNECTED, LinkState.DISCONNECTED, LinkState.RESUMING)


class LinkStateMachine(StateMachine):
    """The state of a session's connection (the session's cond serialises
    its changes)."""

    INITIAL = LinkState.CONNECTING
    FINAL = frozenset({LinkState.FAILED, LinkState.CLOSED})
    TABLE = {
        LinkEvent.OPENED: {LinkState.CONNECTING: LinkState.CONNECTED},
        LinkEvent.LOST: {LinkState.CONNECTING: LinkState.DISCONNECTED,
                         LinkState.CONNECTED: LinkState.DISCONNECTED,
                         # refused, unreachable, or the new link died
                         LinkState.RESUMING: LinkState.DISCONNECTED},
        LinkEvent.RESUME: {LinkState.CONNECTED: LinkState.RESUMING,
                           LinkState.DISCONNECTED: LinkState.RESUMING},
        LinkEvent.ACCEPTED: {LinkState.RESUMING: LinkState.CONNECTED},
        LinkEvent.FAIL: {state: LinkState.FAILED for state in _OPEN},
        LinkEvent.CLOSE: {LinkState.CONNECTED: LinkState.CLOSED,
                          LinkState.DISCONNECTED: LinkState.CLOSED,
                          LinkState.RESUMING: LinkState.CLOSED},
    }

    def __init__(self, on_change=None) -> None:
        super().__init__()
        self.on_change = on_change        # called after every change (wakes the session's threads)

    def on_transition(self, old, new, event, **context) -> None:
        if self.on_change is not None:
            self.on_change(new)

    @property
    def connected(self) -> bool:
        return self.state is LinkState.CONNECTED

    @property
    def ended(self) -> bool:
        return self.state is LinkState.FAILED or self.state is LinkState.CLOSED


class Session:
    """One session and its link.  ``accelmig.agent.driver.device.Device`` is
    its public face; the guest agent's registration drives ``resume``.

    ``cond`` guards the state, the window, the epoch and endpoint, and the
    link's socket; the link's ``send_lock`` is taken before it.
    """

    def __init__(self, endpoint: str, token: str, *, timeout: float, window_commands: int,
                 window_bytes: int, auto_reconnect: bool, name: str | None, connect_timeout: float,
                 tls_context=None, domain: str | None = None, device: str | None = None,
                 protocol_versions=None):
        dp.parse_endpoint(endpoint)
        self.domain = dp.domain_claim(domain)  # checked here: a bad one is the caller's error, not the pool's
        selector = parse_selector(device)      # so is a bad device selector
        self.selector = str(selector) if selector is not None else None
        self.device_id: str | None = None      # the device the pool placed the session on, for good
        self.endpoint = endpoint
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.auto_reconnect = auto_reconnect
        self.name = name or f"pid{os.getpid()}"
        self.secret = os.urandom(32)          # proves ownership at a resume; never leaves the guest
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        # The housekeeping thread sleeps until there is something to do (an
        # acknowledgement due, a lost link, the end): a guest with a thousand
        # idle sessions pays no wake-ups for them.
        self._housework = threading.Event()
        self._housekeeper_lock = threading.Lock()
        self._housekeeper_started = True          # (not before the session opened)
        self.states = LinkStateMachine(on_change=self._state_changed)
        self.window = CommandWindow(window_commands, window_bytes)
        self.failure: AccelmigError | None = None
        self.last_error: object = None
        self.pipeline_errors: list[AccelmigError] = []
        self.sid: str | None = None
        self.epoch = 0
        self.bound_host: str | None = None
        self.pool_instance: str | None = None
        self.stats = {"resumes": 0, "resent_commands": 0, "resent_bytes": 0, "replies": 0,
                      "duplicate_replies": 0, "reconnect_attempts": 0, "last_resume_s": None,
                      "tls_resumed": 0,     # resumes whose TLS handshake resumed the last session
                      "replies_read_by_caller": 0}   # reads a waiting caller made itself (``Turn``)
        self.link = Link(self, tls_context)
        if protocol_versions is not None:
            self.link.versions = dp.offered_versions(protocol_versions)
        self._challenge = ""
        self._max_payload = self.link.limits.max_payload
        self._next_handle = 1
        self._resume_lock = threading.Lock()
        self._preempt = threading.Event()      # an explicit resume is on its way: background, step aside
        self._target: tuple[str, str | None] | None = None   # an unfinished explicit resume
        self._used_tickets: set[str] = set()
        # the node that redirected the open (a pool of several nodes): while the
        # session's own node does not answer, every other reconnect asks it, and
        # it says whether that node is gone (SESSION_LOST) or elsewhere
        self.placed_by: str | None = None
        self._ask_placer = False
        # the housekeeping thread starts when it first has work (replies to
        # acknowledge, a lost link), the link's flusher with the first corked
        # frame: an open starts one thread (its reader), not three
        self._housekeeper_started = False
        self._open(token)
        LOG.info("session %s opened at %s", self.sid, endpoint)

    @property
    def state(self) -> LinkState:
        return self.states.state

    def _state_changed(self, new: LinkState) -> None:
        self._housework.set()
        if new is LinkState.FAILED or new is LinkState.CLOSED:
            self.link.wake_flusher()        # it ends
            self.link.end_readers()
        elif new is LinkState.DISCONNECTED:
            self._start_housekeeper()       # it reconnects

    def replies_arrived(self) -> None:
        """The reader dispatched replies: an acknowledgement may be due."""
        if self.window.last_seen > self.link.acked_sent:
            self._start_housekeeper()
            self._housework.set()

    @property
    def housekeeper_started(self) -> bool:
        """The housekeeping thread runs: a lost link or replies to acknowledge
        start no thread on the caller's (``link.Turn``)."""
        return self._housekeeper_started and self.sid is not None

    def _start_housekeeper(self) -> None:
        if self._housekeeper_started or self.sid is None:
            return
        with self._housekeeper_lock:
            if not self._housekeeper_started:
                self._housekeeper_started = True
                threading.Thread(target=self._housekeep, name=f"accelmig-{self.sid}-hk", daemon=True).start()

    # -- opening --------------------------------------------------------------------
    def _dial(self, endpoint: str, timeout: float, then: dict | None = None):
        sock, reader, welcome, after = self.link.dial(endpoint, timeout, then)
        self.pool_instance = welcome.get("instance")
        self._challenge = welcome.get("challenge", "")
        self._max_payload = dp.announced_payload_limit(welcome, self.link.limits.max_payload)
        if then is None:
            return sock, reader
        return sock, reader, after

    def _open(self, token: str, placed: dict | None = None, unreachable: dict | None = None) -> None:
        # the open goes with the hello (it needs nothing of the welcome)
        sock, reader, after = self._dial(self.endpoint, self.connect_timeout, then={
            "op": Op.OPEN.value, "token": token, "secret": self.secret.hex(),
            "client": {"name": self.name, "pid": os.getpid()},
            **({"domain": self.domain} if self.domain else {}),
            **({"device": self.selector} if self.selector else {}),
            **({"placed": placed} if placed else {}),
            **({"unreachable": unreachable} if unreachable else {})})
        try:
            if after:
                answer, leftovers = after[0].header, after[1:]
                if answer.get("op") == Op.ERROR.value:
                    raise from_wire(answer.get("error", {}))
            else:
                answer, leftovers = read_answer(sock, reader)
        except BaseException:
            sock.close()
            raise
        if answer.get("op") == Op.REDIRECT.value:
            # a pool of several nodes placed the session on another node: once, at open
            sock.close()
            if placed is not None:
                raise ProtocolError(reason=f"redirected again by {self.endpoint}: a session is placed once")
            target = dp.parse_redirect(answer)
            LOG.info("open at %s redirected to node %s at %s", self.endpoint, target["node"], target["endpoint"])
            placer = self.placed_by = self.endpoint
            self.endpoint = target["endpoint"]
            node = {"node": target["node"], "instance": target["instance"]}
            try:
                self._open(token, node)
            except Unavailable as exc:
                if unreachable is not None:            # placed again once already: say why, stop
                    raise
                # a node killed less than its lease's TTL ago is still listed live: the
                # node that placed the open places it once more, without that one
                LOG.warning("could not open at node %s (%s): asking %s to place the open again",
                            target["node"], exc, placer)
                self.endpoint, self.placed_by = placer, None
                self._open(token, unreachable=node)
            return
        if answer.get("op") != Op.OPENED.value:
            sock.close()
            raise ProtocolError(reason=f"expected opened, got {answer.get('op')!r}")
        self.sid = answer["sid"]
        self.epoch = answer["epoch"]
        self.bound_host = answer.get("bound_host")
        self.device_id = answer.get("device")
        self.link.install(sock, reader, leftovers)
        with self.cond:
            if self.states.state is LinkState.CONNECTING:   # its reader may have lost it already
                self.states.fire(LinkEvent.OPENED)

    # -- state changes that others report ---------------------------------------------
    def link_lost_locked(self, error) -> None:
        """The link's socket failed (the caller holds cond)."""
        if self.states.can(LinkEvent.LOST):     # CONNECTING, CONNECTED, RESUMING
            # RESUMING: the new link died while the resume re-sent; the
            # resume must not then declare it connected.
            self.states.fire(LinkEvent.LOST)
            self.last_error = error
            LOG.warning("session %s: connection lost (%s)", self.sid, error)

    def fail_locked(self, err: AccelmigError) -> None:
        """The pool ended the session for good (the caller holds cond)."""
        if self.states.ended:
            return
        self.states.fire(LinkEvent.FAIL)
        self.failure = err
        LOG.error("session %s failed: %s", self.sid, err)
        self.cond.notify_all()

    # -- commands ---------------------------------------------------------------------
    def new_handle(self) -> int:
        """A buffer or program handle: chosen here, so that a re-sent command
        is idempotent."""
        with self.cond:
            handle = self._next_handle
            self._next_handle += 1
            return handle

    @property
    def max_payload(self) -> int:
        """The largest payload one frame may carry (the pool said at hello)."""
        return self._max_payload

    @property
    def batching(self) -> bool:
        """The pool agreed to launch batches (protocol 2, ``wire.batch``)."""
        return self.link.batching

    def submit(self, op: Op, fields: dict | None, payload=b"", *, wait: bool, sink=None,
               timeout: float | None = None, defer: bool = False,
               record: bytes | None = None) -> PendingCommand:
        """Number a command, keep it in the window and send it; with ``wait``,
        block for its reply (and raise a pipelined command's failure).  With
        ``defer`` it is sent at once and the caller waits later
        (``wait_reply``): its failure is the caller's, not a pipelined one.
        ``record``: a pipelined launch as its batch record (``wire.batch``;
        ``fields`` None), corked into a batch frame; sent alone as JSON
        where the link does not batch."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        nbytes = len(payload)
        if nbytes > self._max_payload:
            # The pool would close the connection on it, again at every resume.
            raise FrameTooLarge(part=f"{op.value} payload", size=nbytes, limit=self._max_payload)
        link = self.link
        while True:
            with self.cond:
                self._wait_ready_locked(nbytes, deadline)
            with link.send_lock:
                with self.cond:
                    if not self.states.connected or link.sock is None or not self.window.has_room(nbytes):
                        continue   # lost it between the two locks: wait again
                    header = {"op": op.value, "epoch": self.epoch, "ack": self.window.last_seen}
                    if record is not None and link.batching:
                        cmd = self.window.add(header, record=record)
                    else:
                        header.update(fields if record is None else batch.launch_fields(record))
                        cmd = self.window.add(header, payload, waited=wait or defer, sink=sink)
                        record = None
                    sock, gen = link.sock, link.gen
                    link.acked_sent = max(link.acked_sent, header["ack"])
                    # a caller that waits reads its reply itself: the turn
                    # is taken before the reply can wake the reader thread
                    turn = link.take_turn_locked() if wait else None
                try:
                    if record is not None:
                        link.cork_launch(sock, gen, cmd.seq, header["epoch"], header["ack"], record)
                    else:
                        link.send_command(sock, gen, encode_prefix_and_header(header, nbytes), payload,
                                          pipelined=not wait)
                except BaseException:
                    if turn is not None:
                        with self.cond:
                            turn.give_back(link.turn_free)
                    raise
            break
        if not wait:
            return cmd
        return self._wait_reply(cmd, deadline, turn=turn)

    def submit_launch(self, record: bytes) -> None:
        """A pipelined launch as its batch record: the common case (connected,
        room in the window, a pool that batches) under one take of each
        lock; anything else as ``submit`` does it (waits, raises, JSON)."""
        link = self.link
        with link.send_lock:
            with self.cond:
                ready = self.states.state is LinkState.CONNECTED and link.sock is not None \
                    and link.batching and self.window.has_room(0)
                if ready:
                    epoch, ack = self.epoch, self.window.last_seen
                    seq = self.window.add({"op": "launch", "epoch": epoch, "ack": ack}, record=record).seq
                    sock, gen = link.sock, link.gen
                    if ack > link.acked_sent:
                        link.acked_sent = ack
            if ready:
                link.cork_launch(sock, gen, seq, epoch, ack, record)
                return
        self.submit(Op.LAUNCH, None, wait=False, record=record)

    def _wait_ready_locked(self, nbytes: int, deadline: float) -> None:
        """Until connected with room in the window (the caller holds cond)."""
        while True:
            state = self.states.state
            if state is LinkState.FAILED:
                raise self.failure
            if state is LinkState.CLOSED:
                raise Closed(what=f"session {self.sid}")
            if state is LinkState.CONNECTED and self.window.has_room(nbytes):
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if state is LinkState.CONNECTED:
                    raise WindowFull(timeout=self.timeout, count=len(self.window.pending),
                                     bytes=self.window.bytes)
                raise Disconnected(timeout=self.timeout, reason=f"state {state.value}, "
                                   f"last error: {self.last_error}")
            self.cond.wait(remaining)

    def wait_reply(self, cmd: PendingCommand, *, pipelined_errors: bool = True) -> PendingCommand:
        """Block for a deferred command's reply (``submit(defer=True)``);
        raise its failure, and with ``pipelined_errors`` a pipelined one's."""
        return self._wait_reply(cmd, time.monotonic() + self.timeout, pipelined_errors)

    def _wait_reply(self, cmd: PendingCommand, deadline: float,
                    pipelined_errors: bool = True, turn=None) -> PendingCommand:
        link = self.link
        prompt = True       # read for the reply while it comes promptly (``Turn``)
        with self.cond:
            while cmd.reply is None:
                state = self.states.state
                if state is LinkState.CONNECTED and prompt:
                    if turn is None:
                        turn = link.take_turn_locked()
                    if turn is not None:
                        prompt = link.read_own_reply_locked(turn, cmd)
                        turn = None
                        continue
                elif turn is not None:
                    turn.give_back(link.turn_free)
                    turn = None
                if state is LinkState.FAILED:
                    raise self.failure
                if state is LinkState.CLOSED:
                    raise Closed(what=f"session {self.sid}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    what = f"{cmd.header['op']} (seq {cmd.seq}; it stays in flight"
                    if state is not LinkState.CONNECTED:
                        what += f"; {state.value}, last error: {self.last_error}"
                    raise Timeout(what=what + ")", timeout=self.timeout)
                self.cond.wait(remaining)
            if turn is not None:           # (the reply came before the caller could read it)
                turn.give_back(link.turn_free)
            if not cmd.reply.get("ok", False):
                raise from_wire(cmd.reply.get("error", {}))
            if not pipelined_errors:
                return cmd
            errors, self.pipeline_errors = self.pipeline_errors, []
        if errors:
            first = errors[0]
            if len(errors) > 1:
                first.details["more_errors"] = len(errors) - 1
            raise first
        return cmd

    # -- resume -----------------------------------------------------------------------
    def resume(self, endpoint: str | None = None, ticket: str | None = None) -> dict:
        """Continue this session on a new connection (thread-safe).

        ``endpoint``: where the pool is now (default: the last endpoint);
        ``ticket``: the resume ticket of a migration, when the session moved
        to another host.  Returns what happened (epoch, replayed replies,
        re-sent commands, seconds); raises the pool's refusal otherwise.
        """
        self._preempt.set()
        self.link.cut_attempt()      # a background reconnect is in the way: cut it
        with self._resume_lock:
            self._preempt.clear()
            target = endpoint or self.endpoint
            if ticket and ticket in self._used_tickets:
                # This move already happened (a background retry made it, or
                # the rehome was delivered twice): the session is bound there.
                if self.states.connected and target == self.endpoint:
                    return {"sid": self.sid, "epoch": self.epoch, "endpoint": target,
                            "replayed": 0, "resent": 0, "seconds": 0.0, "ticket": True,
                            "already": True}
                ticket = None
            try:
                try:
                    return self._resume(target, ticket)
                except Unavailable as exc:
                    # a pool of several nodes: the node asked (the host's) says which node
                    # holds the session; once, to a node endpoint it names (checked, TLS as ever)
                    home = _lives_at(exc)
                    if home is None or home == target:
                        raise
                    LOG.info("session %s lives on node %s at %s: resuming there", self.sid,
                             exc.details.get("node"), home)
                    target = home
                    return self._resume(target, ticket)
            except AccelmigError as exc:
                if exc.retriable or isinstance(exc, Unavailable):
                    # Keep trying in the background where we were told to go:
                    # the answer may have been lost, or the path not be up yet.
                    self._target = (target, ticket)
                raise

    def _resume(self, endpoint: str, ticket: str | None, timeout: float | None = None) -> dict:
        """One resume attempt (the caller holds the resume lock)."""
        started = time.monotonic()
        times = {"asked": time.time()}          # wall clock: the migration's timeline
        link = self.link
        with self.cond:
            if self.states.ended:
                raise self.failure or Closed(what=f"session {self.sid}")
            self.states.fire(LinkEvent.RESUME)
            old = link.detach_locked()
        if old is not None:
            link.release(old)
        try:
            sock, reader = self._dial(endpoint, timeout or self.connect_timeout)
            times["connected"] = time.time()
            try:
                with self.cond:
                    last_seen = self.window.last_seen
                    next_seq = self.window.next_seq
                    epoch = self.epoch
                request = {"op": Op.RESUME.value, "sid": self.sid, "epoch": epoch,
                           "last_seen": last_seen, "next_seq": next_seq,
                           "proof": dp.ownership_proof(self.secret, self._challenge, self.sid, epoch,
                                                       self.link.binding)}
                if ticket:
                    request["ticket"] = ticket
                handshake_send(sock, request)
                answer, leftovers = read_answer(sock, reader)
                times["answered"] = time.time()
                if answer.get("op") != Op.RESUMED.value:
                    raise ProtocolError(reason=f"expected resumed, got {answer.get('op')!r}")
            except BaseException:
                sock.close()
                raise
        except BaseException as exc:
            # Whatever failed, never leave the state at RESUMING.
            with self.cond:
                if isinstance(exc, AccelmigError) and exc.code in TERMINAL_SESSION_CODES:
                    self.fail_locked(exc)
                elif self.states.state is LinkState.RESUMING:
                    self.states.fire(LinkEvent.LOST)
                    self.last_error = exc
                self.cond.notify_all()
            raise
        # Accepted: switch to the new link, then re-send what the pool lacks.
        self._target = None
        if ticket:
            self._used_tickets.add(ticket)
        with link.send_lock:
            link.drop_cork()          # corked commands are in the window: re-sent below
            with self.cond:
                self.epoch = answer["epoch"]
                self.endpoint = endpoint
                self.bound_host = answer.get("bound_host")
            link.install(sock, reader, leftovers)
            with self.cond:
                resend = self.window.resend_from(answer["expect"])
                ack = self.window.last_seen
            resent_bytes = 0
            try:
                for cmd in resend:
                    cmd.header["epoch"] = self.epoch
                    cmd.header["ack"] = ack
                    cmd.resent += 1
                    # alone, as JSON: the pool knows a launch a cut batch
                    # carried by its identity, whichever frame brought it
                    send_all(sock, encode_prefix_and_header(cmd.wire_header(), len(cmd.payload)),
                             cmd.payload)
                    resent_bytes += len(cmd.payload)
            except OSError as exc:
                LOG.warning("session %s: connection lost while re-sending: %s", self.sid, exc)
            with self.cond:
                if self.states.state is LinkState.RESUMING:
                    self.states.fire(LinkEvent.ACCEPTED)
                link.acked_sent = ack
                self.cond.notify_all()
        elapsed = time.monotonic() - started
        self.stats["resumes"] += 1
        self.stats["resent_commands"] += len(resend)
        self.stats["resent_bytes"] += resent_bytes
        self.stats["last_resume_s"] = elapsed
        if link.tls_resumed:
            self.stats["tls_resumed"] += 1
        result = {"sid": self.sid, "epoch": self.epoch, "endpoint": endpoint,
                  "replayed": answer.get("replay", 0), "resent": len(resend),
                  "seconds": round(elapsed, 6), "ticket": bool(ticket), "times": times}
        LOG.info("session %s resumed at %s: epoch %d, %d replayed, %d re-sent, %.1f ms%s", self.sid,
                 endpoint, self.epoch, result["replayed"], len(resend), elapsed * 1000,
                 " (TLS session resumed)" if link.tls_resumed else "")
        return result

    # -- housekeeping -----------------------------------------------------------------
    def _reconnect_endpoint(self) -> str:
        if self.placed_by is None or self.placed_by == self.endpoint:
            return self.endpoint
        self._ask_placer = not self._ask_placer
        return self.placed_by if self._ask_placer else self.endpoint

    def _housekeep(self) -> None:
        """Acknowledges when idle; reconnects with backoff (a thread for the
        session's life).  It waits for work rather than polling: replies to
        acknowledge (``replies_arrived``) or a change of the link's state."""
        first, longest = RECONNECT_BACKOFF
        backoff = first
        while True:
            self._housework.clear()
            state = self.states.state
            if state is LinkState.FAILED or state is LinkState.CLOSED:
                return
            if state is LinkState.CONNECTED:
                backoff = first
                if self.window.last_seen > self.link.acked_sent:
                    time.sleep(HOUSEKEEPING_TICK)      # a burst of replies: one acknowledgement
                    self._idle_ack()
                else:
                    self._housework.wait()
            elif state is LinkState.DISCONNECTED and self.auto_reconnect and not self._preempt.is_set():
                time.sleep(backoff)
                if not self._resume_lock.acquire(blocking=False):
                    continue
                try:
                    if self.states.state is LinkState.DISCONNECTED:
                        self.stats["reconnect_attempts"] += 1
                        endpoint, ticket = self._target or (self._reconnect_endpoint(), None)
                        self._resume(endpoint, ticket, timeout=min(2.0, self.connect_timeout))
                except AccelmigError as exc:
                    backoff = min(backoff * 2, longest)
                    LOG.debug("session %s: reconnect to %s failed: %s", self.sid, self.endpoint, exc)
                finally:
                    self._resume_lock.release()
            elif state is LinkState.DISCONNECTED and not self.auto_reconnect:
                self._housework.wait()                 # until someone resumes it, or it ends
            else:
                # connecting, resuming, or an explicit resume under way: look
                # again when it is over (or after a backoff's while)
                self._housework.wait(backoff)

    def _idle_ack(self) -> None:
        link = self.link
        with self.cond:
            upto = self.window.last_seen
            sock, gen = link.sock, link.gen
        if upto > link.acked_sent and sock is not None:
            link.try_ack(sock, gen, upto)

    # -- the end ----------------------------------------------------------------------
    def close(self) -> None:
        """Release the session at the pool (when connected) and drop the link."""
        with self.cond:
            connected = self.states.connected
        if connected:
            try:
                self.submit(Op.RELEASE, {}, wait=True, timeout=min(self.timeout, 10.0))
            except AccelmigError as exc:
                LOG.warning("session %s: release failed: %s", self.sid, exc)
        with self.cond:
            if not self.states.ended:
                self.states.fire(LinkEvent.CLOSE)
            sock = self.link.detach_locked()
            self.cond.notify_all()
        if sock is not None:
            self.link.release(sock)

    def describe(self) -> dict:
        with self.cond:
            return {"sid": self.sid, "epoch": self.epoch, "state": self.states.state.value,
                    "endpoint": self.endpoint, "bound_host": self.bound_host,
                    "last_seen": self.window.last_seen, "next_seq": self.window.next_seq,
                    "pending": len(self.window.pending), "window_bytes": self.window.bytes,
                    **self.stats}


def _lives_at(exc: Unavailable) -> str | None:
    """The endpoint of the node a pool says holds the session, if it says one."""
    endpoint = exc.details.get("lives_at") if isinstance(exc.details, dict) else None
    if not isinstance(endpoint, str) or len(endpoint) > 300:
        return None
    try:
        dp.parse_endpoint(endpoint)
    except AccelmigError:
        return None
    return endpoint
