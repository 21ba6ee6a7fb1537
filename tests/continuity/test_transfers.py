"""Transfers of any size: writes, uploads and reads larger than the frame
limit go in chunks, each an ordinary sequenced command.

The pool here negotiates a small frame limit (``LIMIT``), so that chunking
happens with MiB-sized data in seconds; a cut or a rehome in the middle of
a chunked transfer is placed at an exact byte count on the wire
(``CutProxy.cut_after``), never by timing.
"""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from accelmig.agent.driver import LinkState, connect
from accelmig.agent.driver.transfer import MAX_IN_FLIGHT, chunk_size, pieces
from accelmig.lab.cutproxy import CutProxy
from accelmig.pool.config import parse_size
from accelmig.pool.sequencing import REPLY_BYTES
from accelmig.pool.session import BUFFER_CHARGE
from accelmig.wire.errors import FrameTooLarge, NoSuchObject, OutOfRange, QuotaExceeded
from tests.support.attest import bind
from tests.support.tenants import ALICE, BOB, TENANTS
from tests.support.twohosts import TwoHosts, make_pool
from tests.support.wait import wait_for

LIMIT = 256 << 10          # the pool's frame limit: > 64 KiB, so chunks land in place
TINY = 4 << 10             # below the reader's direct threshold: chunks are copied in


@pytest.fixture(scope="module")
def small():
    with make_pool(max_payload=LIMIT) as pool:
        yield pool


@pytest.fixture
def hosts(small):
    two = TwoHosts(small)
    yield two
    two.close()


@pytest.fixture
def proxy(small):
    relay = CutProxy(small.endpoint)
    yield relay
    relay.close()


def pattern(nbytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def counters(pool, dev) -> dict:
    return pool.session(dev.sid)["counters"]


# -- plans --------------------------------------------------------------------------
def test_a_plan_covers_every_byte_once_in_order():
    assert chunk_size(1 << 30) == 64 << 20 and chunk_size(LIMIT) == LIMIT
    assert pieces(0, 10) == [] and pieces(10, 10) == [(0, 10)]
    assert pieces(21, 10) == [(0, 10), (10, 20), (20, 21)]


# -- round trips around the limit ---------------------------------------------------
@pytest.mark.parametrize("nbytes", [LIMIT - 1, LIMIT, LIMIT + 1, 5 * LIMIT + 7, 64 * LIMIT])
def test_round_trips_around_the_limit_are_bit_exact(small, nbytes):
    data = pattern(nbytes, nbytes)
    with connect(small.endpoint, ALICE, agent=False, timeout=20) as dev:
        assert dev.chunk == LIMIT                    # what the pool said at hello
        buf = dev.upload(data)
        assert bytes(dev.read(buf)) == data.tobytes()
        back = np.empty_like(data)
        dev.read_into(buf, back)
        assert np.array_equal(back, data)
        state = counters(small, dev)
        assert state["bytes_uploaded"] == nbytes and state["bytes_downloaded"] == 2 * nbytes
        chunks = len(pieces(nbytes, LIMIT))
        # one alloc, then a command per chunk of the write and of each read
        assert state["commands"] == 1 + 3 * chunks


def test_tiny_chunks_are_copied_into_place_bit_exact():
    data = pattern(25 * TINY + 3, 7)
    with make_pool(max_payload=TINY) as pool:
        with connect(pool.endpoint, ALICE, agent=False) as dev:
            assert dev.chunk == TINY
            buf = dev.upload(data)
            back = np.zeros_like(data)
            dev.read_into(buf, back)
            assert np.array_equal(back, data)
            assert counters(pool, dev)["bytes_downloaded"] == data.nbytes


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(1, 6 * LIMIT), offset=st.integers(0, 2 * LIMIT), tail=st.integers(0, 1000),
       seed=st.integers(0, 2 ** 32 - 1))
def test_any_size_at_any_offset_round_trips(small, size, offset, tail, seed):
    data = pattern(size, seed)
    with connect(small.endpoint, ALICE, agent=False, timeout=20) as dev:
        buf = dev.alloc(offset + size + tail)
        dev.write(buf, data, offset)
        whole = np.frombuffer(dev.read(buf), dtype=np.uint8)
        assert np.array_equal(whole[offset:offset + size], data)
        assert not whole[:offset].any() and not whole[offset + size:].any()   # nothing spilled
        part = np.empty(size, dtype=np.uint8)
        dev.read_into(buf, part, offset)
        assert np.array_equal(part, data)


