"""Length-prefixed frames: a binary prefix, a JSON header, a raw payload.

::

    +-------+---------+-------+------------+-------------+---------+---------+
    | "AM"  | version | flags | header len | payload len | header  | payload |
    | 2 B   | u8      | u8    | u32 BE     | u64 BE      | JSON    | bytes   |
    +-------+---------+-------+------------+-------------+---------+---------+

Buffers travel as raw bytes, never inside JSON.  Sizes are bounded by
``Limits``; a peer that breaks the format gets ``FrameError`` and its
connection is closed (no other connection is affected).

``FrameReader`` is the one incremental decoder, usable from an asyncio
``BufferedProtocol`` (``get_buffer``/``feed`` map to ``get_buffer``/
``buffer_updated``) and from a blocking socket (``sock.recv_into``).  Small
frames are parsed out of one staging buffer; a large payload is received
straight into its own destination buffer, so bulk data is copied by the
kernel only, never accumulated and re-copied in Python.

Standard library only.
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from typing import Callable

from accelmig.wire.errors import FrameError, FrameTooLarge

MAGIC = b"AM"
FRAME_VERSION = 1
PREFIX = struct.Struct("!2sBBIQ")
PREFIX_SIZE = PREFIX.size  # 16


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds on what a peer may send in one frame."""

    max_header: int = 64 * 1024
    max_payload: int = 1 << 30
    #: payloads up to this size are copied out of the staging buffer; larger
    #: ones are received straight into a buffer of their own
    direct_threshold: int = 64 * 1024


DEFAULT_LIMITS = Limits()


@dataclasses.dataclass
class Frame:
    header: dict
    payload: bytes | bytearray | memoryview = b""
    #: the header's length on the wire (what a receiver keeping the header
    #: may count it for)
    header_size: int = 0

    @property
    def op(self) -> str:
        return self.header.get("op", "")


def _json_default(obj):
    if isinstance(obj, (bytes, bytearray)):
        raise TypeError("bytes go in the payload, not in the JSON header")
    if hasattr(obj, "to_wire"):
        return obj.to_wire()
    raise TypeError(f"cannot encode {type(obj).__name__} in a frame header")


# made once: json.dumps with any option builds a new encoder per call (0.7 us
# of a 2 us header, on every frame of both sides)
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=_json_default, allow_nan=False)


def encode_header(header: dict) -> bytes:
    return _ENCODER.encode(header).encode("utf-8")


def encode_prefix_and_header(header: dict, payload_len: int = 0, flags: int = 0) -> bytes:
    """Prefix and header as one bytes object; send the payload after it."""
    head = encode_header(header)
    return PREFIX.pack(MAGIC, FRAME_VERSION, flags, len(head), payload_len) + head


def encode_frame(header: dict, payload: bytes | bytearray | memoryview = b"") -> bytes:
    """A whole frame in one bytes object (copies the payload: small frames only)."""
    return encode_prefix_and_header(header, len(payload)) + bytes(payload)


def parse_prefix(data, limits: Limits = DEFAULT_LIMITS) -> tuple[int, int, int]:
    """Validate a 16-byte prefix; return (flags, header_len, payload_len)."""
    magic, version, flags, hlen, plen = PREFIX.unpack(bytes(data[:PREFIX_SIZE]))
    if magic != MAGIC:
        raise FrameError(reason=f"bad magic {magic!r} (expected {MAGIC!r})")
    if version != FRAME_VERSION:
        raise FrameError(reason=f"frame version {version} (this side speaks {FRAME_VERSION})")
    if hlen == 0:
        raise FrameError(reason="empty header")
    if hlen > limits.max_header:
        raise FrameTooLarge(part="header", size=hlen, limit=limits.max_header)
    if plen > limits.max_payload:
        raise FrameTooLarge(part="payload", size=plen, limit=limits.max_payload)
    return flags, hlen, plen


def _finite(text: str) -> float:
    value = float(text)
    if value in (_INF, -_INF):      # 1e400 parses as infinity, which JSON has not
        raise ValueError(f"number {text[:20]} overflows")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


