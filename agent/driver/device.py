"""What applications hold: ``Device`` (a session on a pooled accelerator),
the ``Buffer`` and ``Program`` handles it makes, and ``connect``.

Launches, small writes, allocations and copies are pipelined (no round trip
each); reads, ``finish``, builds and large writes wait for their reply.  A
pipelined command that fails raises at the next call that waits.  Writes of
``ZERO_COPY_WRITE`` bytes or more are sent from the caller's memory and wait
for their reply (nothing is copied); smaller writes are copied and pipelined.

Transfers of any size: a write, upload, read or ``read_into`` larger than
one chunk (64 MiB, or the pool's frame limit when smaller) goes as
consecutive chunks (``accelmig.agent.driver.transfer``), each an ordinary
command: a cut or a migration in the middle re-sends only the chunks the
pool never got.  Its range is checked once, before any byte travels.  A
transfer's chunks are consecutive commands of the thread that issued it;
another thread's commands on the same ``Device`` may fall between them, as
between two writes: order them yourself if they touch the same bytes.
``copy`` needs no chunks: it carries no payload, whatever its size.
"""

from __future__ import annotations

import logging
import operator
import os

from accelmig.agent.driver import transfer
from accelmig.agent.driver.args import as_bytes_view, dims, encode_arg, record_arg
from accelmig.agent.driver.registry import AgentRegistration, domain_of_this_guest, endpoint_from_agent
from accelmig.agent.driver.session import LinkState, Session
from accelmig.wire import batch, driverconfig, tls
from accelmig.wire.dataplane import Op
from accelmig.wire.errors import AccelmigError, BadRequest, ConfigInvalid, Unavailable

LOG = logging.getLogger(__name__)

ZERO_COPY_WRITE = 1 << 20
DEFAULT_TIMEOUT = 60.0


def _reusable(global_size, local_size, args) -> bool:
    """A launch whose record stays right for as long as the same objects are
    passed: its sizes ints or tuples of ints, its arguments buffers (a
    buffer's record is its handle; a scalar or a list may change in place)."""
    for size in (global_size, local_size):
        if not (size is None or type(size) is int
                or (type(size) is tuple and all(type(v) is int for v in size))):
            return False
    return all(type(arg) is Buffer for arg in args)


class Buffer:
    """Device memory owned by a session.  ``handle`` is chosen by the driver."""

    def __init__(self, device: "Device", handle: int, size: int):
        self.device = device
        self.handle = handle
        self.size = size
        self.freed = False
        self.record_arg = batch.buffer_arg(handle)    # as a launch record's argument

    def write(self, data, offset: int = 0) -> None:
        self.device.write(self, data, offset)

    def read(self, nbytes: int | None = None, offset: int = 0) -> bytes:
        return self.device.read(self, nbytes, offset)

    def free(self) -> None:
        self.device.free(self)

    def __repr__(self) -> str:
        return f"<Buffer {self.handle} {self.size} bytes>"


class Program:
    """A built program; ``kernels`` lists its kernel names."""

    def __init__(self, device: "Device", handle: int, kernels: list[str], log: str = ""):
        self.device = device
        self.handle = handle
        self.kernels = list(kernels)
        self.build_log = log
        self._names: dict[str, bytes] = {}     # kernel name -> its UTF-8 (launch records)
        # (kernel name, global size, local size, args, record) of the last
        # launch whose parts cannot change (Device.launch)
        self.last_launch: tuple | None = None

    def kernel_name_bytes(self, name: str) -> bytes:
        encoded = self._names.get(name)
        if encoded is None:
            encoded = name.encode("utf-8")
            if len(self._names) < 1024:          # (names a caller made up: not kept without end)
                self._names[name] = encoded
        return encoded

    def launch(self, kernel_name: str, global_size, local_size=None, *args) -> None:
        """Enqueue ``kernel_name`` over ``global_size`` (pipelined)."""
        self.device.launch(self, kernel_name, global_size, local_size, *args)

    def binary(self) -> bytes:
        """The device binary (to build the same program elsewhere with ``build_binary``)."""
        return self.device.program_binary(self)

    def free(self) -> None:
        self.device.free_program(self)

    def __repr__(self) -> str:
        return f"<Program {self.handle} {self.kernels}>"


