"""A large write copied to the device while it arrives (issue 11, item 1;
``accelmig.pool.streaming``).

Real pools, real PoCL, real device processes, real sockets.  A write of at
least ``STREAM_MIN`` on an idle session has its pieces copied from the
upload arena by the session's worker while the rest arrives; the result is
bit-exact, its identity the same as if it had been digested whole.  A write
cut half-way after some of it reached the device leaves a torn range: only
a write of the same buffer, offset and length may come at its sequence
number (the same driver's re-send, or another copy's write of that range);
anything else there is refused as SESSION_DIVERGED.  A write that would
fail (past its buffer) never streams, and changes nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings, strategies as st

from accelmig.agent.driver import connect
from accelmig.lab.cutproxy import CutProxy
from accelmig.lab.poolthread import PoolThread
from accelmig.pool.dataplane import PAYLOAD_DIGEST, PAYLOAD_DIGEST_STREAM
from accelmig.pool.streaming import STREAM_MIN, STREAM_PIECE
from tests.support.tenants import ALICE, TENANTS
from tests.support.twohosts import Raw
from tests.support.wait import wait_for

MIB = 1 << 20
SIZE = 32 * MIB


def pattern(nbytes: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def counters(pool, sid: str) -> dict:
    return pool.session(sid)["counters"]


@settings(max_examples=50, deadline=None)
@given(data=st.binary(max_size=4096), cuts=st.lists(st.integers(0, 4096), max_size=6))
def test_the_digest_taken_piece_by_piece_is_the_digest_of_the_whole(data, cuts):
    """Identities compare a streamed write's digest with a re-send's, taken whole."""
    hasher = PAYLOAD_DIGEST_STREAM()
    start = 0
    for cut in sorted(min(c, len(data)) for c in cuts):
        hasher.update(data[start:cut])
        start = cut
    hasher.update(data[start:])
    assert hasher.intdigest() == PAYLOAD_DIGEST(data) == xxhash.xxh3_64_intdigest(data)


def test_a_large_write_streams_to_the_device_and_is_bit_exact():
    first, second = pattern(SIZE, 1), pattern(SIZE, 2)
    with PoolThread(tenants=TENANTS) as pool:
        with connect(pool.endpoint, ALICE, agent=False, timeout=60) as dev:
            buf = dev.upload(first)
            assert dev.read(buf) == first
            dev.write(buf, second)                 # over other bytes: each byte is the new one
            assert dev.read(buf) == second
            got = counters(pool, dev.sid)
            # pieces of both writes went ahead; the last piece of each was the command's own
            assert got["streamed_bytes"] >= 2 * STREAM_PIECE
            assert got["streamed_bytes"] <= 2 * (SIZE - STREAM_PIECE)
            small = dev.upload(b"x" * (STREAM_MIN - 1))   # below the floor: not streamed
            assert counters(pool, dev.sid)["streamed_bytes"] == got["streamed_bytes"]
            assert dev.read(small) == b"x" * (STREAM_MIN - 1)


def test_a_write_past_its_buffer_never_streams_and_changes_nothing():
    with PoolThread(tenants=TENANTS) as pool:
        with connect(pool.endpoint, ALICE, agent=False, timeout=60) as dev:
            buf = dev.alloc(STREAM_MIN)
            with pytest.raises(Exception) as refused:
                dev.write(buf, pattern(STREAM_MIN + MIB, 3))
            assert refused.value.code.value == "OUT_OF_RANGE", refused.value
            assert counters(pool, dev.sid)["streamed_bytes"] == 0
            assert dev.read(buf) == bytes(STREAM_MIN)


def test_a_write_cut_half_way_and_resent_by_its_driver_is_exact():
    """The relay resets the connection once 20 MiB of a 32 MiB write went up
    (some pieces are on the device by then); the driver resumes and sends
    the write again: the buffer is the write's bytes, and nothing is torn."""
    data = pattern(SIZE, 4)
    with PoolThread(tenants=TENANTS) as pool, CutProxy(pool.endpoint) as relay:
        with connect(relay.endpoint, ALICE, agent=False, timeout=60) as dev:
            buf = dev.alloc(SIZE)
            dev.finish()
            relay.cut_after(20 * MIB, "up")
            dev.write(buf, data)                   # resumed and re-sent under the hood
            assert relay.tripped.is_set() and dev.stats["resumes"] >= 1
            assert dev.read(buf) == data
            state = pool.session(dev.sid)
            assert state["torn"] is None
            assert state["counters"]["streamed_bytes"] > 0


