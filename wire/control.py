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

Standard library only.  ``ControlSession`` is the protocol, written once;
``ControlClient`` (blocking: the CLIs, the lab, tests) and
``AsyncControlClient`` (asyncio, pipelined: hostd) only carry its bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import socket
import ssl
import threading

from accelmig.wire import tls
from accelmig.wire.errors import AuthFailed, FrameError, ProtocolError, Unavailable, from_wire
from accelmig.wire.frames import (PREFIX_SIZE, Limits, decode_header, encode_frame,
                                  parse_prefix)

CONTROL_VERSIONS = (1,)
ADMIN_HOST = "admin"

#: Every method of the control plane, and who may call it.
METHODS = {
    # host identity and attestation (the proofs and tokens: ``wire.attestation``)
    "register_host": "host",      # args: addresses [cidr], identity {...}
    "bind_challenge": "host",     # args: domain_uuid? -> challenge, instance, ttl, unattested?
    "bind_sessions": "host",      # args: domain_uuid, sessions {sid: proof|null}, challenge?, domain_name?
                                  #   -> bound [sid], prove [sid], refused {sid: error}
    "unbind_session": "host",     # args: sid, domain_uuid
    "register_token": "host",     # args: domain_uuid, digest -> registered, state (fresh, in_use, spent)
    # migrations
    "register_intent": "host",    # args: domain_uuid, policy, dest_host?, migration_id?
    "open_migration": "host",     # args: domain_uuid, migration_id?, domain_name?, policy?, token?
    "switchover": "host",         # args: domain_uuid, migration_id?
    "commit": "host",             # args: domain_uuid, migration_id
    "complete": "host",           # args: domain_uuid, migration_id, cursor?, limit? -> record, tickets (a page), next, now
    "note_timeline": "host",      # args: domain_uuid, migration_id, steps {step: stamp} -> taken [step]
    "close": "host",              # args: domain_uuid, migration_id?
    "abort": "host",              # args: domain_uuid, migration_id?, reason
    "renew": "host",              # args: records [[domain_uuid, migration_id]]
    # saved domains
    "park": "host",               # args: domain_uuid, retention?
    "unpark": "host",             # args: domain_uuid
    # reading
    # (a host reads only its own: the sessions bound or moving to it, the records it takes part in)
    "list_sessions": "any",       # args: domain_uuid?, cursor?, limit? -> sessions (a page), next, elsewhere?
    "list_records": "any",        # args: open_only?, domain_uuid?, cursor?, limit? -> records (a page), next
    "record_sessions": "any",     # args: domain_uuid, migration_id, cursor?, limit? -> sessions (a page), next
    "list_hosts": "any",
    "list_devices": "any",        # -> instance, devices [{id, type, name, vendor, memory, in use}]
    "accel_domains": "host",      # args: since?, cursor?, limit? -> version, domains {uuid: unattested} (a page), next
    "wait_record": "any",         # args: domain_uuid, migration_id?, until, timeout -> record, reached
    "metrics": "any",             # -> {"text": prometheus exposition}
    "ping": "any",
    # a pool of several nodes (etcd): the live nodes, for hostd to reach each one
    "list_nodes": "any",          # -> cluster (bool), node (this one's name), nodes [{name, instance, control}]
}


#: The control plane carries no payloads.  What the pool reads from a peer
#: that has not authenticated is a tiny hello; a call (a renewal of many
#: records) is bounded; an answer is bounded too.  What grows with the
#: number of sessions is paged (``PAGED``: within PAGED_ANSWER_MAX); the
#: larger ANSWER_LIMITS is for what does not (every host's networks, the
#: metrics) and for pools from before pages, which answered whole lists.
HELLO_LIMITS = Limits(max_header=4096, max_payload=0)
CALL_LIMITS = Limits(max_header=1 << 20, max_payload=0)
ANSWER_LIMITS = Limits(max_header=32 << 20, max_payload=0)