def test_a_copy_larger_than_a_frame_needs_no_chunks(small):
    data = pattern(3 * LIMIT + 5, 3)
    with connect(small.endpoint, ALICE, agent=False) as dev:
        src = dev.upload(data)
        dst = dev.alloc(data.nbytes + 10)
        dev.finish()
        before = counters(small, dev)["commands"]
        dev.copy(src, dst, data.nbytes, dst_offset=10)
        dev.finish()
        assert counters(small, dev)["commands"] == before + 2        # the copy, one command; the finish
        assert bytes(dev.read(dst, data.nbytes, 10)) == data.tobytes()


def test_a_payload_that_cannot_be_split_is_still_refused_before_sending(small):
    with connect(small.endpoint, ALICE, agent=False) as dev:
        with pytest.raises(FrameTooLarge, match=f"exceeds the limit of {LIMIT}"):
            dev.build_binary(bytes(LIMIT + 1))
        dev.finish()


# -- quota and range: checked once, up front ----------------------------------------
def test_an_upload_over_quota_is_refused_up_front_with_nothing_written(small, proxy):
    quota = parse_size(TENANTS["bob"][1])
    with connect(proxy.endpoint, BOB, agent=False) as dev:
        dev.finish()
        sent = proxy.relayed["up"]
        with pytest.raises(QuotaExceeded):
            dev.upload(np.zeros(quota + LIMIT, dtype=np.uint8))
        assert proxy.relayed["up"] - sent < 4096         # the alloc alone crossed the wire
        state = counters(small, dev)
        assert state["bytes_uploaded"] == 0 and state["commands"] == 2
        # the whole quota (less what the buffer's own bookkeeping is charged),
        # written in chunks: no chunk is refused for quota
        size = quota - BUFFER_CHARGE
        data = pattern(size, 5)
        buf = dev.upload(data)
        assert bytes(dev.read(buf, LIMIT, size - LIMIT)) == data[-LIMIT:].tobytes()


def test_out_of_range_is_refused_once_before_any_byte_travels(small, proxy):
    with connect(proxy.endpoint, ALICE, agent=False) as dev:
        buf = dev.alloc(4 * LIMIT)
        dev.finish()
        sent = proxy.relayed["up"]
        with pytest.raises(OutOfRange, match=f"write of buffer {buf.handle}: offset 1 \\+ size {4 * LIMIT}"):
            dev.write(buf, bytes(4 * LIMIT), 1)
        with pytest.raises(OutOfRange, match=f"read of buffer {buf.handle}"):
            dev.read_into(buf, bytearray(2 * LIMIT), 3 * LIMIT)
        assert proxy.relayed["up"] == sent
        dev.finish()                                     # nothing pending, nothing to raise


def test_a_chunk_refused_mid_way_is_reported_once_saying_what_was_done():
    # tiny chunks: a whole flight of them fits in the socket buffers while held
    chunks = MAX_IN_FLIGHT + 20
    data = pattern(chunks * TINY, 9)
    with make_pool(max_payload=TINY) as pool:
        relay = CutProxy(pool.endpoint)
        try:
            with connect(relay.endpoint, ALICE, agent=False, timeout=20) as dev:
                buf = dev.alloc(data.nbytes)
                dev.finish()
                relay.hold()                                 # the chunks wait in the relay
                failure = []

                def write():
                    try:
                        dev.write(buf, data)
                    except NoSuchObject as exc:
                        failure.append(exc)
                writer = threading.Thread(target=write, daemon=True)
                writer.start()
                wait_for(lambda: dev.describe()["pending"] >= MAX_IN_FLIGHT, 10, "a full flight of chunks")
                dev.free(buf)                                # lands after the first flight
                relay.release()
                writer.join(20)
                assert not writer.is_alive() and len(failure) == 1
                exc = failure[0]
                done = MAX_IN_FLIGHT * TINY
                assert f"stopped at bytes {done}-{done + TINY} ({done} bytes done)" in str(exc)
                assert exc.details["done_bytes"] == done and exc.details["bytes"] == data.nbytes
                dev.finish()             # the chunks refused after it are not raised again
                assert counters(pool, dev)["bytes_uploaded"] == done
        finally:
            relay.close()


