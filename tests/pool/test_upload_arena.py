"""Uploads straight into shared memory (issue 11, item 1: the upload arena).

A write's payload is received from TCP into the tenant's upload arena, a
sealed memfd that its device process maps read-only, and the device
process enqueues the write from there: the payload never crosses the
socket pair.  Real pools, real PoCL, real device processes; what crossed
the socket pair is counted by the pool (``pipe_payload_bytes``), what the
process took from the arena too (``arena_bytes``).

The arena is bounded: a payload that finds no room takes the copy path
and the result stays exact; a lease goes back however its command ends
(run, answered from the log, refused, cut off half-received); one arena per
tenant's process, and no process can resize the pool's mapping.
"""

from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from accelmig.agent.driver import connect
from accelmig.lab.cutproxy import CutProxy
from accelmig.lab.poolthread import PoolThread
from accelmig.pool.devices.arena import ALIGN, UploadArena
from accelmig.wire.errors import BadRequest
from tests.support.tenants import ALICE, BOB, TENANTS
from tests.support.twohosts import Raw
from tests.support.wait import wait_for

MIB = 1 << 20


def pattern(nbytes: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def process_of(pool, tenant: str):
    """The pool's side of the tenant's device process (its counters, its arena)."""
    return pool.call(lambda: pool.backend._tenants[tenant])


def figures(pool, tenant: str) -> dict:
    def read():
        process = pool.backend._tenants[tenant]
        arena = process.arena
        return {"pipe": process.pipe_payload_bytes, "arena_bytes": process.arena_bytes,
                "leases": arena.leases if arena else 0, "fallbacks": arena.fallbacks if arena else 0,
                "in_use": arena.in_use if arena else 0}
    return pool.call(read)


# -- the path ----------------------------------------------------------------------
@pytest.mark.parametrize("arena", [True, False])
def test_a_writes_bytes_reach_the_device_without_crossing_the_socket_pair(arena):
    """With the arena the socket pair carries none of the written bytes;
    without it (``upload_arena = 0``, the control) it carries all of them."""
    config = {} if arena else {"upload_arena": 0}
    with PoolThread(tenants=TENANTS, **config) as pool:
        with connect(pool.endpoint, ALICE, agent=False, timeout=60) as dev:
            buf = dev.alloc(4 * MIB)
            dev.finish()                                   # the device process is up and ready
            before = figures(pool, "alice")
            data = [pattern(MIB, seed) for seed in range(3)]
            for index, piece in enumerate(data):
                dev.write(buf, piece, offset=index * MIB)
            assert bytes(dev.read(buf, 3 * MIB)) == b"".join(data)
            after = figures(pool, "alice")
            if arena:
                assert after["pipe"] - before["pipe"] == 0
                assert after["arena_bytes"] - before["arena_bytes"] == 3 * MIB
                assert after["leases"] - before["leases"] == 3 and after["fallbacks"] == before["fallbacks"]
                assert after["in_use"] == 0                # each lease back once its write ran
            else:
                assert process_of(pool, "alice").arena is None
                assert after["pipe"] - before["pipe"] == 3 * MIB
            assert pool.session(dev.sid)["counters"]["bytes_uploaded"] == 3 * MIB


def test_small_writes_and_other_payloads_keep_the_copy_path():
    """Payloads the frame reader copies out of its staging buffer (64 KiB
    and less) and payloads of other commands (a build's source) never take
    a lease: the arena is for bulk writes."""
    with PoolThread(tenants=TENANTS) as pool:
        with connect(pool.endpoint, ALICE, agent=False, timeout=60) as dev:
            buf = dev.alloc(64 << 10)
            dev.finish()
            before = figures(pool, "alice")
            dev.write(buf, pattern(64 << 10, 1))
            dev.build("__kernel void k(__global uint *x) { x[0] = 1u; }")
            after = figures(pool, "alice")
            assert after["leases"] == before["leases"] and after["fallbacks"] == before["fallbacks"]
            assert after["pipe"] - before["pipe"] >= 64 << 10


# -- bounded ------------------------------------------------------------------------
def test_a_full_arena_falls_back_to_the_copy_path_and_the_result_stays_exact():
    """An arena of two chunks, a write of 32 chunks held back by a pause (as
    a migration's switch-over holds commands): every chunk is received while
    the first two hold the arena, so exactly two are leased and thirty take
    the copy path; once released, all of them run once, in order, exact."""
    chunk = 256 << 10
    with PoolThread(tenants=TENANTS, upload_arena=2 * chunk, max_payload=chunk) as pool:
        with connect(pool.endpoint, ALICE, agent=False, timeout=60) as dev:
            assert dev.chunk == chunk
            data = pattern(32 * chunk, 7)
            buf = dev.alloc(len(data))
            dev.finish()
            before = figures(pool, "alice")
            session = pool.call(lambda: pool.pool.sessions[dev.sid])
            pool.call(lambda: session.pause("test-hold", time.time()))
            first = session.log.next_seq
            errors: list = []

            def write():
                try:
                    dev.write(buf, data)
                except Exception as exc:      # reported below
                    errors.append(exc)
            writer = threading.Thread(target=write)
            writer.start()
            wait_for(lambda: pool.session(dev.sid)["sequence"]["next_seq"] == first + 32, 30,
                     "the pool to receive all 32 chunks")
            held = figures(pool, "alice")
            assert held["leases"] - before["leases"] == 2
            assert held["fallbacks"] - before["fallbacks"] == 30
            assert held["in_use"] == 2 * chunk                  # never more than the arena
            pool.call(lambda: session.unpause("test-hold"))
            writer.join(60)
            assert not writer.is_alive() and errors == []
            assert bytes(dev.read(buf)) == data
            after = figures(pool, "alice")
            assert after["arena_bytes"] - before["arena_bytes"] == 2 * chunk
            assert after["pipe"] - before["pipe"] == 30 * chunk
            assert after["in_use"] == 0
            assert pool.session(dev.sid)["counters"]["bytes_uploaded"] == len(data)


def test_the_arena_is_at_most_the_tenants_quota():
    with PoolThread(tenants={"alice": (ALICE, "3MiB")}, upload_arena=256 * MIB) as pool:
        with connect(pool.endpoint, ALICE, agent=False, timeout=60) as dev:
            buf = dev.upload(pattern(2 * MIB, 3))
            assert process_of(pool, "alice").arena.size == 3 * MIB
            assert bytes(dev.read(buf)) == pattern(2 * MIB, 3)


# -- exactly once ------------------------------------------------------------------
def test_a_resent_arena_write_is_a_duplicate_or_diverged_and_gives_its_lease_back():
    """The identity of a write received into the arena is taken before its
    bytes go back (the region is re-used at once by the next write): the
    same write re-sent is answered from the log, another one under its
    sequence number is refused as diverged, and neither keeps a lease."""
    with PoolThread(tenants=TENANTS) as pool:
        raw = Raw(pool.endpoint)
        raw.open()
        first, second = pattern(MIB, 21), pattern(MIB, 22)
        raw.send({"op": "alloc", "seq": 1, "epoch": 1, "buf": 1, "size": 2 * MIB})
        assert raw.recv()["ok"]                               # the device process is ready now
        raw.send({"op": "write", "seq": 2, "epoch": 1, "buf": 1, "offset": 0}, first)
        raw.send({"op": "write", "seq": 3, "epoch": 1, "buf": 1, "offset": MIB}, second)
        assert [raw.recv()["ok"] for _ in range(2)] == [True, True]
        assert figures(pool, "alice")["leases"] == 2          # both took the arena
        copy = Raw(pool.endpoint)
        resumed = copy.resume(raw.sid, raw.secret, 1, 1)      # a copy that saw only reply 1
        assert resumed["expect"] == 4 and resumed["replay"] == 2
        assert [copy.recv()["seq"] for _ in range(2)] == [2, 3]
        copy.send({"op": "write", "seq": 2, "epoch": 2, "buf": 1, "offset": 0}, first)
        assert copy.recv() == {"op": "reply", "seq": 2, "ok": True}       # from the log
        assert pool.session(raw.sid)["counters"]["duplicates"] == 1
        copy.send({"op": "write", "seq": 3, "epoch": 2, "buf": 1, "offset": MIB}, first)
        answer = copy.recv()
        assert answer["error"]["code"] == "SESSION_DIVERGED", answer
        wait_for(lambda: figures(pool, "alice")["in_use"] == 0, 10, "every lease back")
        third = Raw(pool.endpoint)
        third.resume(raw.sid, raw.secret, 2, 3)
        third.send({"op": "read", "seq": 4, "epoch": 3, "buf": 1, "offset": 0, "size": 2 * MIB})
        frames = []
        while not frames:
            frames = [f for f in third.reader.feed(third.sock.recv_into(third.reader.get_buffer()))
                      if f.op == "reply"]
        assert bytes(frames[0].payload) == first + second
        for conn in (raw, copy, third):
            conn.close()


def test_a_cut_in_the_middle_of_a_payload_gives_its_lease_back_and_the_write_runs_once():
    with PoolThread(tenants=TENANTS) as pool:
        relay = CutProxy(pool.endpoint)
        try:
            with connect(relay.endpoint, ALICE, agent=False, timeout=60) as dev:
                data = pattern(8 * MIB, 5)
                buf = dev.alloc(len(data))
                dev.finish()
                before = figures(pool, "alice")
                relay.cut_after(3 * MIB)               # inside the write's payload
                dev.write(buf, data)                   # resumed and re-sent by the driver
                assert relay.tripped.is_set() and dev.stats["resumes"] >= 1
                assert bytes(dev.read(buf)) == data
                after = wait_for(lambda: (lambda f: f if f["in_use"] == 0 else None)(figures(pool, "alice")),
                                 10, "the half-received payload's lease to go back")
                assert after["leases"] - before["leases"] == 2   # the cut one and the re-sent one
                state = pool.session(dev.sid)["counters"]
                assert state["bytes_uploaded"] == len(data) and state["duplicates"] == 0
        finally:
            relay.close()


# -- kept apart --------------------------------------------------------------------
def _confined(pid: int) -> int:
    """The process of a device process that holds its arena: the sandbox's
    confined one (the one the pool started hands its descriptors over to it
    and waits, accelmig.pool.devices.sandbox)."""
    import psutil
    (child,) = psutil.Process(pid).children()
    return child.pid


def _arena_fds(pid: int) -> dict[int, int]:
    """fd -> inode of every upload arena a process holds open."""
    found = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{name}"
        try:
            if UploadArena.NAME in os.readlink(path):
                found[int(name)] = os.stat(path).st_ino
        except FileNotFoundError:
            continue
    return found


def _mapped_arenas(pid: int) -> set[int]:
    with open(f"/proc/{pid}/maps") as maps:
        return {int(line.split()[4]) for line in maps if UploadArena.NAME in line}


def test_each_tenants_process_holds_its_own_arena_read_only_and_sealed():
    with PoolThread(tenants=TENANTS) as pool:
        with connect(pool.endpoint, ALICE, agent=False, timeout=60) as alice, \
                connect(pool.endpoint, BOB, agent=False, timeout=60) as bob:
            alice.upload(pattern(MIB, 1))
            bob.upload(pattern(MIB, 2))
            pids = {t: _confined(pid) for t, pid in pool.call(lambda: pool.backend.processes()).items()}
            inodes = {t: pool.call(lambda t=t: pool.backend._tenants[t].arena.inode) for t in pids}
            assert inodes["alice"] != inodes["bob"]
            for tenant, pid in pids.items():
                held = _arena_fds(pid)
                assert list(held.values()) == [inodes[tenant]], (tenant, held)
                assert _mapped_arenas(pid) == {inodes[tenant]}
                (fd,) = held
                with open(f"/proc/{pid}/fdinfo/{fd}") as info:
                    flags = int(next(line for line in info if line.startswith("flags:")).split()[1], 8)
                assert flags & os.O_ACCMODE == os.O_RDONLY
                # even opened again for writing, its size cannot change under the pool's mapping
                again = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
                try:
                    with pytest.raises(PermissionError) as refused:
                        os.ftruncate(again, 0)
                    assert refused.value.errno == errno.EPERM
                finally:
                    os.close(again)


def test_a_device_process_refuses_a_write_outside_its_arena():
    """The process checks where the pool says a payload lies (its answers
    are checked the other way round): out of the arena is BAD_REQUEST."""
    with PoolThread(tenants=TENANTS) as pool:
        with connect(pool.endpoint, ALICE, agent=False, timeout=60) as dev:
            buf = dev.alloc(4096)
            dev.finish()
            context = pool.call(lambda: pool.pool.sessions[dev.sid].context)
            size = context.process.arena.size
            for at, nbytes in ((size - 100, 4096), (-1, 10), (0, size + 1), ("0", 10)):
                with pytest.raises(BadRequest) as refused:
                    context.process.call(context.ctx_id, "write_arena",
                                         {"buf": buf.handle, "offset": 0, "at": at, "size": nbytes})
                assert "outside its upload arena" in str(refused.value)
            dev.write(buf, pattern(4096, 9))           # the session is unharmed
            assert bytes(dev.read(buf)) == pattern(4096, 9)


# -- the allocator -----------------------------------------------------------------
def test_the_allocator_fits_first_joins_neighbours_and_counts_what_did_not_fit():
    arena = UploadArena(8 * ALIGN)
    arena.close_child_fd()                   # (no device process here to hand it to)
    a, b, c = arena.lease(ALIGN), arena.lease(2 * ALIGN + 1), arena.lease(ALIGN)
    assert (a.offset, b.offset, c.offset) == (0, ALIGN, 4 * ALIGN)    # page-aligned, first fit
    assert arena.lease(4 * ALIGN) is None and arena.fallbacks == 1    # 3 pages free, not 4
    b.release()
    b.release()                                                     # (idempotent)
    assert arena.free_runs() == [(ALIGN, 3 * ALIGN), (5 * ALIGN, 3 * ALIGN)]
    a.release()
    c.release()
    assert arena.free_runs() == [(0, 8 * ALIGN)] and arena.in_use == 0
    whole = arena.lease(8 * ALIGN)
    whole.view[:5] = b"hello"
    assert bytes(arena.map[:5]) == b"hello"
    assert arena.lease(1) is None
    whole.release()
    assert arena.lease(0) is None and arena.free_runs() == [(0, 8 * ALIGN)]   # nothing to place


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * ALIGN)), max_size=60))
def test_leases_never_overlap_and_every_byte_comes_back(steps):
    arena = UploadArena(16 * ALIGN)
    arena.close_child_fd()
    held: list = []
    for take, nbytes in steps:
        if take or not held:
            lease = arena.lease(nbytes)
            if lease is not None:
                held.append(lease)
        else:
            held.pop(nbytes % len(held)).release()
        spans = sorted((lease.offset, lease.offset + lease.size) for lease in held)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
        assert all(0 <= start and end <= arena.size for start, end in spans)
        free = arena.free_runs()
        assert sum(size for _, size in free) + arena.in_use == arena.size
        assert all(o1 + s1 < o2 for (o1, s1), (o2, _) in zip(free, free[1:]))   # joined
    for lease in held:
        lease.release()
    assert arena.free_runs() == [(0, arena.size)]


