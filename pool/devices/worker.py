"""The device process of one tenant (``python -m accelmig.pool.devices.worker``).

The pool starts one per tenant (``accelmig.pool.devices.isolated``) and
talks to it over a socket pair in the data plane's own frames
(``wire.frames``: a JSON header, raw payload bytes).  Here the tenant's
contexts live on the real backend (OpenCL), each with a thread of its own
executing its calls in order; builds take a slot of a small semaphore, so
one tenant's builds cannot pile up.

Why a process: a kernel that never ends cannot be stopped inside a process
(OpenCL has no cancel), a PoCL kernel runs as native code that may write
anywhere in the process it runs in, and PoCL's kernel cache is per process
environment (``POCL_CACHE_DIR``, set by the pool to a directory of the
tenant's own, so no tenant can time another's builds).  The pool kills this
process when a call overruns its time limit.  It exits by itself when the
pool's end of the socket closes.

A write's payload usually does not cross the socket: the pool receives it
into the tenant's upload arena (``accelmig.pool.devices.arena``: shared
memory this process inherits read-only) and calls ``write_arena`` with
where it lies; the write is enqueued from this process's mapping.

Before it reads its socket or loads PoCL, the process confines itself
(``accelmig.pool.devices.sandbox``: namespaces, a root of its own,
Landlock): a build's ``#include`` and a kernel's native code find none of
the node's files.  The pool passes ``--sandbox off`` only where its check
at start found that this node cannot; builds are then refused unless
``--allow-unconfined-builds``.

Nothing here trusts the pool less than the pool trusts it: the pool treats
every answer from this process as hostile (sizes, ids), since a tenant's
kernel may have rewritten this process's memory.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import socket
import sys
import threading

from accelmig.pool.devices import clops
from accelmig.pool.devices.base import BufferArg, LocalArg, RawArg, ScalarArg
from accelmig.wire.errors import AccelmigError, BadRequest, InternalError, Unavailable
from accelmig.wire.frames import FrameReader, Limits, encode_prefix_and_header

LOG = logging.getLogger("accelmig.pool.device-process")

#: what may cross the socket pair: a whole write or read in one frame
PIPE_LIMITS = Limits(max_header=1 << 20, max_payload=(1 << 40), direct_threshold=64 << 10)


def encode_args(args: list) -> list:
    """Launch arguments as JSON (the pool's side)."""
    out = []
    for arg in args:
        if isinstance(arg, BufferArg):
            out.append({"buf": arg.handle})
        elif isinstance(arg, LocalArg):
            out.append({"local": arg.nbytes})
        elif isinstance(arg, RawArg):
            out.append({"raw": arg.raw.hex()})
        else:
            out.append({"t": arg.type_name, "x": arg.raw.hex()})
    return out


def decode_args(args: list) -> list:
    out = []
    for arg in args:
        if "buf" in arg:
            out.append(BufferArg(None if arg["buf"] is None else int(arg["buf"])))
        elif "local" in arg:
            out.append(LocalArg(int(arg["local"])))
        elif "raw" in arg:
            out.append(RawArg(bytes.fromhex(arg["raw"])))
        else:
            out.append(ScalarArg(str(arg["t"]), bytes.fromhex(arg["x"])))
    return out


#: corked frames go out at this size at the latest
CORK_BYTES = 256 << 10

#: pipelined launches the pool sends as one call at most (``launches``)
LAUNCH_BATCH = 256


class FrameWriter:
    """Whole frames onto a socket of the pair, one writer at a time (both
    ends: the process's answers, the pool's calls).

    A frame without payload may be *corked* (``cork``): kept until the next
    ``send`` or ``flush``, so a burst of pipelined launches costs one system
    call, not one each.  Order is kept: a send writes the corked frames first.
    """

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.lock = threading.Lock()
        self._corked: list[bytes] = []
        self._corked_bytes = 0

    def send(self, header: dict, payload=b"") -> None:
        head = encode_prefix_and_header(header, len(payload))
        with self.lock:
            if self._corked:
                head = self._take_corked() + head
            self.sock.sendall(head)
            if payload:
                self.sock.sendall(memoryview(payload).cast("B"))

    def cork(self, header: dict) -> None:
        head = encode_prefix_and_header(header, 0)
        with self.lock:
            self._corked.append(head)
            self._corked_bytes += len(head)
            if self._corked_bytes >= CORK_BYTES:
                self.sock.sendall(self._take_corked())

    def flush(self) -> None:
        """Send the corked frames (none: nothing happens)."""
        if not self._corked:        # (read without the lock: a cork after it is its corker's to flush)
            return
        with self.lock:
            if self._corked:
                self.sock.sendall(self._take_corked())

    def _take_corked(self) -> bytes:
        data = b"".join(self._corked)
        self._corked.clear()
        self._corked_bytes = 0
        return data

    def send_headers(self, headers: list[dict]) -> None:
        """Answers without payload in one write (a burst of launches)."""
        data = b"".join(encode_prefix_and_header(h, 0) for h in headers)
        with self.lock:
            self.sock.sendall(data)


class ContextThread:
    """One session's context and the thread that runs its calls in order."""

    def __init__(self, ctx_id: int, context, answers: FrameWriter, builds: threading.Semaphore,
                 arena: memoryview | None = None):
        self.ctx_id = ctx_id
        self.context = context
        self.answers = answers
        self.builds = builds
        self.arena = arena
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=f"ctx-{ctx_id}", daemon=True).start()

    def _run(self) -> None:
        try:
            self._answer_calls()
        except OSError as exc:       # the pool's end closed (it stopped): nobody to answer
            LOG.info("context %d: the pool went away (%s)", self.ctx_id, exc)

    def _answer_calls(self) -> None:
        held: list[dict] = []        # payload-less answers not sent yet
        while True:
            header, payload = self.calls.get()
            call_id = header.get("id")
            out = b""
            try:
                result, out = self._execute(header, payload)
                answer = {"op": "answer", "id": call_id, "ok": True, "r": result}
            except AccelmigError as exc:
                answer = {"op": "answer", "id": call_id, "ok": False, "error": exc.to_wire()}
            except Exception as exc:       # a runtime failing oddly: the pool reports it
                LOG.exception("context %d: %s failed", self.ctx_id, header.get("m"))
                answer = {"op": "answer", "id": call_id, "ok": False,
                          "error": InternalError(reason=f"{type(exc).__name__}: {exc}").to_wire()}
            # A burst of calls (pipelined launches) is answered in one write
            # once nothing more is queued; a payload goes at once.
            if out:
                if held:
                    self.answers.send_headers(held)
                    held = []
                self.answers.send(answer, out)
            else:
                held.append(answer)
                if self.calls.empty() or len(held) >= 256:
                    self.answers.send_headers(held)
                    held = []
            if header.get("m") == "release":
                if held:
                    self.answers.send_headers(held)
                return

    def _launches(self, shapes: list, launches: list) -> list:
        """A batch of pipelined launches, in order, in one loop: each is its
        own command, so one that fails stops none after it; the answer
        lists only the failures, [index, error] each.  ``launches`` are
        indexes into ``shapes`` (program, kernel, sizes, arguments), each
        decoded and looked up once: nothing else runs on this context
        between them, so what a shape names cannot change in the batch."""
        if not isinstance(launches, list) or len(launches) > LAUNCH_BATCH or \
                not isinstance(shapes, list) or len(shapes) > LAUNCH_BATCH:
            raise BadRequest(reason="device process: a launch batch is a list of at most "
                                    f"{LAUNCH_BATCH} launches of as many shapes")
        ctx, failed = self.context, []
        prepared: list = [None] * len(shapes)
        for index, shape in enumerate(launches):
            try:
                ready = prepared[shape]
                if ready is None:
                    prog, kernel, gsize, lsize, args, *offset = shapes[shape]
                    try:
                        ready = ctx.prepare_launch(prog, kernel, gsize, lsize, decode_args(args),
                                                   offset[0] if offset else None)
                    except Exception as exc:      # each launch of the shape fails the same way
                        ready = exc
                    prepared[shape] = ready
                if isinstance(ready, Exception):
                    raise ready
                ctx.enqueue_launch(ready)
            except AccelmigError as exc:
                failed.append([index, exc.to_wire()])
            except Exception as exc:       # a runtime failing oddly, or a malformed entry
                failed.append([index, InternalError(reason=f"{type(exc).__name__}: {exc}").to_wire()])
        return failed

    def _execute(self, h: dict, payload) -> tuple:
        ctx, a, method = self.context, h.get("a", {}), h.get("m")
        if method == "alloc":
            ctx.alloc(a["buf"], a["size"])
        elif method == "free":
            return ctx.free(a["buf"]), b""
        elif method == "write":
            ctx.write(a["buf"], a["offset"], payload)
        elif method == "write_arena":
            # the payload lies in the upload arena; the write is blocking, so
            # the pool may reuse those bytes once this call is answered
            at, size = a["at"], a["size"]
            arena = self.arena
            if arena is None or not (isinstance(at, int) and isinstance(size, int)
                                     and 0 <= at and 0 <= size and at + size <= len(arena)):
                raise BadRequest(reason=f"device process: write_arena of {size!r} bytes at {at!r} "
                                        f"is outside its upload arena")
            ctx.write(a["buf"], a["offset"], arena[at:at + size])
        elif method == "read":
            out = bytearray(a["size"])
            ctx.read_into(a["buf"], a["offset"], memoryview(out))
            return None, out
        elif method == "copy":
            ctx.copy(a["src"], a["dst"], a["src_offset"], a["dst_offset"], a["size"])
        elif method in ("build_source", "build_binary"):
            with self.builds:
                if method == "build_source":
                    result = ctx.build_source(a["prog"], bytes(payload).decode("utf-8"), a["options"])
                else:
                    result = ctx.build_binary(a["prog"], bytes(payload), a["options"])
            return {"kernels": result.kernels, "log": result.log, "binary_size": result.binary_size}, b""
        elif method == "program_binary":
            return None, ctx.program_binary(a["prog"])
        elif method == "free_program":
            ctx.free_program(a["prog"])
        elif method == "launch":
            ctx.launch(a["prog"], a["kernel"], a["gsize"], a.get("lsize"), decode_args(a["args"]), a.get("goffset"))
        elif method == "launches":
            return {"failed": self._launches(a["s"], a["l"])}, b""
        elif method == "finish":
            ctx.finish()
        elif method == "release":
            return ctx.release(), b""
        elif method in clops.DEVICE_PROCESS_METHODS:
            return clops.run_in_device_process(ctx, method, a, payload)
        else:
            raise BadRequest(reason=f"device process: no method {method!r}")
        return None, b""


