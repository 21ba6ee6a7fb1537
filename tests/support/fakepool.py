"""Test support: a real ``Pool`` with nothing real under it but the pool's
own code — a device that does nothing and a connection whose frames land in
a list — for the tests that drive the pool's rules on an injected clock or
under Hypothesis (``tests/pool/test_time_injected.py``,
``tests/pool/test_sequencing_model.py``).  Only the transport and the device
are fake: every frame goes through the pool's own ``DataConnection``
logic, every resume and migration through the pool and its ledger."""

from __future__ import annotations

from accelmig.pool.dataplane import ConnState, DataConnection
from accelmig.wire import dataplane as dp


class NullContext:
    """A device context that runs nothing: allocations are bookkeeping."""

    def __init__(self):
        self.buffers: dict[int, int] = {}

    def alloc(self, buf, size):
        self.buffers[buf] = size

    def finish(self):
        pass

    def finish_is_noop(self) -> bool:   # nothing ever runs on it: the pool answers a finish on its loop
        return True

    def lost(self):                     # in-process: its device state is never gone
        return None

    def info(self):
        return {"name": "null device"}

    def abandon(self) -> int:           # in-process: everything comes back at release
        return 0

    def release(self) -> int:
        released, self.buffers = sum(self.buffers.values()), {}
        return released


class NullBackend:
    def new_context(self, tenant="", upload_arena=0):
        return NullContext()

    def trim_idle(self, idle_for):       # nothing kept for reuse
        pass


class ListConnection(DataConnection):
    """The pool's own connection logic from a host's address; outgoing
    frames land in ``frames``.  ``hello=True``: its hello is sent and the
    welcome taken off ``frames``."""

    def __init__(self, pool, host: str, address: str, hello: bool = False):
        super().__init__(pool)
        self.peer = (address, 40000)
        self.peer_host = host
        self.frames: list[dict] = []
        if hello:
            self._handle({"op": "hello", "versions": list(dp.PROTOCOL_VERSIONS)}, b"")
            assert self.frames.pop(0)["op"] == "welcome"

    def send(self, header, payload=b""):
        if self.state is not ConnState.CLOSED:
            self.frames.append(dict(header))

    def send_reply(self, reply):
        if self.state is ConnState.ATTACHED:
            self.frames.append(dict(reply.header))

    def lost(self, now: float | None = None) -> None:
        """The transport went away at ``now`` (the pool's clock for the
        session's grace): the pool hears of it first with that time, then
        the connection's own ``connection_lost`` runs as asyncio would call it."""
        session = self.session
        if now is not None and session is not None and session.connection is self:
            self.pool.connection_lost(session, self, now=now)
        self.connection_lost(None)
