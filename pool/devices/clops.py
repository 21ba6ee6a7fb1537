"""The device side of data-plane protocol 3 (``wire.opencl``): fill, rect
transfers, sub-buffers and kernel queries, for each backend.

- ``OpenCLOps``: on a real OpenCL context (``pool.devices.opencl``);
- ``IsolatedOps``: the same calls forwarded to the tenant's device process
  (``pool.devices.isolated``), which runs them with ``run_in_device_process``
  (``pool.devices.worker``).

Rectangles travel as ``RectSpec`` tuples (origin, region, row pitch, slice
pitch: pitches resolved, ``wire.opencl.Rect``), checked against the buffer
here before the runtime sees them (``OUT_OF_RANGE``): a runtime's own check
is not relied on for memory safety.

Sub-buffers share their parent's memory: they cost the tenant no quota
(their bytes are counted once, with the parent), and a parent with live
sub-buffers cannot be freed (its bytes would go back to the quota while
the sub-buffers still held them).
"""

from __future__ import annotations

from typing import NamedTuple

from accelmig.wire.errors import BadRequest, DeviceError, NoSuchObject, ObjectExists, OutOfRange


class RectSpec(NamedTuple):
    origin: tuple
    region: tuple
    row_pitch: int
    slice_pitch: int

    @classmethod
    def of(cls, rect) -> "RectSpec":
        """From a ``wire.opencl.Rect`` (or a list, as a call carries it)."""
        if isinstance(rect, (list, tuple)):
            origin, region, row, slab = rect
            return cls(tuple(origin), tuple(region), int(row), int(slab))
        return cls(tuple(rect.origin), tuple(rect.region), rect.row_pitch, rect.slice_pitch)

    @property
    def extent(self) -> int:
        x, y, z = self.origin
        width, height, depth = self.region
        return z * self.slice_pitch + y * self.row_pitch + x + (depth - 1) * self.slice_pitch \
            + (height - 1) * self.row_pitch + width

    @property
    def packed_size(self) -> int:
        width, height, depth = self.region
        return width * height * depth


def check_rect(what: str, spec: RectSpec, size: int) -> None:
    if spec.extent > size:
        raise OutOfRange(what=what, offset=spec.extent - spec.packed_size, size=spec.packed_size, limit=size)


KERNEL_ARG_FIELDS = (("address", "ADDRESS_QUALIFIER"), ("access", "ACCESS_QUALIFIER"),
                     ("type", "TYPE_NAME"), ("type_qualifier", "TYPE_QUALIFIER"), ("name", "NAME"))
WORK_GROUP_FIELDS = (("size", "WORK_GROUP_SIZE"), ("compile_size", "COMPILE_WORK_GROUP_SIZE"),
                     ("local_mem", "LOCAL_MEM_SIZE"), ("preferred_multiple", "PREFERRED_WORK_GROUP_SIZE_MULTIPLE"),
                     ("private_mem", "PRIVATE_MEM_SIZE"))
#: a kernel's argument info: type and argument names at most this long
MAX_ARG_TEXT = 256


