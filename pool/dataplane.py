"""One data-plane connection from a guest driver.

State machine::

    HELLO --hello--> READY --open/resume--> ATTACHED --(lost, bad frame, fenced)--> CLOSED

Everything here runs on the pool's event loop, so each frame is handled
whole before the next: a resume that fences this connection takes effect
between two frames, and nothing this connection still has buffered is
looked at once it is fenced.
"""

from __future__ import annotations

import collections
import enum
import logging
import secrets
import asyncio

import xxhash

from accelmig.pool import clcommands, streaming
from accelmig.pool.sequencing import (COMMAND_BYTES, HEADER_FACTOR, RUN_REPLY_BYTES, StoredReply, Verdict,
                                      command_cost)
from accelmig.pool.session import Command, LaunchRun
from accelmig.wire import batch
from accelmig.wire import dataplane as dp
from accelmig.wire import opencl as wire_opencl
from accelmig.wire import tls
from accelmig.wire.dataplane import Op
from accelmig.wire.errors import (AccelmigError, AuthFailed, BadRequest, FrameError, ProtocolError,
                                  SessionDiverged, StaleEpoch, Timeout)
from accelmig.wire.frames import (FRAME_VERSION, MAGIC, PREFIX, FrameReader, Limits,
                                  encode_prefix_and_header)
from accelmig.wire.values import is_int

#: What a command's payload is digested with, for divergence checks
#: (``dp.CommandIdentity``).  Every byte of every upload passes through it,
#: beside the device process's write: zlib's CRC-32 ran at ~2.2–2.8 GiB/s
#: on the lab's cores, XXH3 at ~11 GiB/s (and 64 bits instead of 32).
PAYLOAD_DIGEST = xxhash.xxh3_64_intdigest
PAYLOAD_DIGEST_STREAM = xxhash.xxh3_64      # the same digest, taken piece by piece (pool.streaming)

LOG = logging.getLogger(__name__)

#: What a peer may send before it authenticated (hello, open, resume: small
#: headers, never a payload): a stranger costs a few KiB, not a buffer the
#: size of its claim.
PREAUTH_LIMITS = Limits(max_header=4096, max_payload=0, direct_threshold=0)


class ConnState(enum.Enum):
    HELLO = "hello"
    READY = "ready"
    PLACING = "placing"      # an open waits for the cluster's placement (an etcd read, off the loop)
    ATTACHED = "attached"
    CLOSED = "closed"