_INF = float("inf")
#: one decoder for every header (json.loads with these options would build one per call)
_DECODER = json.JSONDecoder(parse_float=_finite, parse_constant=_no_constant)
#: ``\uD800``-``\uDFFF`` as an escape: the only way a lone surrogate gets into
#: a decoded string (UTF-8 cannot carry one); only then is every string looked at
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def _lone_surrogate(value) -> bool:
    """True if a string anywhere in ``value`` cannot be encoded as UTF-8."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def decode_header(raw) -> dict:
    """A header as a dict, or ``FrameError``: never any other exception, so a
    hostile header costs its connection an error frame, not a traceback."""
    data = bytes(raw)
    try:
        header = _DECODER.decode(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise FrameError(reason=f"header is not UTF-8 JSON ({str(exc)[:100]})") from None
    except RecursionError:
        raise FrameError(reason="header is nested too deeply") from None
    if _SURROGATE_ESCAPE.search(data) and _lone_surrogate(header):
        # a name with one in it would fail deep inside a runtime (INTERNAL)
        raise FrameError(reason="header holds a lone surrogate (not valid Unicode text)")
    if not isinstance(header, dict):
        raise FrameError(reason=f"header is a JSON {type(header).__name__}, not an object")
    if not isinstance(header.get("op"), str):
        raise FrameError(reason="header has no string 'op'")
    return header


PayloadSink = Callable[[dict, int], "bytearray | memoryview"]


def _default_sink(header: dict, size: int) -> bytearray:
    return bytearray(size)


class FrameReader:
    """Incremental frame decoder over a receive-into buffer.

    Usage, blocking::

        n = sock.recv_into(reader.get_buffer())
        for frame in reader.feed(n): ...

    ``payload_sink(header, size)`` may supply the destination of a large
    payload (a numpy array's memory, say); the default allocates a bytearray.
    After a ``FrameError`` the reader is unusable: close the connection.
    """

    #: the staging buffer's usual floor: big enough that a burst of small
    #: frames is read in one system call
    STAGING_FLOOR = 256 * 1024

    def __init__(self, limits: Limits = DEFAULT_LIMITS, payload_sink: PayloadSink | None = None,
                 staging_floor: int = STAGING_FLOOR):
        self.limits = limits
        self.payload_sink = payload_sink or _default_sink
        self._staging = bytearray(self._staging_size(limits, staging_floor))
        self._start = 0          # first unparsed byte in staging
        self._end = 0            # one past the last received byte in staging
        self._header: dict | None = None   # header of a frame whose payload is pending
        self._header_size = 0
        self._payload: memoryview | None = None
        self._payload_obj = None
        self._filled = 0
        self.broken: FrameError | None = None
        self.frames_read = 0
        self.bytes_read = 0

    @staticmethod
    def _staging_size(limits: Limits, floor: int) -> int:
        return max(PREFIX_SIZE + limits.max_header + limits.direct_threshold, floor)

    def relimit(self, limits: Limits, staging_floor: int = STAGING_FLOOR) -> None:
        """Change the bounds between two frames (a peer that authenticated may
        send more than one that has not); bytes already received are kept."""
        if self._payload is not None:
            raise RuntimeError("relimit in the middle of a payload")
        self.limits = limits
        size = self._staging_size(limits, staging_floor)
        if size > len(self._staging):
            staging = bytearray(size)
            tail = self._end - self._start
            staging[:tail] = self._staging[self._start:self._end]
            self._staging, self._start, self._end = staging, 0, tail

    # -- receive side -------------------------------------------------------
    def get_buffer(self, sizehint: int = -1) -> memoryview:
        if self.broken is not None:
            raise self.broken
        if self._payload is not None:
            return self._payload[self._filled:]
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._staging) - self._end < PREFIX_SIZE + self.limits.max_header:
            # Compact: move the unparsed tail to the front.
            tail = self._end - self._start
            self._staging[:tail] = self._staging[self._start:self._end]
            self._start, self._end = 0, tail
        return memoryview(self._staging)[self._end:]

    def pending_payload(self) -> tuple[dict, int] | None:
        """(header, bytes received so far) of a frame whose payload is being
        received into its own buffer; None between such frames."""
        if self._payload is None:
            return None
        return self._header, self._filled

    def feed(self, nbytes: int) -> list[Frame]:
        """Account for ``nbytes`` written into the last ``get_buffer()``."""
        if self.broken is not None:
            raise self.broken
        self.bytes_read += nbytes
        frames: list[Frame] = []
        if self._payload is not None:
            self._filled += nbytes
            if self._filled < len(self._payload):
                return frames
            frames.append(self._finish_direct())
            return frames
        self._end += nbytes
        try:
            self._parse(frames)
        except FrameError as exc:
            self.broken = exc
            if not frames:
                raise
            # Deliver what was good before the bad frame; the next call raises.
        self.frames_read += len(frames)
        return frames

    def _finish_direct(self) -> Frame:
        frame = Frame(self._header, self._payload_obj, self._header_size)
        self._header = self._payload = self._payload_obj = None
        self._filled = 0
        self.frames_read += 1
        return frame

    def _parse(self, frames: list[Frame]) -> None:
        buf = self._staging
        while True:
            avail = self._end - self._start
            if avail < PREFIX_SIZE:
                return
            _flags, hlen, plen = parse_prefix(memoryview(buf)[self._start:self._start + PREFIX_SIZE],
                                              self.limits)
            if avail < PREFIX_SIZE + hlen:
                return
            hstart = self._start + PREFIX_SIZE
            header = decode_header(memoryview(buf)[hstart:hstart + hlen])
            pstart = hstart + hlen
            if plen <= self.limits.direct_threshold:
                if avail < PREFIX_SIZE + hlen + plen:
                    return
                payload = bytes(buf[pstart:pstart + plen]) if plen else b""
                self._start = pstart + plen
                frames.append(Frame(header, payload, hlen))
                continue
            # Large payload: give it its own buffer and receive straight into it.
            target = self.payload_sink(header, plen)
            view = memoryview(target).cast("B")
            if len(view) != plen:
                raise FrameError(reason=f"payload sink gave {len(view)} bytes for {plen}")
            have = min(avail - PREFIX_SIZE - hlen, plen)
            if have:
                view[:have] = buf[pstart:pstart + have]
            self._start = pstart + have
            if have == plen:
                frames.append(Frame(header, target, hlen))
                continue
            self._header, self._payload, self._payload_obj, self._filled = header, view, target, have
            self._header_size = hlen
            self._start = self._end = 0
            return

    @property
    def idle(self) -> bool:
        """True when no partial frame is buffered."""
        return self._payload is None and self._start == self._end
