"""Each tenant's device work in a process of its own, under a time limit.

``IsolatedBackend`` wraps a real backend spec (``opencl:N``): every tenant
gets a device process (``accelmig.pool.devices.worker``), started at its
first session and stopped once it has had none for ``idle_exit`` seconds;
its sessions' contexts live there.  So:

- a kernel that spins stalls only its tenant: other tenants' processes get
  their share of the device from the OS (or the GPU driver's time slicing);
- every call has a deadline (``time_limit``): a finish, a read or a build
  that has not answered by then gets the tenant's process killed; every
  call in flight, and every later call of the tenant's sessions, fails with
  ``KILLED`` (the pool then ends those sessions);
- quota is counted here, not in the process: a session released while its
  kernel runs gives its bytes back at once (``abandon``);
- a PoCL kernel that writes out of bounds corrupts only its own tenant's
  process, and each tenant has its own kernel cache (``POCL_CACHE_DIR``);
- the process is confined (``accelmig.pool.devices.sandbox``): its builds
  and kernels see none of the node's files, processes or network.

The process is not trusted: its answers are checked (the call they answer
must be in flight, a read's payload must have the size asked for).

A write's payload reaches the process through the tenant's upload arena
where there is room (``accelmig.pool.devices.arena``): the data plane
receives it there straight from TCP (``IsolatedContext.lease_upload``) and
the call carries only where it lies (``write_arena``); else it goes down
the socket pair as before.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from accelmig.pool.devices.arena import ArenaLease, UploadArena
from accelmig.pool.devices.base import BuildResult, DeviceBackend, DeviceContext
from accelmig.pool.devices.clops import IsolatedOps
from accelmig.pool.devices.sandbox import device_environment, probe
from accelmig.pool.devices.worker import LAUNCH_BATCH, PIPE_LIMITS, FrameWriter, encode_args
from accelmig.wire.errors import AccelmigError, Killed, NoSuchObject, ProtocolError, from_wire
from accelmig.wire.frames import FrameReader

LOG = logging.getLogger("accelmig.pool.devices")


class _Done:
    """A call's end: set once (by the answer's reader, or by the process's
    end: whoever took the call out of ``_calls``), waited for by its caller.
    One lock, not an Event's condition and lock: one is made per launch."""

    __slots__ = ("_lock", "_set")

    def __init__(self):
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self) -> None:
        if not self._set:
            self._lock.acquire()
            self._lock.release()      # (for any other waiter)


class _Call:
    __slots__ = ("ctx_id", "method", "deadline", "done", "answer", "payload", "out", "error")

    def __init__(self, ctx_id: int, method: str, deadline: float, out=None):
        self.ctx_id, self.method, self.deadline, self.out = ctx_id, method, deadline, out
        self.done = _Done()
        self.answer: dict | None = None
        self.payload = b""
        self.error: AccelmigError | None = None


class _LaunchBatch:
    """Pipelined launches of one context gathered into one ``launches`` call
    (one frame, one answer, one loop in the device process).  Written and
    read by the session's worker only."""

    __slots__ = ("launches", "shapes", "shape_of", "call", "error", "failed")

    def __init__(self):
        # Each launch is the index of its shape (program, kernel, sizes,
        # arguments): a loop's launches are one shape again and again, and
        # the process decodes and looks up each shape once a batch.  Shapes
        # are told apart by the identity of their parts, which a launch
        # batch's records share (wire.batch.RecordCache): equal content.
        self.launches: list[int] = []
        self.shapes: list = []
        self.shape_of: dict = {}
        self.call: _Call | None = None
        self.error: AccelmigError | None = None     # it could not be sent, or its call failed
        self.failed: dict | None = None             # index -> error (wire form), once answered

    def shape(self, program: int, kernel: str, gsize, lsize, args: list, goffset=None) -> int:
        """The index of this launch's shape, added if new (a global work
        offset, protocol 4, is a sixth part of it, only where there is one)."""
        key = (program, kernel, id(gsize), id(lsize), id(args), id(goffset))
        shape = self.shape_of.get(key)
        if shape is None:       # (the shapes list keeps the parts alive: ids stay theirs)
            shape = self.shape_of[key] = len(self.shapes)
            self.shapes.append([program, kernel, gsize, lsize or None, args] + ([goffset] if goffset else []))
        return shape


