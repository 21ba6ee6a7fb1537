"""The guest end of the host channel: its state machine, what the host may
send (one dispatch table over ``wire.channel.HOST_TYPES``), the hello, and
the identity the host gave (kept in a file across the agent's restarts).

The channel's state, as the agent sees the host end::

    NO_HOST --the host writes--> CONNECTED --sync--> SYNCED --the host goes--> NO_HOST
                                     \\----------the host goes------------------^

The host end disconnects and reconnects across a migration (hostd reopens
the QEMU chardev socket on each host) and synchronises on every connect, as
qemu-guest-agent's ``guest-sync-delimited`` does.  A host may synchronise
again on the same connection (SYNCED -> SYNCED: it gets a fresh hello).
The agent reads the channel, and changes its state, on its poll thread
only; anything may write to it (``send``, under a lock).

A ``rehome`` and a ``prove`` wait for the drivers: each is answered from a
thread of its own (``answer_later``) while the poll thread goes on.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import socket
import threading
import time

from accelmig.agent.daemon.drivers import MAX_SID
from accelmig.agent.daemon.ports import PortClosed, open_port
from accelmig.runtime.dispatch import Dispatch
from accelmig.runtime.files import atomic_write
from accelmig.runtime.statemachine import StateMachine
from accelmig.wire import attestation as att
from accelmig.wire import channel as ch
from accelmig.wire.errors import AccelmigError, InternalError
from accelmig.wire.identity import HostIdentity

# the agent's logger, as before the split: operators' filters keep working
LOG = logging.getLogger("accelmig.agent.daemon.agent")

#: said in the hello and in ``status``
AGENT_VERSION = "0.1.0"


class ChannelState(enum.Enum):
    NO_HOST = "no_host"
    CONNECTED = "connected"
    SYNCED = "synced"


class ChannelEvent(enum.Enum):
    HOST_WROTE = "host_wrote"      # bytes came from the host
    HOST_SYNCED = "host_synced"    # the host synchronised (guest-sync-delimited)
    HOST_GONE = "host_gone"        # the host end hung up


class ChannelStateMachine(StateMachine):
    INITIAL = ChannelState.NO_HOST
    TABLE = {
        ChannelEvent.HOST_WROTE: {ChannelState.NO_HOST: ChannelState.CONNECTED},
        # a sync arrives in bytes, which say a host is there: never from NO_HOST
        ChannelEvent.HOST_SYNCED: {ChannelState.CONNECTED: ChannelState.SYNCED,
                                   ChannelState.SYNCED: ChannelState.SYNCED},
        ChannelEvent.HOST_GONE: {ChannelState.CONNECTED: ChannelState.NO_HOST,
                                 ChannelState.SYNCED: ChannelState.NO_HOST},
    }
    REPEATS = {
        ChannelEvent.HOST_WROTE: frozenset({ChannelState.CONNECTED, ChannelState.SYNCED}),
        ChannelEvent.HOST_GONE: frozenset({ChannelState.NO_HOST}),
    }

    def host_wrote(self) -> None:
        """Bytes came from the host: a host is there (if none was)."""
        self.fire(ChannelEvent.HOST_WROTE)

    def host_synced(self) -> None:
        self.fire(ChannelEvent.HOST_SYNCED)

    def host_gone(self) -> None:
        self.fire(ChannelEvent.HOST_GONE)


def answer_later(send, request_id, work, *args, what: str) -> None:
    """Answer ``request_id`` with ``work(*args)``'s outcome from a thread of
    its own, sent with ``send`` (the channel's, or a local client's): an
    error is answered as its wire error, never no answer."""
    def run() -> None:
        try:
            answer = ch.result(request_id, result=work(*args))
        except AccelmigError as exc:
            answer = ch.result(request_id, ok=False, error=exc.to_wire())
        except Exception as exc:     # never leave the caller without an answer (nor die on stderr)
            LOG.exception("%s failed", what)
            answer = ch.result(request_id, ok=False, error=InternalError(
                reason=f"{type(exc).__name__}: {exc}").to_wire())
        try:
            send(answer)
        except OSError:
            pass
    threading.Thread(target=run, name=f"{what}-{request_id}", daemon=True).start()


class HostChannel:
    """The channel to the host.  ``agent`` answers what is not the
    channel's own: ``hello_messages``, ``status``, ``stage_tickets``,
    ``rehome_answer``, ``prove``, the ``network`` to apply, the ``stats``
    to count in."""

    on_host = Dispatch("a message from the host", ch.HOST_TYPES)

    #: the sessions a hello lists, in bytes: past it, the rest follow one
    #: session_opened each (local users may register many sessions with long
    #: fields; one line over the host's MAX_LINE would be dropped whole, and
    #: the host's sync with this guest would time out)
    HELLO_SESSIONS_BUDGET = ch.MAX_LINE // 2

    def __init__(self, agent, port_path: str, state_dir: str, identity: HostIdentity | None = None):
        self.agent = agent
        self.port_path = port_path
        self.state_dir = state_dir
        self.port = None
        self.machine = ChannelStateMachine()
        self.parser = ch.LineParser(name="channel")
        self._lock = threading.Lock()           # one writer at a time
        self.identity = identity or self._load_identity()

    @property
    def state(self) -> ChannelState:
        return self.machine.state

    # -- the identity -----------------------------------------------------------------------
    @property
    def identity_file(self) -> str:
        return os.path.join(self.state_dir, "identity.json")

    def _load_identity(self) -> HostIdentity | None:
        try:
            with open(self.identity_file) as handle:
                return HostIdentity.from_wire(json.load(handle))
        except (OSError, ValueError, AccelmigError):
            return None

    def store_identity(self, identity: HostIdentity) -> None:
        """The identity, and its file.  Not synced to disk (``durable``):
        the file lives on a tmpfs (``/run``), and a lost one costs only the
        host's next identity (it sends one at every sync)."""
        self.identity = identity
        try:
            os.makedirs(self.state_dir, exist_ok=True)
            atomic_write(self.identity_file, json.dumps(identity.to_wire()), durable=False)
        except OSError as exc:
            LOG.warning("cannot keep the identity in %s: %s", self.identity_file, exc)

    # -- the port ---------------------------------------------------------------------------
    def open(self) -> None:
        self.port = open_port(self.port_path)

    def close(self) -> None:
        if self.port is not None:
            self.port.close()

    def send(self, message: dict, resync: bool = False) -> bool:
        data = ch.encode(message)
        if resync:
            data = ch.SENTINEL + data
        with self._lock:
            try:
                self.port.write(data)
                return True
            except PortClosed as exc:
                LOG.info("channel: could not send %s: %s", message.get("type"), exc)
                return False

    def read(self, revents: int) -> None:
        """The poll thread: what the host wrote, each message answered."""
        data = self.port.read(revents)
        if data is None:
            self.machine.host_gone()
            self.parser.reset()
            return
        if not data:
            return
        self.machine.host_wrote()
        for message in self.parser.feed(data):
            try:
                self.handle(message)
            except Exception as exc:     # a bug costs only its message: the rest of the read is handled
                LOG.exception("channel: handling a %s failed", message.get("type"))
                self.send(ch.result(message.get("id"), ok=False, error=InternalError(
                    reason=f"{type(exc).__name__} handling a {message.get('type')}").to_wire()))

    def handle(self, message: dict) -> None:
        kind, request_id = message.get("type"), message.get("id")
        # (a host inventing types does not grow the counters without end)
        self.agent.stats[f"host_{kind}" if kind in ch.HOST_TYPES else "host_unknown"] += 1
        try:
            answer = self.on_host.call(self, kind, message)
            if answer is not None:
                self.send(ch.result(request_id, result=answer))
        except AccelmigError as exc:
            LOG.warning("channel: %s refused: %s", kind, exc)
            self.send(ch.result(request_id, ok=False, error=exc.to_wire()))

    def hello_messages(self, sessions: list[dict], ids) -> list[dict]:
        """The hello, then a session_opened for each session it had no room for."""
        listed, rest, size = [], [], 0
        for session in sessions:
            size += len(json.dumps(session)) + 2
            (listed if size <= self.HELLO_SESSIONS_BUDGET else rest).append(session)
        hello = {"type": "hello", "id": next(ids), "agent_version": AGENT_VERSION,
                 "protocol": ch.CHANNEL_PROTOCOL, "guest": guest_identity(), "sessions": listed,
                 "identity": self.identity.to_wire() if self.identity else None}
        return [hello] + [{"type": "session_opened", "id": next(ids), **session} for session in rest]

    # Each row returns its answer's result (None: answered already, or later).
    @on_host("sync")
    def _sync(self, message: dict):
        self.machine.host_synced()
        self.send({"type": "sync", "id": message.get("id"), "nonce": message.get("nonce")}, resync=True)
        for line in self.agent.hello_messages():       # (the agent's: what a guest says of itself)
            self.send(line)
        return None

    @on_host("ping")
    def _ping(self, message: dict):
        return {"pong": True, "time": time.time()}

    @on_host("status")
    def _status(self, message: dict):
        return self.agent.status(after=message.get("after"))

    @on_host("tickets")
    def _tickets(self, message: dict):
        return self.agent.stage_tickets(message)

    @on_host("identity")
    def _identity(self, message: dict):
        identity = HostIdentity.from_wire(message.get("identity"))
        # The host assigns the fabric NIC's address (host-bound fabrics):
        # apply it before anyone connects through it.
        network = self.agent.network.apply(identity.guest_nic) if identity.guest_nic else []
        self.store_identity(identity)
        LOG.info("identity from host %s: pool at %s%s", identity.host_id, identity.pool_endpoint,
                 f"; network: {'; '.join(network)}" if network else "")
        return {"accepted": True, "network": network}

    @on_host("rehome")
    def _rehome(self, message: dict):
        answer_later(self.send, message.get("id"), self.agent.rehome_answer, message, time.time(), what="rehome")
        return None

    @on_host("prove")
    def _prove(self, message: dict):
        att.parse_prove(message, MAX_SID)       # a bad request is answered at once
        answer_later(self.send, message.get("id"), self.agent.prove, message, what="prove")
        return None


def guest_identity() -> dict:
    """What the hello says of this guest: its host name, the agent's pid,
    its boot and machine ids where it has them."""
    out = {"hostname": socket.gethostname(), "pid": os.getpid()}
    for key, path in (("boot_id", "/proc/sys/kernel/random/boot_id"), ("machine_id", "/etc/machine-id")):
        try:
            with open(path) as handle:
                out[key] = handle.read().strip()
        except OSError:
            pass
    return out
