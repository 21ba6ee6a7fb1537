"""Kernel arguments and the byte views the driver sends and reads into.

A kernel scalar must say its C type: ``i32(3)``, ``f32(0.5)`` or a numpy
scalar (whose dtype says it).  Plain Python numbers are refused: their C
type would be a guess.
"""

from __future__ import annotations

from accelmig.wire import batch
from accelmig.wire import dataplane as dp
from accelmig.wire.errors import BadRequest


class Scalar:
    """A typed kernel scalar: ``i32(3)``, ``f32(0.5)``."""

    __slots__ = ("type_name", "value", "_record")

    def __init__(self, type_name: str, value):
        if type_name not in dp.SCALAR_TYPES:
            raise BadRequest(reason=f"unknown scalar type {type_name!r}")
        self.type_name = type_name
        self.value = value
        self._record = None

    def to_wire(self) -> dict:
        return dp.encode_scalar(self.type_name, self.value)

    def record(self) -> bytes:
        """Its bytes in a launch record (``wire.batch``), made once: a
        scalar passed to many launches is encoded once."""
        cached = self._record
        if cached is None or cached[0] is not self.value:      # (is: -0.0 == 0.0)
            cached = self._record = (self.value, _scalar_record(self.to_wire()))
        return cached[1]

    def __repr__(self) -> str:
        return f"{self.type_name}({self.value!r})"


def _scalar_maker(name):
    def make(value) -> Scalar:
        return Scalar(name, value)
    make.__name__ = name
    make.__doc__ = f"A {name} kernel argument."
    return make


i8, u8, i16, u16, i32, u32, i64, u64, f32, f64 = (
    _scalar_maker(n) for n in ("i8", "u8", "i16", "u16", "i32", "u32", "i64", "u64", "f32", "f64"))

#: numpy dtype name -> kernel scalar type
NUMPY_TO_TYPE = {v: k for k, v in dp.NUMPY_NAMES.items()}


class LocalMemory:
    """A ``__local`` kernel argument of ``nbytes`` bytes."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int):
        self.nbytes = int(nbytes)


def encode_arg(index: int, arg) -> dict:
    """The wire form of a kernel argument that is not a buffer."""
    if isinstance(arg, Scalar):
        return arg.to_wire()
    if isinstance(arg, LocalMemory):
        return {"local": arg.nbytes}
    if hasattr(arg, "dtype") and getattr(arg, "shape", None) == ():
        name = NUMPY_TO_TYPE.get(str(arg.dtype))
        if name is None:
            raise BadRequest(reason=f"argument {index}: numpy {arg.dtype} is not a kernel scalar type")
        return dp.encode_scalar(name, arg.item())
    raise BadRequest(reason=f"argument {index}: {type(arg).__name__} {arg!r} is not a Buffer, "
                            "a typed scalar (i32(3), f32(0.5), a numpy scalar) or LocalMemory")


def record_arg(index: int, arg) -> bytes | None:
    """A kernel argument that is not a buffer, as its bytes in a launch
    record (``wire.batch``); the same checks as ``encode_arg``.  None: it
    has no record form (a local size out of range: the JSON path sends it,
    and the pool says what is wrong)."""
    if isinstance(arg, Scalar):
        return arg.record()
    if isinstance(arg, LocalMemory):
        return batch.local_arg(arg.nbytes) if 0 < arg.nbytes <= dp.MAX_INT else None
    return _scalar_record(encode_arg(index, arg))


def _scalar_record(wire: dict) -> bytes:
    """A scalar's JSON form (``dp.encode_scalar``) as its launch-record bytes."""
    return batch.scalar_arg(wire["t"], bytes.fromhex(wire["x"]))


def as_bytes_view(data) -> memoryview:
    """A flat byte view of ``data`` (no copy)."""
    try:
        view = memoryview(data)
    except TypeError:
        raise BadRequest(reason=f"{type(data).__name__} is not bytes-like "
                                "(bytes, bytearray, memoryview or a numpy array)") from None
    if not view.c_contiguous:
        raise BadRequest(reason="data must be C-contiguous (numpy: np.ascontiguousarray)")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def dims(value, what: str) -> list[int] | None:
    """A global or local size as the wire wants it: a list of 1-3 ints."""
    if value is None:
        return None
    if isinstance(value, int):
        return [value]
    try:
        return [int(v) for v in value]
    except TypeError:
        raise BadRequest(reason=f"{what} must be an int or a tuple of 1-3 ints") from None