class DataConnection(asyncio.BufferedProtocol):
    """``server_cert_der``: the pool's own certificate when it serves TLS
    (what ownership proofs are bound to, with the connection's challenge).
    ``admitted``: the ``pool.admission.AcceptedConnection`` that counted it
    from accept, ran its TLS handshake and holds its deadline (the pool
    reports to it when the connection authenticates and when it ends)."""

    def __init__(self, pool, server_cert_der: bytes | None = None, admitted=None):
        self.pool = pool
        self.server_cert_der = server_cert_der
        self.admitted = admitted
        self.binding = b""          # wire.tls.channel_binding, once TLS is up
        self.tls_resumed = False    # the driver resumed a TLS session (a reconnect's ticket)
        self._first_bytes = True    # a TLS hello on a plain pool gets a clear log line
        self._buffer: memoryview | None = None
        self.reader = FrameReader(PREAUTH_LIMITS, staging_floor=0, payload_sink=self._payload_sink)
        # (view, lease) of payloads received into the upload arena, in frame
        # order, until their frame is handled (or the connection ends)
        self._leases: collections.deque = collections.deque()
        self.state = ConnState.HELLO
        self.transport: asyncio.Transport | None = None
        self.session = None
        self.epoch = 0
        self.version = 0
        self.challenge = secrets.token_hex(16)
        self.peer = ("?", 0)
        self.peer_host: str | None = None
        self.reading_paused = False
        self._out: list = []
        self._done: tuple[int, int] | None = None   # a run of plain successes not yet sent
        self._flush_scheduled = False
        self._feeding = False          # frames are being handled: they flush at the end
        self._idle_timer: asyncio.TimerHandle | None = None
        self._heard = 0.0              # when the peer last sent anything (the loop's clock)
        self._header_size = 0          # the wire length of the header being handled
        self._backlogged = False       # reading paused: the session holds too much back
        self._output_full = False      # reading paused: the peer does not read what is sent
        self._records: batch.RecordCache | None = None     # launch records parsed lately (protocol 2)
        # a write copied to the device while its payload arrives (pool.streaming)
        self._stream: streaming.UploadStream | None = None

    # -- asyncio protocol ------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername") or ("?", 0)
        self.peer = peer[:2] if isinstance(peer, tuple) else (str(peer), 0)
        self.peer_host = self.pool.host_for_address(self.peer[0])
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            self.binding = tls.channel_binding(ssl_object, self.server_cert_der)
            self.tls_resumed = ssl_object.session_reused
            self._first_bytes = False
        self.pool.connections.add(self)
        if self.admitted is not None:
            # one deadline from accept: the TLS handshake took part of it
            self.admitted.on_deadline = self._handshake_expired

    def _handshake_expired(self) -> None:
        """The connection's deadline passed before an open or resume (an
        open waiting for the cluster's placement is answered by it)."""
        if self.state in (ConnState.HELLO, ConnState.READY):
            self.fail(ProtocolError(reason=f"no open or resume within "
                                           f"{self.pool.config.handshake_timeout:g} s"))

    def _idle_check(self) -> None:
        """An attached connection whose peer sent nothing for
        ``idle_timeout`` is closed (its session detaches: the grace starts).
        Not while the pool itself stopped reading for work of the session
        still running or paused by a migration: that silence is the pool's."""
        self._idle_timer = None
        if self.state is not ConnState.ATTACHED:
            return
        loop = self.pool.loop
        idle = self.pool.config.idle_timeout
        quiet = loop.time() - self._heard
        session = self.session
        pools_own = self._backlogged and (session.in_worker or session.paused)
        if quiet < idle or pools_own:
            self._idle_timer = loop.call_later(idle - quiet if quiet < idle else idle, self._idle_check)
            return
        self.pool.metrics.idle_connections.inc()
        self.fail(Timeout(what=f"the next frame from {self.peer[0]} (idle_timeout)", timeout=idle))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.reader.broken is not None:
            # Already failing: swallow whatever is still arriving.
            return memoryview(bytearray(65536))
        self._buffer = self.reader.get_buffer(sizehint)
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        self._heard = self.pool.loop.time()
        self._feeding = True
        try:
            self._frames_arrived(nbytes)
        finally:
            self._feeding = False
            if self._flush_scheduled:
                # Answers made while these frames were handled (a finish
                # done on the loop) go now, in one write, not one loop pass
                # later (no callback was scheduled: no pass for nothing).
                self.flush()

    def _frames_arrived(self, nbytes: int) -> None:
        if self.state is ConnState.CLOSED or self.reader.broken is not None:
            return
        if self._first_bytes:
            self._first_bytes = False
            if self._buffer is not None and tls.looks_like_tls(self._buffer[:min(nbytes, 2)]):
                self.fail(ProtocolError(reason="the peer speaks TLS, this pool plain TCP "
                                               "(--insecure): give the pool --tls-cert/--tls-key, "
                                               "or the driver insecure too"))
                return
        try:
            frames = self.reader.feed(nbytes)
        except FrameError as exc:
            self.fail(exc)
            return
        if self._stream is not None:
            pending = self.reader.pending_payload()
            if pending is not None and pending[0] is self._stream.header:
                self._stream.received(pending[1])
        for frame in frames:
            if self.state is ConnState.CLOSED:
                return
            try:
                self._header_size = frame.header_size
                self._handle(frame.header, frame.payload)
            except AccelmigError as exc:
                self.fail(exc)
                return
            except Exception as exc:  # a bug must cost one connection, not the pool
                LOG.exception("data plane: unexpected failure on %s", self.peer)
                self.fail(ProtocolError(reason=f"internal error: {type(exc).__name__}"))
                return
        if self.reader.broken is not None:
            self.fail(self.reader.broken)

    def _payload_sink(self, header: dict, size: int):
        """Where a large payload is received: a write's into its tenant's
        upload arena when there is room (its device process takes it from
        there, no copy through a socket), anything else into a pool buffer.
        The header is not validated yet: a bad one gives its lease back in
        ``_handle``, a connection that ends gives back every one it holds."""
        if self.state is ConnState.ATTACHED and header.get("op") == Op.WRITE.value:
            lease = self.session.context.lease_upload(size)
            if lease is not None:
                self._leases.append((lease.view, lease))
                if self._stream is None and streaming.may_stream(self, header, size):
                    self._stream = streaming.UploadStream(self.session, header, lease, PAYLOAD_DIGEST_STREAM)
                return lease.view
        return self.pool.buffers.get(size)

    def _give_back(self, lease) -> None:
        """A lease no command took: back to the arena, or, if its write was
        streaming, once its pieces have run (and the write may be torn)."""
        stream = self._stream
        if stream is not None and lease is stream.lease:
            self._stream = None
            stream.abandon()
        else:
            lease.release()

    def _take_lease(self, payload):
        """The arena lease ``payload`` was received into, if any (now the caller's)."""
        if self._leases and self._leases[0][0] is payload:
            return self._leases.popleft()[1]
        return None

    def _drop_leases(self) -> None:
        while self._leases:
            self._give_back(self._leases.popleft()[1])

    def eof_received(self):
        return False  # close our side too

    def connection_lost(self, exc) -> None:
        self.pool.connections.discard(self)
        if self.admitted is not None:
            self.admitted.closed()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self.state = ConnState.CLOSED
        self._drop_leases()        # payloads received (or half received) that no command took
        # Whoever closed it (the peer, or this side after an error), a
        # session still attached here is detached: its grace starts, and at
        # the end of it the quota, device memory and worker are released.
        # A fenced connection no longer holds its session (a newer one does).
        session = self.session
        if session is not None and session.connection is self:
            self.pool.connection_lost(session, self)

    # -- sending -------------------------------------------------------------------
    def send(self, header: dict, payload=b"") -> None:
        """Queue a frame; frames queued in one loop pass go out in one write."""
        if self.transport is None or self.transport.is_closing():
            return
        if self._done is not None:
            self._queue_done()
        self._out.append(encode_prefix_and_header(header, len(payload)))
        if payload:
            self._out.append(payload)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        """Write what is queued at the end of this loop pass: at the end of
        the frames being handled (``buffer_updated``), else one callback."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            if not self._feeding:
                asyncio.get_running_loop().call_soon(self.flush)

    def _queue_done(self) -> None:
        first, last = self._done
        self._done = None
        # the header as encode_header writes it (tests/wire/test_frames.py
        # keeps them equal), formatted: a tenth of the encoder's time, on
        # every idle round trip's path
        head = b'{"op":"done","from":%d,"to":%d}' % (first, last)
        self._out.append(PREFIX.pack(MAGIC, FRAME_VERSION, 0, len(head), 0) + head)

    def flush(self) -> None:
        self._flush_scheduled = False
        if self._done is not None:
            self._queue_done()
        parts, self._out = self._out, []
        if self.transport is None or self.transport.is_closing():
            return
        small: list = []
        for part in parts:
            if len(part) <= 65536:
                small.append(part)
                continue
            if small:
                self.transport.write(b"".join(small))
                small = []
            self.transport.write(part)   # a bulk payload: never joined (no copy)
        if small:
            self.transport.write(b"".join(small))

    def send_reply(self, reply: StoredReply) -> None:
        if self.state is not ConnState.ATTACHED:
            return
        header = reply.header
        if not reply.payload and len(header) == 3 and header.get("ok") is True:
            self.send_ok_run(reply.seq, reply.seq)
            return
        self.send(header, reply.payload)

    def send_ok_run(self, first: int, last: int) -> None:
        """Plain successes first..last: coalesced with the run before into
        one "done" frame."""
        if self.state is not ConnState.ATTACHED:
            return
        if self._done is not None and self._done[1] + 1 == first:
            self._done = (self._done[0], last)
            return
        if self._done is not None:
            self._queue_done()
        self._done = (first, last)
        self._schedule_flush()

    def fail(self, exc: AccelmigError) -> None:
        """Answer with an error frame where possible, then close."""
        if self.state is ConnState.CLOSED:
            return
        LOG.warning("data plane: closing connection from %s: %s", self.peer[0], exc,
                    extra={"sid": getattr(self.session, "sid", None), "code": exc.code.value})
        if isinstance(exc, FrameError):
            self.pool.metrics.frame_errors.labels(exc.code.value).inc()
        self.send({"op": Op.ERROR.value, "error": exc.to_wire()})
        self.close()

    def fence(self, by_epoch: int) -> None:
        """A later resume took the session: this connection issues nothing more."""
        if self.state is ConnState.CLOSED:
            return
        sid = self.session.sid if self.session else "?"
        self.send({"op": Op.ERROR.value, "error": StaleEpoch(sid=sid, got=self.epoch,
                                                             current=by_epoch).to_wire()})
        self.close()

    def close(self) -> None:
        """The pool ends this connection.  Its session, if it still holds
        it, is detached now: its grace runs from this decision, not from
        when the transport lets go (asyncio waits up to 30 s for a TLS
        peer's close_notify, and for a plain peer that never reads, for
        ever).  What is queued still goes out, for ``pool.admission.CLOSE_GRACE`` at most."""
        if self.state is ConnState.CLOSED:
            return
        self.state = ConnState.CLOSED
        session = self.session
        if session is not None and session.connection is self:
            self.pool.connection_lost(session, self)
        if self.transport is not None:
            self.flush()
            if self.admitted is not None:
                self.admitted.close_soon(self.transport)
            else:
                self.transport.close()

    def flow_changed(self) -> None:
        session = self.session
        if session is None:
            return
        self._backlogged = session.backlogged
        self._apply_flow()

    def pause_writing(self) -> None:
        """The transport holds more than its high-water mark of what the pool
        sent: the peer does not read.  No more commands are read from it
        (they would make more replies) until it does: a peer that
        acknowledges replies it never reads cannot grow the pool's output."""
        self._output_full = True
        self._apply_flow()

    def resume_writing(self) -> None:
        self._output_full = False
        self._heard = self.pool.loop.time()      # (the peer read: it is there)
        self._apply_flow()

    def _apply_flow(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        pause = self._backlogged or self._output_full
        if pause and not self.reading_paused:
            self.transport.pause_reading()
            self.reading_paused = True
        elif not pause and self.reading_paused:
            self.transport.resume_reading()
            self.reading_paused = False

    # -- frames --------------------------------------------------------------------
    def _handle(self, header: dict, payload) -> None:
        op = dp.parse_op(header)
        if self.state is ConnState.HELLO:
            if op is not Op.HELLO:
                raise ProtocolError(reason=f"expected hello first, got {op.value}")
            self.version = dp.negotiate(header.get("versions", []), self.pool.data_versions)
            self.state = ConnState.READY
            self.send({"op": Op.WELCOME.value, "version": self.version,
                       "instance": self.pool.instance, "challenge": self.challenge,
                       # (a read's reply must fit what a session keeps unacknowledged)
                       "max_payload": min(self.pool.config.max_payload, self.pool.config.max_reply_bytes),
                       "max_header": self.pool.config.max_header,
                       "idle_timeout": self.pool.config.idle_timeout,
                       "peer_host": self.peer_host})
            return
        if self.state is ConnState.PLACING:
            raise ProtocolError(reason=f"{op.value} before the open was answered: one frame at a time")
        if self.state is ConnState.READY:
            if op is Op.OPEN and self.pool.placement is not None:
                self._place(header)
            elif op is Op.OPEN:
                self._open(header)
            elif op is Op.RESUME and self.pool.placement is not None and \
                    not str(header.get("sid")).startswith(f"s-{self.pool.instance}-"):
                self._off_loop(self.pool.placement.locate, header.get("sid"), header=header)
            elif op is Op.LIST_DEVICES and self.version >= wire_opencl.OPENCL_VERSION:
                self.send(clcommands.list_devices(self.pool, header))      # (then open, resume or close)
            elif op is Op.RESUME:
                session, replay = self.pool.resume_session(self, header)
                self._attach(session)
                self.send({"op": Op.RESUMED.value, "sid": session.sid, "epoch": session.epoch,
                           "expect": session.log.next_seq, "replay": len(replay),
                           "bound_host": session.bound_host})
                for reply in replay:
                    self.send_reply(reply)
            else:
                raise ProtocolError(reason=f"expected open or resume, got {op.value}")
            return
        # ATTACHED
        lease = self._take_lease(payload) if self._leases else None
        try:
            submitted = self._handle_command(op, header, payload, lease)
        except BaseException:
            if lease is not None:
                self._give_back(lease)   # (no command took it: it raised before)
            raise
        if submitted:
            self.flow_changed()

    def _handle_command(self, op: Op, header: dict, payload, lease) -> bool:
        """A frame on an attached connection; ``lease``: the arena lease its
        payload is in.  True: a new command took it (and nothing after may
        raise); else it was given back here or the caller gives it back."""
        session = self.session
        if op is Op.ACK:
            self._acknowledge(session, header.get("ack"))
            return False
        if op in dp.CONNECTION_OPS:
            raise ProtocolError(reason=f"{op.value} on an attached connection")
        if op is Op.LAUNCHES:
            self._launches(session, header, payload)
            return False
        dp.validate_command(header, len(payload), self.version)
        if header["epoch"] != session.epoch or self.epoch != session.epoch:
            raise StaleEpoch(sid=session.sid, got=header["epoch"], current=session.epoch)
        if "ack" in header:
            self._acknowledge(session, header["ack"])
        return self._sequenced(session, op, header, payload, lease)

    def _launches(self, session, header: dict, payload) -> None:
        """A batch of launches (protocol 2): each one the command it would
        have been alone, classified and taken one by one (``wire.batch``)."""
        if self.version < batch.BATCH_VERSION:
            raise ProtocolError(reason=f"launches on a connection that agreed to protocol {self.version} "
                                       f"(batches need {batch.BATCH_VERSION})")
        if self._records is None:
            self._records = batch.RecordCache()
        # bounds first: nothing trusted before
        epoch, ack, first, launches = batch.decode_run(header, payload, self._records)
        if epoch != session.epoch or self.epoch != session.epoch:
            raise StaleEpoch(sid=session.sid, got=epoch, current=session.epoch)
        self._acknowledge(session, ack)
        log = session.log
        if first == log.next_seq and session.torn is None:
            # All new (the common case): accepted and handed on as one run;
            # what ``_sequenced`` would do for each, with one identity per
            # distinct launch (a repeat's identity is its twin's)
            identities: dict[int, dp.CommandIdentity] = {}
            digests = []
            for launch in launches:
                identity = identities.get(id(launch))
                if identity is None:
                    identity = identities[id(launch)] = dp.CommandIdentity(launch, b"", PAYLOAD_DIGEST)
                digests.append(identity)
            # the identities (one per distinct launch), an entry per launch,
            # the records as parsed: counted until acknowledged
            log.accept_run(first, digests, COMMAND_BYTES * len(identities) + RUN_REPLY_BYTES * len(launches)
                           + HEADER_FACTOR * (self._header_size + len(payload)))
            session.counters.batched_launches += len(launches)
            session.submit_launches(LaunchRun(first, launches))
            self.flow_changed()
            return
        # A batch re-sent over what the pool has (a resume): launch by
        # launch, each a duplicate, new or diverged
        run: list = []
        try:
            for command in batch.expand_run(epoch, ack, first, launches):
                self._sequenced(session, Op.LAUNCH, command, b"", None, run)
        finally:
            if run:          # (accepted before a refusal later in the batch: they run)
                session.counters.batched_launches += len(run)
                session.submit_run(run)
                self.flow_changed()

    def _sequenced(self, session, op: Op, header: dict, payload, lease, run: list | None = None) -> bool:
        """A checked command: new (handed to the session, or added to
        ``run`` for the caller to hand over), a duplicate (its reply again)
        or a divergence (refused); see ``_handle_command``."""
        seq = header["seq"]
        torn = session.torn
        if torn is not None and seq == torn.seq and not torn.admits(op, header, len(payload)):
            raise torn.refusal(session.sid, op)
        identity = dp.CommandIdentity(header, payload, PAYLOAD_DIGEST)
        verdict = session.log.classify(seq, identity)
        if verdict is Verdict.NEW:
            session.log.accept(seq, identity, command_cost(self._header_size))
            if torn is not None and seq == torn.seq:
                session.torn = None          # its write came whole: the range is whole again
            command = Command(seq, op, header, payload, identity, lease)
            if lease is not None and self._stream is not None and lease is self._stream.lease:
                command.stream, self._stream = self._stream, None
            if run is not None:
                run.append(command)
            else:
                session.submit(command)
            return True
        if verdict is Verdict.DUPLICATE:
            session.counters.duplicates += 1
            self.pool.metrics.duplicates.inc()
            if lease is not None:
                self._give_back(lease)
            else:
                self.pool.buffers.put(payload)
            stored = session.log.stored_reply(seq)
            if stored is not None:
                self.send_reply(stored)
            # else: still queued; its reply will come on this connection
            return False
        if verdict is Verdict.DIVERGED:
            raise SessionDiverged(sid=session.sid, reason=(
                f"command {seq} ({op.value}) differs from the command the pool accepted "
                f"under that sequence number"), details={"seq": seq})
        else:
            raise ProtocolError(reason=f"sequence gap: got {seq}, expected {session.log.next_seq}")

    def _open(self, header: dict) -> None:
        session = self.pool.open_session(self, header)
        self._attach(session)
        self.send({"op": Op.OPENED.value, "sid": session.sid, "epoch": session.epoch,
                   "bound_host": session.bound_host, "device": session.device.id})

    def _place(self, header: dict) -> None:
        """In a cluster: the token first (a stranger costs no etcd read),
        then the placement off the loop; this connection takes no frame
        meanwhile."""
        token = header.get("token")
        if not isinstance(token, str) or token not in self.pool.tenants:
            raise AuthFailed(reason="unknown tenant token")
        self._off_loop(self.pool.placement.decide, header, self.pool.live_session_count(), header=header)

    def _off_loop(self, fn, *args, header: dict) -> None:
        """``fn(*args)`` (an etcd read) on a thread; ``_placed`` takes its answer."""
        self.state = ConnState.PLACING
        future = asyncio.get_running_loop().run_in_executor(None, fn, *args)
        future.add_done_callback(lambda done: self._placed(done, header))

    def _placed(self, done, header: dict) -> None:
        if self.state is not ConnState.PLACING:        # closed meanwhile
            return
        self.state = ConnState.READY
        try:
            target = done.result()
            if dp.parse_op(header) is not Op.OPEN:         # locate answers only by raising
                raise ProtocolError(reason="internal error: a resume was located")
            if target is None:
                self._open(header)
                return
            LOG.info("open from %s placed on node %s (instance %s): redirected to %s", self.peer[0],
                     target.name, target.instance, target.data,
                     extra={"node": target.name, "instance": target.instance})
            self.send({"op": Op.REDIRECT.value, "endpoint": target.data, "node": target.name,
                       "instance": target.instance})
            self.close()
        except AccelmigError as exc:
            self.fail(exc)
        except Exception as exc:  # a bug must cost one connection, not the pool
            LOG.exception("data plane: placement failed for %s", self.peer)
            self.fail(ProtocolError(reason=f"internal error: {type(exc).__name__}"))

    def _acknowledge(self, session, ack) -> None:
        if not is_int(ack, 0):
            raise BadRequest(reason="ack must be a non-negative integer")
        session.acknowledge(ack)

    def _attach(self, session) -> None:
        self.session = session
        self.epoch = session.epoch
        self.state = ConnState.ATTACHED
        if self.admitted is not None:
            self.admitted.authenticated()
        if self._idle_timer is None:
            loop = self.pool.loop
            self._heard = loop.time()
            self._idle_timer = loop.call_later(self.pool.config.idle_timeout, self._idle_check)
        # Authenticated: now frames may be as large as the pool allows.
        self.reader.relimit(Limits(max_header=self.pool.config.max_header,
                                   max_payload=self.pool.config.max_payload))