#: What grows with the number of sessions comes in pages: these methods
#: answer one page of their list (the key named here) and ``next``, an
#: opaque cursor (None after the last page) that the same host passes back
#: as ``cursor`` for the next page.  The pool fills a page up to PAGE_BYTES
#: of items (and at most ``limit`` items, 1 to MAX_PAGE_ITEMS, when the
#: caller asks for fewer), so a whole answer stays within PAGED_ANSWER_MAX
#: however many sessions a domain holds; a cursor names its listing (the
#: method, its record or filter) and its caller, and the pool refuses it for
#: any other (``BAD_REQUEST``).  Why pages, not a larger frame: a domain may
#: hold a thousand sessions and the pool many thousands; an answer that
#: grows with them would grow past any frame limit chosen today (a tenth of
#: a megabyte of tickets at 256 sessions), and every answer and call stays
#: small enough to be read at once.  ``call_all`` follows the pages.
PAGED = {"complete": "tickets", "list_sessions": "sessions", "list_records": "records",
         "record_sessions": "sessions", "accel_domains": "domains"}
PAGE_BYTES = 32 << 10
PAGED_ANSWER_MAX = 64 << 10
MAX_PAGE_ITEMS = 1000
#: pages a client follows before it gives up on a listing (a pool that
#: never ends one): with PAGE_BYTES, far more than any pool holds
MAX_PAGES = 4096

#: Methods the pool answers when what they wait for happens (other calls on
#: the same connection go on meanwhile).
WAITING_METHODS = frozenset({"wait_record"})


def merge_page(method: str, answer: dict, following) -> dict:
    """``answer`` with the items of the page after it added, and that page's
    ``next``; a list continues a list, an object's keys are added (a domain
    whose sessions span two pages of ``accel_domains`` gets both parts)."""
    key = PAGED.get(method)
    if key is None or not isinstance(following, dict):
        raise ProtocolError(reason=f"{method}: a page that is not an object")
    have, more = answer.get(key), following.get(key)
    if isinstance(have, list) and isinstance(more, list):
        merged = have + more
    elif isinstance(have, dict) and isinstance(more, dict):
        merged = dict(have)
        for name, value in more.items():
            old = merged.get(name)
            merged[name] = old + value if isinstance(old, list) and isinstance(value, list) else value
    else:
        raise ProtocolError(reason=f"{method}: a page's {key!r} does not continue the previous one's")
    return dict(answer, **{key: merged, "next": following.get("next")})


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


async def read_frame_async(reader: asyncio.StreamReader, limits: Limits = ANSWER_LIMITS) -> dict:
    """One control frame from a StreamReader; the prefix is checked against
    ``limits`` before a byte of the header is buffered."""
    prefix = await reader.readexactly(PREFIX_SIZE)
    _check_not_tls(prefix)
    _flags, hlen, _plen = parse_prefix(prefix, limits)
    return decode_header(await reader.readexactly(hlen))


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame_blocking(sock: socket.socket, limits: Limits = ANSWER_LIMITS) -> dict:
    """One control frame from a blocking socket, read to its exact size (an
    answer of many MiB costs its own size, not a staging buffer per client)."""
    prefix = _recv_exactly(sock, PREFIX_SIZE)
    _check_not_tls(prefix)
    _flags, hlen, _plen = parse_prefix(prefix, limits)
    return decode_header(_recv_exactly(sock, hlen))


def _check_not_tls(prefix: bytes) -> None:
    # a plain client's first read of a TLS pool: say so, not "bad magic"
    if tls.looks_like_tls(prefix):
        raise ProtocolError(reason="the pool's control plane speaks TLS and this client plain TCP: "
                                   "configure TLS ([pool] ca_file, cert_file, key_file) or the pool "
                                   "--insecure too")


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