class TenantProcess:
    """One tenant's device process: calls out, answers back, a watchdog."""

    def __init__(self, backend: "IsolatedBackend", tenant: str, upload_arena: int = 0):
        self.backend = backend
        self.tenant = tenant
        self.dead: Killed | None = None
        self.contexts = 0
        self.idle_since: float | None = None
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Condition()
        self._watch_until = 0.0          # when the watchdog looks next (it sets it; the lock guards it)
        self.calls_started = 0           # every call sent (status, tests: a finish that skipped it)
        self.pipe_payload_bytes = 0      # payload bytes sent down the socket pair
        self.arena_bytes = 0             # write bytes the process took from the arena instead
        self.arena = self._make_arena(tenant, upload_arena)
        self.arena_ready = False         # the process said it mapped it ("ready")
        self.sandbox: dict | None = None  # the layers the process said confine it ("ready")
        self.directory = tempfile.mkdtemp(prefix=f"tenant-{_safe(tenant)}-", dir=backend.directory)
        os.makedirs(os.path.join(self.directory, "cache"))
        ours, theirs = socket.socketpair()
        # what runtimes read of the pool's environment (POCL_KERNEL_CACHE=0
        # turns the cache off; nothing else: it may hold secrets), its own
        # cache directory (the sandbox shows it at /tenant/cache)
        env = device_environment(os.environ, POCL_CACHE_DIR=os.path.join(self.directory, "cache"))
        arena_args: list[str] = []
        if self.arena is not None:
            arena_args = ["--arena-fd", str(self.arena.child_fd), "--arena-size", str(self.arena.size)]
        sandbox_args = ["--sandbox", "required" if backend.confinement is not None else "off"]
        if backend.allow_unconfined_builds:
            sandbox_args.append("--allow-unconfined-builds")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "accelmig.pool.devices.worker", "--fd", str(theirs.fileno()),
                 "--device", backend.device_spec, "--max-builds", str(backend.max_builds),
                 "--tenant", tenant, *arena_args, *sandbox_args],
                pass_fds=[theirs.fileno()] + ([self.arena.child_fd] if self.arena else []),
                cwd=self.directory, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        finally:
            theirs.close()
            if self.arena is not None:
                self.arena.close_child_fd()
        self.sock = ours
        self._frames = FrameWriter(ours)       # whole frames, one writer at a time (as the process's)
        self.reader = FrameReader(PIPE_LIMITS, payload_sink=self._payload_sink)
        # Not waiting for its "ready" here (this runs on the pool's event
        # loop): calls queue in the socket meanwhile, under their deadlines.
        LOG.info("device process of tenant %s starting: pid %d", tenant, self.proc.pid,
                 extra={"tenant": tenant, "pid": self.proc.pid})
        threading.Thread(target=self._read_answers, name=f"devproc-{tenant}-rx", daemon=True).start()
        threading.Thread(target=self._watch, name=f"devproc-{tenant}-watchdog", daemon=True).start()

    @staticmethod
    def _make_arena(tenant: str, size: int) -> UploadArena | None:
        if size <= 0:
            return None
        try:
            return UploadArena(size)
        except (OSError, ValueError) as exc:      # no memfd here, or too small: the copy path
            LOG.warning("tenant %s: no upload arena (%s); writes go through the device process's "
                        "socket", tenant, exc, extra={"tenant": tenant})
            return None

    def lease_upload(self, nbytes: int) -> ArenaLease | None:
        """Where to receive a write's payload of ``nbytes``: a lease of the
        arena, or None (no arena, not mapped yet, full, or the process is
        gone): the caller then takes a buffer of its own."""
        if self.arena is None or not self.arena_ready or self.dead is not None:
            return None
        return self.arena.lease(nbytes)

    # -- calls -------------------------------------------------------------------------
    def new_context(self) -> int:
        with self._lock:
            if self.dead is not None:
                raise self.dead
            ctx_id = next(self._ids)
            self.contexts += 1
            self.idle_since = None
        self._send({"op": "new", "ctx": ctx_id})
        return ctx_id

    def start(self, ctx_id: int, method: str, args: dict, payload=b"", out=None, cork: bool = False) -> _Call:
        """Send a call; its answer comes to ``_Call.done``.  ``cork``: it
        may wait in the writer for the next call or ``wait`` (a launch)."""
        call = _Call(ctx_id, method, self.backend.clock() + self.backend.time_limit, out)
        with self._lock:
            if self.dead is not None:
                raise self.dead
            call_id = next(self._ids)
            self._calls[call_id] = call
            self.calls_started += 1
            self.pipe_payload_bytes += len(payload)
            if call.deadline < self._watch_until:
                # the watchdog sleeps past this deadline: wake it (a call
                # after another one has a later deadline: no wake-up each)
                self._lock.notify_all()
        header = {"op": "call", "ctx": ctx_id, "id": call_id, "m": method, "a": args}
        try:
            if cork and not payload:
                self._frames.cork(header)
            else:
                self._send(header, payload)
        except OSError as exc:
            self._kill(f"its socket failed: {exc}")
        return call

    def call(self, ctx_id: int, method: str, args: dict, payload=b"", out=None):
        return self.wait(self.start(ctx_id, method, args, payload, out))

    def wait(self, call: _Call):
        """The outcome of a call: its result and payload, or its error."""
        if not call.done.is_set():
            try:
                self._frames.flush()         # it may be corked still
            except OSError as exc:
                self._kill(f"its socket failed: {exc}")
        call.done.wait()                     # the watchdog ends every call by its deadline
        if call.error is not None:
            raise call.error
        answer = call.answer
        if not answer.get("ok"):
            raise from_wire(answer.get("error") if isinstance(answer.get("error"), dict) else {})
        if call.out is not None and call.payload is not call.out:
            # a small payload comes inline in the frame: copy it where it belongs
            if len(call.payload) != len(call.out):
                self._kill(f"it sent {len(call.payload)} bytes for a read of {len(call.out)}")
                raise self.dead
            call.out[:] = call.payload
        return answer.get("r"), call.payload

    def context_released(self) -> None:
        with self._lock:
            self.contexts -= 1
            if self.contexts == 0:
                self.idle_since = self.backend.clock()
                self._lock.notify_all()

    def _send(self, header: dict, payload=b"") -> None:
        self._frames.send(header, payload)

    # -- answers -----------------------------------------------------------------------
    def _payload_sink(self, header: dict, nbytes: int):
        """A read's payload straight into the buffer the session gave, if
        the size is the one asked for; anything else is refused."""
        with self._lock:
            call = self._calls.get(header.get("id"))
        if call is None:
            raise ProtocolError(reason=f"device process answered call {header.get('id')!r}, "
                                       f"which is not in flight")
        if call.out is not None:
            if nbytes != len(call.out):
                raise ProtocolError(reason=f"device process sent {nbytes} bytes for a read of "
                                           f"{len(call.out)}")
            return call.out
        if call.method != "program_binary":
            raise ProtocolError(reason=f"device process sent a payload with {call.method}")
        return bytearray(nbytes)

    def _read_answers(self) -> None:
        try:
            self._read_until_closed()
        finally:
            self.sock.close()          # only here: no other thread reads this descriptor

    def _read_until_closed(self) -> None:
        why = "it exited"
        started = False
        try:
            while True:
                n = self.sock.recv_into(self.reader.get_buffer())
                if n == 0:
                    break
                for frame in self.reader.feed(n):
                    if not started:
                        if frame.header.get("op") != "ready":
                            error = frame.header.get("error")
                            raise ProtocolError(reason="it did not start: " + (
                                str(error.get("message")) if isinstance(error, dict) else str(frame.header)[:200]))
                        started = True
                        self.arena_ready = self.arena is not None and frame.header.get("arena") == self.arena.size
                        sandbox = frame.header.get("sandbox")
                        self.sandbox = sandbox if isinstance(sandbox, dict) else None
                        LOG.info("device process of tenant %s ready (upload arena: %s; sandbox: %s)", self.tenant,
                                 f"{self.arena.size} bytes" if self.arena_ready else "none",
                                 ", ".join(map(str, self.sandbox.get("layers", []))) if self.sandbox else "none",
                                 extra={"tenant": self.tenant})
                        continue
                    with self._lock:
                        call = self._calls.pop(frame.header.get("id"), None)
                    if call is None:
                        raise ProtocolError(reason="an answer to no call")
                    call.answer, call.payload = frame.header, frame.payload
                    call.done.set()
        except (OSError, AccelmigError) as exc:
            why = exc.kwargs.get("reason", str(exc)) if isinstance(exc, ProtocolError) else \
                f"its answers were unreadable ({exc})"
        if self.dead is not None:      # stopped or killed: said already
            return
        code = self.proc.poll()
        if code is None:
            self._kill(why)
        else:
            how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
            self._mark_dead(f"it died ({how})")

    # -- the watchdog ------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._watch_until_due():
            pass

    def _watch_until_due(self) -> bool:
        """Wait for a late call (kill: True) or idleness (stop if still idle)."""
        with self._lock:
            while self.dead is None:
                now = self.backend.clock()
                late = [c for c in self._calls.values() if c.deadline <= now]
                if late:
                    call = min(late, key=lambda c: c.deadline)
                    reason = (f"its {call.method} ran past the device time limit of "
                              f"{self.backend.time_limit:g} s")
                    break
                if self.idle_since is not None and now - self.idle_since >= self.backend.idle_exit:
                    reason = None
                    break
                deadlines = [c.deadline for c in self._calls.values()]
                if self.idle_since is not None:
                    deadlines.append(self.idle_since + self.backend.idle_exit)
                self._watch_until = min(deadlines) if deadlines else float("inf")
                self._lock.wait(self._watch_until - now if deadlines else None)
            else:
                return True
        if reason is None:
            return self.backend.stop_if_idle(self)
        self._kill(reason)
        return True

    # -- the end -----------------------------------------------------------------------
    def _mark_dead(self, reason: str) -> None:
        with self._lock:
            if self.dead is None:
                self.dead = Killed(tenant=self.tenant, reason=reason)
            calls, self._calls = list(self._calls.values()), {}
            self._lock.notify_all()
        for call in calls:
            call.error = self.dead
            call.done.set()
        self.backend.forget(self)

    def _kill(self, reason: str) -> None:
        """SIGKILL the process: the only way to stop a kernel."""
        first = self.dead is None
        self._mark_dead(reason)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        if first:
            LOG.warning("device process of tenant %s (pid %d) killed: %s; its sessions end with KILLED",
                        self.tenant, self.proc.pid, reason, extra={"tenant": self.tenant})
        self._cleanup()

    def stop(self) -> None:
        """An orderly end: close the socket (the process exits), then reap it."""
        self._mark_dead("its device process was stopped")
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.proc.wait(2)            # it exits at the socket's end, unless a kernel holds it
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        LOG.info("device process of tenant %s (pid %d) stopped", self.tenant, self.proc.pid,
                 extra={"tenant": self.tenant})
        self._cleanup()

    def _cleanup(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)   # wakes the reader, which closes it
        except OSError:
            pass
        shutil.rmtree(self.directory, ignore_errors=True)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:40] or "_"


