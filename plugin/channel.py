"""The host end of a guest's accelmig channel.

libvirt gives each domain's ``org.accelmig.agent.0`` channel a unix socket
(QEMU listens; read its path from the live XML).  Only hostd ever opens it:
a QEMU chardev serves one client.  Every connection starts with the
resynchronising handshake of accelmig.wire.channel (sentinel, ``sync`` with
a nonce, everything before the matching answer dropped), then carries
requests with ids and the agent's unsolicited events.

Both transports here run one ``accelmig.wire.channel.LineSession`` (gated
by the handshake): ``GuestChannel`` blocking (the CLI, tests),
``AsyncGuestChannel`` on hostd's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import socket
import threading
import time

from accelmig.wire import channel as ch
from accelmig.wire.errors import Timeout, Unavailable

LOG = logging.getLogger(__name__)


def _session() -> ch.LineSession:
    # ids start far from 1: an agent that still holds an answer of an
    # earlier host end cannot match a new request by accident
    return ch.LineSession("host-channel", gated=True, first_id=int(time.time() * 1000) % 1_000_000 * 1000)


class GuestChannel:
    """Blocking host-side channel client.

    ``events``: a queue of the agent's unsolicited messages (hello,
    session_opened, session_closed).
    """

    def __init__(self, path: str, *, connect_timeout: float = 10.0):
        self.path = path
        self.connect_timeout = connect_timeout
        self.events: queue.Queue = queue.Queue()
        self.hello: dict | None = None
        self._sock: socket.socket | None = None
        self._session = _session()
        self._answers: dict = {}
        self._cond = threading.Condition()
        self._reader: threading.Thread | None = None
        self._closed = False

    def connect(self, sync_timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + self.connect_timeout
        while True:
            try:
                sock = ch.connect_unix(self.path, None)
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise Unavailable(what=f"the guest channel {self.path}", reason=str(exc)) from None
                time.sleep(0.05)        # QEMU creates the socket as it starts
        self._sock = sock
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name="guest-channel")
        self._reader.start()
        return self.sync(sync_timeout)

    def sync(self, timeout: float = 10.0) -> dict:
        """Resynchronise (sentinel + sync/nonce); returns the agent's hello."""
        with self._cond:
            sync_id, frame = self._session.sync()
            self.hello = None
        deadline = time.monotonic() + timeout
        # Re-send the sync until answered: the guest may not run yet (a
        # migration's destination before resume) or have lost our first one.
        while True:
            self._send(frame)
            with self._cond:
                self._cond.wait_for(lambda: self.hello is not None or self._closed,
                                    min(1.0, max(0.0, deadline - time.monotonic())))
                if self.hello is not None:
                    return self.hello
                if self._closed:
                    raise Unavailable(what="the guest channel", reason="closed during sync")
            if time.monotonic() > deadline:
                raise Timeout(what="the guest agent's sync answer", timeout=timeout)
            frame = self._session.resend_sync(sync_id)

    def _send(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise Unavailable(what="the guest channel", reason=str(exc)) from None

    def _read_loop(self) -> None:
        while True:
            try:
                data = self._sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                with self._cond:
                    self._closed = True
                    self._cond.notify_all()
                return
            with self._cond:
                for kind, msg_id, message in self._session.feed(data):
                    if kind == "answer":
                        self._answers[msg_id] = message
                    elif kind == "event":
                        if message.get("type") == "hello":
                            self.hello = message
                        self.events.put(message)
                self._cond.notify_all()

    def request(self, kind: str, timeout: float = 30.0, **fields):
        with self._cond:
            request_id, line = self._session.request(kind, **fields)
        self._send(line)
        deadline = time.monotonic() + timeout
        with self._cond:
            while request_id not in self._answers:
                if self._closed:
                    raise Unavailable(what="the guest channel", reason="closed before the answer")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Timeout(what=f"the agent's answer to {kind}", timeout=timeout)
                self._cond.wait(remaining)
            return ch.answer_of(self._answers.pop(request_id))

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncGuestChannel:
    """The same on asyncio.  ``on_event(message)`` receives the agent's events."""

    def __init__(self, path: str, on_event=None):
        self.path = path
        self.on_event = on_event
        self.hello: dict | None = None
        self._session = _session()
        self._waiters: dict[int, asyncio.Future] = {}
        self._synced: asyncio.Future | None = None
        self._reader_task: asyncio.Task | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def connect(self, connect_timeout: float = 10.0, sync_timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                reader, self._writer = await asyncio.open_unix_connection(self.path)
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise Unavailable(what=f"the guest channel {self.path}", reason=str(exc)) from None
                await asyncio.sleep(0.05)     # QEMU creates the socket as it starts
        self._reader_task = asyncio.ensure_future(self._read_loop(reader))
        return await self.sync(sync_timeout)

    async def sync(self, timeout: float = 10.0) -> dict:
        loop = asyncio.get_running_loop()
        sync_id, frame = self._session.sync()
        self._synced = loop.create_future()
        deadline = time.monotonic() + timeout
        while True:
            self._write(frame)
            try:
                return await asyncio.wait_for(asyncio.shield(self._synced),
                                              min(1.0, max(0.01, deadline - time.monotonic())))
            except asyncio.TimeoutError:
                if time.monotonic() > deadline:
                    raise Timeout(what="the guest agent's sync answer", timeout=timeout) from None
            frame = self._session.resend_sync(sync_id)

    def _write(self, data: bytes) -> None:
        if self._writer is None or self._writer.is_closing():
            raise Unavailable(what="the guest channel", reason="not connected")
        self._writer.write(data)

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                for kind, msg_id, message in self._session.feed(data):
                    if kind == "answer":
                        waiter = self._waiters.pop(msg_id, None)
                        if waiter is not None and not waiter.done():
                            waiter.set_result(message)
                    elif kind == "event":
                        if message.get("type") == "hello":
                            self.hello = message
                            if self._synced is not None and not self._synced.done():
                                self._synced.set_result(message)
                        if self.on_event is not None:
                            self.on_event(message)
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            for waiter in self._waiters.values():
                if not waiter.done():
                    waiter.set_exception(Unavailable(what="the guest channel", reason="closed"))
            if self._synced is not None and not self._synced.done():
                self._synced.set_exception(Unavailable(what="the guest channel", reason="closed"))

    async def request(self, kind: str, timeout: float = 30.0, **fields):
        request_id, line = self._session.request(kind, **fields)
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = waiter
        self._write(line)
        try:
            message = await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            raise Timeout(what=f"the agent's answer to {kind}", timeout=timeout) from None
        finally:
            self._waiters.pop(request_id, None)
        return ch.answer_of(message)

    async def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except (OSError, asyncio.CancelledError):
                pass