# -- resident only while used ------------------------------------------------------
def test_an_idle_arena_gives_its_pages_back_once_and_only_when_idle_long_enough():
    now = [100.0]
    arena = UploadArena(16 * ALIGN, clock=lambda: now[0])
    blocks = lambda: os.fstat(arena.child_fd).st_blocks      # the memfd's pages, counted by the kernel
    lease = arena.lease(8 * ALIGN)
    lease.view[:] = b"\xab" * (8 * ALIGN)
    assert blocks() > 0
    now[0] += 100
    assert arena.trim_if_idle(30) == 0                        # in use: kept
    lease.release()
    now[0] += 29
    assert arena.trim_if_idle(30) == 0 and blocks() > 0       # idle, not long enough
    now[0] += 2
    assert arena.trim_if_idle(30) == arena.size and blocks() == 0
    assert bytes(arena.map[:8]) == bytes(8)                   # given back: zeros if read again
    assert arena.trim_if_idle(30) == 0 and arena.trims == 1   # once
    now[0] += 100
    assert arena.begin_trim(30) is False                      # nothing resident: nothing to do
    lease = arena.lease(ALIGN)
    lease.release()
    now[0] += 100
    assert arena.begin_trim(30) is True
    assert arena.lease(ALIGN) is None                         # while trimming: the copy path
    assert arena.begin_trim(30) is False                      # (one trim at a time)
    arena.end_trim()
    again = arena.lease(ALIGN)                                # and usable again
    again.view[:3] = b"new"
    assert bytes(arena.map[:3]) == b"new" and arena.touched
    again.release()
    arena.close_child_fd()


def test_the_janitor_gives_an_idle_tenants_arena_pages_back():
    with PoolThread(tenants=TENANTS, upload_arena_keep=0.2) as pool:
        with connect(pool.endpoint, ALICE, agent=False, timeout=60) as dev:
            buf = dev.alloc(4 * MIB)
            dev.finish()
            dev.write(buf, pattern(4 * MIB, 1))
            process = process_of(pool, "alice")
            holder = _confined(process.proc.pid)
            (fd,) = _arena_fds(holder)
            wait_for(lambda: process.arena.trims == 1, 20, "the janitor to trim the idle arena")
            assert os.stat(f"/proc/{holder}/fd/{fd}").st_blocks == 0
            dev.write(buf, pattern(4 * MIB, 2))                # the arena takes writes again
            assert bytes(dev.read(buf)) == pattern(4 * MIB, 2)
            assert figures(pool, "alice")["leases"] == 2