class ControlSession:
    """The host's half of the control protocol, without any I/O.

    It makes the bytes to send (``hello``, ``call``) and judges the frames
    that come back (``welcome``, ``answer``): challenge, ids, MACs, errors.
    The two clients below only move those bytes, one on a blocking socket
    and one on asyncio — so the protocol is written once (as h11 does for
    HTTP).  A session is one connection's worth: make a new one to reconnect.
    """

    def __init__(self, host: str, secret: bytes | None):
        self.host = host
        self.secret = secret
        self.challenge: str | None = None
        self.instance: str | None = None
        self._ids = itertools.count(1)

    def hello(self) -> bytes:
        return encode_frame({"op": "hello", "versions": list(CONTROL_VERSIONS), "host": self.host})

    def welcome(self, header: dict) -> None:
        """Accept the pool's first frame, or raise what it says."""
        if header.get("op") == "error":
            raise from_wire(header.get("error", {}))
        if header.get("op") != "welcome":
            raise ProtocolError(reason=f"expected welcome, got {header.get('op')!r}")
        self.challenge = str(header.get("challenge", ""))
        self.instance = header.get("instance")

    def call(self, method: str, args: dict) -> tuple[int, bytes]:
        """(call id, frame) of a request; ids grow with every call."""
        if self.challenge is None:
            raise ProtocolError(reason="call before the pool's welcome")
        call_id = next(self._ids)
        header = {"op": "call", "id": call_id, "method": method, "args": args}
        if self.secret is not None:
            header["mac"] = request_mac(self.secret, self.challenge, call_id, method, args)
        return call_id, encode_frame(header)

    def answer_id(self, header: dict) -> int | None:
        """The call a frame answers (None: a connection-level error frame)."""
        call_id = header.get("id")
        return call_id if header.get("op") == "result" and isinstance(call_id, int) else None

    def answer(self, header: dict, call_id: int):
        """The result of call ``call_id``, or the error it carries.  ``AuthFailed``
        and ``ProtocolError`` mean the connection can no longer be trusted."""
        return check_answer(self.secret, self.challenge or "", header, call_id)


#: Errors after which a connection is dropped (the next call makes a new one).
BROKEN = (ProtocolError, AuthFailed, FrameError)


def _closed_before_welcome(exc: Unavailable, tls_on: bool) -> Unavailable:
    """A pool closes a connection it will not talk to before its welcome
    (a refused certificate, TLS against plain): say what that likely means."""
    reason = str(exc.kwargs.get("reason", ""))
    if "connection closed" not in reason:
        return exc
    hint = ("the pool refused this host's TLS (no client certificate, or one its --tls-client-ca "
            "did not sign: [pool] cert_file, key_file)" if tls_on else
            "a pool that serves TLS closes plain connections: configure [pool] ca_file, "
            "cert_file, key_file (or run both ends insecure)")
    return Unavailable(what="the pool's control plane", reason=f"{reason} before its welcome: {hint}")