def _cut_half_way(pool, raw: Raw, buf: int, seq: int, data: bytes) -> None:
    """Send a write's header and 20 MiB of its payload, wait until a piece
    reached the device, then drop the connection."""
    from accelmig.wire.frames import encode_prefix_and_header
    header = {"op": "write", "seq": seq, "epoch": raw.epoch, "ack": seq - 1, "buf": buf, "offset": 0}
    raw.sock.sendall(encode_prefix_and_header(header, len(data)) + data[:20 * MIB])
    wait_for(lambda: counters(pool, raw.sid)["streamed_bytes"] >= STREAM_PIECE, 30,
             "a piece of the write to reach the device")
    raw.sock.close()
    wait_for(lambda: pool.session(raw.sid)["torn"] is not None, 30, "the pool to see the write torn")


def _resumed(pool, raw: Raw, last_seen: int) -> Raw:
    """The session resumed on a new connection (``raw.epoch`` follows)."""
    again = Raw(pool.endpoint)
    answer = again.resume(raw.sid, raw.secret, raw.epoch, last_seen, next_seq=last_seen + 1)
    assert answer["op"] == "resumed", answer
    again.sid, again.secret = raw.sid, raw.secret
    raw.epoch = again.epoch = answer["epoch"]
    return again


def _torn_session(pool, data: bytes) -> Raw:
    """A session whose buffer 1 holds some of ``data``'s write at seq 2, cut half-way."""
    raw = Raw(pool.endpoint)
    raw.epoch = raw.open()["epoch"]
    raw.send({"op": "alloc", "seq": 1, "epoch": raw.epoch, "ack": 0, "buf": 1, "size": SIZE})
    assert raw.recv()["ok"]
    _cut_half_way(pool, raw, 1, 2, data)
    assert pool.session(raw.sid)["torn"] == {"seq": 2, "buf": 1, "offset": 0, "size": SIZE}
    return raw


def _write_the_range_whole(pool, raw: Raw, payload: bytes) -> None:
    """Resume, write the torn range whole at seq 2, read it back."""
    copy = _resumed(pool, raw, 1)
    copy.send({"op": "write", "seq": 2, "epoch": copy.epoch, "ack": 1, "buf": 1, "offset": 0}, payload)
    assert copy.recv() == {"op": "reply", "seq": 2, "ok": True}
    copy.send({"op": "read", "seq": 3, "epoch": copy.epoch, "ack": 2, "buf": 1, "offset": 0, "size": SIZE})
    assert copy.recv()["ok"]
    assert copy.payloads[3] == payload
    assert pool.session(raw.sid)["torn"] is None
    copy.sock.close()


def test_after_a_torn_write_only_a_write_of_that_range_may_come_at_its_seq():
    data, other = pattern(SIZE, 5), pattern(SIZE, 6)
    with PoolThread(tenants=TENANTS) as pool:
        raw = _torn_session(pool, data)
        # another command at seq 2 (a finish; a write elsewhere in the buffer) is refused
        for header, payload in (({"op": "finish"}, b""),
                                ({"op": "write", "buf": 1, "offset": 0}, other[:MIB])):
            copy = _resumed(pool, raw, 1)
            copy.send({**header, "seq": 2, "epoch": copy.epoch, "ack": 1}, payload)
            refused = copy.recv()
            assert refused["op"] == "error" and refused["error"]["code"] == "SESSION_DIVERGED", refused
            assert "only that write may come there" in refused["error"]["message"]
        # a write of the same range with other bytes (another copy's) is taken whole
        _write_the_range_whole(pool, raw, other)


def test_a_torn_write_resent_whole_leaves_the_buffer_exact():
    data = pattern(SIZE, 7)
    with PoolThread(tenants=TENANTS) as pool:
        _write_the_range_whole(pool, _torn_session(pool, data), data)
