"""One control-plane connection: a host's (or the admin socket's).

What the transport asks before and around each call, so that
``pool.control.ControlServer`` holds only the methods: the hello within the
deadline its admission set (``pool.admission``), a host's name checked
against its client certificate (issue 28: the CA's word, the secret a second
factor), each call's MAC and strictly increasing id, the idle cut, how many
waits one connection may hold, and the answers, signed, written now or when
a waiting or clustered call is over.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time

from accelmig.pool.ledger.cluster import CLUSTERED
from accelmig.wire import control as wc
from accelmig.wire import tls
from accelmig.wire.errors import AccelmigError, AuthFailed, BadRequest, FrameError, ProtocolError, VersionUnsupported
from accelmig.wire.frames import encode_frame
from accelmig.wire.values import is_int

LOG = logging.getLogger("accelmig.pool.control")

#: ``wait_record`` calls one connection may have pending at once (hostd
#: waits once per ``accelmig migrate`` under way on its host).
MAX_WAITS = 1024


def _answered_below() -> None:
    """A host's connection whose deadline passed: ``serve``'s wait for its
    hello ends at the same moment and says so to the host."""


class ControlConnection:
    """Serves one connection for ``server`` (a ``ControlServer``)."""

    def __init__(self, server):
        self.server = server
        self.pool = server.pool

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    admin: bool, admitted=None) -> None:
        """Serve one connection until it ends: hello (and, for a host, its
        certificate's names), then calls, each MAC-checked and answered in
        turn, or later where it waits or goes to etcd first."""
        peer = writer.get_extra_info("peername") or "admin-socket"
        challenge = secrets.token_hex(16)
        host = None
        last_id = 0
        waits: set[asyncio.Task] = set()
        # A host's connection was counted from accept (pool.admission) and
        # stays counted as a stranger until its hello is accepted, within
        # what is left of the deadline its TLS handshake started (the hello's
        # wait below answers it: "no hello within").
        if admitted is not None:
            admitted.on_deadline = _answered_below
        try:
            try:
                header = await asyncio.wait_for(
                    wc.read_frame_async(reader, wc.HELLO_LIMITS),
                    admitted.remaining() if admitted is not None else self.pool.config.handshake_timeout)
            except asyncio.TimeoutError:
                raise ProtocolError(reason=f"no hello within "
                                           f"{self.pool.config.handshake_timeout:g} s") from None
            if header.get("op") != "hello":
                raise ProtocolError(reason="expected hello")
            offered = header.get("versions") or []
            if not isinstance(offered, list) or not all(is_int(v) for v in offered):
                raise BadRequest(reason="hello: versions must be a list of integers")
            if not set(offered) & set(wc.CONTROL_VERSIONS):
                raise VersionUnsupported(offered=offered, supported=list(wc.CONTROL_VERSIONS))
            name = header.get("host")
            if admin:
                host = None
            else:
                host = self.pool.hosts.get(name) if isinstance(name, str) else None
                if host is None:
                    raise AuthFailed(reason=f"no secret for host {name!r} (add it to the pool's hosts file)")
                self._check_certificate_names(writer, name, peer)
            writer.write(encode_frame({"op": "welcome", "version": 1, "challenge": challenge,
                                       "instance": self.pool.instance}))
            if admitted is not None:
                admitted.authenticated()
            while True:
                try:
                    header = await self._next_call(reader, waits, idle=admitted is not None)
                except asyncio.IncompleteReadError:
                    return
                if header is None:
                    # closed without an error frame: a client finds the connection
                    # gone at its next call and makes a new one
                    LOG.info("control plane: closing %s: nothing received for %g s (idle_timeout)", peer,
                             self.pool.config.idle_timeout)
                    return
                call_id = header.get("id")
                method = header.get("method")
                if not isinstance(method, str):      # a list is no method (and no dict key)
                    method = repr(method)[:100]
                args = header.get("args") if isinstance(header.get("args"), dict) else {}
                if header.get("op") != "call" or not isinstance(call_id, int) or call_id <= last_id:
                    raise ProtocolError(reason="calls need op 'call' and strictly increasing ids")
                last_id = call_id
                if host is not None:
                    if self.pool.hosts.get(host.name) is not host:      # a reload (SIGHUP) removed it
                        raise AuthFailed(reason=f"host {host.name} is no longer in the pool's hosts file")
                    expected = wc.request_mac(host.secret, challenge, call_id, str(header.get("method")), args)
                    if not hmac.compare_digest(expected, str(header.get("mac", ""))):
                        raise AuthFailed(reason=f"request MAC from host {host.name} does not verify")
                    host.last_seen = time.time()
                if method in CLUSTERED and self.server.ledger.follower is not None:
                    # etcd is written first, off the loop: other calls go on meanwhile
                    step = asyncio.ensure_future(self._answer_later(
                        writer, host, challenge, call_id,
                        self.server.call_clustered(host, admin, method, args)))
                    waits.add(step)
                    step.add_done_callback(waits.discard)
                    continue
                if method in wc.WAITING_METHODS:
                    if len(waits) >= MAX_WAITS:
                        error = BadRequest(reason=f"{method}: {len(waits)} waits already pending on this "
                                                  f"connection, the most one may hold")
                        self._answer(writer, host, challenge, call_id, {"ok": False, "error": error.to_wire()})
                        await writer.drain()
                        continue
                    # A long wait must not hold up this connection's other calls:
                    # answered when it is over (clients match answers by id).
                    wait = asyncio.ensure_future(self._answer_later(
                        writer, host, challenge, call_id, self.server.call_waiting(host, admin, method, args)))
                    waits.add(wait)
                    wait.add_done_callback(waits.discard)
                    continue
                self._answer(writer, host, challenge, call_id, self.server.call(host, admin, method, args))
                await writer.drain()
        except (AccelmigError, FrameError) as exc:
            LOG.warning("control plane: closing %s: %s", peer, exc)
            try:
                writer.write(encode_frame({"op": "error", "error": exc.to_wire()}))
            except Exception:
                pass
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            for wait in waits:
                wait.cancel()
            if admitted is not None:
                admitted.closed()
                admitted.close_soon(writer.transport)   # (a peer that never reads keeps no descriptor)
            else:
                writer.close()

    async def _next_call(self, reader, waits: set, idle: bool) -> dict | None:
        """The connection's next call; None for a host's connection
        (``idle``) that sent nothing for ``idle_timeout`` while none of its
        waits was pending: it is closed (hostd calls every few seconds)."""
        if not idle:
            return await wc.read_frame_async(reader, wc.CALL_LIMITS)
        timeout = self.pool.config.idle_timeout
        frame = asyncio.ensure_future(wc.read_frame_async(reader, wc.CALL_LIMITS))
        try:
            while True:
                done, _ = await asyncio.wait({frame}, timeout=timeout)
                if done:
                    return frame.result()
                if not waits:
                    self.pool.metrics.idle_connections.inc()
                    return None
        finally:
            if not frame.done():
                frame.cancel()
            elif not frame.cancelled():
                frame.exception()        # (read: a serve cancelled meanwhile leaves no unread failure)

    def _check_certificate_names(self, writer, name: str, peer) -> None:
        """A host acts only as the name its client certificate gives (the
        CA's word), its secret a second factor: a stolen secret alone, or
        one host's certificate with another's secret, names nobody.  Plain
        TCP (``insecure``, said at start) has no certificate to ask."""
        if writer.get_extra_info("ssl_object") is None:
            LOG.info("host %s connected from %s: INSECURE plain TCP, its secret alone names it",
                     name, peer, extra={"host": name, "tls": False})
            return
        names = tls.certificate_names(writer.get_extra_info("peercert"))
        if name not in names:
            raise AuthFailed(reason=f"host {name!r}: the client certificate names "
                                    f"{', '.join(repr(n) for n in names[:4]) or 'no host'}, not this host")
        LOG.info("host %s connected from %s (mutual TLS, its certificate names it)", name, peer,
                 extra={"host": name, "tls": True})

    @staticmethod
    def _answer(writer, host, challenge: str, call_id: int, body: dict) -> None:
        out = {"op": "result", "id": call_id, **body}
        if host is not None:
            out["mac"] = wc.result_mac(host.secret, challenge, call_id, wc.result_body(out))
        writer.write(encode_frame(out))

    async def _answer_later(self, writer, host, challenge: str, call_id: int, body) -> None:
        """Answer a call whose ``body`` (an awaitable) is ready later, on a
        connection that may have ended meanwhile."""
        body = await body
        if not writer.is_closing():
            self._answer(writer, host, challenge, call_id, body)
