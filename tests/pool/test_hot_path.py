"""The data plane's hot path keeps its meaning (issue 11, item 1).

Real pools, real PoCL, real device processes.  A finish with nothing in
flight is answered on the pool's loop, without the session's worker and
without a round trip to the tenant's device process; a finish after work
still goes to the device and waits for it; a finish on a device process
the pool knows dead still says ``KILLED``.  Pipelined launches go to the
device process as batches, one call of up to 256 launches enqueued in one
loop there: they still run exactly once each, in order, across cuts, and
one that fails fails alone.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accelmig.agent.driver import connect
from accelmig.lab.cutproxy import CutProxy
from accelmig.lab.poolthread import PoolThread
from accelmig.pool.devices.worker import LAUNCH_BATCH
from accelmig.wire.errors import AccelmigError, DeviceError, NoSuchObject
from tests.support.wait import wait_for

# order matters: a[i] = 3 a[i] + n is not the same result in another order
ADVANCE = ("__kernel void advance(__global uint *a, uint n) "
           "{ a[get_global_id(0)] = a[get_global_id(0)] * 3u + n; }")
TENANTS = {"hot": ("hot-token-000001", "1GiB")}
TOKEN = TENANTS["hot"][0]


def calls_started(pool) -> int:
    """Calls the pool sent to the tenant's device process so far."""
    return pool.call(lambda: pool.backend._tenants["hot"].calls_started)


def expected(start: np.ndarray, ns) -> np.ndarray:
    a = start.astype(np.uint64)
    for n in ns:
        a = (a * 3 + n) % (1 << 32)
    return a.astype(np.uint32)


def test_an_idle_finish_skips_the_device_process_and_one_after_work_does_not():
    with PoolThread(tenants=TENANTS) as pool:
        with connect(pool.endpoint, TOKEN, agent=False, timeout=60) as dev:
            buf = dev.upload(np.arange(64, dtype=np.uint32).tobytes())
            prog = dev.build(ADVANCE)
            before = calls_started(pool)
            prog.launch("advance", 64, None, buf, np.uint32(1))
            dev.finish()                       # after a launch: the device is asked
            assert calls_started(pool) == before + 2
            commands = pool.session(dev.sid)["counters"]["commands"]
            for _ in range(50):
                dev.finish()                   # nothing ran since: answered by the pool
            assert calls_started(pool) == before + 2
            assert pool.session(dev.sid)["counters"]["commands"] == commands + 50
            prog.launch("advance", 64, None, buf, np.uint32(2))
            dev.finish()                       # work again: launch and finish both go
            assert calls_started(pool) == before + 4
            assert (np.frombuffer(dev.read(buf), np.uint32)
                    == expected(np.arange(64, dtype=np.uint32), [1, 2])).all()


def test_an_idle_finish_on_a_device_process_that_died_says_killed():
    with PoolThread(tenants=TENANTS) as pool:
        with connect(pool.endpoint, TOKEN, agent=False, timeout=60) as dev:
            dev.upload(bytes(64))
            dev.finish()
            dev.finish()                       # quiet now: this one was answered by the pool
            pid = pool.backend.processes()["hot"]
            os.kill(pid, signal.SIGKILL)       # the tenant's own process, started by this pool
            wait_for(lambda: "hot" not in pool.backend.processes(), 20,
                     "the pool to notice its device process died")
            with pytest.raises(AccelmigError) as killed:
                dev.finish()
            assert killed.value.code.value == "KILLED", killed.value


def test_pipelined_launches_run_once_each_in_order_with_finishes_between_and_cuts():
    with PoolThread(tenants=TENANTS) as pool:
        proxy = CutProxy(pool.endpoint)
        try:
            with connect(proxy.endpoint, TOKEN, agent=False, timeout=60) as dev:
                start = np.arange(256, dtype=np.uint32)
                buf = dev.upload(start.tobytes())
                prog = dev.build(ADVANCE)
                ns = [(i * 7919) % 1000 for i in range(3000)]
                cuts = 0
                for i, n in enumerate(ns, 1):
                    prog.launch("advance", 256, None, buf, np.uint32(n))
                    if i % 500 == 0:
                        dev.finish()
                    if i % 1000 == 250:
                        assert proxy.cut() == 1
                        cuts += 1
                        wait_for(lambda: dev.stats["resumes"] >= cuts, 20,
                                 f"the driver's resume after cut {cuts}", interval=0.01)
                got = np.frombuffer(dev.read(buf), np.uint32)
                assert (got == expected(start, ns)).all()
                counters = pool.session(dev.sid)["counters"]
                assert counters["launches"] == len(ns)
                assert dev.stats["resumes"] >= 3
        finally:
            proxy.close()


