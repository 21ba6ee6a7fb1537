"""The pluggable part of the pool: a device backend.

A backend owns one accelerator and hands out one ``DeviceContext`` per
session: the session's buffers, programs and in-order queue live there.  The
interface is the intersection of the OpenCL and CUDA driver APIs, small on
purpose, so a CUDA backend (CuPy) fits beside the OpenCL one.

Every method of a context is called from the session's own worker thread, in
command order; contexts never see each other's objects.
"""

from __future__ import annotations

import abc
import dataclasses


@dataclasses.dataclass(frozen=True)
class ScalarArg:
    type_name: str     # one of accelmig.wire.dataplane.SCALAR_TYPES
    raw: bytes         # little-endian bytes


@dataclasses.dataclass(frozen=True)
class LocalArg:
    nbytes: int


@dataclasses.dataclass(frozen=True)
class BufferArg:
    handle: int | None     # None: a NULL buffer (protocol 3)


@dataclasses.dataclass(frozen=True)
class RawArg:
    """A by-value argument's bytes as the kernel takes them (protocol 3:
    a struct, a vector, any scalar)."""
    raw: bytes


@dataclasses.dataclass
class BuildResult:
    kernels: list[str]
    log: str = ""
    binary_size: int = 0


def args_from_wire(args: list) -> list:
    """Validated wire arguments as ``BufferArg``, ``LocalArg``, ``ScalarArg``."""
    from accelmig.wire.dataplane import decode_scalar
    from accelmig.wire.opencl import raw_arg
    out = []
    for index, arg in enumerate(args):
        if "buf" in arg:
            out.append(BufferArg(arg["buf"]))
        elif "local" in arg:
            out.append(LocalArg(arg["local"]))
        elif "raw" in arg:
            out.append(RawArg(raw_arg(arg, index)))
        else:
            out.append(ScalarArg(arg["t"], decode_scalar(arg, index)))
    return out


class DeviceBackend(abc.ABC):
    """One accelerator device, shared by many sessions."""

    #: e.g. "opencl:0"
    spec: str

    @abc.abstractmethod
    def info(self) -> dict:
        """Name, vendor, memory sizes, limits: JSON-safe."""

    @abc.abstractmethod
    def new_context(self, tenant: str = "", upload_arena: int = 0) -> "DeviceContext":
        """A fresh per-session context with its own in-order queue, for a
        session of ``tenant`` (a backend may keep tenants apart).
        ``upload_arena``: bytes of shared memory the backend may set aside
        for the tenant's write payloads (``DeviceContext.lease_upload``)."""

    def close(self) -> None:
        """Release the device."""

    def trim_idle(self, idle_for: float) -> None:
        """Give back host memory kept for reuse that nothing used for
        ``idle_for`` seconds (upload arenas); called from the pool's janitor."""