class OpenCLOps:
    """Protocol 3's operations on ``OpenCLContext`` (a mixin: its queue,
    buffers, programs and kernels)."""

    #: (set by ``OpenCLContext``) sub-buffer handle -> its parent's handle
    subs: dict

    def is_sub_buffer(self, handle: int) -> bool:
        return handle in self.subs

    def check_free(self, handle: int) -> bool:
        """True for a sub-buffer (no bytes come back); BadRequest for a
        parent whose sub-buffers live on."""
        if handle in self.subs:
            return True
        if handle in self.subs.values():
            held = sorted(h for h, parent in self.subs.items() if parent == handle)
            raise BadRequest(reason=f"buffer {handle} has live sub-buffers {held[:8]}: free them first")
        return False

    def fill(self, handle: int, offset: int, size: int, pattern: bytes) -> None:
        import numpy as np
        import pyopencl as cl
        buf, limit = self._buffer(handle)
        self._check_range(f"fill of buffer {handle}", offset, size, limit)
        if size:
            try:
                cl.enqueue_fill_buffer(self.queue, buf, np.frombuffer(bytes(pattern), np.uint8), offset, size)
            except cl.Error as exc:
                raise _cl_error(exc) from None

    def write_rect(self, handle: int, spec: RectSpec, data) -> None:
        import pyopencl as cl
        buf, limit = self._buffer(handle)
        check_rect(f"write_rect to buffer {handle}", spec, limit)
        width, height, _ = spec.region
        try:
            cl.enqueue_copy(self.queue, buf, memoryview(data).cast("B"), buffer_origin=spec.origin,
                            host_origin=(0, 0, 0), region=spec.region,
                            buffer_pitches=(spec.row_pitch, spec.slice_pitch),
                            host_pitches=(width, width * height), is_blocking=True)
        except cl.Error as exc:
            raise _cl_error(exc) from None

    def read_rect(self, handle: int, spec: RectSpec, out) -> None:
        import pyopencl as cl
        buf, limit = self._buffer(handle)
        check_rect(f"read_rect of buffer {handle}", spec, limit)
        view = memoryview(out).cast("B")
        if len(view) != spec.packed_size:
            raise BadRequest(reason=f"read_rect: {len(view)} bytes to read {spec.packed_size} into")
        width, height, _ = spec.region
        try:
            cl.enqueue_copy(self.queue, view, buf, buffer_origin=spec.origin, host_origin=(0, 0, 0),
                            region=spec.region, buffer_pitches=(spec.row_pitch, spec.slice_pitch),
                            host_pitches=(width, width * height), is_blocking=True)
        except cl.Error as exc:
            raise _cl_error(exc) from None

    def copy_rect(self, src: int, dst: int, src_spec: RectSpec, dst_spec: RectSpec) -> None:
        import pyopencl as cl
        sbuf, ssize = self._buffer(src)
        dbuf, dsize = self._buffer(dst)
        check_rect(f"copy_rect from buffer {src}", src_spec, ssize)
        check_rect(f"copy_rect to buffer {dst}", dst_spec, dsize)
        if src_spec.region != dst_spec.region:
            raise BadRequest(reason="copy_rect: the source and destination regions differ")
        try:
            cl.enqueue_copy(self.queue, dbuf, sbuf, src_origin=src_spec.origin, dst_origin=dst_spec.origin,
                            region=src_spec.region, src_pitches=(src_spec.row_pitch, src_spec.slice_pitch),
                            dst_pitches=(dst_spec.row_pitch, dst_spec.slice_pitch))
        except cl.Error as exc:
            raise _cl_error(exc) from None

    def alloc_sub(self, handle: int, parent: int, origin: int, size: int) -> None:
        import pyopencl as cl
        if handle in self.buffers:
            raise ObjectExists(kind="buffer", handle=handle)
        if self.is_sub_buffer(parent):
            raise BadRequest(reason=f"buffer {parent} is a sub-buffer: a sub-buffer has none of its own")
        buf, limit = self._buffer(parent)
        self._check_range(f"sub-buffer of buffer {parent}", origin, size, limit)
        try:
            sub = buf.get_sub_region(origin, size)
        except cl.Error as exc:
            raise _cl_error(exc) from None
        self.buffers[handle] = (sub, size)
        self.subs[handle] = parent

    def kernel_info(self, program: int, name: str) -> dict:
        import pyopencl as cl
        kernel = self._kernel(program, name)
        device = self.backend.device
        try:
            nargs = int(kernel.num_args)
            attributes = str(kernel.get_info(cl.kernel_info.ATTRIBUTES) or "")[:MAX_ARG_TEXT * 4]
            work_group = {}
            for key, param in WORK_GROUP_FIELDS:
                value = kernel.get_work_group_info(getattr(cl.kernel_work_group_info, param), device)
                work_group[key] = [int(v) for v in value] if isinstance(value, (list, tuple)) else int(value)
        except cl.Error as exc:
            raise _cl_error(exc) from None
        args = []
        for index in range(nargs):
            try:
                arg = {}
                for key, param in KERNEL_ARG_FIELDS:
                    value = kernel.get_arg_info(index, getattr(cl.kernel_arg_info, param))
                    arg[key] = str(value)[:MAX_ARG_TEXT] if isinstance(value, str) else int(value)
            except cl.Error:       # built without -cl-kernel-arg-info (a binary): not available
                arg = None
            args.append(arg)
        return {"num_args": nargs, "attributes": attributes, "args": args, "work_group": work_group}


def _cl_error(exc) -> DeviceError:
    from accelmig.pool.devices.opencl import _cl_error as describe
    return describe(exc)


