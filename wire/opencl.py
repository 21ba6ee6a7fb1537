"""What the OpenCL API needs of the data plane beyond today's commands:
data-plane protocol version 3 (``dataplane.PROTOCOL_VERSIONS``), spoken by
the accelmig OpenCL driver (``icd/``, a C library: ``libaccelmig-opencl.so``).

Versions 1 and 2 are untouched: a connection that agreed to fewer than 3
gets ``PROTOCOL_ERROR`` for anything below, and the pool answers its old
commands exactly as before.

Connection level (before ``open``, as often as needed, then ``open`` or
``resume`` or nothing)::

    {"op": "list_devices", "token": T}
      -> {"op": "devices", "devices": [{"id", "type", "name", "vendor",
                                         "platform", "global_mem_size", ...,
                                         "cl": {PARAM: value, ...}}, ...]}

  Every device of the node a tenant may open a session on (``open``'s
  ``device`` takes the id), each with ``cl``: the values of ``DEVICE_PARAMS``
  as the device's own runtime answers ``clGetDeviceInfo`` (read raw through
  the ICD loader, ``pool.devices.deviceinfo``), typed by ``PARAM_KINDS``. A
  parameter the runtime refuses is absent. An unknown token is
  ``AUTH_FAILED`` and closes the connection, as for ``open``.

Sequenced commands (pipelined unless said otherwise; handles the driver's)::

    fill        buf, offset, size, pattern (hex, 1-128 bytes, a power of two;
                offset and size multiples of its length)
    write_rect  buf, origin [x bytes, y, z], region [w bytes, h, d],
                row_pitch, slice_pitch; payload: the region packed
                (w * h * d bytes, rows then slices)
    read_rect   the same fields; waits; reply payload: the region packed
    copy_rect   src, dst, src_origin, dst_origin, region, src_row_pitch,
                src_slice_pitch, dst_row_pitch, dst_slice_pitch
    alloc_sub   buf (the new handle), parent, origin, size: a sub-buffer
                (no memory of its own: no quota; one object)
    kernel_info prog, kernel; waits; reply "kernel": {"num_args",
                "attributes", "args": [{"address", "access", "type",
                "type_qualifier", "name"} or null], "work_group": {"size",
                "compile_size", "local_mem", "preferred_multiple",
                "private_mem"}}

A pitch of 0 means "packed" (``row_pitch = w``, ``slice_pitch = row_pitch *
h``), as in OpenCL. Every extent is checked against ``MAX_INT`` before it is
used, and against the buffer by the pool (``OUT_OF_RANGE``).

Launch arguments gain (v3 only) ``{"raw": HEX}``: a by-value argument's
bytes as the kernel takes them (a struct, a vector, any scalar: at most
``MAX_RAW_ARG`` bytes), and ``{"buf": null}``: a NULL buffer.

Version 4 adds a launch's global work offset: ``"goffset": [x, y, z]``
(as many entries as ``gsize``, each from 0, ``goffset + gsize`` within
2**63-1), what ``clEnqueueNDRangeKernel``'s ``global_work_offset`` gives;
absent or all zeros, none. A connection that agreed to 3 gets
``PROTOCOL_ERROR`` for it (a pool that ignored it would run the kernel on
the wrong work-items).

Profiling: ``launch``, ``write``, ``read``, ``copy``, ``fill``,
``write_rect``, ``read_rect`` and ``copy_rect`` may carry ``"prof": true``;
the pool then runs the command alone (the session's queue drained before
and after it) and its reply carries ``"times": [queued, submit, start,
end]``, nanoseconds of the pool's monotonic clock: when its worker took the
command, when the queue before it was drained (submit = start), and when
the command had completed. Such a command is not answered before it has
completed.

Standard library only (the guest side imports it; Python 3.9+).
"""

from __future__ import annotations

from accelmig.wire.errors import BadRequest
from accelmig.wire.values import is_int

#: the data-plane protocol version that brought what this module describes
OPENCL_VERSION = 3
#: the version that brought a launch's global work offset (``goffset``)
OFFSET_VERSION = 4

