"""OpenCL backend (pyopencl): PoCL on a CPU, GPU and FPGA vendor runtimes.

The device index ``N`` in ``opencl:N`` counts devices across all platforms,
in the order pyopencl lists them (``accelmig-pool devices`` prints it); a
device's stable id (``wire.devices``: type, a digest of platform, vendor and
name, its rank among identical ones) does not depend on that order alone.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import pyopencl as cl

from accelmig.pool.devices.base import (BufferArg, BuildResult, DeviceBackend, DeviceContext,
                                        LocalArg, RawArg, ScalarArg)
from accelmig.pool.devices.clops import OpenCLOps
from accelmig.wire.dataplane import NUMPY_NAMES
from accelmig.wire.devices import assign_ids, device_type
from accelmig.wire.errors import (BuildFailed, DeviceError, Forbidden, NoSuchObject, ObjectExists,
                                  OutOfRange, Unavailable)

LOG = logging.getLogger(__name__)
_DTYPES = {name: np.dtype(numpy_name).newbyteorder("<") for name, numpy_name in NUMPY_NAMES.items()}
#: the same types in the host's order, for ``set_scalar_arg_dtypes`` (its
#: invoker packs each value natively, as the host's device reads it)
_NATIVE_DTYPES = {name: np.dtype(numpy_name) for name, numpy_name in NUMPY_NAMES.items()}
#: argument-type signatures per kernel that get a typed kernel of their own
#: (a hostile tenant could make up many; past this many a kernel's other
#: signatures take the untyped path: slower, never wrong)
TYPED_SIGNATURES = 8
#: the OpenCL platform name of accelmig's own driver (icd/): never a device of a pool
ACCELMIG_PLATFORM = "accelmig"


def _all_devices() -> list[cl.Device]:
    try:
        platforms = cl.get_platforms()
    except cl.Error as exc:  # no ICD at all
        LOG.warning("no OpenCL platform: %s", exc)
        return []
    devices: list[cl.Device] = []
    for platform in platforms:
        if platform.name.strip() == ACCELMIG_PLATFORM:
            continue    # the accelmig driver itself (a guest's ICD installed here): its devices are this pool's
        try:
            devices.extend(platform.get_devices())
        except cl.Error:
            continue
    return devices


def _describe(device: cl.Device) -> dict:
    return {
        "name": device.name.strip(),
        "vendor": device.vendor.strip(),
        "platform": device.platform.name.strip(),
        "version": device.version.strip(),
        "driver_version": device.driver_version.strip(),
        "type": device_type(int(device.type)),
        "cl_type": cl.device_type.to_string(device.type),
        "global_mem_size": int(device.global_mem_size),
        "max_mem_alloc_size": int(device.max_mem_alloc_size),
        "max_work_group_size": int(device.max_work_group_size),
        "max_compute_units": int(device.max_compute_units),
    }


def list_devices() -> list[dict]:
    described = [dict(_describe(dev), spec=f"opencl:{i}", index=i) for i, dev in enumerate(_all_devices())]
    for dev, device_id in zip(described, assign_ids(described)):
        dev["id"] = device_id
    return described


def index_of(device_id: str) -> int:
    """The ``opencl:N`` index of a device by its stable id, in this process."""
    found = list_devices()
    for dev in found:
        if dev["id"] == device_id:
            return dev["index"]
    raise Unavailable(what=f"OpenCL device {device_id}",
                      reason="present: " + (", ".join(d["id"] for d in found) or "none"))


class OpenCLBackend(DeviceBackend):
    """One device in this process.  ``builds_refused``: why no program may
    be built here (nothing confines what a build reads: the pool's own
    process, or a device process that could not be confined), or None."""

    def __init__(self, index: int = 0, builds_refused: str | None = None):
        self.builds_refused = builds_refused
        devices = _all_devices()
        if not 0 <= index < len(devices):
            raise Unavailable(what=f"OpenCL device {index}",
                              reason=f"{len(devices)} OpenCL device(s) present")
        self.spec = f"opencl:{index}"
        self.device = devices[index]
        self.context = cl.Context([self.device])
        described = list_devices()[index]
        self._info = dict(described, backend="opencl")
        self._info.pop("index", None)
        LOG.info("device %s: %s (%s)", self.spec, self._info["name"], self._info["platform"])

    def info(self) -> dict:
        return dict(self._info)

    def new_context(self, tenant: str = "", upload_arena: int = 0) -> "OpenCLContext":
        return OpenCLContext(self)


def _cl_error(exc: Exception) -> DeviceError:
    # the runtime's own error code travels too: the OpenCL driver in the
    # guest answers the application with it (wire.opencl)
    code = getattr(exc, "code", None)
    return DeviceError(reason=str(exc).strip() or type(exc).__name__,
                       details={"cl_error": code} if isinstance(code, int) else None)


class OpenCLContext(OpenCLOps, DeviceContext):
    def __init__(self, backend: OpenCLBackend):
        self.backend = backend
        self.queue = cl.CommandQueue(backend.context, backend.device)
        self.buffers: dict[int, tuple[cl.Buffer, int]] = {}
        self.subs: dict[int, int] = {}        # sub-buffer -> its parent (``clops``: no bytes of their own)
        self.programs: dict[int, cl.Program] = {}
        # (program, name): the kernel; (program, name, signature): a kernel
        # told its scalar arguments' types (``_typed_kernel``)
        self.kernels: dict[tuple, cl.Kernel] = {}
        # The prepared launch whose arguments its kernel holds now (an
        # OpenCL kernel keeps them between enqueues): the same one again
        # skips set_args.  Every set_args goes through enqueue_launch.
        self._args_set_for: tuple | None = None
        self._lock = threading.Lock()  # release() may come from another thread

    def info(self) -> dict:
        return self.backend.info()

    # -- lookups -----------------------------------------------------------------

    def _buffer(self, handle: int) -> tuple[cl.Buffer, int]:
        try:
            return self.buffers[handle]
        except KeyError:
            raise NoSuchObject(kind="buffer", handle=handle) from None

    def _program(self, handle: int) -> cl.Program:
        try:
            return self.programs[handle]
        except KeyError:
            raise NoSuchObject(kind="program", handle=handle) from None

    @staticmethod
    def _check_range(what: str, offset: int, nbytes: int, size: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > size:
            raise OutOfRange(what=what, offset=offset, size=nbytes, limit=size)

    def buffer_size(self, handle: int) -> int:
        return self._buffer(handle)[1]

    # -- buffers -----------------------------------------------------------------
    def alloc(self, handle: int, nbytes: int) -> None:
        if handle in self.buffers:
            raise ObjectExists(kind="buffer", handle=handle)
        try:
            buf = cl.Buffer(self.backend.context, cl.mem_flags.READ_WRITE, max(nbytes, 1))
            # Zeroed: device memory is recycled, and what a session freed must
            # not be read by the next one (of any tenant).
            cl.enqueue_fill_buffer(self.queue, buf, np.zeros(1, np.uint8), 0, max(nbytes, 1))
        except cl.Error as exc:
            raise _cl_error(exc) from None
        self.buffers[handle] = (buf, nbytes)

    def free(self, handle: int) -> int:
        buf, size = self._buffer(handle)
        sub = self.check_free(handle)
        del self.buffers[handle]
        self.subs.pop(handle, None)
        buf.release()
        return 0 if sub else size

    def write(self, handle: int, offset: int, data) -> None:
        buf, size = self._buffer(handle)
        nbytes = memoryview(data).nbytes
        self._check_range(f"write to buffer {handle}", offset, nbytes, size)
        if nbytes:
            try:
                cl.enqueue_copy(self.queue, buf, data, dst_offset=offset, is_blocking=True)
            except cl.Error as exc:
                raise _cl_error(exc) from None

    def read_into(self, handle: int, offset: int, out: memoryview) -> None:
        buf, size = self._buffer(handle)
        nbytes = out.nbytes
        self._check_range(f"read of buffer {handle}", offset, nbytes, size)
        if nbytes:
            try:
                cl.enqueue_copy(self.queue, out, buf, src_offset=offset, is_blocking=True)
            except cl.Error as exc:
                raise _cl_error(exc) from None

    def copy(self, src: int, dst: int, src_offset: int, dst_offset: int, nbytes: int) -> None:
        sbuf, ssize = self._buffer(src)
        dbuf, dsize = self._buffer(dst)
        self._check_range(f"copy from buffer {src}", src_offset, nbytes, ssize)
        self._check_range(f"copy to buffer {dst}", dst_offset, nbytes, dsize)
        if nbytes:
            try:
                cl.enqueue_copy(self.queue, dbuf, sbuf, byte_count=nbytes,
                                src_offset=src_offset, dst_offset=dst_offset)
            except cl.Error as exc:
                raise _cl_error(exc) from None

    # -- programs ----------------------------------------------------------------
    def _finish_build(self, handle: int, program: cl.Program, options: str) -> BuildResult:
        device = self.backend.device
        try:
            program.build(options=options.split(), devices=[device])
        except cl.Error as exc:
            try:
                log = program.get_build_info(device, cl.program_build_info.LOG)
            except cl.Error:
                log = str(exc)
            raise BuildFailed(reason=str(exc).splitlines()[0] if str(exc) else "build error",
                              details={"log": log}) from None
        log = program.get_build_info(device, cl.program_build_info.LOG) or ""
        # KERNEL_NAMES, not all_kernels(): that one leaks about 1 MiB a build
        # (pyopencl 2026.1 with PoCL 3.1, found by the soak test)
        names = [n for n in program.get_info(cl.program_info.KERNEL_NAMES).split(";") if n]
        self.programs[handle] = program
        sizes = program.get_info(cl.program_info.BINARY_SIZES)
        return BuildResult(kernels=sorted(names), log=log.strip(), binary_size=int(sizes[0]))

    def _check_builds_allowed(self) -> None:
        if self.backend.builds_refused:
            raise Forbidden(who="a tenant", what=f"build programs on this pool node: {self.backend.builds_refused}")

    def build_source(self, handle: int, source: str, options: str) -> BuildResult:
        self._check_builds_allowed()
        if handle in self.programs:
            raise ObjectExists(kind="program", handle=handle)
        try:
            program = cl.Program(self.backend.context, source)
        except cl.Error as exc:
            raise BuildFailed(reason=str(exc), details={"log": str(exc)}) from None
        return self._finish_build(handle, program, options)

    def build_binary(self, handle: int, binary: bytes, options: str) -> BuildResult:
        self._check_builds_allowed()         # (a binary is native code: the same reach)
        if handle in self.programs:
            raise ObjectExists(kind="program", handle=handle)
        try:
            program = cl.Program(self.backend.context, [self.backend.device], [bytes(binary)])
        except cl.Error as exc:
            raise BuildFailed(reason=f"device binary refused: {exc}", details={"log": str(exc)}) from None
        return self._finish_build(handle, program, options)

    def program_binary(self, handle: int) -> bytes:
        return bytes(self._program(handle).get_info(cl.program_info.BINARIES)[0])

    def free_program(self, handle: int) -> None:
        self._program(handle)
        del self.programs[handle]
        for key in [k for k in self.kernels if k[0] == handle]:
            del self.kernels[key]

    # -- execution ---------------------------------------------------------------
    def _kernel(self, program: int, name: str) -> cl.Kernel:
        key = (program, name)
        kernel = self.kernels.get(key)
        if kernel is None:
            prg = self._program(program)
            try:
                kernel = cl.Kernel(prg, name)
            except cl.Error:
                raise NoSuchObject(kind=f"kernel named {name!r} in program", handle=program) from None
            self.kernels[key] = kernel
        return kernel

    def launch(self, program: int, kernel: str, gsize, lsize, args, goffset=None) -> None:
        self.enqueue_launch(self.prepare_launch(program, kernel, gsize, lsize, args, goffset))

    def prepare_launch(self, program: int, kernel: str, gsize, lsize, args, goffset=None) -> tuple:
        """Everything a launch needs looked up and converted (the kernel,
        its arguments, the sizes), for ``enqueue_launch``: once for many
        launches of the same shape, while nothing it names changes."""
        k = self._kernel(program, kernel)
        cl_args = []
        signature = []
        for arg in args:
            if isinstance(arg, BufferArg):
                cl_args.append(None if arg.handle is None else self._buffer(arg.handle)[0])
                signature.append(None)
            elif isinstance(arg, ScalarArg):
                cl_args.append(np.frombuffer(arg.raw, dtype=_DTYPES[arg.type_name])[0])
                signature.append(arg.type_name)
            elif isinstance(arg, LocalArg):
                cl_args.append(cl.LocalMemory(arg.nbytes))
                signature.append(None)
            elif isinstance(arg, RawArg):
                cl_args.append(np.frombuffer(arg.raw, np.uint8))     # its bytes as they are
                signature.append(None)
            else:  # pragma: no cover - the session layer only builds these three
                raise DeviceError(reason=f"unknown argument {arg!r}")
        try:
            if len(cl_args) != k.num_args:
                raise DeviceError(reason=f"kernel {kernel!r} takes {k.num_args} arguments, "
                                         f"{len(cl_args)} given")
            if any(signature):
                k = self._typed_kernel(program, kernel, tuple(signature), k)
        except cl.Error as exc:
            raise _cl_error(exc) from None
        return k, cl_args, tuple(gsize), tuple(lsize) if lsize else None, tuple(goffset) if goffset else None

    def _typed_kernel(self, program: int, name: str, signature: tuple, untyped: cl.Kernel) -> cl.Kernel:
        """The kernel for launches whose scalar arguments have these types:
        told them once (``set_scalar_arg_dtypes``), its ``set_args`` packs
        them in ~0.5 µs, where pyopencl's untyped one took ~10 µs per
        scalar argument (measured on PoCL 3.1, 2026-12-04). A kernel object
        of its own per signature: telling a kernel its types costs a look in
        pyopencl's on-disk invoker cache, too slow to repeat when one
        kernel is launched with two signatures in turn."""
        key = (program, name, signature)
        typed = self.kernels.get(key)
        if typed is None:
            if sum(1 for other in self.kernels if len(other) == 3 and other[:2] == key[:2]) >= TYPED_SIGNATURES:
                return untyped
            typed = cl.Kernel(self._program(program), name)
            typed.set_scalar_arg_dtypes([None if t is None else _NATIVE_DTYPES[t] for t in signature])
            self.kernels[key] = typed
        return typed

    def enqueue_launch(self, prepared: tuple) -> None:
        k, cl_args, gsize, lsize, goffset = prepared
        try:
            if self._args_set_for is not prepared:
                self._args_set_for = None        # (until set: a failed set_args leaves them unknown)
                k.set_args(*cl_args)
                self._args_set_for = prepared
            cl.enqueue_nd_range_kernel(self.queue, k, gsize, lsize, global_work_offset=goffset)
        except cl.Error as exc:
            raise _cl_error(exc) from None

    def finish(self) -> None:
        try:
            self.queue.finish()
        except cl.Error as exc:
            raise _cl_error(exc) from None

    def release(self) -> int:
        with self._lock:
            released = 0
            try:
                self.queue.finish()
            except cl.Error:
                pass
            for handle, (buf, size) in self.buffers.items():
                if handle not in self.subs:
                    released += size
                buf.release()
            self.buffers.clear()
            self.subs.clear()
            self.kernels.clear()
            self.programs.clear()
            return released
