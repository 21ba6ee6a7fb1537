"""Every ``CL_DEVICE_*`` value of a device as its own runtime answers it,
for ``list_devices`` (data-plane protocol 3, ``wire.opencl``): what the
accelmig OpenCL driver in a guest answers ``clGetDeviceInfo`` with.

Read raw through the ICD loader (``clGetDeviceInfo`` by ctypes on the
device pyopencl holds), not through pyopencl's ``get_info``: that one knows
a fixed list of parameters and their types (it fails on
``CL_DEVICE_PRINTF_BUFFER_SIZE`` with PoCL 3.1 and lacks
``CL_DEVICE_LATEST_CONFORMANCE_VERSION_PASSED``), where the driver must
answer what the runtime itself would (clinfo compares them). The bytes are
decoded by ``wire.opencl.DEVICE_PARAMS``' kinds and bounded by its limits;
a parameter the runtime refuses (an error, a size that does not fit its
kind) is left out, and the driver answers it as the runtime did:
``CL_INVALID_VALUE``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import struct

from accelmig.wire import opencl as wcl

LOG = logging.getLogger("accelmig.pool.devices")

_CL_NAME_VERSION = struct.Struct("<I64s")     # cl_version, char name[64]
_SCALARS = {"uint": "<I", "bool": "<I", "ulong": "<Q", "size": "<Q"}


class _Loader:
    """The process's ICD loader, opened once (the pool process has it
    loaded already: pyopencl links it)."""

    _lib = None

    @classmethod
    def get(cls):
        if cls._lib is None:
            path = ctypes.util.find_library("OpenCL") or "libOpenCL.so.1"
            lib = ctypes.CDLL(path)
            lib.clGetDeviceInfo.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_size_t,
                                            ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
            lib.clGetDeviceInfo.restype = ctypes.c_int32
            cls._lib = lib
        return cls._lib


def _raw(lib, device_ptr: int, code: int) -> bytes | None:
    size = ctypes.c_size_t(0)
    if lib.clGetDeviceInfo(ctypes.c_void_p(device_ptr), code, 0, None, ctypes.byref(size)) != 0:
        return None
    if size.value > wcl.MAX_PARAM_TEXT + wcl.MAX_PARAM_LIST * _CL_NAME_VERSION.size:
        return None
    out = ctypes.create_string_buffer(max(1, size.value))
    if lib.clGetDeviceInfo(ctypes.c_void_p(device_ptr), code, size.value, out, None) != 0:
        return None
    return out.raw[:size.value]


def decode(kind: str, raw: bytes):
    """A parameter's bytes as its kind's JSON value; None if they do not fit it."""
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        if kind == "ulong" and len(raw) == 4:
            fmt = "<I"          # a bit field answered as a cl_uint (PoCL 3.1's DEVICE_ENQUEUE_CAPABILITIES)
        if len(raw) != struct.calcsize(fmt):
            return None
        value = struct.unpack(fmt, raw)[0]
        return bool(value) if kind == "bool" else value
    if kind == "str":
        text = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
        return text if len(text.encode()) <= wcl.MAX_PARAM_TEXT else None
    if kind in ("sizes", "props"):
        if len(raw) % 8:
            return None
        fmt = "<%d%s" % (len(raw) // 8, "Q" if kind == "sizes" else "q")
        values = list(struct.unpack(fmt, raw))
        return values if len(values) <= wcl.MAX_PARAM_LIST else None
    if kind == "versions":
        if len(raw) % _CL_NAME_VERSION.size or len(raw) // _CL_NAME_VERSION.size > wcl.MAX_PARAM_LIST:
            return None
        out = []
        for version, name in _CL_NAME_VERSION.iter_unpack(raw):
            out.append([version, name.split(b"\0", 1)[0].decode("utf-8", "replace")[:wcl.MAX_VERSION_NAME]])
        return out
    return None


def read_params(device_ptr: int) -> dict:
    """``{CL_DEVICE_NAME: value, ...}`` of the ``cl_device_id`` at ``device_ptr``."""
    lib = _Loader.get()
    params = {}
    for name, code, kind in wcl.DEVICE_PARAMS:
        raw = _raw(lib, device_ptr, code)
        if raw is None:
            continue
        value = decode(kind, raw)
        if value is None:
            LOG.info("device parameter %s: %d bytes that are no %s: left out", name, len(raw), kind)
            continue
        try:
            wcl.check_param(name, value)
        except Exception:          # (a runtime's odd answer: leave it out, as if refused)
            continue
        params[name] = value
    return params


def params_of_spec(spec: str) -> dict:
    """The parameters of the pool process's device ``opencl:N`` ({} for
    any other spec: a backend with no OpenCL device behind it)."""
    kind, _, index = spec.partition(":")
    if kind != "opencl" or not index.isdigit():
        return {}
    from accelmig.pool.devices import opencl
    devices = opencl._all_devices()
    number = int(index)
    if number >= len(devices):
        return {}
    return read_params(devices[number].int_ptr)
