"""Launch batches: pipelined launches in one frame, a fixed binary record each.

Data-plane protocol version 2 (``dataplane.PROTOCOL_VERSIONS``).  Per
launch a JSON header cost the driver its encoding and the pool its decoding,
the largest Python work per launch left on both sides (docs/DESIGN.md,
"Where a round trip's time goes").  A driver whose pool agreed to version 2
at ``hello`` sends a run of consecutive pipelined launches as one frame::

    header (JSON): {"op": "launches", "epoch": E, "ack": A, "from": S, "to": T}
    payload:       T - S + 1 launch records, back to back, nothing after

Each launch keeps its own sequence number (``S``, ``S+1``, ... ``T``), so
the pool expands the batch into exactly the commands the same launches sent
one by one (``op: launch``, JSON) would have been: the same header fields,
the same ``CommandIdentity``.  A launch re-sent alone after a cut (the
driver's window keeps each command; a resume re-sends singles) is
recognised as the one the batch carried, and a different command under the
same sequence number is a divergence, as ever.  One ``ack`` (the last
launch's) and one ``epoch`` for the whole batch; the replies stay one per
launch (coalesced into ``done`` frames as any plain successes).

A launch record, little endian (OpenCL devices are; scalars travel as the
device reads them)::

    +------+---------+------+-------+-------+-----------+---------+------------+--------------+------+
    | size | prog    | ndim | flags | nargs | name len  | kernel  | gsize      | lsize        | args |
    | u16  | i64     | u8   | u8    | u8    | u8        | UTF-8   | ndim x u64 | ndim x u64,  |      |
    |      | >= 0    | 1-3  | bit 0:|       | 0-255     |         | each >= 1  | if flags & 1 |      |
    |      |         |      | lsize |       |           |         |            |              |      |
    +------+---------+------+-------+-------+-----------+---------+------------+--------------+------+

``size`` is the whole record's, itself included: the pool splits a batch
into records without parsing them, and a record it has parsed before (a
loop launches the same kernel on the same arguments again and again) is
not parsed again (``RecordCache``).

    an argument: u8 tag, then   0 (buffer):  i64 handle
                                1 (local):   u64 bytes (>= 1)
                                2-11:        a scalar's bytes, SCALAR_TAGS[tag] (i8 ... f64)

A launch whose kernel name is over 255 bytes or that has over 255
arguments has no record: the driver sends that one as JSON (``op:
launch``), which closes the batch before it.

Bounds, checked before anything is trusted (``decode_batch``): at most
``MAX_LAUNCHES`` launches and ``MAX_PAYLOAD`` bytes a batch, the count
agreeing with ``from``..``to``, every record whole and nothing after the
last, every integer within ``dataplane.MAX_INT`` as for JSON.  A batch that
breaks them is ``BAD_REQUEST`` (``FRAME_TOO_LARGE`` over a bound) and closes
its connection, as a malformed command does.

Standard library only (the driver runs in guests, Python 3.9+).
"""

from __future__ import annotations

import struct

from accelmig.wire import dataplane as dp
from accelmig.wire.errors import BadRequest, FrameTooLarge
from accelmig.wire.values import is_int

#: the data-plane protocol version that brought launch batches
BATCH_VERSION = 2
#: launches in one batch, at most (the driver sends at most DRIVER_LAUNCHES)
MAX_LAUNCHES = 1024
#: a batch's payload, at most: small enough to be parsed from the frame
#: reader's staging buffer (``frames.Limits.direct_threshold``)
MAX_PAYLOAD = 64 << 10
#: the driver closes a batch at this many launches: the pool's device
#: process takes launches in runs of 256 (``pool.devices.isolated``)
DRIVER_LAUNCHES = 256

SIZE = struct.Struct("<H")
HEAD = struct.Struct("<HqBBBB")
ARG_TAG = struct.Struct("<B")
BUF_ARG = struct.Struct("<Bq")
LOCAL_ARG = struct.Struct("<BQ")
LSIZE_FLAG = 0x01
TAG_BUF, TAG_LOCAL = 0, 1
#: scalar tags 2.. in this order
SCALAR_TAGS = ("i8", "u8", "i16", "u16", "i32", "u32", "i64", "u64", "f32", "f64")
SCALAR_TAG_OF = {name: TAG_LOCAL + 1 + i for i, name in enumerate(SCALAR_TAGS)}
_SCALAR_SIZE = {TAG_LOCAL + 1 + i: struct.calcsize(dp.SCALAR_TYPES[name]) for i, name in enumerate(SCALAR_TAGS)}
_DIMS = {n: struct.Struct(f"<{n}Q") for n in (1, 2, 3)}
_I64 = struct.Struct("<q")
_U64 = struct.Struct("<Q")
_MAX_NAME = 255
_MAX_ARGS = 255


# -- the driver's side ---------------------------------------------------------------
def buffer_arg(handle: int) -> bytes:
    """A buffer argument's bytes (the driver keeps them with the buffer)."""
    return BUF_ARG.pack(TAG_BUF, handle)