class IsolatedBackend(DeviceBackend):
    """A device shared by tenants, each in a device process of its own,
    confined (``accelmig.pool.devices.sandbox``) where this node can: it is
    checked once, here, and said loudly when it cannot; then no build is
    served unless ``allow_unconfined_builds``."""

    def __init__(self, device_spec: str, info: dict, *, time_limit: float = 60.0,
                 max_builds: int = 2, idle_exit: float = 60.0, clock=time.monotonic,
                 allow_unconfined_builds: bool = False):
        self.device_spec = device_spec
        self.spec = device_spec
        self._info = dict(info, isolation="process")
        self.time_limit = time_limit
        self.max_builds = max_builds
        self.idle_exit = idle_exit
        self.clock = clock
        self.allow_unconfined_builds = allow_unconfined_builds
        self.directory = tempfile.mkdtemp(prefix="accelmig-pool-devices-")
        self._tenants: dict[str, TenantProcess] = {}
        self._lock = threading.Lock()
        self.confinement, why = probe(self.directory)
        if self.confinement is not None:
            LOG.info("device %s: tenants' device processes are confined: %s", device_spec,
                     self.confinement.describe())
            if self.confinement.missing:
                LOG.warning("device %s: the device processes' sandbox lacks %s (a second layer: node "
                            "paths stay invisible)", device_spec, ", ".join(self.confinement.missing))
        elif allow_unconfined_builds:
            LOG.warning("device %s: tenants' device processes cannot be confined here (%s); builds are "
                        "served anyway (allow_unconfined_builds): a build can read every file the pool "
                        "can, and a kernel can do what the pool's user can", device_spec, why)
        else:
            LOG.error("device %s: tenants' device processes cannot be confined here (%s): program builds "
                      "are REFUSED (a build could read the pool node's files); give the pool user "
                      "namespaces (docs/DESIGN.md, Device isolation) or, for one trusted tenant, set "
                      "allow_unconfined_builds = true", device_spec, why)

    def info(self) -> dict:
        return dict(self._info)

    def new_context(self, tenant: str = "", upload_arena: int = 0) -> "IsolatedContext":
        with self._lock:
            process = self._tenants.get(tenant)
            if process is None or process.dead is not None:
                process = self._tenants[tenant] = TenantProcess(self, tenant, upload_arena)
            ctx_id = process.new_context()
        return IsolatedContext(self, process, ctx_id)

    def stop_if_idle(self, process: TenantProcess) -> bool:
        """Stop a process that has had no context for ``idle_exit`` seconds,
        unless a session came for it meanwhile (False: watch on)."""
        with self._lock:
            with process._lock:
                idle = process.dead is None and process.contexts == 0 and process.idle_since is not None \
                    and self.clock() - process.idle_since >= self.idle_exit
                if not idle:
                    return process.dead is not None
            if self._tenants.get(process.tenant) is process:
                del self._tenants[process.tenant]
        process.stop()
        return True

    def forget(self, process: TenantProcess) -> None:
        with self._lock:
            if self._tenants.get(process.tenant) is process:
                del self._tenants[process.tenant]

    def trim_idle(self, idle_for: float) -> None:
        """(On the loop) idle arenas' pages go back on a thread: giving back
        256 MiB takes ~0.1 s, which the loop must not wait for."""
        with self._lock:
            processes = [p for p in self._tenants.values() if p.arena is not None and p.dead is None]
        due = [p for p in processes if p.arena.begin_trim(idle_for)]
        if due:
            threading.Thread(target=self._trim, args=(due, idle_for), name="arena-trim", daemon=True).start()

    @staticmethod
    def _trim(due: list, idle_for: float) -> None:
        for process in due:
            given = process.arena.end_trim()
            LOG.info("tenant %s: upload arena idle for %g s: its pages (up to %d MiB) given back",
                     process.tenant, idle_for, given >> 20, extra={"tenant": process.tenant})

    def processes(self) -> dict[str, int]:
        """Tenant -> pid of its device process (for status and tests)."""
        with self._lock:
            return {name: p.proc.pid for name, p in self._tenants.items() if p.dead is None}

    def close(self) -> None:
        with self._lock:
            processes, self._tenants = list(self._tenants.values()), {}
        for process in processes:
            process.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