# -- a cut or a rehome in the middle ------------------------------------------------
def _transfer_in_thread(dev, direction: str, buf, data: np.ndarray, out: np.ndarray):
    errors: list = []

    def run():
        try:
            if direction == "write":
                dev.write(buf, data)
            else:
                dev.read_into(buf, out)
        except BaseException as exc:         # reported by the test, not lost in a thread
            errors.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def _quiet(state: dict):
    """The session's sequence once its connection is gone and every command
    it accepted has its reply; None before."""
    seq = state["sequence"]
    return seq if state["state"] == "detached" and seq["highest_reply"] == seq["next_seq"] - 1 else None


@pytest.mark.parametrize("direction", ["write", "read"])
@pytest.mark.parametrize("move", ["cut", "rehome"])
def test_a_cut_or_rehome_mid_transfer_resends_only_what_the_pool_lacks(small, hosts, direction, move):
    """The transfer's connection is reset a third of the way through (at an
    exact byte count); the driver resumes on the same host or, rehomed with
    a ticket, on the other.  Only chunks the pool never accepted are sent
    again, only replies the driver never saw are replayed, each chunk runs
    once on the device, and the result is bit-exact."""
    chunks = 3 * MAX_IN_FLIGHT
    size = chunks * LIMIT
    data = pattern(size, 11)
    out = np.zeros_like(data)
    relay = CutProxy(hosts.a.endpoint)
    domain = str(uuid.uuid4())
    dev = None
    try:
        dev = connect(relay.endpoint, ALICE, agent=False, timeout=30, auto_reconnect=False)
        bind(hosts.a, dev, domain)
        buf = dev.upload(data) if direction == "read" else dev.alloc(size)
        dev.finish()
        before = counters(small, dev)
        wire = "up" if direction == "write" else "down"
        relay.cut_after(size // 3, wire)
        thread, errors = _transfer_in_thread(dev, direction, buf, data, out)
        assert relay.tripped.wait(20), "the transfer never reached the cut"
        wait_for(lambda: dev.state is LinkState.DISCONNECTED, 10, "the driver to see the cut")
        # what the pool holds at the cut, once it ran all it accepted, before anything is re-sent
        at_cut = wait_for(lambda: _quiet(small.session(dev.sid)), 10, "the pool to run what it accepted")
        seen = dev.last_seen
        on_wire = dict(relay.relayed)             # (a resume on this host goes through the relay again)
        if move == "cut":
            result = dev.resume()
        else:
            tickets = hosts.migrate(domain, hosts.a, hosts.b)["tickets"]
            result = dev.resume(hosts.b.endpoint, tickets[dev.sid])
        thread.join(30)
        assert not thread.is_alive() and errors == []
        since = {way: relay.relayed[way] - on_wire[way] for way in on_wire}
        if direction == "write":
            assert bytes(dev.read(buf)) == data.tobytes()
        else:
            assert np.array_equal(out, data)
        after = counters(small, dev)
        first_chunk = before["commands"] + 1                 # the sequence number of chunk 1
        accepted = at_cut["next_seq"] - first_chunk          # chunks the pool had at the cut
        assert 0 < accepted < chunks, "the cut fell outside the transfer"
        if direction == "write":
            # the chunks the pool accepted were never sent again...
            assert dev.stats["resent_bytes"] <= size - accepted * LIMIT
            assert result["resent"] <= chunks - accepted
            # ...and each chunk ran once
            assert after["bytes_uploaded"] - before["bytes_uploaded"] == size
            if move == "cut":        # on the wire too: the payload after the cut is what the pool lacked
                assert since["up"] <= size - accepted * LIMIT + chunks * 512 + 4096
        else:
            answered = at_cut["highest_reply"] - seen        # answered, not yet seen by the driver
            assert seen >= first_chunk, "no chunk had arrived before the cut"
            assert result["replayed"] == answered and answered <= MAX_IN_FLIGHT
            assert after["bytes_downloaded"] - before["bytes_downloaded"] == size
            # the reply log never held the transfer: at most a flight of chunks
            assert at_cut["reply_bytes"] <= (MAX_IN_FLIGHT + 1) * (LIMIT + REPLY_BYTES)
            if move == "cut":        # on the wire too: the chunks after the cut are those not seen
                seen_chunks = seen - first_chunk + 1
                assert since["down"] <= (chunks - seen_chunks) * (LIMIT + 512) + 4096
        assert after["duplicates"] == 0
        state = small.session(dev.sid)
        assert state["bound_host"] == ("hostB" if move == "rehome" else "hostA")
    finally:
        if dev is not None:
            dev.close()
        relay.close()

