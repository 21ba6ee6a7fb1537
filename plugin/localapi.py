"""hostd's local API: how the hook and the CLI talk to the host daemon.

A unix socket (``[hostd] socket``, default /run/accelmig/hostd.sock), with
the line format of accelmig.wire.channel: a request ``{"type", "id", ...}``
is answered by ``{"type": "result", "id", "ok", "result"|"error"}``.

Requests:
  ``ping``                         -> {"host", "pid", "pool": reachable?}
  ``hook``  op, sub, uuid, name     a libvirt hook note; for ``migrate begin``
                                    and ``restore begin`` the answer comes once
                                    hostd has opened the record at the pool
  ``status``                        domains watched, records, identity
  ``intent`` uuid, policy, dest_host  register an operator's migration intent
  ``wait_rehomed`` uuid, migration_id?, timeout
                                    until the destination rehomed the domain

The client is standard library only (the hook imports it and must start fast).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time

from accelmig.wire import channel as ch
from accelmig.wire.errors import AccelmigError, InternalError, Timeout, Unavailable, UnknownOp, from_wire
from accelmig.wire.sockets import OwnedUnixSocket

LOG = logging.getLogger(__name__)
DEFAULT_SOCKET = "/run/accelmig/hostd.sock"


class LocalClient:
    """Blocking client; every call has a deadline (the hook has a time budget)."""

    def __init__(self, path: str = DEFAULT_SOCKET, timeout: float = 3.0):
        self.path = path
        self.timeout = timeout
        self._ids = itertools.count(1)

    def call(self, kind: str, timeout: float | None = None, **fields):
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise Unavailable(what=f"hostd at {self.path}", reason=exc.strerror or str(exc)) from None
        try:
            request_id = next(self._ids)
            sock.sendall(ch.encode({"type": kind, "id": request_id, **fields}))
            parser = ch.LineParser(name="hostd")
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Timeout(what=f"hostd's answer to {kind}", timeout=timeout)
                sock.settimeout(remaining)
                try:
                    data = sock.recv(65536)
                except socket.timeout:
                    raise Timeout(what=f"hostd's answer to {kind}", timeout=timeout) from None
                except OSError as exc:
                    raise Unavailable(what=f"hostd at {self.path}", reason=str(exc)) from None
                if not data:
                    raise Unavailable(what=f"hostd at {self.path}", reason="closed without an answer")
                for message in parser.feed(data):
                    if message.get("type") == "result" and message.get("id") == request_id:
                        if message.get("ok"):
                            return message.get("result")
                        raise from_wire(message.get("error") or {})
        finally:
            sock.close()


class LocalServer:
    """asyncio server: ``handlers[type](message) -> awaitable result``.

    One hostd per socket: ``start()`` raises ``AlreadyRunning`` when another
    one owns the path, before it changes anything."""

    def __init__(self, path: str, handlers: dict):
        self.path = path
        self.handlers = handlers
        self._server = None
        self._owned = OwnedUnixSocket(path, mode=0o600, what="accelmig hostd")

    async def start(self) -> None:
        sock = self._owned.open()
        self._server = await asyncio.start_unix_server(self._client, sock=sock)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2)
            except (asyncio.TimeoutError, Exception):
                pass
        self._owned.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        parser = ch.LineParser(name="localapi")
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                for message in parser.feed(data):
                    asyncio.ensure_future(self._answer(message, writer))
        except (OSError, asyncio.CancelledError):
            pass

    async def _answer(self, message: dict, writer: asyncio.StreamWriter) -> None:
        kind, request_id = message.get("type"), message.get("id")
        try:
            handler = self.handlers.get(kind)
            if handler is None:
                raise UnknownOp(op=kind)
            reply = ch.result(request_id, result=await handler(message))
        except AccelmigError as exc:
            reply = ch.result(request_id, ok=False, error=exc.to_wire())
        except Exception as exc:
            LOG.exception("local API: %s failed", kind)
            reply = ch.result(request_id, ok=False,
                              error=InternalError(reason=f"{type(exc).__name__}: {exc}").to_wire())
        try:
            writer.write(ch.encode(reply))
            await writer.drain()
        except (OSError, ConnectionError):
            pass