def serve(sock: socket.socket, backend, max_builds: int, arena: memoryview | None = None,
          sandbox: dict | None = None) -> None:
    answers = FrameWriter(sock)
    # "arena": the size mapped (0: none), so the pool uses it only when it is
    # there; "sandbox": the layers that confine this process (None: none)
    answers.send({"op": "ready", "info": backend.info(), "arena": len(arena) if arena is not None else 0,
                  "sandbox": sandbox})
    builds = threading.Semaphore(max_builds)
    contexts: dict[int, ContextThread] = {}
    reader = FrameReader(PIPE_LIMITS)
    while True:
        n = sock.recv_into(reader.get_buffer())
        if n == 0:
            return                     # the pool closed its end (or died): so do we
        for frame in reader.feed(n):
            h = frame.header
            ctx_id = h.get("ctx")
            if h["op"] == "new":
                contexts[ctx_id] = ContextThread(ctx_id, backend.new_context(), answers, builds, arena)
            elif h["op"] == "call":
                target = contexts.get(ctx_id)
                if target is None:
                    answers.send({"op": "answer", "id": h.get("id"), "ok": False, "error": BadRequest(
                        reason=f"device process: no context {ctx_id}").to_wire()})
                    continue
                target.calls.put((h, frame.payload))
                if h.get("m") == "release":
                    contexts.pop(ctx_id, None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="accelmig.pool.devices.worker",
                                     description="A tenant's device process (started by accelmig-pool).")
    parser.add_argument("--fd", type=int, required=True, help="the socket to the pool")
    parser.add_argument("--device", required=True, help="opencl:N")
    parser.add_argument("--max-builds", type=int, default=2)
    parser.add_argument("--tenant", default="?", help="for the log")
    parser.add_argument("--arena-fd", type=int, default=-1,
                        help="the tenant's upload arena (a memfd the pool shares, read-only here)")
    parser.add_argument("--arena-size", type=int, default=0, help="its size in bytes")
    parser.add_argument("--sandbox", choices=("required", "off"), default="required",
                        help="required: confine this process (accelmig.pool.devices.sandbox) before "
                             "anything else, or fail to start; off: this node cannot (the pool checked), "
                             "so no build is served unless --allow-unconfined-builds")
    parser.add_argument("--allow-unconfined-builds", action="store_true",
                        help="serve builds even without the sandbox (a trusted single tenant)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"accelmig-pool device process (tenant {args.tenant}): %(message)s")
    refused = None
    confinement = None
    if args.sandbox == "required":
        # Before the socket is read, before PoCL is loaded: nothing of the
        # tenant's runs, or is even parsed, outside the sandbox.
        from accelmig.pool.devices.sandbox import confine
        try:
            confinement = confine(os.getcwd(), keep_fds=tuple(fd for fd in (args.fd, args.arena_fd) if fd >= 0))
        except Unavailable as exc:       # the pool checked it could; it cannot now: no start
            FrameWriter(socket.socket(fileno=args.fd)).send({"op": "failed", "error": exc.to_wire()})
            return 1
    elif not args.allow_unconfined_builds:
        refused = ("its device processes cannot be confined (see the pool's log at start); an operator "
                   "with one trusted tenant may set allow_unconfined_builds")
    sock = socket.socket(fileno=args.fd)
    from accelmig.pool.devices import open_backend
    try:
        backend = open_backend(args.device)
    except AccelmigError as exc:
        FrameWriter(sock).send({"op": "failed", "error": exc.to_wire()})
        return 1
    backend.builds_refused = refused
    arena = None
    if args.arena_fd >= 0:
        from accelmig.pool.devices.arena import map_child_arena
        try:
            arena = map_child_arena(args.arena_fd, args.arena_size)
        except (OSError, ValueError) as exc:
            # the pool sees "arena": 0 and sends every payload through the socket
            LOG.warning("no upload arena (every write's payload comes through the socket): %s", exc)
    try:
        serve(sock, backend, args.max_builds, arena, confinement.to_wire() if confinement else None)
    except (OSError, AccelmigError) as exc:
        LOG.warning("stopping: %s", exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
