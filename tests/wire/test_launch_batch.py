"""Launch batches (``wire.batch``, data-plane protocol 2): the contract alone.

A batch stands for exactly the launches it carries sent one by one: each
record decodes to the header the same launch has in JSON (so its
``CommandIdentity`` is the same: a launch re-sent alone after a cut is the
same command, a different one under its sequence number is not), and a
batch out of bounds is refused with a code before anything is trusted.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accelmig.agent.driver.args import LocalMemory, Scalar, encode_arg, record_arg
from accelmig.wire import batch
from accelmig.wire import dataplane as dp
from accelmig.wire.errors import BadRequest, ErrorCode, FrameTooLarge
from tests.fuzz.strategies import fuzz_settings

BUMP = dict(prog=1, kernel="bump", gsize=[16], lsize=None)


def record(prog=1, kernel="bump", gsize=(16,), lsize=None, args=(batch.buffer_arg(2),)) -> bytes:
    return batch.encode_launch(prog, kernel.encode(), list(gsize), None if lsize is None else list(lsize),
                               list(args))


def decode(first: int, last: int, payload: bytes, epoch: int = 1, ack: int = 0) -> list[dict]:
    return batch.decode_batch(batch.batch_header(epoch, ack, first, last), payload)


def json_launch(seq: int, epoch: int, ack: int, prog, kernel, gsize, lsize, args) -> dict:
    """The header a v1 driver sends for the same launch."""
    header = {"op": "launch", "epoch": epoch, "ack": ack, "prog": prog, "kernel": kernel, "gsize": gsize,
              "args": args, "seq": seq}
    if lsize is not None:
        header["lsize"] = lsize
    return header


# -- what a record stands for -------------------------------------------------------
scalars = st.sampled_from(sorted(dp.SCALAR_TYPES)).flatmap(
    lambda t: st.tuples(st.just(t), st.binary(min_size=struct.calcsize(dp.SCALAR_TYPES[t]),
                                              max_size=struct.calcsize(dp.SCALAR_TYPES[t]))))
wire_args = st.lists(st.one_of(
    st.integers(-dp.MAX_INT, dp.MAX_INT).map(lambda h: ("buf", h)),
    st.integers(1, dp.MAX_INT).map(lambda n: ("local", n)),
    scalars.map(lambda pair: ("scalar", pair))), max_size=12)
dimensions = st.integers(1, 3).flatmap(lambda n: st.tuples(
    st.lists(st.integers(1, dp.MAX_INT), min_size=n, max_size=n),
    st.one_of(st.none(), st.lists(st.integers(1, dp.MAX_INT), min_size=n, max_size=n))))


def as_record_and_json(arg):
    kind, value = arg
    if kind == "buf":
        return batch.buffer_arg(value), {"buf": value}
    if kind == "local":
        return batch.local_arg(value), {"local": value}
    type_name, raw = value
    return batch.scalar_arg(type_name, raw), {"t": type_name, "x": raw.hex()}


@fuzz_settings(150)
@given(prog=st.integers(0, dp.MAX_INT), kernel=st.text(max_size=40).filter(lambda k: len(k.encode()) <= 255),
       dims=dimensions, args=wire_args, first=st.integers(1, 1 << 40), count=st.integers(1, 5),
       epoch=st.integers(0, 1 << 31), ack=st.integers(0, 1 << 40))
def test_a_batch_decodes_to_the_launches_it_stands_for_with_their_json_identity(prog, kernel, dims, args, first,
                                                                                count, epoch, ack):
    gsize, lsize = dims
    pairs = [as_record_and_json(a) for a in args]
    one = batch.encode_launch(prog, kernel.encode(), gsize, lsize, [p[0] for p in pairs])
    assert one is not None
    commands = decode(first, first + count - 1, one * count, epoch, ack)
    assert [c["seq"] for c in commands] == list(range(first, first + count))
    for command in commands:
        alone = json_launch(command["seq"], epoch, ack, prog, kernel, gsize, lsize, [p[1] for p in pairs])
        assert command == alone
        assert dp.validate_command(command, 0) is dp.Op.LAUNCH     # what v1 checks holds too
        # the same command, whichever frame carried it (and at another epoch, after a resume)
        resent = dict(alone, epoch=epoch + 1, ack=ack + 1)
        assert dp.CommandIdentity(command) == dp.CommandIdentity(resent)
    assert batch.launch_fields(one) == {k: v for k, v in commands[0].items()
                                        if k not in ("op", "seq", "epoch", "ack")}


def test_another_launch_under_the_same_seq_has_another_identity():
    batched = decode(7, 7, record())[0]
    for other in (json_launch(7, 1, 0, 1, "bump", [17], None, [{"buf": 2}]),
                  json_launch(7, 1, 0, 1, "bump", [16], None, [{"buf": 3}]),
                  json_launch(7, 1, 0, 1, "other", [16], None, [{"buf": 2}]),
                  json_launch(7, 1, 0, 1, "bump", [16], [16], [{"buf": 2}])):
        assert dp.CommandIdentity(batched) != dp.CommandIdentity(other)


def test_the_drivers_argument_forms_agree_with_json():
    import numpy as np
    for arg in (Scalar("u32", 7), Scalar("f64", -0.0), np.float32(0.5), np.int64(-3)):
        wire = encode_arg(0, arg)
        assert record_arg(0, arg) == batch.scalar_arg(wire["t"], bytes.fromhex(wire["x"]))
    assert record_arg(0, LocalMemory(64)) == batch.local_arg(64)
    assert record_arg(0, LocalMemory(0)) is None          # no record: JSON says what is wrong
    scalar = Scalar("i32", 1)
    first = scalar.record()
    scalar.value = 2                                      # a scalar changed after use is encoded again
    assert scalar.record() != first and batch.launch_fields(record(args=[scalar.record()]))["args"] == \
        [{"t": "i32", "x": "02000000"}]


def test_a_launch_without_a_record_form_is_left_to_json():
    assert record(kernel="k" * 256) is None
    assert record(args=[batch.buffer_arg(1)] * 256) is None
    assert record(gsize=(1, 1, 1, 1)) is None
    assert record(gsize=(-1,)) is None                    # struct refuses: JSON carries the error
    assert record(gsize=(4, 4), lsize=(4,)) is None


# -- hostile batches ------------------------------------------------------------------
def refused(first, last, payload, code=ErrorCode.BAD_REQUEST, match=None, header=None):
    kind = FrameTooLarge if code is ErrorCode.FRAME_TOO_LARGE else BadRequest
    with pytest.raises(kind, match=match) as info:
        batch.decode_batch(header or batch.batch_header(1, 0, first, last), payload)
    assert info.value.code is code
    return info.value


def test_a_truncated_batch_is_refused():
    two = record() * 2
    for cut in (1, batch.HEAD.size - 1, batch.HEAD.size + 2, len(two) // 2 - 1, len(two) // 2 + 5, len(two) - 1):
        refused(1, 2, two[:cut], match="cut short")


def test_a_count_that_disagrees_with_the_records_is_refused():
    refused(1, 3, record() * 2, match="cut short")                       # fewer records than from..to
    refused(1, 2, record() * 3, match="bytes after the last of 2")      # more records
    refused(5, 4, record(), match="'to' .4. before 'from' .5.")


def test_a_batch_over_the_limits_is_refused_before_its_records_are_read():
    one = record()
    err = refused(1, batch.MAX_LAUNCHES + 1, one * (batch.MAX_LAUNCHES + 1), ErrorCode.FRAME_TOO_LARGE)
    assert err.details["limit"] == batch.MAX_LAUNCHES
    refused(1, 1, b"\0" * (batch.MAX_PAYLOAD + 1), ErrorCode.FRAME_TOO_LARGE)
    assert len(decode(1, batch.MAX_LAUNCHES, one * batch.MAX_LAUNCHES)) == batch.MAX_LAUNCHES


@pytest.mark.parametrize("field, value", [("epoch", -1), ("epoch", "1"), ("ack", None), ("from", True),
                                          ("to", 1 << 64), ("from", 1.5)])
def test_batch_header_fields_must_be_non_negative_integers(field, value):
    header = dict(batch.batch_header(1, 0, 1, 1), **{field: value})
    refused(1, 1, record(), header=header, match=repr(field))


def sized(body: bytes) -> bytes:
    """A record of ``body`` (everything after its size)."""
    return struct.pack("<H", len(body) + 2) + body


@pytest.mark.parametrize("bad, match", [
    (sized(struct.pack("<qBBBB", -1, 1, 0, 0, 0) + struct.pack("<Q", 1)), "'prog' must not be negative"),
    (sized(struct.pack("<qBBBB", 1, 0, 0, 0, 0)), "1 to 3 dimensions"),
    (sized(struct.pack("<qBBBB", 1, 4, 0, 0, 0) + b"\1" * 32), "1 to 3 dimensions"),
    (sized(struct.pack("<qBBBB", 1, 1, 2, 0, 0) + struct.pack("<Q", 1)), "unknown flags"),
    (sized(struct.pack("<qBBBB", 1, 1, 0, 0, 2) + b"\xff\xfe" + struct.pack("<Q", 1)), "not UTF-8"),
    (sized(struct.pack("<qBBBB", 1, 1, 0, 0, 0) + struct.pack("<Q", 0)), "gsize entries must be positive"),
    (sized(struct.pack("<qBBBB", 1, 1, 0, 0, 0) + struct.pack("<Q", 1 << 63)), "gsize entries must be positive"),
    (sized(struct.pack("<qBBBB", 1, 1, 1, 0, 0) + struct.pack("<QQ", 1, 0)), "lsize entries must be positive"),
    (sized(struct.pack("<qBBBB", 1, 1, 0, 1, 0) + struct.pack("<QB", 1, 12)), "unknown tag 12"),
    (sized(struct.pack("<qBBBB", 1, 1, 0, 1, 0) + struct.pack("<QBQ", 1, 1, 0)), "local must be a positive size"),
    (sized(struct.pack("<qBBBB", 1, 1, 0, 1, 0) + struct.pack("<QBq", 1, 0, -(1 << 63))), "buf must be an integer"),
    (sized(struct.pack("<qBBBB", 1, 1, 0, 1, 0) + struct.pack("<QB", 1, 6) + b"\0\0"), "cut short"),
    (sized(struct.pack("<qBBBB", 1, 1, 0, 0, 0) + struct.pack("<Q", 1))[:-1], "cut short"),
    (struct.pack("<H", 40) + struct.pack("<qBBBB", 1, 1, 0, 0, 0) + struct.pack("<Q", 1), "cut short"),
    (struct.pack("<H", 30) + struct.pack("<qBBBB", 1, 1, 0, 0, 0) + struct.pack("<Q", 1) + b"\0" * 8,
     "its size says 30 bytes, its fields take 22"),
    (struct.pack("<H", 0) + b"\0" * 20, "cut short"),
])
def test_a_malformed_record_is_refused_with_its_reason(bad, match):
    refused(1, 1, bad, match=match)


def test_records_parsed_before_decode_the_same_and_the_cache_stays_bounded():
    cache = batch.RecordCache()
    records = [record(gsize=(n,)) for n in range(1, 2 * batch.RecordCache.ENTRIES + 2)]
    payload = b"".join(records)
    first = decode(1, len(records), payload)
    assert batch.decode_batch(batch.batch_header(1, 0, 1, len(records)), payload, cache) == first
    assert batch.decode_batch(batch.batch_header(1, 0, 1, len(records)), payload, cache) == first   # from the cache
    assert len(cache._fields) <= batch.RecordCache.ENTRIES
    big = record(args=[batch.buffer_arg(1)] * 40)          # over LARGEST: parsed every time, never kept
    assert len(big) > batch.RecordCache.LARGEST
    batch.decode_batch(batch.batch_header(1, 0, 1, 1), big, cache)
    assert big not in cache._fields
    good = record()
    bad = good[:-9] + b"\x0c" + good[-8:]                   # an unknown tag: refused each time, never kept
    for _ in range(2):
        with pytest.raises(BadRequest):
            batch.decode_batch(batch.batch_header(1, 0, 1, 1), bad, cache)
    assert bad not in cache._fields