class Device:
    """A session on a pooled accelerator.  Thread-safe.

    Parameters: ``endpoint`` ``"HOST:PORT"``; ``token`` the tenant token;
    ``timeout`` how long a call may wait for a reply, and how long a call
    made while disconnected waits for the connection to come back;
    ``window_commands``/``window_bytes`` bound the commands kept for replay
    (a full window blocks the caller); ``auto_reconnect`` retries the last
    endpoint with backoff when the connection drops (accepted by the pool
    only at the current epoch, from the host the session is bound to);
    ``agent`` registers the session with the guest agent so it can be
    rehomed after a migration (``None``: the default socket if it exists);
    ``domain`` is the domain this guest says it is at open (``None``: its
    SMBIOS system UUID, from ``/sys`` or, not root, from the agent;
    ``False``: say nothing), so that hosts find the sessions of VMs nobody
    marked for accelmig (Nova's); ``device`` what the session needs of its
    device (``wire.devices``: an id, or terms such as ``"type=gpu"``,
    ``"vendor=nvidia,min_memory=8GiB"``; ``None``: the pool chooses, least
    loaded); the session stays on the device it got (``device_id``) for its
    whole life, across every resume and migration.  ``protocol_versions``:
    the data-plane versions offered at hello (default: all this driver
    speaks; ``(1,)`` sends every launch alone, as JSON, as drivers before
    launch batches did).

    TLS: the pool's certificate is verified against ``cafile`` (else
    ``$ACCELMIG_CAFILE``, else the system's trust store) and must name the
    endpoint's host (an IP endpoint: an IP subjectAltName).  Plain TCP only
    with ``insecure=True`` (or, when neither argument is given,
    ``ACCELMIG_INSECURE=1``), logged as a warning.
    """

    def __init__(self, endpoint: str, token: str, *, timeout: float = DEFAULT_TIMEOUT,
                 window_commands: int = 4096, window_bytes: int = 512 << 20,
                 auto_reconnect: bool = True, agent: str | bool | None = None,
                 name: str | None = None, connect_timeout: float = 10.0,
                 cafile: str | None = None, insecure: bool | None = None,
                 domain: str | bool | None = None, device: str | None = None,
                 protocol_versions=None):
        if domain is None:
            domain = domain_of_this_guest(agent if agent is not False else None)
        self._session = Session(endpoint, token, timeout=timeout, window_commands=window_commands,
                                window_bytes=window_bytes, auto_reconnect=auto_reconnect, name=name,
                                connect_timeout=connect_timeout, domain=domain or None, device=device,
                                tls_context=tls_context(endpoint, cafile, insecure),
                                protocol_versions=protocol_versions)
        self._agent = None
        if agent is not False:
            self._agent = AgentRegistration.start(self._session, agent)

    # -- the session's state ------------------------------------------------------------
    @property
    def sid(self) -> str:
        return self._session.sid

    @property
    def epoch(self) -> int:
        return self._session.epoch

    @property
    def endpoint(self) -> str:
        """Where the pool is (the last endpoint resumed at)."""
        return self._session.endpoint

    @property
    def device_id(self) -> str | None:
        """The id of the pool's device this session lives on (``info()["id"]``)."""
        return self._session.device_id

    @property
    def bound_host(self) -> str | None:
        return self._session.bound_host

    @property
    def pool_instance(self) -> str | None:
        return self._session.pool_instance

    @property
    def name(self) -> str:
        return self._session.name

    @property
    def timeout(self) -> float:
        return self._session.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._session.timeout = seconds

    @property
    def auto_reconnect(self) -> bool:
        return self._session.auto_reconnect

    @auto_reconnect.setter
    def auto_reconnect(self, on: bool) -> None:
        self._session.auto_reconnect = on

    @property
    def stats(self) -> dict:
        return self._session.stats

    @property
    def state(self) -> LinkState:
        return self._session.state

    @property
    def last_seen(self) -> int:
        return self._session.window.last_seen

    def resume(self, endpoint: str | None = None, ticket: str | None = None,
               migration_id: str | None = None) -> dict:
        """Continue this session on a new connection (thread-safe).

        ``endpoint``: where the pool is now (default: the last endpoint);
        ``ticket``: the resume ticket of a migration, when the session moved
        to another host; ``migration_id``: that migration's (the same move
        asked again is done once).  Returns what happened (epoch, replayed
        replies, re-sent commands, seconds); raises the pool's refusal
        otherwise.
        """
        return self._session.resume(endpoint, ticket, migration_id)

    def describe(self) -> dict:
        return self._session.describe()

    # -- the API -----------------------------------------------------------------------
    def _submit(self, op: Op, fields: dict, payload=b"", **options):
        return self._session.submit(op, fields, payload, **options)

    def _own(self, obj, kind):
        if obj.device is not self:
            raise BadRequest(reason=f"that {kind} belongs to another session")

    def info(self) -> dict:
        """The pool's device this session got: id, type, name, vendor, memory sizes, limits."""
        return self._submit(Op.INFO, {}, wait=True).reply.get("device", {})

    def build(self, source: str, options: str = "") -> Program:
        """Build OpenCL C ``source``; BuildFailed (with ``.build_log``) on error."""
        handle = self._session.new_handle()
        cmd = self._submit(Op.BUILD, {"prog": handle, "options": options}, source.encode("utf-8"), wait=True)
        return Program(self, handle, cmd.reply.get("kernels", []), cmd.reply.get("log", ""))

    def build_binary(self, binary: bytes, options: str = "") -> Program:
        """Build a program from a device binary (FPGA bitstreams, cached binaries)."""
        handle = self._session.new_handle()
        cmd = self._submit(Op.BUILD_BINARY, {"prog": handle, "options": options}, bytes(binary), wait=True)
        return Program(self, handle, cmd.reply.get("kernels", []), cmd.reply.get("log", ""))

    def program_binary(self, program: Program) -> bytes:
        self._own(program, "program")
        cmd = self._submit(Op.PROGRAM_BINARY, {"prog": program.handle}, wait=True)
        return bytes(cmd.reply_payload)

    def free_program(self, program: Program) -> None:
        self._own(program, "program")
        self._submit(Op.FREE_PROGRAM, {"prog": program.handle}, wait=False)

    def alloc(self, nbytes: int) -> Buffer:
        """Allocate ``nbytes`` of device memory (pipelined; quota errors raise
        at the next waiting call)."""
        if not isinstance(nbytes, int) or nbytes < 0:
            raise BadRequest(reason="alloc: nbytes must be a non-negative int")
        handle = self._session.new_handle()
        self._submit(Op.ALLOC, {"buf": handle, "size": nbytes}, wait=False)
        return Buffer(self, handle, nbytes)

    @property
    def chunk(self) -> int:
        """The largest transfer that goes as one command (larger ones go in
        chunks of this size): ``TRANSFER_CHUNK`` or the pool's frame limit."""
        return transfer.chunk_size(self._session.max_payload)

    def upload(self, data) -> Buffer:
        """A new buffer holding ``data`` (bytes, memoryview or numpy array), of any size."""
        view = as_bytes_view(data)
        if view.nbytes <= self.chunk:
            buf = self.alloc(view.nbytes)
            self.write(buf, view)
            return buf
        # Chunked: the quota is checked once, before any byte travels (a
        # refused alloc sends no chunk, and no chunk is refused for quota).
        handle = self._session.new_handle()
        self._submit(Op.ALLOC, {"buf": handle, "size": view.nbytes}, wait=True)
        buf = Buffer(self, handle, view.nbytes)
        try:
            self.write(buf, view)
        except AccelmigError:
            self._free_quietly(buf)      # the caller never gets it: give it back
            raise
        return buf

    def write(self, buffer: Buffer, data, offset: int = 0) -> None:
        """Write ``data`` at ``offset`` (any size: chunked past ``chunk``)."""
        self._own(buffer, "buffer")
        view = as_bytes_view(data)
        chunk = self.chunk
        if view.nbytes > chunk:
            transfer.check_range("write", buffer.handle, buffer.size, offset, view.nbytes)
            # Chunks are sent from the caller's memory, and all are answered
            # before this returns: that memory stays stable for any replay.
            transfer.run(self._session, Op.WRITE, view.nbytes, chunk,
                         lambda start, end: ({"buf": buffer.handle, "offset": offset + start},
                                             view[start:end], None),
                         what=f"write to buffer {buffer.handle}")
            return
        if view.nbytes >= ZERO_COPY_WRITE:
            # Sent from the caller's memory; waiting keeps that memory stable
            # for as long as a replay might need it.
            self._submit(Op.WRITE, {"buf": buffer.handle, "offset": offset}, view, wait=True)
        else:
            self._submit(Op.WRITE, {"buf": buffer.handle, "offset": offset}, bytes(view), wait=False)

    def read(self, buffer: Buffer, nbytes: int | None = None, offset: int = 0) -> bytes:
        """``nbytes`` (default: the rest of the buffer) from ``offset``, of any
        size (past ``chunk``, in chunks; ``read_into`` spares the copy into bytes)."""
        self._own(buffer, "buffer")
        if nbytes is None:
            nbytes = buffer.size - offset
        if nbytes > self.chunk:
            out = bytearray(nbytes)        # (read_into spares the copy to bytes)
            self._read_chunks(buffer, memoryview(out), offset)
            return bytes(out)
        cmd = self._submit(Op.READ, {"buf": buffer.handle, "offset": offset, "size": nbytes}, wait=True)
        payload = cmd.reply_payload
        return payload if isinstance(payload, bytes) else bytes(payload)

    def read_into(self, buffer: Buffer, out, offset: int = 0) -> None:
        """Read ``len(out)`` bytes straight into ``out`` (a writable buffer, e.g.
        a numpy array): no intermediate copy for large reads; any size, each
        chunk landing in its slice of ``out``."""
        self._own(buffer, "buffer")
        view = as_bytes_view(out)
        if view.readonly:
            raise BadRequest(reason="read_into needs a writable buffer")
        if view.nbytes > self.chunk:
            self._read_chunks(buffer, view, offset)
            return
        cmd = self._submit(Op.READ, {"buf": buffer.handle, "offset": offset, "size": view.nbytes},
                           wait=True, sink=view)
        if cmd.reply_payload is not view and cmd.reply_payload is not None:
            # copy, unless the reader already put the payload in place
            got = memoryview(cmd.reply_payload).cast("B")
            if got.obj is not view.obj:
                view[:] = got

    def _read_chunks(self, buffer: Buffer, view: memoryview, offset: int) -> None:
        """A read larger than a chunk, each chunk straight into its slice of ``view``."""
        transfer.check_range("read", buffer.handle, buffer.size, offset, view.nbytes)

        def landed(cmd, start, end):
            if cmd.reply_payload is not cmd.sink:      # the reader could not put it in place
                view[start:end] = memoryview(cmd.reply_payload).cast("B")

        transfer.run(self._session, Op.READ, view.nbytes, self.chunk,
                     lambda start, end: ({"buf": buffer.handle, "offset": offset + start,
                                          "size": end - start}, b"", view[start:end]),
                     what=f"read of buffer {buffer.handle}", on_done=landed)

    def _free_quietly(self, buffer: Buffer) -> None:
        try:
            self.free(buffer)
        except AccelmigError as exc:       # the session itself is gone: so is the buffer
            LOG.debug("free of buffer %d after a failed upload: %s", buffer.handle, exc)

    def copy(self, src: Buffer, dst: Buffer, nbytes: int | None = None, src_offset: int = 0,
             dst_offset: int = 0) -> None:
        self._own(src, "buffer")
        self._own(dst, "buffer")
        if nbytes is None:
            nbytes = min(src.size - src_offset, dst.size - dst_offset)
        self._submit(Op.COPY, {"src": src.handle, "dst": dst.handle, "src_offset": src_offset,
                               "dst_offset": dst_offset, "size": nbytes}, wait=False)

    def free(self, buffer: Buffer) -> None:
        self._own(buffer, "buffer")
        if not buffer.freed:
            buffer.freed = True
            self._submit(Op.FREE, {"buf": buffer.handle}, wait=False)

    def launch(self, program: Program, kernel_name: str, global_size, local_size=None, *args) -> None:
        self._own(program, "program")
        if self._session.batching and isinstance(kernel_name, str):
            # The same launch as the program's last one (the same objects:
            # a loop's): its record again, not made again (a fifth of the
            # driver's time per launch).  Only immutable parts are compared
            # by identity: buffers, ints, tuples of ints (_reusable).
            last = program.last_launch
            if (last is not None and last[0] is kernel_name and last[1] is global_size
                    and last[2] is local_size and len(args) == len(last[3])
                    and all(map(operator.is_, args, last[3]))):
                self._session.submit_launch(last[4])
                return
            record = self._launch_record(program, kernel_name, global_size, local_size, args)
            if record is not None:
                if _reusable(global_size, local_size, args):
                    program.last_launch = (kernel_name, global_size, local_size, args, record)
                self._session.submit_launch(record)
                return
        wire_args = []
        for index, arg in enumerate(args):
            if isinstance(arg, Buffer):
                self._own(arg, "buffer")
                wire_args.append({"buf": arg.handle})
            else:
                wire_args.append(encode_arg(index, arg))
        fields = {"prog": program.handle, "kernel": kernel_name, "gsize": dims(global_size, "global_size"),
                  "args": wire_args}
        lsize = dims(local_size, "local_size")
        if lsize is not None:
            fields["lsize"] = lsize
        self._submit(Op.LAUNCH, fields, wait=False)

    def _launch_record(self, program: Program, kernel_name: str, global_size, local_size, args):
        """The launch as a batch record (``wire.batch``), or None where it has
        none (then it goes alone, as JSON, checked the same way)."""
        parts = []
        for index, arg in enumerate(args):
            if isinstance(arg, Buffer):
                self._own(arg, "buffer")
                parts.append(arg.record_arg)
            else:
                part = record_arg(index, arg)
                if part is None:
                    return None
                parts.append(part)
        try:
            name = program.kernel_name_bytes(kernel_name)
        except UnicodeEncodeError:
            return None
        return batch.encode_launch(program.handle, name, dims(global_size, "global_size"),
                                   dims(local_size, "local_size"), parts)

    def finish(self) -> None:
        """Wait until every command so far has completed on the device."""
        self._submit(Op.FINISH, {}, wait=True)

    def close(self) -> None:
        """End the session: the pool frees its device memory."""
        self._session.close()
        if self._agent is not None:
            self._agent.stop()

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Device {self.sid} {self.state.value} at {self.endpoint}>"


