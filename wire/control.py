"""The control plane: hypervisor hosts (and operators) talking to the pool.

Same framing as the data plane.  A connection opens with::

    host -> {"op": "hello", "versions": [1], "host": "hostA"}
    pool -> {"op": "welcome", "version": 1, "challenge": "<hex>", "instance": "<id>"}

then carries requests and results::

    host -> {"op": "call", "id": 7, "method": "open_migration", "args": {...}, "mac": "<hex>"}
    pool -> {"op": "result", "id": 7, "ok": true, "result": {...}, "mac": "<hex>"}

``mac`` is HMAC-SHA256 with the host's secret over the challenge, the id and
the canonical JSON of (method, args) — or of the result — so every request
and every answer is authenticated and bound to this connection; ids must
grow, so nothing can be replayed.  There is no unauthenticated default: a
host the pool has no secret for is refused.  (The pool's local admin socket
speaks the same protocol with ``"host": "admin"`` and no MAC: filesystem
permissions guard it.)

Standard library only; the blocking ``ControlClient`` is used by the pool
CLI and by tests, the asyncio one by hostd.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import socket
import threading

from accelmig.wire.errors import AuthFailed, ProtocolError, Unavailable, from_wire
from accelmig.wire.frames import (DEFAULT_LIMITS, PREFIX_SIZE, FrameReader, decode_header,
                                  encode_frame, parse_prefix)

CONTROL_VERSIONS = (1,)
ADMIN_HOST = "admin"

#: Every method of the control plane, and who may call it.
METHODS = {
    # host identity and attestation
    "register_host": "host",      # args: addresses [cidr], identity {...}
    "bind_session": "host",       # args: sid, domain_uuid, domain_name?
    "unbind_session": "host",     # args: sid
    # migrations
    "register_intent": "host",    # args: domain_uuid, policy, dest_host?, migration_id?
    "open_migration": "host",     # args: domain_uuid, migration_id?, domain_name?, policy?
    "switchover": "host",         # args: domain_uuid, migration_id?
    "commit": "host",             # args: domain_uuid, migration_id
    "complete": "host",           # args: domain_uuid, migration_id -> tickets
    "close": "host",              # args: domain_uuid, migration_id?
    "abort": "host",              # args: domain_uuid, migration_id?, reason
    "renew": "host",              # args: records [[domain_uuid, migration_id]]
    "report_resume": "host",      # args: domain_uuid, migration_id, results {sid: {...}}
    # saved domains
    "park": "host",               # args: domain_uuid, retention?
    "unpark": "host",             # args: domain_uuid
    # reading
    "list_sessions": "any",       # args: domain_uuid?
    "list_records": "any",        # args: open_only?, domain_uuid?
    "list_hosts": "any",
    "metrics": "any",             # -> {"text": prometheus exposition}
    "ping": "any",
}


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def request_mac(secret: bytes, challenge: str, call_id: int, method: str, args: dict) -> str:
    msg = challenge.encode() + b"|" + str(call_id).encode() + b"|" + canonical([method, args])
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def result_mac(secret: bytes, challenge: str, call_id: int, body: dict) -> str:
    msg = challenge.encode() + b"|r" + str(call_id).encode() + b"|" + canonical(body)
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def result_body(header: dict) -> dict:
    return {k: header[k] for k in ("ok", "result", "error") if k in header}


async def read_frame_async(reader: asyncio.StreamReader, limits=DEFAULT_LIMITS):
    """One frame from a StreamReader (control messages are small)."""
    prefix = await reader.readexactly(PREFIX_SIZE)
    _flags, hlen, plen = parse_prefix(prefix, limits)
    header = decode_header(await reader.readexactly(hlen))
    payload = await reader.readexactly(plen) if plen else b""
    return header, payload


def check_answer(secret: bytes | None, challenge: str, answer: dict, call_id: int):
    """The result of a call, or the error it carries (AuthFailed and
    ProtocolError mean the connection can no longer be trusted)."""
    if answer.get("op") == "error":
        raise from_wire(answer.get("error", {}))
    if answer.get("op") != "result" or answer.get("id") != call_id:
        raise ProtocolError(reason=f"unexpected answer {answer.get('op')!r} id {answer.get('id')}")
    if secret is not None:
        expected = result_mac(secret, challenge, call_id, result_body(answer))
        if not hmac.compare_digest(expected, str(answer.get("mac", ""))):
            raise AuthFailed(reason="the pool's answer does not verify (wrong secret?)")
    if not answer.get("ok"):
        raise from_wire(answer.get("error", {}))
    return answer.get("result")


class ControlClient:
    """Blocking control-plane client, thread-safe (one call at a time).

    ``endpoint`` is ``HOST:PORT`` or ``unix:/path`` (the admin socket).
    """

    def __init__(self, endpoint: str, host: str, secret: bytes | None, timeout: float = 10.0):
        self.endpoint = endpoint
        self.host = host
        self.secret = secret
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._reader: FrameReader | None = None
        self._challenge = ""
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.instance: str | None = None

    def _connect(self) -> None:
        from accelmig.wire.dataplane import parse_endpoint
        try:
            if self.endpoint.startswith("unix:"):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout)
                sock.connect(self.endpoint[5:])
            else:
                sock = socket.create_connection(parse_endpoint(self.endpoint), timeout=self.timeout)
        except OSError as exc:
            raise Unavailable(what=f"the pool's control plane at {self.endpoint}", reason=str(exc)) from None
        self._sock = sock
        self._reader = FrameReader()
        sock.sendall(encode_frame({"op": "hello", "versions": list(CONTROL_VERSIONS), "host": self.host}))
        welcome = self._recv()
        if welcome.get("op") == "error":
            self.close()
            raise from_wire(welcome.get("error", {}))
        if welcome.get("op") != "welcome":
            self.close()
            raise ProtocolError(reason=f"expected welcome, got {welcome.get('op')!r}")
        self._challenge = welcome.get("challenge", "")
        self.instance = welcome.get("instance")

    def _recv(self) -> dict:
        while True:
            buf = self._reader.get_buffer()
            try:
                n = self._sock.recv_into(buf)
            except OSError as exc:
                raise Unavailable(what="the pool's control plane", reason=str(exc)) from None
            if n == 0:
                raise Unavailable(what="the pool's control plane", reason="connection closed")
            frames = self._reader.feed(n)
            if frames:
                # one request in flight at a time: one answer
                return frames[0].header

    def call(self, method: str, **args):
        with self._lock:
            for attempt in (1, 2):
                if self._sock is None:
                    self._connect()
                call_id = next(self._ids)
                header = {"op": "call", "id": call_id, "method": method, "args": args}
                if self.secret is not None:
                    header["mac"] = request_mac(self.secret, self._challenge, call_id, method, args)
                try:
                    self._sock.sendall(encode_frame(header))
                    answer = self._recv()
                except (Unavailable, OSError):
                    self.close()
                    if attempt == 2:
                        raise
                    continue  # the pool restarted or the connection idled out: once more
                try:
                    return check_answer(self.secret, self._challenge, answer, call_id)
                except (ProtocolError, AuthFailed):
                    self.close()
                    raise

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncControlClient:
    """The same client on asyncio (hostd)."""

    def __init__(self, endpoint: str, host: str, secret: bytes | None, timeout: float = 10.0):
        self.endpoint = endpoint
        self.host = host
        self.secret = secret
        self.timeout = timeout
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._challenge = ""
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self.instance: str | None = None

    async def _connect(self) -> None:
        from accelmig.wire.dataplane import parse_endpoint
        try:
            if self.endpoint.startswith("unix:"):
                conn = asyncio.open_unix_connection(self.endpoint[5:])
            else:
                host, port = parse_endpoint(self.endpoint)
                conn = asyncio.open_connection(host, port)
            self._reader, self._writer = await asyncio.wait_for(conn, self.timeout)
            self._writer.write(encode_frame({"op": "hello", "versions": list(CONTROL_VERSIONS),
                                             "host": self.host}))
            welcome, _ = await asyncio.wait_for(read_frame_async(self._reader), self.timeout)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
            await self.close()
            raise Unavailable(what=f"the pool's control plane at {self.endpoint}",
                              reason=str(exc) or type(exc).__name__) from None
        if welcome.get("op") != "welcome":
            await self.close()
            raise from_wire(welcome.get("error", {})) if welcome.get("op") == "error" else \
                ProtocolError(reason=f"expected welcome, got {welcome.get('op')!r}")
        self._challenge = welcome.get("challenge", "")
        self.instance = welcome.get("instance")

    async def call(self, method: str, **args):
        async with self._lock:
            for attempt in (1, 2):
                if self._writer is None:
                    await self._connect()
                call_id = next(self._ids)
                header = {"op": "call", "id": call_id, "method": method, "args": args}
                if self.secret is not None:
                    header["mac"] = request_mac(self.secret, self._challenge, call_id, method, args)
                try:
                    self._writer.write(encode_frame(header))
                    answer, _ = await asyncio.wait_for(read_frame_async(self._reader), self.timeout)
                except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
                    await self.close()
                    if attempt == 2:
                        raise Unavailable(what="the pool's control plane",
                                          reason=str(exc) or type(exc).__name__) from None
                    continue
                try:
                    return check_answer(self.secret, self._challenge, answer, call_id)
                except (ProtocolError, AuthFailed):
                    await self.close()
                    raise

    async def close(self) -> None:
        writer, self._writer, self._reader = self._writer, None, None
        if writer is not None:
            writer.close()
            try:
                await writer.wait_closed()
            except (OSError, asyncio.CancelledError):
                pass
