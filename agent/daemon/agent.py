"""The guest agent: the guest end of the host channel and the hub of the
guest's drivers; the wiring of its parts (each a module of this package).

One thread polls the channel port, the local socket and every registered
driver's connection (``Poller``: the poll set is kept from one wait to the
next); a rehome and a prove run on threads of their own (they wait for
drivers) while polling goes on.

- ``hostchannel``: the channel's state machine and what the host may send;
- ``drivers``: the drivers' links and the registry of their sessions;
- ``driverapi``: what the guest's processes may send on the local socket;
- ``rehome``: a migration's rehome (once per migration id), a state machine;
- ``proofs``: the sessions' binding proofs, relayed to their drivers;
- ``netconfig``: the fabric NIC's addressing.

Sessions come and go with their drivers' connections: a driver that dies
is noticed when its socket closes.
"""

from __future__ import annotations

import collections
import itertools
import json
import operator
import os
import select
import socket
import threading
import time

from accelmig.agent import dmi
from accelmig.agent.daemon.driverapi import DriverApi
from accelmig.agent.daemon.drivers import LOG, MAX_SID, DriverLink, DriverRegistry, DriverState
from accelmig.agent.daemon.hostchannel import AGENT_VERSION, HostChannel
from accelmig.agent.daemon.netconfig import NetworkConfigurator
from accelmig.agent.daemon.proofs import ProofRelay
from accelmig.agent.daemon.rehome import RehomeBook, answered
from accelmig.runtime.sockets import OwnedUnixSocket
from accelmig.wire import channel as ch
from accelmig.wire.errors import BadRequest
from accelmig.wire.identity import HostIdentity
from accelmig.wire.values import describe

__all__ = ["AGENT_VERSION", "Agent", "DriverLink", "Poller"]


class Poller:
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