class ControlClient:
    """Blocking control-plane client, thread-safe (one call at a time).

    ``endpoint`` is ``HOST:PORT`` or ``unix:/path`` (the admin socket).  A
    connection that breaks, times out, or answers with a frame it cannot
    trust is closed; the next call connects again (once more within a call
    when the pool restarted or the connection idled out).  ``tls``: an
    ``ssl.SSLContext`` (``wire.tls.client_context``: the pool verified, this
    host's certificate presented); None: plain TCP (the admin socket; a pool
    that runs ``--insecure``).
    """

    def __init__(self, endpoint: str, host: str, secret: bytes | None, timeout: float = 10.0,
                 tls: ssl.SSLContext | None = None):
        self.endpoint = endpoint
        self.host = host
        self.secret = secret
        self.timeout = timeout
        self.tls = tls
        self._sock: socket.socket | None = None
        self._session: ControlSession | None = None
        self._lock = threading.Lock()

    @property
    def instance(self) -> str | None:
        return self._session.instance if self._session else None

    def _connect(self) -> None:
        from accelmig.wire.dataplane import parse_endpoint
        try:
            if self.endpoint.startswith("unix:"):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout)
                sock.connect(self.endpoint[5:])
            else:
                host, port = parse_endpoint(self.endpoint)
                sock = socket.create_connection((host, port), timeout=self.timeout)
                if self.tls is not None:
                    try:
                        sock = self.tls.wrap_socket(sock, server_hostname=host)
                    except BaseException:
                        sock.close()
                        raise
        except ssl.SSLError as exc:
            raise Unavailable(what=f"the pool's control plane at {self.endpoint}",
                              reason=tls.describe_ssl_error(exc, self.endpoint)) from None
        except OSError as exc:
            raise Unavailable(what=f"the pool's control plane at {self.endpoint}", reason=str(exc)) from None
        self._sock = sock
        self._session = ControlSession(self.host, self.secret)
        try:
            self._send(self._session.hello())
            self._session.welcome(self._recv())
        except Unavailable as exc:
            self.close()
            raise _closed_before_welcome(exc, self.tls is not None) from None
        except BaseException:
            self.close()
            raise

    def _send(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise Unavailable(what="the pool's control plane", reason=str(exc)) from None

    def _recv(self) -> dict:
        try:
            return read_frame_blocking(self._sock)
        except ssl.SSLError as exc:     # mutual TLS: a refused certificate shows here (TLS 1.3)
            raise Unavailable(what="the pool's control plane",
                              reason=tls.describe_ssl_error(exc, self.endpoint)) from None
        except OSError as exc:          # ConnectionError and timeouts included
            raise Unavailable(what="the pool's control plane", reason=str(exc) or
                              type(exc).__name__) from None

    def call(self, method: str, **args):
        with self._lock:
            for attempt in (1, 2):
                if self._sock is None:
                    self._connect()
                call_id, frame = self._session.call(method, args)
                try:
                    self._send(frame)
                    while True:
                        answer = self._recv()
                        if self._session.answer_id(answer) in (call_id, None):
                            break       # an older id: the late answer of a call that timed out
                except Unavailable:
                    self.close()
                    if attempt == 2:
                        raise
                    continue  # the pool restarted or the connection idled out: once more
                except BROKEN:
                    self.close()
                    raise
                try:
                    return self._session.answer(answer, call_id)
                except BROKEN:
                    self.close()
                    raise

    def call_all(self, method: str, **args):
        """A paged method's answer with every page's items (``PAGED``) in it."""
        answer = self.call(method, **args)
        for _ in range(MAX_PAGES):
            if not isinstance(answer, dict) or not answer.get("next"):
                return answer
            following = self.call(method, **dict(args, cursor=answer["next"]))
            answer = merge_page(method, answer, following)
        raise ProtocolError(reason=f"{method}: more than {MAX_PAGES} pages")

    def close(self) -> None:
        sock, self._sock, self._session = self._sock, None, None
        if sock is not None:
            sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncControlClient:
    """The control-plane client on asyncio (hostd).

    Calls are pipelined on one connection: each is matched to its answer by
    id, so a slow caller never holds up another (the hook's budgeted call
    does not queue behind lease renewals and status polls), and a call that
    is cancelled or times out leaves nothing behind — its late answer is
    dropped by id.  A connection that breaks, or answers with a frame that
    cannot be trusted, fails every call waiting on it and is closed; the next
    call connects again.
    ``tls``: as ``ControlClient``'s.
    """

    def __init__(self, endpoint: str, host: str, secret: bytes | None, timeout: float = 10.0,
                 tls: ssl.SSLContext | None = None):
        self.endpoint = endpoint
        self.host = host
        self.secret = secret
        self.timeout = timeout
        self.tls = tls
        self._writer: asyncio.StreamWriter | None = None
        self._session: ControlSession | None = None
        self._reader_task: asyncio.Task | None = None
        self._waiters: dict[int, asyncio.Future] = {}
        self._connecting: asyncio.Future | None = None

    @property
    def instance(self) -> str | None:
        return self._session.instance if self._session else None

    async def _connection(self) -> ControlSession:
        if self._writer is not None and not self._writer.is_closing():
            return self._session
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._connect())
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> ControlSession:
        from accelmig.wire.dataplane import parse_endpoint
        session = ControlSession(self.host, self.secret)
        writer = None
        try:
            if self.endpoint.startswith("unix:"):
                conn = asyncio.open_unix_connection(self.endpoint[5:])
            else:
                host, port = parse_endpoint(self.endpoint)
                conn = asyncio.open_connection(host, port, ssl=self.tls,
                                               server_hostname=host if self.tls else None)
            reader, writer = await asyncio.wait_for(conn, self.timeout)
            writer.write(session.hello())
            try:
                welcome = await asyncio.wait_for(read_frame_async(reader), self.timeout)
            except asyncio.IncompleteReadError:
                raise _closed_before_welcome(Unavailable(what="the pool's control plane",
                                                         reason="connection closed"),
                                             self.tls is not None) from None
            session.welcome(welcome)
        except Unavailable:
            if writer is not None:
                writer.close()
            raise
        except ssl.SSLError as exc:
            if writer is not None:
                writer.close()
            raise Unavailable(what=f"the pool's control plane at {self.endpoint}",
                              reason=tls.describe_ssl_error(exc, self.endpoint)) from None
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
            if writer is not None:
                writer.close()
            raise Unavailable(what=f"the pool's control plane at {self.endpoint}",
                              reason=str(exc) or type(exc).__name__) from None
        except BaseException:
            if writer is not None:
                writer.close()
            raise
        self._writer, self._session = writer, session
        self._reader_task = asyncio.ensure_future(self._read_answers(reader, writer, session))
        return session

    async def _read_answers(self, reader, writer, session: ControlSession) -> None:
        error: Exception = Unavailable(what="the pool's control plane", reason="connection closed")
        try:
            while True:
                header = await read_frame_async(reader)
                call_id = session.answer_id(header)
                if call_id is None:             # the pool closes the connection with an error
                    error = from_wire(header.get("error", {})) if header.get("op") == "error" else \
                        ProtocolError(reason=f"unexpected {header.get('op')!r} frame")
                    return
                waiter = self._waiters.pop(call_id, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(header)
                # else: the answer of a call nobody waits for any more (cancelled, timed out)
        except (asyncio.IncompleteReadError, OSError) as exc:
            error = Unavailable(what="the pool's control plane", reason=str(exc) or "connection closed")
        except FrameError as exc:
            error = exc
        except asyncio.CancelledError:
            error = Unavailable(what="the pool's control plane", reason="client closed")
            raise
        finally:
            self._drop(writer, error)

    def _drop(self, writer, error: Exception) -> None:
        """Close ``writer``'s connection and fail every call still waiting on it."""
        if self._writer is writer:
            self._writer, self._session = None, None
        writer.close()
        waiters, self._waiters = self._waiters, {}
        for waiter in waiters.values():
            if not waiter.done():
                waiter.set_exception(error)

    async def call(self, method: str, **args):
        return await self._call(method, args, self.timeout)

    async def call_all(self, method: str, **args):
        """A paged method's answer with every page's items (``PAGED``) in it
        (each page a call of its own: other calls go on between them)."""
        answer = await self.call(method, **args)
        for _ in range(MAX_PAGES):
            if not isinstance(answer, dict) or not answer.get("next"):
                return answer
            following = await self.call(method, **dict(args, cursor=answer["next"]))
            answer = merge_page(method, answer, following)
        raise ProtocolError(reason=f"{method}: more than {MAX_PAGES} pages")

    def rekey(self, secret: bytes) -> None:
        """Use a new secret (hostd's SIGHUP).  The open connection signs with
        the old one, so it is closed now: calls waiting on it go once more on
        a new connection, as after a pool restart."""
        self.secret = secret
        writer = self._writer
        if writer is not None:
            self._drop(writer, Unavailable(what="the pool's control plane",
                                           reason="new secret: reconnecting"))

    async def call_within(self, timeout: float, method: str, /, **args):
        """A call that may take longer than the client's timeout (``wait_record``).
        Positional-only: the call's own arguments may be named ``timeout``."""
        return await self._call(method, args, timeout)

    async def _call(self, method: str, args: dict, timeout: float):
        for attempt in (1, 2):
            session = await self._connection()
            writer = self._writer
            call_id, frame = session.call(method, args)
            waiter = asyncio.get_running_loop().create_future()
            self._waiters[call_id] = waiter
            try:
                writer.write(frame)
                answer = await asyncio.wait_for(waiter, timeout)
            except asyncio.TimeoutError:
                raise Unavailable(what="the pool's control plane",
                                  reason=f"no answer to {method} within {timeout:.1f} s") from None
            except Unavailable:
                if attempt == 2:
                    raise
                continue          # the pool restarted or the connection idled out: once more
            finally:
                self._waiters.pop(call_id, None)
            try:
                return session.answer(answer, call_id)
            except BROKEN:
                if self._writer is writer:
                    self._drop(writer, Unavailable(what="the pool's control plane",
                                                   reason="an answer did not verify"))
                raise

    async def close(self) -> None:
        task, self._reader_task = self._reader_task, None
        writer = self._writer
        if writer is not None:
            self._drop(writer, Unavailable(what="the pool's control plane", reason="client closed"))
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if writer is not None:
            try:
                await writer.wait_closed()
            except (OSError, asyncio.CancelledError):
                pass