#: a by-value kernel argument's bytes, at most (CL_DEVICE_MAX_PARAMETER_SIZE
#: is 1024 at least on every full-profile device; 4 KiB leaves room)
MAX_RAW_ARG = 4096
#: fill patterns: 1 to 128 bytes, a power of two (OpenCL's rule)
FILL_PATTERN_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
#: the ops that may carry ``"prof": true``
PROFILED_OPS = frozenset({"launch", "write", "read", "copy", "fill", "write_rect", "read_rect", "copy_rect"})

MAX_INT = (1 << 63) - 1

# -- device parameters ----------------------------------------------------------------
#
# kind -> how the value travels (JSON) and what C type the driver answers with:
#   uint    int 0..2**32-1            cl_uint (also cl_bool's 0/1 kept as bool)
#   bool    true/false                cl_bool
#   ulong   int 0..2**64-1            cl_ulong, every cl_bitfield
#   size    int 0..2**64-1            size_t
#   str     string                    char[], NUL-terminated
#   sizes   [int, ...]                size_t[]
#   props   [int, ...]                cl_device_partition_property[] (intptr_t)
#   versions [[version, name], ...]   cl_name_version[] (name < 64 bytes)
PARAM_KINDS = ("uint", "bool", "ulong", "size", "str", "sizes", "props", "versions")