class DeviceContext(abc.ABC):
    """One session's objects on a device.  Handles are the driver's."""

    @abc.abstractmethod
    def info(self) -> dict:
        """The device this context runs on (``DeviceBackend.info``)."""

    @abc.abstractmethod
    def alloc(self, handle: int, nbytes: int) -> None: ...

    @abc.abstractmethod
    def free(self, handle: int) -> int:
        """Free a buffer; return the bytes released."""

    @abc.abstractmethod
    def write(self, handle: int, offset: int, data) -> None: ...

    def lease_upload(self, nbytes: int):
        """Where the data plane may receive a write's payload of ``nbytes``
        so that this context takes it without a copy: an ``ArenaLease``
        (``pool.devices.arena``), or None: a buffer of the pool's own."""
        return None

    def write_leased(self, handle: int, offset: int, lease, meanwhile=None, start: int = 0,
                     end: int | None = None) -> None:
        """A write whose payload was received into ``lease`` (its bytes
        ``start`` to ``end`` of it, at ``offset + start``); ``meanwhile()``
        (which only reads the payload) runs while the write does, where the
        backend can run them side by side."""
        if meanwhile is not None:
            meanwhile()
        end = lease.size if end is None else end
        self.write(handle, offset + start, lease.view[start:end])

    @abc.abstractmethod
    def read_into(self, handle: int, offset: int, out: memoryview) -> None:
        """Read ``len(out)`` bytes from ``offset`` into ``out``."""

    @abc.abstractmethod
    def copy(self, src: int, dst: int, src_offset: int, dst_offset: int, nbytes: int) -> None: ...

    @abc.abstractmethod
    def build_source(self, handle: int, source: str, options: str) -> BuildResult: ...

    @abc.abstractmethod
    def build_binary(self, handle: int, binary: bytes, options: str) -> BuildResult: ...

    @abc.abstractmethod
    def program_binary(self, handle: int) -> bytes: ...

    @abc.abstractmethod
    def free_program(self, handle: int) -> None: ...

    @abc.abstractmethod
    def launch(self, program: int, kernel: str, gsize: list[int], lsize: list[int] | None,
               args: list, goffset: list[int] | None = None) -> None: ...

    def launch_begin(self, program: int, kernel: str, gsize: list[int], lsize: list[int] | None,
                     args: list, goffset: list[int] | None = None):
        """Start a launch without waiting for the backend to accept it: None
        when it is done already (an in-process enqueue does not wait for the
        kernel anyway), else a callable that waits for the outcome (raising
        its error).  The session settles it before it answers the command.
        ``goffset``: the global work offset (protocol 4), None for none."""
        self.launch(program, kernel, gsize, lsize, args, goffset)
        return None

    def launch_begin_wire(self, program: int, kernel: str, gsize: list[int], lsize: list[int] | None,
                          args: list, goffset: list[int] | None = None):
        """``launch_begin`` with the arguments as the data plane carries
        them (``wire.dataplane``, validated already: ``{"buf"}``,
        ``{"local"}``, ``{"t", "x"}``); a backend that passes them on as
        they are (to a device process) skips their decoding."""
        return self.launch_begin(program, kernel, gsize, lsize, args_from_wire(args), goffset)

    def launch_run_begin(self, launches: list[dict]):
        """Start a run of launches (their ``op: launch`` headers, validated
        already) as one unit; a callable that waits for them all and
        returns the failures, ``{index in the run: the exception}`` (empty
        when every launch ran).  Launches are independent: one failing
        does not stop the others, as when they came one by one."""
        failures: dict[int, Exception] = {}
        pending = []
        for index, launch in enumerate(launches):
            try:
                outcome = self.launch_begin_wire(launch["prog"], launch["kernel"], launch["gsize"],
                                                 launch.get("lsize"), launch["args"])
            except Exception as exc:
                failures[index] = exc
                continue
            if outcome is not None:
                pending.append((index, outcome))

        def settle() -> dict[int, Exception]:
            for index, outcome in pending:
                try:
                    outcome()
                except Exception as exc:
                    failures[index] = exc
            return failures
        return settle

    @abc.abstractmethod
    def finish(self) -> None: ...

    def finish_is_noop(self) -> bool:
        """True when a ``finish`` now would wait for nothing and could fail
        for nothing: the pool may then answer it on its loop, without the
        session's worker (and a device process) in the round trip.  Only a
        backend that tracks what it left running can say so: False."""
        return False

    @abc.abstractmethod
    def release(self) -> int:
        """Free everything; return the buffer bytes released."""

    def lost(self):
        """Why this context's device state is gone (its device process was
        killed: a ``Killed``), or None.  The pool asks at every sweep, so a
        session with no call in flight learns it too.  In-process contexts
        are never lost."""
        return None

    def abandon(self) -> int:
        """The session was released, perhaps while a command of its still
        runs (on another thread): the buffer bytes a backend can give back
        at once, without waiting for the device; the rest comes back from
        ``release``.  In-process contexts cannot: 0."""
        return 0

    @abc.abstractmethod
    def buffer_size(self, handle: int) -> int: ...

    # -- protocol 3 (``wire.opencl``; ``pool.devices.clops`` implements them) ----------
    def _unsupported(self, what: str):
        from accelmig.wire.errors import DeviceError
        raise DeviceError(reason=f"this device backend has no {what}")

    def fill(self, handle: int, offset: int, size: int, pattern: bytes) -> None:
        self._unsupported("fill")

    def write_rect(self, handle: int, spec, data) -> None:
        self._unsupported("rect transfers")

    def read_rect(self, handle: int, spec, out) -> None:
        self._unsupported("rect transfers")

    def copy_rect(self, src: int, dst: int, src_spec, dst_spec) -> None:
        self._unsupported("rect transfers")

    def alloc_sub(self, handle: int, parent: int, origin: int, size: int) -> None:
        self._unsupported("sub-buffers")

    def kernel_info(self, program: int, name: str) -> dict:
        self._unsupported("kernel queries")