def local_arg(nbytes: int) -> bytes:
    return LOCAL_ARG.pack(TAG_LOCAL, nbytes)


def scalar_arg(type_name: str, raw: bytes) -> bytes:
    """A scalar argument's bytes from its little-endian value (``raw``)."""
    return ARG_TAG.pack(SCALAR_TAG_OF[type_name]) + raw


def encode_launch(prog: int, kernel: bytes, gsize: list, lsize, args: list) -> bytes | None:
    """One launch record; ``kernel`` the name in UTF-8, ``args`` each
    argument's bytes (``buffer_arg``, ``local_arg``, ``scalar_arg``).
    None: the launch has no record (a name or argument list too long; the
    caller sends it as JSON).  The caller checked the values (``args.dims``)."""
    ndim = len(gsize)
    if len(kernel) > _MAX_NAME or len(args) > _MAX_ARGS or not 1 <= ndim <= 3:
        return None
    dims = _DIMS[ndim]
    size = HEAD.size + len(kernel) + dims.size + sum(map(len, args))
    try:
        if lsize is None:
            return b"".join((HEAD.pack(size, prog, ndim, 0, len(args), len(kernel)), kernel, dims.pack(*gsize),
                             *args))
        if len(lsize) != ndim:
            return None
        return b"".join((HEAD.pack(size + dims.size, prog, ndim, LSIZE_FLAG, len(args), len(kernel)), kernel,
                         dims.pack(*gsize), dims.pack(*lsize), *args))
    except struct.error:          # a value out of range: the JSON path says what is wrong
        return None


def launch_fields(record: bytes) -> dict:
    """A record's launch as the JSON fields it stands for (prog, kernel,
    gsize, args, lsize): what a launch re-sent alone carries."""
    record = bytes(record)
    if len(record) < SIZE.size or SIZE.unpack_from(record)[0] != len(record):
        raise BadRequest(reason="launches: a launch record's size is not its length")
    return _decode_record(record, 0)


def batch_header(epoch: int, ack: int, first: int, last: int) -> dict:
    return {"op": dp.Op.LAUNCHES.value, "epoch": epoch, "ack": ack, "from": first, "to": last}


# -- the pool's side -----------------------------------------------------------------
def _nonneg(header: dict, key: str) -> int:
    value = header.get(key)
    if not is_int(value, 0, dp.MAX_INT):
        raise BadRequest(reason=f"launches: {key!r} must be a non-negative integer")
    return value


class RecordCache:
    """The launches (``op`` and fields) of records parsed lately (one per connection): a loop's
    launches are the same few records again and again.  Bounded in entries
    and in the size of a record it keeps; full, it starts again.  The
    fields it hands out are shared: nobody changes them."""

    ENTRIES = 32
    LARGEST = 256        # bytes: a record's fields grow with it

    def __init__(self):
        self._fields: dict[bytes, dict] = {}

    def get(self, record: bytes):
        return self._fields.get(record)

    def keep(self, record: bytes, fields: dict) -> None:
        if len(record) <= self.LARGEST:
            if len(self._fields) >= self.ENTRIES:
                self._fields.clear()
            self._fields[record] = fields


def decode_batch(header: dict, payload, cache: RecordCache | None = None) -> list[dict]:
    """A ``launches`` frame as the launch commands it stands for: one header
    dict per launch, exactly as ``op: launch`` in JSON would have carried it
    (``seq``, ``epoch``, ``ack`` and the launch's fields).  BadRequest or
    FrameTooLarge for anything out of bounds; nothing is trusted before.
    ``cache``: records parsed before."""
    return expand_run(*decode_run(header, payload, cache))


def expand_run(epoch: int, ack: int, first: int, launches: list[dict]) -> list[dict]:
    """``decode_run``'s launches as whole command headers, one dict each."""
    commands = []
    for seq, launch in enumerate(launches, first):
        command = {"seq": seq, "epoch": epoch, "ack": ack}
        command.update(launch)
        commands.append(command)
    return commands