#: (name, code, kind) of every CL_DEVICE_* a driver answers from the pool:
#: OpenCL 1.0 to 3.0, as clinfo asks them. CL_DEVICE_PLATFORM,
#: CL_DEVICE_PARENT_DEVICE, CL_DEVICE_REFERENCE_COUNT and
#: CL_DEVICE_PARTITION_TYPE are the driver's own (objects of its process).
#: The C driver keeps the same table (icd/src/devparams.c); a test holds
#: them equal (tests/icd/test_driver.py).
DEVICE_PARAMS = (
    ("CL_DEVICE_TYPE", 0x1000, "ulong"),
    ("CL_DEVICE_VENDOR_ID", 0x1001, "uint"),
    ("CL_DEVICE_MAX_COMPUTE_UNITS", 0x1002, "uint"),
    ("CL_DEVICE_MAX_WORK_ITEM_DIMENSIONS", 0x1003, "uint"),
    ("CL_DEVICE_MAX_WORK_GROUP_SIZE", 0x1004, "size"),
    ("CL_DEVICE_MAX_WORK_ITEM_SIZES", 0x1005, "sizes"),
    ("CL_DEVICE_PREFERRED_VECTOR_WIDTH_CHAR", 0x1006, "uint"),
    ("CL_DEVICE_PREFERRED_VECTOR_WIDTH_SHORT", 0x1007, "uint"),
    ("CL_DEVICE_PREFERRED_VECTOR_WIDTH_INT", 0x1008, "uint"),
    ("CL_DEVICE_PREFERRED_VECTOR_WIDTH_LONG", 0x1009, "uint"),
    ("CL_DEVICE_PREFERRED_VECTOR_WIDTH_FLOAT", 0x100A, "uint"),
    ("CL_DEVICE_PREFERRED_VECTOR_WIDTH_DOUBLE", 0x100B, "uint"),
    ("CL_DEVICE_MAX_CLOCK_FREQUENCY", 0x100C, "uint"),
    ("CL_DEVICE_ADDRESS_BITS", 0x100D, "uint"),
    ("CL_DEVICE_MAX_READ_IMAGE_ARGS", 0x100E, "uint"),
    ("CL_DEVICE_MAX_WRITE_IMAGE_ARGS", 0x100F, "uint"),
    ("CL_DEVICE_MAX_MEM_ALLOC_SIZE", 0x1010, "ulong"),
    ("CL_DEVICE_IMAGE2D_MAX_WIDTH", 0x1011, "size"),
    ("CL_DEVICE_IMAGE2D_MAX_HEIGHT", 0x1012, "size"),
    ("CL_DEVICE_IMAGE3D_MAX_WIDTH", 0x1013, "size"),
    ("CL_DEVICE_IMAGE3D_MAX_HEIGHT", 0x1014, "size"),
    ("CL_DEVICE_IMAGE3D_MAX_DEPTH", 0x1015, "size"),
    ("CL_DEVICE_IMAGE_SUPPORT", 0x1016, "bool"),
    ("CL_DEVICE_MAX_PARAMETER_SIZE", 0x1017, "size"),
    ("CL_DEVICE_MAX_SAMPLERS", 0x1018, "uint"),
    ("CL_DEVICE_MEM_BASE_ADDR_ALIGN", 0x1019, "uint"),
    ("CL_DEVICE_MIN_DATA_TYPE_ALIGN_SIZE", 0x101A, "uint"),
    ("CL_DEVICE_SINGLE_FP_CONFIG", 0x101B, "ulong"),
    ("CL_DEVICE_GLOBAL_MEM_CACHE_TYPE", 0x101C, "uint"),
    ("CL_DEVICE_GLOBAL_MEM_CACHELINE_SIZE", 0x101D, "uint"),
    ("CL_DEVICE_GLOBAL_MEM_CACHE_SIZE", 0x101E, "ulong"),
    ("CL_DEVICE_GLOBAL_MEM_SIZE", 0x101F, "ulong"),
    ("CL_DEVICE_MAX_CONSTANT_BUFFER_SIZE", 0x1020, "ulong"),
    ("CL_DEVICE_MAX_CONSTANT_ARGS", 0x1021, "uint"),
    ("CL_DEVICE_LOCAL_MEM_TYPE", 0x1022, "uint"),
    ("CL_DEVICE_LOCAL_MEM_SIZE", 0x1023, "ulong"),
    ("CL_DEVICE_ERROR_CORRECTION_SUPPORT", 0x1024, "bool"),
    ("CL_DEVICE_PROFILING_TIMER_RESOLUTION", 0x1025, "size"),
    ("CL_DEVICE_ENDIAN_LITTLE", 0x1026, "bool"),
    ("CL_DEVICE_AVAILABLE", 0x1027, "bool"),
    ("CL_DEVICE_COMPILER_AVAILABLE", 0x1028, "bool"),
    ("CL_DEVICE_EXECUTION_CAPABILITIES", 0x1029, "ulong"),
    ("CL_DEVICE_QUEUE_ON_HOST_PROPERTIES", 0x102A, "ulong"),
    ("CL_DEVICE_NAME", 0x102B, "str"),
    ("CL_DEVICE_VENDOR", 0x102C, "str"),
    ("CL_DRIVER_VERSION", 0x102D, "str"),
    ("CL_DEVICE_PROFILE", 0x102E, "str"),
    ("CL_DEVICE_VERSION", 0x102F, "str"),
    ("CL_DEVICE_EXTENSIONS", 0x1030, "str"),
    ("CL_DEVICE_DOUBLE_FP_CONFIG", 0x1032, "ulong"),
    ("CL_DEVICE_HALF_FP_CONFIG", 0x1033, "ulong"),
    ("CL_DEVICE_PREFERRED_VECTOR_WIDTH_HALF", 0x1034, "uint"),
    ("CL_DEVICE_HOST_UNIFIED_MEMORY", 0x1035, "bool"),
    ("CL_DEVICE_NATIVE_VECTOR_WIDTH_CHAR", 0x1036, "uint"),
    ("CL_DEVICE_NATIVE_VECTOR_WIDTH_SHORT", 0x1037, "uint"),
    ("CL_DEVICE_NATIVE_VECTOR_WIDTH_INT", 0x1038, "uint"),
    ("CL_DEVICE_NATIVE_VECTOR_WIDTH_LONG", 0x1039, "uint"),
    ("CL_DEVICE_NATIVE_VECTOR_WIDTH_FLOAT", 0x103A, "uint"),
    ("CL_DEVICE_NATIVE_VECTOR_WIDTH_DOUBLE", 0x103B, "uint"),
    ("CL_DEVICE_NATIVE_VECTOR_WIDTH_HALF", 0x103C, "uint"),
    ("CL_DEVICE_OPENCL_C_VERSION", 0x103D, "str"),
    ("CL_DEVICE_LINKER_AVAILABLE", 0x103E, "bool"),
    ("CL_DEVICE_BUILT_IN_KERNELS", 0x103F, "str"),
    ("CL_DEVICE_IMAGE_MAX_BUFFER_SIZE", 0x1040, "size"),
    ("CL_DEVICE_IMAGE_MAX_ARRAY_SIZE", 0x1041, "size"),
    ("CL_DEVICE_PARTITION_MAX_SUB_DEVICES", 0x1043, "uint"),
    ("CL_DEVICE_PARTITION_PROPERTIES", 0x1044, "props"),
    ("CL_DEVICE_PARTITION_AFFINITY_DOMAIN", 0x1045, "ulong"),
    ("CL_DEVICE_PREFERRED_INTEROP_USER_SYNC", 0x1048, "bool"),
    ("CL_DEVICE_PRINTF_BUFFER_SIZE", 0x1049, "size"),
    ("CL_DEVICE_IMAGE_PITCH_ALIGNMENT", 0x104A, "uint"),
    ("CL_DEVICE_IMAGE_BASE_ADDRESS_ALIGNMENT", 0x104B, "uint"),
    ("CL_DEVICE_MAX_READ_WRITE_IMAGE_ARGS", 0x104C, "uint"),
    ("CL_DEVICE_MAX_GLOBAL_VARIABLE_SIZE", 0x104D, "size"),
    ("CL_DEVICE_QUEUE_ON_DEVICE_PROPERTIES", 0x104E, "ulong"),
    ("CL_DEVICE_QUEUE_ON_DEVICE_PREFERRED_SIZE", 0x104F, "uint"),
    ("CL_DEVICE_QUEUE_ON_DEVICE_MAX_SIZE", 0x1050, "uint"),
    ("CL_DEVICE_MAX_ON_DEVICE_QUEUES", 0x1051, "uint"),
    ("CL_DEVICE_MAX_ON_DEVICE_EVENTS", 0x1052, "uint"),
    ("CL_DEVICE_SVM_CAPABILITIES", 0x1053, "ulong"),
    ("CL_DEVICE_GLOBAL_VARIABLE_PREFERRED_TOTAL_SIZE", 0x1054, "size"),
    ("CL_DEVICE_MAX_PIPE_ARGS", 0x1055, "uint"),
    ("CL_DEVICE_PIPE_MAX_ACTIVE_RESERVATIONS", 0x1056, "uint"),
    ("CL_DEVICE_PIPE_MAX_PACKET_SIZE", 0x1057, "uint"),
    ("CL_DEVICE_PREFERRED_PLATFORM_ATOMIC_ALIGNMENT", 0x1058, "uint"),
    ("CL_DEVICE_PREFERRED_GLOBAL_ATOMIC_ALIGNMENT", 0x1059, "uint"),
    ("CL_DEVICE_PREFERRED_LOCAL_ATOMIC_ALIGNMENT", 0x105A, "uint"),
    ("CL_DEVICE_IL_VERSION", 0x105B, "str"),
    ("CL_DEVICE_MAX_NUM_SUB_GROUPS", 0x105C, "uint"),
    ("CL_DEVICE_SUB_GROUP_INDEPENDENT_FORWARD_PROGRESS", 0x105D, "bool"),
    ("CL_DEVICE_NUMERIC_VERSION", 0x105E, "uint"),
    ("CL_DEVICE_EXTENSIONS_WITH_VERSION", 0x1060, "versions"),
    ("CL_DEVICE_ILS_WITH_VERSION", 0x1061, "versions"),
    ("CL_DEVICE_BUILT_IN_KERNELS_WITH_VERSION", 0x1062, "versions"),
    ("CL_DEVICE_ATOMIC_MEMORY_CAPABILITIES", 0x1063, "ulong"),
    ("CL_DEVICE_ATOMIC_FENCE_CAPABILITIES", 0x1064, "ulong"),
    ("CL_DEVICE_NON_UNIFORM_WORK_GROUP_SUPPORT", 0x1065, "bool"),
    ("CL_DEVICE_OPENCL_C_ALL_VERSIONS", 0x1066, "versions"),
    ("CL_DEVICE_PREFERRED_WORK_GROUP_SIZE_MULTIPLE", 0x1067, "size"),
    ("CL_DEVICE_WORK_GROUP_COLLECTIVE_FUNCTIONS_SUPPORT", 0x1068, "bool"),
    ("CL_DEVICE_GENERIC_ADDRESS_SPACE_SUPPORT", 0x1069, "bool"),
    ("CL_DEVICE_OPENCL_C_FEATURES", 0x106F, "versions"),
    ("CL_DEVICE_DEVICE_ENQUEUE_CAPABILITIES", 0x1070, "ulong"),
    ("CL_DEVICE_PIPE_SUPPORT", 0x1071, "bool"),
    ("CL_DEVICE_LATEST_CONFORMANCE_VERSION_PASSED", 0x1072, "str"),
)
PARAM_BY_NAME = {name: (code, kind) for name, code, kind in DEVICE_PARAMS}

