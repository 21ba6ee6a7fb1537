"""Fuzzing the data plane (issue 14, "Done when"): the frame layer alone
(``wire.frames``: ``decode_header``, ``FrameReader``) and the pool's
``DataConnection`` behind a real ``accelmig-pool serve`` process, before
and after authentication.  Fixed seed, bounded examples (tests/fuzz/strategies.py).

What must hold whatever arrives: the frame layer raises ``FrameError`` or
returns frames, nothing else; the pool answers with frames it may send
(never an ``INTERNAL`` error, never a traceback in its log), closes only
the connection that misbehaved, and goes on serving a real driver.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from accelmig.agent.driver import connect
from accelmig.wire.errors import FrameError
from accelmig.wire.frames import (MAGIC, PREFIX, FrameReader, Limits, decode_header, encode_frame,
                                  encode_prefix_and_header)
from tests.fuzz.peers import FrameConn, problems, start_pool
from tests.fuzz.strategies import fuzz_settings, integers, json_values, objects, text
from tests.support.tenants import ALICE, BOB

SMALL = Limits(max_header=512, max_payload=4096, direct_threshold=64)

clean_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**64, 2**64), st.floats(allow_nan=False, allow_infinity=False),
              st.text(max_size=10)),
    lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(st.text(max_size=6), children,
                                                                                max_size=3)),
    max_leaves=8)
clean_headers = st.tuples(st.text(max_size=10), st.dictionaries(st.text(max_size=6), clean_values, max_size=4)) \
    .map(lambda pair: {**pair[1], "op": pair[0]})


def prefixes(hlen=st.integers(0, 600), plen=st.integers(0, 5000)):
    """A frame prefix, sometimes a wrong one."""
    return st.builds(lambda magic, version, flags, h, p: PREFIX.pack(magic, version, flags, h, p),
                     st.sampled_from([MAGIC, MAGIC, MAGIC, b"MA", b"\x16\x03"]), st.sampled_from([1, 1, 1, 0, 2, 255]),
                     st.integers(0, 255), hlen, plen)


header_bytes = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    clean_headers.map(lambda h: json.dumps(h).encode()),
    st.sampled_from([b'{"op":"x","n":' + b"1" * 5000 + b"}", b'{"op":"x","n":1e400}', b'{"op":NaN}',
                     b'{"op":"x","s":"\\ud800"}', b"[" * 50000 + b"]" * 50000, b'{"op":"x","a":' + b"[" * 3000 + b"]" * 3000 + b"}",
                     b'{"op":"\xff"}', b'{"op":"a","op":"b"}', b"{}", b"null", b'"op"', b'{"op":1}']))


def feed_in_chunks(reader: FrameReader, data: bytes, cuts: list[int]) -> list:
    """Feed ``data`` the way a socket does (into ``get_buffer``, at most
    what it offers), split at ``cuts``; every frame, or ``FrameError``."""
    frames = []
    bounds = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    for start, end in zip(bounds, bounds[1:]):
        chunk = memoryview(data)[start:end]
        while chunk:
            buf = reader.get_buffer()
            n = min(len(buf), len(chunk))
            assert n > 0, "the reader offered an empty buffer"
            buf[:n] = chunk[:n]
            chunk = chunk[n:]
            frames += reader.feed(n)
    return frames


@fuzz_settings(400)
@given(header_bytes)
def test_decode_header_gives_a_dict_or_a_frame_error(raw):
    try:
        header = decode_header(raw)
    except FrameError as exc:
        assert exc.code.value == "BAD_FRAME"
        return
    assert isinstance(header, dict) and isinstance(header["op"], str)
    json.dumps(header).encode("utf-8")       # whatever was accepted is valid text all through


@fuzz_settings(300)
@given(st.lists(st.one_of(st.binary(max_size=200), prefixes(), header_bytes,
                          st.builds(lambda h, p: encode_frame(h, p), clean_headers, st.binary(max_size=300))),
                max_size=6).map(b"".join),
       st.lists(st.integers(0, 10000), max_size=8))
def test_any_bytes_in_any_chunks_give_frames_or_one_frame_error(data, cuts):
    reader = FrameReader(SMALL, staging_floor=0)
    try:
        frames = feed_in_chunks(reader, data, cuts)
    except FrameError:
        assert reader.broken is not None
        with pytest.raises(FrameError):
            reader.get_buffer()          # unusable afterwards: the connection closes
        return
    for frame in frames:
        assert isinstance(frame.header, dict) and isinstance(frame.op, str)
        assert len(frame.payload) <= SMALL.max_payload


@fuzz_settings(200)
@given(st.lists(st.tuples(clean_headers, st.binary(max_size=600)), min_size=1, max_size=6),
       st.lists(st.integers(0, 10000), max_size=10))
def test_valid_frames_come_out_whole_however_they_are_split(frames, cuts):
    encoded = [encode_prefix_and_header(h, len(p)) for h, p in frames]
    # valid frames only: a header over the reader's limit is another test's case
    assume(all(len(e) - PREFIX.size <= SMALL.max_header for e in encoded))
    data = b"".join(e + p for e, (_, p) in zip(encoded, frames))
    out = feed_in_chunks(FrameReader(SMALL, staging_floor=0), data, cuts)
    assert [(f.header, bytes(f.payload)) for f in out] == [(json.loads(json.dumps(h)), p) for h, p in frames]


# -- the pool's DataConnection, in a real pool process ------------------------------

@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    proc = start_pool(tmp_path_factory.mktemp("fuzz-data-pool"), "--grace", "1")
    yield proc
    assert proc.stop() == 0


ALLOWED_OPS = {"welcome", "opened", "resumed", "reply", "done", "error"}


def check_answers(frames: list[dict]) -> None:
    for frame in frames:
        assert frame.get("op") in ALLOWED_OPS, frame
        error = frame.get("error") if frame.get("op") == "error" or frame.get("ok") is False else None
        if error is not None:
            assert error.get("code") not in ("INTERNAL", None), frame
            assert "internal error" not in error.get("message", ""), frame


def still_serving(pool) -> None:
    """A real driver gets in and computes, and the log shows no bug."""
    with connect(pool.endpoint, BOB, agent=False, timeout=30) as dev:
        assert dev.read(dev.upload(b"still serving")) == b"still serving"
        sid = dev.sid
    pool.wait_log(lambda e: sid in e.get("msg", "") and "opened" in e.get("msg", ""))
    assert problems(pool) == []


secrets_hex = st.one_of(st.just("ab" * 16), st.just("00" * 64), text, st.binary(max_size=20).map(bytes.hex))
HANDSHAKE_FIELDS = {
    "versions": st.one_of(st.just([1]), st.lists(json_values, max_size=3)),
    "token": st.sampled_from([ALICE, BOB, "nope"]),
    "secret": secrets_hex,
    "sid": st.sampled_from(["", "s-1", "0" * 32]),
    "epoch": integers, "last_seen": integers, "proof": text, "ticket": text,
    "client": json_values, "ack": integers,
}
handshake_headers = st.tuples(st.sampled_from(["hello", "hello", "open", "resume", "ack", "info", "welcome", "", "x"]),
                              objects(HANDSHAKE_FIELDS)).map(lambda pair: {**pair[1], "op": pair[0]})
handshake_frames = st.one_of(
    handshake_headers.map(encode_frame),
    st.builds(lambda h, p: encode_frame(h, p), handshake_headers, st.binary(min_size=1, max_size=64)),
    prefixes(), st.binary(max_size=64), header_bytes.map(lambda raw: PREFIX.pack(MAGIC, 1, 0, len(raw), 0) + raw))


@fuzz_settings(60)
@given(st.lists(handshake_frames, min_size=1, max_size=4))
def test_strangers_get_answers_or_a_clean_close(pool, frames):
    conn = FrameConn(pool.endpoint)
    try:
        for data in frames:
            conn.sendraw(data)
        conn.done_sending()
        check_answers(conn.until_closed())
    finally:
        conn.close()


@pytest.fixture(scope="module")
def probe_done(pool):
    yield
    still_serving(pool)


KERNELS = b"""
__kernel void k(__global uint *a, uint n) { }
__kernel void k2(__global uchar *a, __local uint *l, float f, ulong g) { }
"""
handles = st.one_of(st.sampled_from([1, 1, 2, 3, 7]), integers, json_values)
sizes = st.one_of(st.sampled_from([0, 1, 4, 16, 64, 4096]), integers, json_values)
small_ranges = st.one_of(st.lists(st.integers(1, 8), min_size=1, max_size=3),
                         # (finite floats: a JSON header cannot carry infinity, this sender would fail)
                         st.lists(st.one_of(st.integers(-3, 0), st.just(2**64), text,
                                            st.floats(allow_nan=False, allow_infinity=False)), max_size=4),
                         json_values)
launch_args = st.lists(st.one_of(
    st.fixed_dictionaries({"buf": handles}),
    st.fixed_dictionaries({"local": st.one_of(st.sampled_from([4, 64, 0, -1]), integers)}),
    st.fixed_dictionaries({"t": st.sampled_from(["u32", "f32", "u64", "i8", "x"]),
                           "x": st.one_of(st.binary(max_size=9).map(bytes.hex), text)}),
    st.dictionaries(text, json_values, max_size=2)), max_size=5)
COMMAND_FIELDS = {
    "buf": handles, "size": sizes, "offset": sizes, "src": handles, "dst": handles,
    "src_offset": sizes, "dst_offset": sizes, "prog": handles, "options": st.one_of(
        st.sampled_from(["", "-cl-fast-relaxed-math", "-I /etc", "-D X=1"]), text),
    "kernel": st.one_of(st.sampled_from(["k", "k2", "nope"]), text), "gsize": small_ranges,
    "lsize": st.one_of(st.none(), small_ranges), "args": st.one_of(launch_args, json_values),
    "ack": st.one_of(st.integers(0, 3), integers, json_values),
}
COMMAND_OPS = ["info", "alloc", "free", "write", "read", "copy", "build", "program_binary", "free_program",
               "launch", "launch", "launch", "finish", "release", "ack", "hello", "open", "nope"]


@st.composite
def commands(draw):
    """(header without seq/epoch, payload, seq offset, epoch offset)."""
    op = draw(st.sampled_from(COMMAND_OPS))
    header = {**draw(objects(COMMAND_FIELDS)), "op": op}
    payload = draw(st.one_of(st.just(b""), st.binary(max_size=200),
                             st.just(KERNELS) if op == "build" else st.just(b"")))
    return header, payload, draw(st.sampled_from([0] * 12 + [1, -1, 5])), draw(st.sampled_from([0] * 12 + [1, -1]))


@fuzz_settings(40)
@given(st.lists(commands(), min_size=1, max_size=8))
def test_an_authenticated_session_sending_anything_harms_nothing(pool, probe_done, cmds):
    conn = FrameConn(pool.endpoint)
    try:
        conn.send({"op": "hello", "versions": [1]})
        assert conn.next()["op"] == "welcome"
        conn.send({"op": "open", "token": ALICE, "secret": "ab" * 32})
        opened = conn.next()
        assert opened["op"] == "opened", opened
        epoch, seq = opened["epoch"], 0
        # something to aim at: a buffer (1), a program with two kernels (1)
        setup = [({"op": "alloc", "buf": 1, "size": 64}, b""), ({"op": "alloc", "buf": 2, "size": 1}, b""),
                 ({"op": "build", "prog": 1, "options": ""}, KERNELS)]
        for header, payload in setup:
            conn.send({**header, "seq": seq, "epoch": epoch}, payload)
            seq += 1
        for header, payload, seq_off, epoch_off in cmds:
            if header["op"] == "ack":
                conn.send(header)
                continue
            conn.send({**header, "seq": max(0, seq + seq_off), "epoch": max(0, epoch + epoch_off)}, payload)
            seq += 1 if seq_off == 0 else 0
        conn.send({"op": "finish", "seq": seq, "epoch": epoch})
        answers = []
        while True:                            # until finish is answered, or the pool closed
            frame = conn.next()
            if frame is None:
                break
            answers.append(frame)
            if frame.get("op") == "error":
                continue                       # then the close
            if (frame.get("op") == "reply" and frame.get("seq") == seq) or \
                    (frame.get("op") == "done" and frame.get("to") == seq):
                conn.send({"op": "release", "seq": seq + 1, "epoch": epoch})   # its memory back at once
                break
        check_answers(answers)
    finally:
        conn.close()