def decode_run(header: dict, payload, cache: RecordCache | None = None) -> tuple[int, int, int, list[dict]]:
    """A ``launches`` frame as (epoch, ack, first seq, launches): each launch
    its ``op: launch`` header without ``seq``, ``epoch`` and ``ack`` (the
    fields that tell one command's identity from another's).  Launches of
    the same record are the same dict (from ``cache`` where it had it):
    shared, never changed; the pool takes a run of them as one unit
    (``pool.session.LaunchRun``).  The same bounds as ``decode_batch``."""
    epoch, ack = _nonneg(header, "epoch"), _nonneg(header, "ack")
    first, last = _nonneg(header, "from"), _nonneg(header, "to")
    if last < first:
        raise BadRequest(reason=f"launches: 'to' ({last}) before 'from' ({first})")
    count = last - first + 1
    if count > MAX_LAUNCHES:
        raise FrameTooLarge(f"a launch batch of {count} launches (seq {first}..{last}) exceeds the "
                            f"limit of {MAX_LAUNCHES} launches", details={"size": count, "limit": MAX_LAUNCHES})
    size = len(payload)
    if size > MAX_PAYLOAD:
        raise FrameTooLarge(part="launch batch payload", size=size, limit=MAX_PAYLOAD,
                            details={"size": size, "limit": MAX_PAYLOAD})
    data = bytes(payload)
    launches = []
    seen: dict[bytes, dict] = {}       # this batch's records (any size: the cache keeps small ones)
    pos = 0
    for seq in range(first, last + 1):
        if pos + SIZE.size > size:
            _need(data, pos, SIZE.size, seq, "size")
        end = pos + SIZE.unpack_from(data, pos)[0]
        if end > size:
            _need(data, end, 0, seq, "record")
        record = data[pos:end]
        launch = seen.get(record)
        if launch is None:
            launch = cache.get(record) if cache is not None else None
            if launch is None:
                launch = {"op": dp.Op.LAUNCH.value}
                launch.update(_decode_record(record, seq))
                if cache is not None:
                    cache.keep(record, launch)
            seen[record] = launch
        pos = end
        launches.append(launch)
    if pos != size:
        raise BadRequest(reason=f"launches: {size - pos} bytes after the last of {count} launches "
                                f"(seq {first}..{last}): the count and the records disagree")
    return epoch, ack, first, launches


def _need(data: bytes, pos: int, nbytes: int, seq: int, what: str) -> None:
    if pos + nbytes > len(data):
        raise BadRequest(reason=f"launches: launch {seq} is cut short in its {what} "
                                f"(the batch's records end early)")


def _decode_record(data: bytes, seq: int) -> dict:
    """One whole record (``data``, its size checked against its length by
    the caller) as its launch's fields."""
    pos = 0
    _need(data, pos, HEAD.size, seq, "fixed header")
    _size, prog, ndim, flags, nargs, name_len = HEAD.unpack_from(data, pos)
    pos += HEAD.size
    if prog < 0:
        raise BadRequest(reason=f"launch: field 'prog' must not be negative (launch {seq})")
    if not 1 <= ndim <= 3:
        raise BadRequest(reason=f"launch: gsize must list 1 to 3 dimensions (launch {seq}: {ndim})")
    if flags & ~LSIZE_FLAG:
        raise BadRequest(reason=f"launches: launch {seq}: unknown flags {flags:#x}")
    _need(data, pos, name_len, seq, "kernel name")
    try:
        kernel = data[pos:pos + name_len].decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest(reason=f"launches: launch {seq}: the kernel name is not UTF-8") from None
    pos += name_len
    dims = _DIMS[ndim]
    _need(data, pos, dims.size, seq, "gsize")
    gsize = list(dims.unpack_from(data, pos))
    pos += dims.size
    if not all(0 < v <= dp.MAX_INT for v in gsize):
        raise BadRequest(reason=f"launch: gsize entries must be positive integers (launch {seq})")
    fields = {"prog": prog, "kernel": kernel, "gsize": gsize}
    if flags & LSIZE_FLAG:
        _need(data, pos, dims.size, seq, "lsize")
        lsize = list(dims.unpack_from(data, pos))
        pos += dims.size
        if not all(0 < v <= dp.MAX_INT for v in lsize):
            raise BadRequest(reason=f"launch: lsize entries must be positive integers (launch {seq})")
    args = []
    for index in range(nargs):
        _need(data, pos, 1, seq, f"argument {index}")
        tag = data[pos]
        pos += 1
        if tag == TAG_BUF:
            _need(data, pos, 8, seq, f"argument {index}")
            handle = _I64.unpack_from(data, pos)[0]
            if handle == -(1 << 63):
                raise BadRequest(reason=f"launch: argument {index}: buf must be an integer (launch {seq})")
            args.append({"buf": handle})
            pos += 8
        elif tag == TAG_LOCAL:
            _need(data, pos, 8, seq, f"argument {index}")
            nbytes = _U64.unpack_from(data, pos)[0]
            if not 0 < nbytes <= dp.MAX_INT:
                raise BadRequest(reason=f"launch: argument {index}: local must be a positive size "
                                        f"(launch {seq})")
            args.append({"local": nbytes})
            pos += 8
        else:
            width = _SCALAR_SIZE.get(tag)
            if width is None:
                raise BadRequest(reason=f"launches: launch {seq}: argument {index} has unknown tag {tag}")
            _need(data, pos, width, seq, f"argument {index}")
            args.append({"t": SCALAR_TAGS[tag - TAG_LOCAL - 1], "x": data[pos:pos + width].hex()})
            pos += width
    fields["args"] = args
    if flags & LSIZE_FLAG:
        fields["lsize"] = lsize
    if pos != len(data):
        raise BadRequest(reason=f"launches: launch {seq}: its size says {len(data)} bytes, "
                                f"its fields take {pos}")
    return fields