#: bounds on what a device's parameters may be (the driver applies them to
#: what the pool sends; the pool to what a runtime answers)
MAX_PARAM_TEXT = 16 * 1024
MAX_PARAM_LIST = 256
MAX_VERSION_NAME = 63          # CL_NAME_VERSION_MAX_NAME_SIZE, less its NUL

_LIMITS = {"uint": (1 << 32) - 1, "ulong": (1 << 64) - 1, "size": (1 << 64) - 1}


def check_param(name: str, value) -> None:
    """BadRequest unless ``value`` is what ``name``'s kind carries, within bounds."""
    entry = PARAM_BY_NAME.get(name)
    if entry is None:
        raise BadRequest(reason=f"unknown device parameter {str(name)[:60]!r}")
    kind = entry[1]
    if kind in _LIMITS:
        if not _uint(value, _LIMITS[kind]):
            raise BadRequest(reason=f"{name}: {str(value)[:40]!r} is not a {kind}")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise BadRequest(reason=f"{name}: {str(value)[:40]!r} is not a bool")
    elif kind == "str":
        if not isinstance(value, str) or len(value.encode("utf-8", "surrogatepass")) > MAX_PARAM_TEXT \
                or "\0" in value:
            raise BadRequest(reason=f"{name}: not a string of at most {MAX_PARAM_TEXT} bytes")
    elif kind in ("sizes", "props"):
        if not isinstance(value, list) or len(value) > MAX_PARAM_LIST or \
                not all(_uint(v, (1 << 64) - 1) if kind == "sizes" else _int64(v) for v in value):
            raise BadRequest(reason=f"{name}: not a list of at most {MAX_PARAM_LIST} integers")
    else:   # versions
        if not isinstance(value, list) or len(value) > MAX_PARAM_LIST or not all(
                isinstance(v, list) and len(v) == 2 and _uint(v[0], (1 << 32) - 1) and isinstance(v[1], str)
                and len(v[1].encode("utf-8", "surrogatepass")) <= MAX_VERSION_NAME and "\0" not in v[1]
                for v in value):
            raise BadRequest(reason=f"{name}: not a list of at most {MAX_PARAM_LIST} [version, name] pairs")