class Agent:
    #: sessions one local connection may register (a driver registers one per connection)
    MAX_SESSIONS_PER_LINK = 256
    #: sessions all local connections together may register
    MAX_SESSIONS = 4096
    #: drivers a rehome asks to resume at once (``rehome.ResumeWindow``)
    RESUME_WINDOW = 16

    def __init__(self, port_path: str, socket_path: str = ch.DEFAULT_AGENT_SOCKET, *,
                 state_dir: str = "/run/accelmig", identity: HostIdentity | None = None,
                 rehome_timeout: float = 30.0, network: NetworkConfigurator | None = None,
                 max_sessions_per_link: int = MAX_SESSIONS_PER_LINK, max_sessions: int = MAX_SESSIONS,
                 dmi_path: str = dmi.PRODUCT_UUID, resume_window: int = RESUME_WINDOW):
        self.port_path = port_path
        self.socket_path = socket_path
        self.state_dir = state_dir
        self.rehome_timeout = rehome_timeout
        self.network = network or NetworkConfigurator()
        # read once, as root: the drivers of other users may not read it (dmi)
        self.domain = dmi.system_uuid(dmi_path)
        self.listener: socket.socket | None = None
        self.ids = itertools.count(1)           # the agent's own message and request ids
        self.stats = collections.Counter()
        self.started = time.time()
        self.channel = HostChannel(self, port_path, state_dir, identity)
        self.registry = DriverRegistry(self.send_host, self.ids, self._unwatch, max_sessions_per_link, max_sessions)
        self.driver_api = DriverApi(self, self.registry)
        self.proofs = ProofRelay(self.registry, self.stats)
        self.rehome_book = RehomeBook(self.registry, self.channel, self.network, self.stats, timeout=rehome_timeout,
                                      window=resume_window, max_staged=max_sessions)
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)     # a wake-up never blocks its sender
        # the poll set, kept between waits: descriptor -> "port", "listener",
        # "wake" or the DriverLink (the poll thread alone changes it)
        self._poller: Poller | None = None
        self._fd_kind: dict[int, object] = {}
        self._port_fd: int | None = None
        self._touched: set = set()               # links whose POLLOUT must be looked at
        self._touch_lock = threading.Lock()

    # -- what the parts hold (the host channel's, read through the agent) --------------
    state = property(operator.attrgetter("channel.state"), doc="The host channel's ``ChannelState``.")
    identity = property(operator.attrgetter("channel.identity"), doc="The host's ``HostIdentity``, or None.")
    identity_file = property(operator.attrgetter("channel.identity_file"))
    parser = property(operator.attrgetter("channel.parser"))
    port = property(operator.attrgetter("channel.port"))

    @property
    def rehomes(self) -> dict:
        """Migration id -> its ``Rehome`` (the last ``RehomeBook.KEPT``)."""
        return self.rehome_book.rehomes

    def sessions(self, uid: int | None = None) -> list[dict]:
        """Every registered session, or only those of ``uid``'s processes."""
        return self.registry.sessions(uid)

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
                                    f"characters), not {describe(after)}")
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
                "rehomes": [{"migration_id": r.migration_id, "done": r.result is not None,
                             **({"result": ch.bounded_outcome(r.result, 0)}
                                if everything and r.result is not None else {})}
                            for r in list(self.rehomes.values())],
                "stats": dict(self.stats),
                **({"dropped": self.parser.dropped[-10:]} if everything else {})}

    # -- what the host and root's requests reach (a subclass may say more) -------------
    def send_host(self, message: dict, resync: bool = False) -> bool:
        return self.channel.send(message, resync)

    def hello(self) -> dict:
        return self.hello_messages()[0]

    def hello_messages(self) -> list[dict]:
        """The hello, then a session_opened for each session it had no room for."""
        return self.channel.hello_messages(self.sessions(), self.ids)

    def stage_tickets(self, message: dict) -> dict:
        return self.rehome_book.stage_tickets(message)

    def rehome(self, message: dict, received: float | None = None) -> dict:
        """Apply a rehome and return its outcome (``rehome.RehomeBook.rehome``)."""
        return self.rehome_book.rehome(message, received)

    def rehome_answer(self, message: dict, received: float) -> dict:
        """A rehome's outcome as its answer carries it (bounded, timed)."""
        return answered(self.rehome(message, received), received)

    def prove(self, request: dict) -> dict:
        """The drivers' binding proofs of sessions (``proofs.ProofRelay``)."""
        return self.proofs.prove(request)

    # -- lifecycle --------------------------------------------------------------------
    def open(self) -> None:
        # any application in the guest may register its sessions
        self._owned = OwnedUnixSocket(self.socket_path, mode=0o666, what="accelmig-agent")
        self.listener = self._owned.open()      # first: a second agent stops here
        try:
            self.channel.open()
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
        self.registry.close()
        if self._poller is not None:
            self._poller.close()
        self._poller, self._port_fd = None, None
        self._fd_kind.clear()
        if self.listener is not None:
            self._owned.close()
            self.listener = None
        self.channel.close()

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
            poller = self._poller = Poller()
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
            if self._fd_kind.get(link.fd) is not link:
                continue                     # dropped already
            if link.state is DriverState.OVERFLOWED:
                LOG.warning("driver %s dropped: it does not read what the agent sends", link.who)
                self.registry.drop(link)
                continue
            poller.set(link.fd, select.POLLIN | (select.POLLOUT if link.backlogged else 0))
        wait = self.port.next_look_in()
        for fd, revents in poller.poll(wait if wait is not None else 1.0):
            kind = self._fd_kind.get(fd)
            try:
                if kind == "port":
                    self.channel.read(revents)
                elif kind == "listener":
                    self._accept()
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

    def _unwatch(self, link: DriverLink) -> None:
        """A dropped link leaves the poll set (the poll thread)."""
        if self._fd_kind.get(link.fd) is link:
            del self._fd_kind[link.fd]
            if self._poller is not None:
                self._poller.remove(link.fd)

    def _accept(self) -> None:
        link = self.registry.accept(self.listener, self._touch)
        if link is None:
            return
        if self._poller is not None:
            self._poller.add(link.fd, select.POLLIN)
        self._fd_kind[link.fd] = link

    def _on_driver(self, link: DriverLink, revents: int = select.POLLIN) -> None:
        if revents & select.POLLOUT:
            try:
                link.flush()
            except OSError:
                self.registry.drop(link)
                return
            if not link.backlogged and self._poller is not None:
                # written out: stop watching POLLOUT (a send that queues again touches it)
                self._poller.set(link.fd, select.POLLIN)
            if not revents & (select.POLLIN | select.POLLHUP | select.POLLERR):
                return
        self.driver_api.read(link)
