"""The client of hostd's local API: what the hook and the CLI use.

A unix socket (``[hostd] socket``, default /run/accelmig/hostd.sock), with
the line format of accelmig.wire.channel: a request ``{"type", "id", ...}``
is answered by ``{"type": "result", "id", "ok", "result"|"error"}``.

Requests (``accelmig.plugin.hostd.api`` answers them):
  ``ping``                          -> {"host", "pid", "pool": reachable?, "libvirt": connected?}
  ``hook``  op, sub, uuid, name, budget
                                    a gated libvirt hook step (``migrate begin``,
                                    ``restore begin``); answered once hostd has
                                    opened the record at the pool (or pinged it)
  ``status``                        domains watched, records, identity
  ``intent`` uuid, policy, dest_host  register an operator's migration intent
  ``wait_rehomed`` uuid, migration_id?, wait
                                    until the pool has every session of that
                                    migration resumed (or the record ended)
  ``sessions`` uuid                 the pool's sessions of a domain
  ``metrics``                       Prometheus text

Standard library and accelmig.wire only: the hook imports it and must start fast.
"""

from __future__ import annotations

import itertools
import socket
import time

from accelmig.wire import channel as ch
from accelmig.wire.errors import Timeout, Unavailable, from_wire

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
