"""The host end of a guest's accelmig channel.

libvirt gives each domain's ``org.accelmig.agent.0`` channel a unix socket
(QEMU listens; read its path from the live XML).  Only hostd ever opens it:
a QEMU chardev serves one client.  Every connection starts with the
resynchronising handshake of accelmig.wire.channel (sentinel, ``sync`` with
a nonce, everything before the matching answer dropped), then carries
requests with ids and the agent's unsolicited events.

``GuestChannel`` is blocking (the CLI, tests); ``AsyncGuestChannel`` runs on
hostd's event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import secrets
import socket
import threading
import time

from accelmig.wire import channel as ch
from accelmig.wire.errors import ProtocolError, Timeout, Unavailable, from_wire

LOG = logging.getLogger(__name__)


class _Demux:
    """Sorts the agent's lines into answers (by id) and events."""

    def __init__(self):
        self.parser = ch.LineParser(name="host-channel")
        self.synced_nonce: str | None = None
        self.wanted_nonce: str | None = None

    def feed(self, data: bytes):
        """Yields ("answer", id, msg) and ("event", None, msg)."""
        for message in self.parser.feed(data):
            kind = message.get("type")
            if kind == "sync":
                if message.get("nonce") == self.wanted_nonce:
                    self.synced_nonce = self.wanted_nonce
                    yield ("synced", message.get("id"), message)
                continue            # a stale sync answer from an earlier connection
            if self.synced_nonce is None:
                continue            # before our sync answer: stale
            if kind == "result":
                yield ("answer", message.get("id"), message)
            else:
                yield ("event", None, message)


def _answer(message: dict):
    if message.get("ok"):
        return message.get("result")
    raise from_wire(message.get("error") or {})


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
        self._demux = _Demux()
        self._ids = itertools.count(int(time.time() * 1000) % 1_000_000 * 1000)
        self._answers: dict = {}
        self._cond = threading.Condition()
        self._reader: threading.Thread | None = None
        self._closed = False

    def connect(self, sync_timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + self.connect_timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.path)
                break
            except OSError as exc:
                sock.close()
                if time.monotonic() > deadline:
                    raise Unavailable(what=f"the guest channel {self.path}", reason=str(exc)) from None
                time.sleep(0.05)
        self._sock = sock
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name="guest-channel")
        self._reader.start()
        return self.sync(sync_timeout)

    def sync(self, timeout: float = 10.0) -> dict:
        """Resynchronise (sentinel + sync/nonce); returns the agent's hello."""
        nonce = secrets.token_hex(8)
        with self._cond:
            self._demux.wanted_nonce = nonce
            self._demux.synced_nonce = None
            self.hello = None
        sync_id = next(self._ids)
        deadline = time.monotonic() + timeout
        # Re-send the sync until answered: the guest may not run yet (a
        # migration's destination before resume) or have lost our first one.
        while True:
            self._send(ch.SENTINEL + ch.encode({"type": "sync", "id": sync_id, "nonce": nonce}))
            with self._cond:
                self._cond.wait_for(lambda: self.hello is not None or self._closed,
                                    min(1.0, max(0.0, deadline - time.monotonic())))
                if self.hello is not None:
                    return self.hello
                if self._closed:
                    raise Unavailable(what="the guest channel", reason="closed during sync")
            if time.monotonic() > deadline:
                raise Timeout(what="the guest agent's sync answer", timeout=timeout)

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
                for kind, msg_id, message in self._demux.feed(data):
                    if kind == "answer":
                        self._answers[msg_id] = message
                    elif kind == "event":
                        if message.get("type") == "hello":
                            self.hello = message
                        self.events.put(message)
                self._cond.notify_all()

    def request(self, kind: str, timeout: float = 30.0, **fields):
        request_id = next(self._ids)
        self._send(ch.encode({"type": kind, "id": request_id, **fields}))
        deadline = time.monotonic() + timeout
        with self._cond:
            while request_id not in self._answers:
                if self._closed:
                    raise Unavailable(what="the guest channel", reason="closed before the answer")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Timeout(what=f"the agent's answer to {kind}", timeout=timeout)
                self._cond.wait(remaining)
            return _answer(self._answers.pop(request_id))

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
        self._demux = _Demux()
        self._ids = itertools.count(int(time.time() * 1000) % 1_000_000 * 1000)
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
                await asyncio.sleep(0.05)
        self._reader_task = asyncio.ensure_future(self._read_loop(reader))
        return await self.sync(sync_timeout)

    async def sync(self, timeout: float = 10.0) -> dict:
        loop = asyncio.get_running_loop()
        nonce = secrets.token_hex(8)
        self._demux.wanted_nonce, self._demux.synced_nonce = nonce, None
        self._synced = loop.create_future()
        sync_id = next(self._ids)
        deadline = time.monotonic() + timeout
        while True:
            self._write(ch.SENTINEL + ch.encode({"type": "sync", "id": sync_id, "nonce": nonce}))
            try:
                return await asyncio.wait_for(asyncio.shield(self._synced),
                                              min(1.0, max(0.01, deadline - time.monotonic())))
            except asyncio.TimeoutError:
                if time.monotonic() > deadline:
                    raise Timeout(what="the guest agent's sync answer", timeout=timeout) from None

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
                for kind, msg_id, message in self._demux.feed(data):
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
        request_id = next(self._ids)
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = waiter
        self._write(ch.encode({"type": kind, "id": request_id, **fields}))
        try:
            message = await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            raise Timeout(what=f"the agent's answer to {kind}", timeout=timeout) from None
        finally:
            self._waiters.pop(request_id, None)
        return _answer(message)

    async def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except (OSError, asyncio.CancelledError):
                pass


def check_protocol(hello: dict) -> None:
    if not isinstance(hello.get("protocol"), int) or hello["protocol"] < 1:
        raise ProtocolError(reason=f"agent hello without a protocol version: {hello!r}")