def _uint(value, limit: int) -> bool:
    return is_int(value, 0, limit)


def _int64(value) -> bool:
    return is_int(value, -(1 << 63), (1 << 63) - 1)


# -- the new commands' fields -----------------------------------------------------------
def _int_field(header: dict, op: str, name: str, low: int = 0) -> int:
    value = header.get(name)
    if not is_int(value, low, MAX_INT):
        raise BadRequest(reason=f"{op}: field {name!r} must be an integer from {low} to 2**63-1")
    return value


def _triple(header: dict, op: str, name: str, low: int) -> list:
    value = header.get(name)
    if not isinstance(value, list) or len(value) != 3 or not all(is_int(v, low, MAX_INT) for v in value):
        raise BadRequest(reason=f"{op}: {name} must be three integers from {low} to 2**63-1")
    return value


def fill_pattern(header: dict) -> bytes:
    """A ``fill``'s pattern bytes, its fields checked (offset, size: multiples of it)."""
    pattern = header.get("pattern")
    try:
        raw = bytes.fromhex(pattern) if isinstance(pattern, str) and len(pattern) <= 256 else None
    except ValueError:
        raw = None
    if raw is None or len(raw) not in FILL_PATTERN_SIZES:
        raise BadRequest(reason="fill: pattern must be 1, 2, 4, ... or 128 bytes, in hex")
    offset, size = _int_field(header, "fill", "offset"), _int_field(header, "fill", "size")
    if offset % len(raw) or size % len(raw):
        raise BadRequest(reason=f"fill: offset {offset} and size {size} must be multiples of the "
                                f"pattern's {len(raw)} bytes")
    return raw