class IsolatedContext(IsolatedOps, DeviceContext):
    """A session's context in its tenant's device process.  Buffer sizes are
    kept here too: quota is given back even when the process is gone."""

    def __init__(self, backend: IsolatedBackend, process: TenantProcess, ctx_id: int):
        self.backend, self.process, self.ctx_id = backend, process, ctx_id
        self.sizes: dict[int, int] = {}
        self.sub_sizes: dict[int, tuple[int, int]] = {}   # sub-buffer -> (parent, size): no quota (``clops``)
        self._released = False
        self._lock = threading.Lock()
        # Nothing sent since the last finish answered (launches, copies and
        # a new buffer's zeroing run on after their call returns): a finish
        # would wait for nothing.  Written by the session's worker only.
        self._quiet = False
        # Launches not sent yet: they go as one call at the next wait for
        # one of them, the next other call, or LAUNCH_BATCH of them.
        self._batch: _LaunchBatch | None = None

    def _call(self, method: str, args: dict | None = None, payload=b"", out=None):
        self._quiet = False
        self._send_batch()                   # (in order: the launches before it go first)
        return self.process.call(self.ctx_id, method, args or {}, payload, out)

    def finish_is_noop(self) -> bool:
        # (the caller knows no command of the session is in flight) a dead
        # process must still answer KILLED: the worker's path says it
        return self._quiet and self.process.dead is None

    def info(self) -> dict:
        return self.backend.info()

    def buffer_size(self, handle: int) -> int:
        try:
            return self.sizes[handle]
        except KeyError:
            sub = self.sub_buffer_size(handle)
            if sub is not None:
                return sub
            raise NoSuchObject(kind="buffer", handle=handle) from None

    def alloc(self, handle: int, nbytes: int) -> None:
        self._call("alloc", {"buf": handle, "size": nbytes})
        with self._lock:
            self.sizes[handle] = nbytes

    def free(self, handle: int) -> int:
        sub = self.check_free(handle)
        self._call("free", {"buf": handle})
        with self._lock:
            if sub:
                self.sub_sizes.pop(handle, None)
                return 0
            return self.sizes.pop(handle, 0)

    def write(self, handle: int, offset: int, data) -> None:
        self._call("write", {"buf": handle, "offset": offset}, data)

    def lease_upload(self, nbytes: int) -> ArenaLease | None:
        return self.process.lease_upload(nbytes)

    def write_leased(self, handle: int, offset: int, lease: ArenaLease, meanwhile=None, start: int = 0,
                     end: int | None = None) -> None:
        if lease.arena is not self.process.arena:     # (not this process's: the copy path)
            super().write_leased(handle, offset, lease, meanwhile, start, end)
            return
        end = lease.size if end is None else end
        self._quiet = False
        self._send_batch()
        call = self.process.start(self.ctx_id, "write_arena", {"buf": handle, "offset": offset + start,
                                                               "at": lease.offset + start, "size": end - start})
        try:
            if meanwhile is not None:
                meanwhile()          # (the pool's digest of the payload, beside the process's write)
        finally:
            self.process.wait(call)  # the lease is the caller's again only once the write is over
        with self.process._lock:
            self.process.arena_bytes += end - start

    def read_into(self, handle: int, offset: int, out: memoryview) -> None:
        view = memoryview(out).cast("B")
        self._call("read", {"buf": handle, "offset": offset, "size": len(view)}, out=view if len(view) else None)

    def copy(self, src: int, dst: int, src_offset: int, dst_offset: int, nbytes: int) -> None:
        self._call("copy", {"src": src, "dst": dst, "src_offset": src_offset, "dst_offset": dst_offset,
                            "size": nbytes})

    def _build(self, method: str, handle: int, payload: bytes, options: str) -> BuildResult:
        result, _ = self._call(method, {"prog": handle, "options": options}, payload)
        return BuildResult(kernels=list(result["kernels"]), log=str(result["log"]),
                           binary_size=int(result["binary_size"]))

    def build_source(self, handle: int, source: str, options: str) -> BuildResult:
        return self._build("build_source", handle, source.encode("utf-8"), options)

    def build_binary(self, handle: int, binary: bytes, options: str) -> BuildResult:
        return self._build("build_binary", handle, binary, options)

    def program_binary(self, handle: int) -> bytes:
        return bytes(self._call("program_binary", {"prog": handle})[1])

    def free_program(self, handle: int) -> None:
        self._call("free_program", {"prog": handle})

    def launch(self, program: int, kernel: str, gsize, lsize, args, goffset=None) -> None:
        self.process.wait(self._start_launch(program, kernel, gsize, lsize, args, goffset))

    def launch_begin(self, program: int, kernel: str, gsize, lsize, args, goffset=None):
        return self.launch_begin_wire(program, kernel, gsize, lsize, encode_args(args), goffset)

    def launch_begin_wire(self, program: int, kernel: str, gsize, lsize, args: list, goffset=None):
        # Pipelined and gathered: a call per launch cost the pool and the
        # process more than the launch; its outcome is settled before the
        # command's reply (the first settle sends the batch).  The data
        # plane's argument form is the device process's: passed on as it is.
        self._quiet = False
        batch = self._batch
        if batch is None:
            batch = self._batch = _LaunchBatch()
        index = len(batch.launches)
        batch.launches.append(batch.shape(program, kernel, gsize, lsize, args, goffset))
        if len(batch.launches) >= LAUNCH_BATCH:
            self._send_batch()
        return lambda: self._launch_outcome(batch, index)

    def launch_run_begin(self, launches: list[dict]):
        # The run's launches join the open batch in one pass (the shapes
        # found once per distinct launch header: a run's repeats share
        # theirs); a run that fills a batch goes on in the next one.
        self._quiet = False
        segments = []                  # (batch, first index in it, first index in the run, count)
        shape_by_header: dict[int, tuple] = {}
        offset, total = 0, len(launches)
        while offset < total:
            batch = self._batch
            if batch is None:
                batch = self._batch = _LaunchBatch()
            out = batch.launches
            start = len(out)
            take = min(total - offset, LAUNCH_BATCH - start)
            for launch in launches[offset:offset + take]:
                found = shape_by_header.get(id(launch))
                if found is None or found[0] is not batch:
                    shape = batch.shape(launch["prog"], launch["kernel"], launch["gsize"], launch.get("lsize"),
                                        launch["args"])
                    found = shape_by_header[id(launch)] = (batch, shape)
                out.append(found[1])
            segments.append((batch, start, offset, take))
            offset += take
            if len(out) >= LAUNCH_BATCH:
                self._send_batch()
        return lambda: self._run_failures(segments)

    def _run_failures(self, segments) -> dict[int, Exception]:
        failures: dict[int, Exception] = {}
        for batch, start, offset, count in segments:
            self._settle_batch(batch)
            if batch.error is not None:
                failures.update(dict.fromkeys(range(offset, offset + count), batch.error))
                continue
            for index, error in batch.failed.items():
                if start <= index < start + count:
                    failures[offset + index - start] = from_wire(error)
        return failures

    def _send_batch(self) -> None:
        batch, self._batch = self._batch, None
        if batch is None:
            return
        try:
            batch.call = self.process.start(self.ctx_id, "launches", {"s": batch.shapes, "l": batch.launches},
                                            cork=True)
        except AccelmigError as exc:          # the process is gone: each launch says so
            batch.error = exc

    def _settle_batch(self, batch: _LaunchBatch) -> None:
        """The batch sent (if still open) and answered: ``failed`` set, or
        ``error`` where it could not be sent or its call failed."""
        if batch is self._batch:
            self._send_batch()
        if batch.error is None and batch.failed is None:
            try:
                result, _ = self.process.wait(batch.call)
                batch.failed = self._failures(result, len(batch.launches))
            except AccelmigError as exc:     # the whole call failed (KILLED): every launch of it
                batch.error = exc

    def _launch_outcome(self, batch: _LaunchBatch, index: int) -> None:
        self._settle_batch(batch)
        if batch.error is not None:
            raise batch.error
        error = batch.failed.get(index)
        if error is not None:
            raise from_wire(error)

    def _failures(self, result, count: int) -> dict:
        """The process's answer to a batch, checked: [index, error] pairs."""
        failed = result.get("failed") if isinstance(result, dict) else None
        if not isinstance(failed, list) or not all(
                isinstance(item, list) and len(item) == 2 and isinstance(item[0], int)
                and 0 <= item[0] < count and isinstance(item[1], dict) for item in failed):
            self.process._kill(f"it answered a launch batch with {str(result)[:200]}")
            raise self.process.dead
        return {index: error for index, error in failed}

    def _start_launch(self, program, kernel, gsize, lsize, args, goffset=None):
        self._quiet = False
        self._send_batch()
        return self.process.start(self.ctx_id, "launch", {
            "prog": program, "kernel": kernel, "gsize": list(gsize),
            "lsize": list(lsize) if lsize else None, "args": encode_args(args),
            **({"goffset": list(goffset)} if goffset else {})}, cork=True)

    def finish(self) -> None:
        self._call("finish")
        self._quiet = True

    def lost(self):
        return self.process.dead

    def abandon(self) -> int:
        """The session is released, maybe while a call of its runs: its bytes
        back now (the worker's ``release`` drops the context when that call
        is over, under its deadline: a kernel that never ends is killed).
        Called from the event loop: it sends nothing."""
        with self._lock:
            # called again (by release): what was made meanwhile
            released = sum(self.sizes.values())
            self.sizes.clear()
        return released

    def release(self) -> int:
        released = self.abandon()
        with self._lock:
            first, self._released = not self._released, True
        if first:
            try:
                self._send_batch()
                self.process.start(self.ctx_id, "release", {})
            except AccelmigError:
                pass                             # the process is gone: nothing to drop
            self.process.context_released()
        return released