class IsolatedOps:
    """Protocol 3's operations on ``IsolatedContext``: calls to the tenant's
    device process. Sub-buffers' sizes are kept apart from ``sizes`` (which
    is what the quota gets back)."""

    #: (set by ``IsolatedContext``) sub-buffer handle -> (its parent's handle, its size)
    sub_sizes: dict

    def sub_buffer_size(self, handle: int) -> int | None:
        entry = self.sub_sizes.get(handle)
        return None if entry is None else entry[1]

    def check_free(self, handle: int) -> bool:
        """True for a sub-buffer (no bytes come back); BadRequest for a
        parent whose sub-buffers live on."""
        subs = self.sub_sizes
        if handle in subs:
            return True
        if any(parent == handle for parent, _ in subs.values()):
            held = sorted(h for h, (parent, _) in subs.items() if parent == handle)
            raise BadRequest(reason=f"buffer {handle} has live sub-buffers {held[:8]}: free them first")
        return False


    def fill(self, handle: int, offset: int, size: int, pattern: bytes) -> None:
        self._call("fill", {"buf": handle, "offset": offset, "size": size, "pattern": bytes(pattern).hex()})

    def write_rect(self, handle: int, spec: RectSpec, data) -> None:
        self._call("write_rect", {"buf": handle, "rect": list(spec)}, data)

    def read_rect(self, handle: int, spec: RectSpec, out) -> None:
        view = memoryview(out).cast("B")
        self._call("read_rect", {"buf": handle, "rect": list(spec)}, out=view if len(view) else None)

    def copy_rect(self, src: int, dst: int, src_spec: RectSpec, dst_spec: RectSpec) -> None:
        self._call("copy_rect", {"src": src, "dst": dst, "src_rect": list(src_spec), "dst_rect": list(dst_spec)})

    def alloc_sub(self, handle: int, parent: int, origin: int, size: int) -> None:
        if handle in self.sizes or handle in self.sub_sizes:
            raise ObjectExists(kind="buffer", handle=handle)
        self._call("alloc_sub", {"buf": handle, "parent": parent, "origin": origin, "size": size})
        with self._lock:
            self.sub_sizes[handle] = (parent, size)

    def kernel_info(self, program: int, name: str) -> dict:
        result, _ = self._call("kernel_info", {"prog": program, "kernel": name})
        return checked_kernel_info(result)


def checked_kernel_info(result) -> dict:
    """A device process's answer to ``kernel_info``, checked (the process
    is not trusted: a tenant's kernel may have rewritten its memory)."""
    def fail(why: str):
        raise DeviceError(reason=f"the device process answered kernel_info with {why}")
    if not isinstance(result, dict) or set(result) != {"num_args", "attributes", "args", "work_group"}:
        fail("an odd shape")
    nargs, args = result["num_args"], result["args"]
    if not isinstance(nargs, int) or not 0 <= nargs <= 4096 or not isinstance(args, list) or len(args) != nargs:
        fail("an argument count that does not add up")
    for arg in args:
        if arg is None:
            continue
        if not isinstance(arg, dict) or set(arg) != {k for k, _ in KERNEL_ARG_FIELDS}:
            fail("an odd argument")
        if not all(isinstance(arg[k], int) for k in ("address", "access", "type_qualifier")) or \
                not all(isinstance(arg[k], str) and len(arg[k]) <= MAX_ARG_TEXT for k in ("type", "name")):
            fail("an odd argument")
    work_group = result["work_group"]
    if not isinstance(work_group, dict) or set(work_group) != {k for k, _ in WORK_GROUP_FIELDS}:
        fail("odd work-group info")
    if not isinstance(result["attributes"], str) or len(result["attributes"]) > MAX_ARG_TEXT * 4:
        fail("odd attributes")
    return result


#: what the device process runs for these methods (``pool.devices.worker``)
DEVICE_PROCESS_METHODS = frozenset({"fill", "write_rect", "read_rect", "copy_rect", "alloc_sub", "kernel_info"})


def run_in_device_process(ctx, method: str, a: dict, payload) -> tuple:
    """One call of protocol 3 in the device process: (result, payload)."""
    if method == "fill":
        ctx.fill(a["buf"], a["offset"], a["size"], bytes.fromhex(a["pattern"]))
    elif method == "write_rect":
        ctx.write_rect(a["buf"], RectSpec.of(a["rect"]), payload)
    elif method == "read_rect":
        spec = RectSpec.of(a["rect"])
        out = bytearray(spec.packed_size)
        ctx.read_rect(a["buf"], spec, out)
        return None, out
    elif method == "copy_rect":
        ctx.copy_rect(a["src"], a["dst"], RectSpec.of(a["src_rect"]), RectSpec.of(a["dst_rect"]))
    elif method == "alloc_sub":
        ctx.alloc_sub(a["buf"], a["parent"], a["origin"], a["size"])
    elif method == "kernel_info":
        return ctx.kernel_info(a["prog"], a["kernel"]), b""
    else:  # pragma: no cover - the caller checks DEVICE_PROCESS_METHODS
        raise NoSuchObject(kind="device process method", handle=method)
    return None, b""