def test_a_burst_of_launches_is_a_few_calls_to_the_device_process():
    """1,000 pipelined launches then a finish: at most a call per 256
    launches (more where the pool settles a burst in parts), never one each."""
    with PoolThread(tenants=TENANTS) as pool:
        with connect(pool.endpoint, TOKEN, agent=False, timeout=60) as dev:
            start = np.arange(64, dtype=np.uint32)
            buf = dev.upload(start.tobytes())
            prog = dev.build(ADVANCE)
            dev.finish()
            before = calls_started(pool)
            ns = [(i * 31) % 977 for i in range(1000)]
            for n in ns:
                prog.launch("advance", 64, None, buf, np.uint32(n))
            dev.finish()
            calls = calls_started(pool) - before
            assert -(-len(ns) // LAUNCH_BATCH) + 1 <= calls <= len(ns) // 10, calls
            assert (np.frombuffer(dev.read(buf), np.uint32) == expected(start, ns)).all()
            assert pool.session(dev.sid)["counters"]["launches"] == len(ns)


def test_a_launch_that_fails_in_a_batch_fails_alone():
    """Failures in the middle of a burst (a kernel that does not exist, a
    wrong argument count): each is its own command's error, raised once at
    the next waiting call; the launches around them all ran, in order."""
    with PoolThread(tenants=TENANTS) as pool:
        with connect(pool.endpoint, TOKEN, agent=False, timeout=60) as dev:
            start = np.arange(64, dtype=np.uint32)
            buf = dev.upload(start.tobytes())
            prog = dev.build(ADVANCE)
            ns = list(range(1, 41))
            for i, n in enumerate(ns):
                prog.launch("advance", 64, None, buf, np.uint32(n))
                if i == 10:
                    prog.launch("no_such_kernel", 64, None, buf, np.uint32(0))
            with pytest.raises(NoSuchObject, match="no_such_kernel"):
                dev.finish()
            for i, n in enumerate(ns):
                prog.launch("advance", 64, None, buf, np.uint32(n))
                if i == 20:
                    prog.launch("advance", 64, None, buf)         # one argument short
            with pytest.raises(DeviceError, match="takes 2 arguments, 1 given"):
                dev.finish()
            dev.finish()                                         # raised once, then clear
            assert (np.frombuffer(dev.read(buf), np.uint32) == expected(start, ns + ns)).all()
            counters = pool.session(dev.sid)["counters"]
            assert counters["launches"] == 2 * len(ns)           # the two failed ones did not count


MIX = ("__kernel void blend(__global uint *a, __local uint *tmp, uint n, ulong m) {"
       " size_t i = get_global_id(0); tmp[get_local_id(0)] = a[i] * 3u + n + (uint)m;"
       " barrier(CLK_LOCAL_MEM_FENCE); a[i] = tmp[get_local_id(0)]; }")


@pytest.mark.parametrize("isolation", ["process", "none"])
def test_launch_arguments_of_every_kind_reach_the_kernel_in_a_device_process_or_in_the_pool(isolation):
    """Buffer, local-memory and scalar arguments: passed on as the data plane
    carried them to a device process, decoded for the in-process backend;
    the same result either way."""
    from accelmig.agent.driver.args import LocalMemory
    # (none: builds run unconfined in the pool, so only when allowed)
    with PoolThread(tenants=TENANTS, device_isolation=isolation,
                    allow_unconfined_builds=isolation == "none") as pool:
        with connect(pool.endpoint, TOKEN, agent=False, timeout=60) as dev:
            start = np.arange(64, dtype=np.uint32)
            buf = dev.upload(start.tobytes())
            prog = dev.build(MIX)
            for n in range(1, 6):
                prog.launch("blend", 64, 16, buf, LocalMemory(16 * 4), np.uint32(n), np.uint64(1 << 33 | n))
            got = np.frombuffer(dev.read(buf), np.uint32)
            assert (got == expected(start, [2 * n for n in range(1, 6)])).all()
            assert pool.session(dev.sid)["counters"]["launches"] == 5


@settings(max_examples=200, deadline=None)
@given(first=st.integers(0, 2**63 - 1), length=st.integers(0, 10**6))
def test_a_done_frame_is_the_frame_the_header_encoder_makes(first, length):
    """The pool formats its ``done`` frames by hand (the encoder's time was
    on every idle round trip's path): byte for byte what ``encode_header``
    makes, and what a driver's reader decodes."""
    from types import SimpleNamespace
    from accelmig.pool.dataplane import DataConnection
    from accelmig.wire.frames import FrameReader, encode_prefix_and_header
    conn = SimpleNamespace(_done=(first, first + length), _out=[])
    DataConnection._queue_done(conn)
    expected = encode_prefix_and_header({"op": "done", "from": first, "to": first + length})
    assert conn._out == [expected] and conn._done is None
    reader = FrameReader()
    buffer = reader.get_buffer()
    buffer[:len(expected)] = expected
    (frame,) = reader.feed(len(expected))
    assert frame.header == {"op": "done", "from": first, "to": first + length}