class Rect:
    """One side of a rect transfer: where in a buffer, and its pitches.
    ``extent``: one past the last byte it touches (0 for an empty region)."""

    __slots__ = ("origin", "region", "row_pitch", "slice_pitch", "offset", "extent")

    def __init__(self, origin: list, region: list, row_pitch: int, slice_pitch: int, what: str):
        width, height, depth = region
        row_pitch = row_pitch or width
        slice_pitch = slice_pitch or row_pitch * height
        if row_pitch < width:
            raise BadRequest(reason=f"{what}: row pitch {row_pitch} is less than the region's width {width}")
        if slice_pitch < row_pitch * height or slice_pitch % row_pitch:
            raise BadRequest(reason=f"{what}: slice pitch {slice_pitch} must be a multiple of the row "
                                    f"pitch {row_pitch} and at least row pitch x height")
        x, y, z = origin
        offset = z * slice_pitch + y * row_pitch + x
        extent = offset + (depth - 1) * slice_pitch + (height - 1) * row_pitch + width
        if max(offset, extent, slice_pitch * depth) > MAX_INT:
            raise BadRequest(reason=f"{what}: the rectangle reaches past 2**63-1 bytes")
        self.origin, self.region = origin, region
        self.row_pitch, self.slice_pitch = row_pitch, slice_pitch
        self.offset, self.extent = offset, extent

    @property
    def packed_size(self) -> int:
        width, height, depth = self.region
        return width * height * depth


def rect(header: dict, op: str, prefix: str = "") -> Rect:
    """``write_rect``/``read_rect``'s rectangle (``prefix`` "src_"/"dst_" for ``copy_rect``)."""
    region = _triple(header, op, "region", 1)
    origin = _triple(header, op, prefix + "origin", 0)
    return Rect(origin, region, _int_field(header, op, prefix + "row_pitch"),
                _int_field(header, op, prefix + "slice_pitch"), op)


def validate(op: str, header: dict, payload_len: int) -> None:
    """The fields of a protocol-3 command (``dataplane.validate_command`` calls it)."""
    if op == "fill":
        fill_pattern(header)
    elif op in ("write_rect", "read_rect"):
        shape = rect(header, op)
        if op == "write_rect" and payload_len != shape.packed_size:
            raise BadRequest(reason=f"write_rect: the region is {shape.packed_size} bytes packed, the "
                                    f"payload {payload_len}")
    elif op == "copy_rect":
        rect(header, op, "src_")
        rect(header, op, "dst_")
    elif op == "alloc_sub":
        _int_field(header, op, "origin")
        _int_field(header, op, "size", 1)
    elif op == "kernel_info":
        kernel = header.get("kernel")
        if not isinstance(kernel, str) or not 0 < len(kernel) <= 1024:
            raise BadRequest(reason="kernel_info: kernel must be a name of 1 to 1024 characters")
    if "prof" in header and (header["prof"] is not True or op not in PROFILED_OPS):
        raise BadRequest(reason=f"{op}: prof is true or absent, and only on "
                                f"{', '.join(sorted(PROFILED_OPS))}")


def global_offset(header: dict, gsize: list) -> list | None:
    """A launch's ``goffset`` (v4), checked against its ``gsize``: the
    offset, or None for none (absent, or all zeros)."""
    value = header.get("goffset")
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != len(gsize) or not all(
            is_int(v, 0, MAX_INT - g) for v, g in zip(value, gsize)):
        raise BadRequest(reason="launch: goffset must list as many integers as gsize, each from 0, "
                                "goffset + gsize at most 2**63-1")
    return value if any(value) else None


def raw_arg(arg: dict, index: int) -> bytes:
    """A launch's ``{"raw": HEX}`` argument's bytes (v3)."""
    value = arg.get("raw")
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) and len(value) <= 2 * MAX_RAW_ARG else None
    except ValueError:
        raw = None
    if not raw:
        raise BadRequest(reason=f"launch: argument {index}: raw must be 1 to {MAX_RAW_ARG} bytes in hex")
    return raw