def tls_context(endpoint: str, cafile: str | None = None, insecure: bool | None = None):
    """The driver's TLS context, or None for plain TCP said explicitly:
    ``insecure=True``; else ``cafile`` (TLS); else ``ACCELMIG_INSECURE``;
    else ``ACCELMIG_CAFILE`` or the system's trust store (TLS)."""
    if insecure is None and cafile is None:
        insecure = tls.env_insecure()
    if insecure:
        if cafile:
            raise BadRequest(reason="insecure=True and a cafile: choose one")
        LOG.warning("INSECURE: plain TCP to the pool at %s (insecure): anyone on the path reads "
                    "the tenant token, the session secret and the data", endpoint)
        return None
    cafile = cafile or os.environ.get(tls.CAFILE_ENV) or None
    try:
        return tls.client_context(cafile)
    except (OSError, ValueError) as exc:
        raise ConfigInvalid(source=cafile or "the system's trust store", reason=f"TLS: {exc}") from None


def connect(endpoint: str | None = None, token: str | None = None, **options) -> Device:
    """Open a session on the pool at ``endpoint`` (``"HOST:PORT"``).

    Without ``endpoint``, the guest agent is asked where the pool is (the
    host told it), then ``$ACCELMIG_ENDPOINT``, then the guest's driver
    configuration file (``wire.driverconfig``: ``/etc/accelmig/driver.toml``);
    without ``token``, ``$ACCELMIG_TOKEN``, then that file; TLS from the
    options, the environment, then that file (the OpenCL driver reads the
    same keys in the same order).  Options: see ``Device`` (TLS: ``cafile``,
    ``insecure``, ``$ACCELMIG_CAFILE``, ``$ACCELMIG_INSECURE``).
    """
    file = None               # the guest's driver.toml (wire.driverconfig), read when something is missing

    def from_file():
        nonlocal file
        if file is None:
            file = driverconfig.load()
        return file

    if endpoint is None:
        endpoint = endpoint_from_agent(options.get("agent")) or os.environ.get("ACCELMIG_ENDPOINT") or \
            from_file().endpoint
        if not endpoint:
            raise Unavailable(what="the pool's endpoint",
                              reason=f"no endpoint given, no guest agent knows one, ACCELMIG_ENDPOINT unset, "
                                     f"and {from_file().source or driverconfig.DEFAULT_PATH} names none")
    if token is None:
        token = os.environ.get("ACCELMIG_TOKEN") or driverconfig.token_of(from_file())
        if not token:
            raise BadRequest(reason="no tenant token given, ACCELMIG_TOKEN unset, and no token in "
                                    f"{from_file().source or driverconfig.DEFAULT_PATH}")
    if options.get("cafile") is None and options.get("insecure") is None and \
            not os.environ.get(tls.CAFILE_ENV) and not os.environ.get(tls.INSECURE_ENV):
        if from_file().cafile:
            options["cafile"] = file.cafile
        elif file.insecure is not None:
            options["insecure"] = file.insecure
    return Device(endpoint, token, **options)
