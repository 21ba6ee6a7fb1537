"""Frame format: round trips under any chunking, and every kind of bad frame."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings, strategies as st

from accelmig.wire.errors import ErrorCode, FrameError, FrameTooLarge
from accelmig.wire.frames import (MAGIC, PREFIX, FrameReader, Limits, encode_frame,
                                  encode_prefix_and_header)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.text(max_size=20)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)
headers = st.dictionaries(st.text(min_size=1, max_size=10).filter(lambda k: k != "op"), json_values,
                          max_size=6).map(lambda d: {"op": "x", **d})


def feed_in_chunks(reader: FrameReader, data: bytes, chunks: list[int]):
    """Deliver ``data`` to ``reader`` the way recv_into would, chunk by chunk."""
    frames, offset, i = [], 0, 0
    while offset < len(data):
        buf = reader.get_buffer()
        want = chunks[i % len(chunks)] if chunks else len(data)
        i += 1
        n = max(1, min(len(buf), want, len(data) - offset))
        buf[:n] = data[offset:offset + n]
        offset += n
        frames.extend(reader.feed(n))
    return frames


@settings(max_examples=150, deadline=None)
@given(frames=st.lists(st.tuples(headers, st.binary(max_size=3000)), min_size=1, max_size=8),
       chunks=st.lists(st.integers(1, 5000), min_size=1, max_size=6),
       threshold=st.sampled_from([16, 1024, 65536]))
def test_round_trip_any_chunking(frames, chunks, threshold):
    data = b"".join(encode_frame(h, p) for h, p in frames)
    reader = FrameReader(Limits(direct_threshold=threshold))
    got = feed_in_chunks(reader, data, chunks)
    assert [(f.header, bytes(f.payload)) for f in got] == frames
    assert reader.idle


def test_large_payload_lands_in_its_own_buffer_via_the_sink():
    payload = bytes(range(256)) * 4096   # 1 MiB
    target = bytearray(len(payload))
    reader = FrameReader(payload_sink=lambda header, size: target)
    got = feed_in_chunks(reader, encode_frame({"op": "reply", "seq": 3}, payload), [65536])
    assert len(got) == 1 and got[0].payload is target and target == payload


def test_prefix_and_header_encoding_leaves_the_payload_out():
    head = encode_prefix_and_header({"op": "write"}, 10)
    magic, version, flags, hlen, plen = PREFIX.unpack(head[:16])
    assert (magic, version, plen) == (MAGIC, 1, 10)
    assert json.loads(head[16:16 + hlen]) == {"op": "write"}


def _prefix(magic=MAGIC, version=1, hlen=2, plen=0):
    return PREFIX.pack(magic, version, 0, hlen, plen)


@pytest.mark.parametrize("data, code, words", [
    (_prefix(magic=b"XX") + b"{}", ErrorCode.BAD_FRAME, "bad magic"),
    (_prefix(version=9) + b"{}", ErrorCode.BAD_FRAME, "frame version 9"),
    (_prefix(hlen=0), ErrorCode.BAD_FRAME, "empty header"),
    (_prefix(hlen=70000), ErrorCode.FRAME_TOO_LARGE, "header of 70000 bytes"),
    (_prefix(plen=2**40), ErrorCode.FRAME_TOO_LARGE, "payload of"),
    (_prefix(hlen=4) + b"\xff\xfe{}", ErrorCode.BAD_FRAME, "not UTF-8 JSON"),
    (_prefix(hlen=5) + b"{nope", ErrorCode.BAD_FRAME, "not UTF-8 JSON"),
    (_prefix(hlen=2) + b"[]", ErrorCode.BAD_FRAME, "not an object"),
    (_prefix(hlen=2) + b"{}", ErrorCode.BAD_FRAME, "no string 'op'"),
    (_prefix(hlen=10) + b'{"op": 5 }', ErrorCode.BAD_FRAME, "no string 'op'"),
])
def test_bad_frames_are_refused_with_a_reason(data, code, words):
    reader = FrameReader(Limits(max_payload=1 << 30))
    with pytest.raises(FrameError) as info:
        feed_in_chunks(reader, data, [7])
    assert info.value.code is code
    assert words in str(info.value)
    # the reader stays broken: the connection must be closed
    with pytest.raises(FrameError):
        reader.get_buffer()


def test_good_frames_before_a_bad_one_are_delivered_then_it_fails():
    reader = FrameReader()
    data = encode_frame({"op": "a"}) + encode_frame({"op": "b"}) + b"garbage-garbage!"
    buf = reader.get_buffer()
    buf[:len(data)] = data
    frames = reader.feed(len(data))
    assert [f.op for f in frames] == ["a", "b"]
    with pytest.raises(FrameError):
        reader.get_buffer()


def test_oversized_payload_limit_is_configurable():
    reader = FrameReader(Limits(max_payload=100))
    with pytest.raises(FrameTooLarge):
        feed_in_chunks(reader, encode_frame({"op": "write"}, b"x" * 101), [4096])


def test_header_must_not_carry_bytes():
    with pytest.raises(TypeError, match="payload"):
        encode_frame({"op": "x", "data": b"raw"})


def test_prefix_struct_is_sixteen_bytes_big_endian():
    assert PREFIX.size == 16
    assert _prefix(hlen=0x01020304, plen=5)[4:8] == struct.pack("!I", 0x01020304)
