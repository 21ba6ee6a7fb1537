"""The driver reuses a launch's record for the same launch again (``Device.launch``).

A loop that launches one kernel on the same buffers and sizes sends the
record it made the first time; anything that could have changed in place
(a list of sizes, a typed scalar) is encoded again each time.  Real pool,
real PoCL: the counters say which launch ran, on which buffer and over how
many elements.
"""

from __future__ import annotations

import numpy as np
import pytest

from accelmig.agent.driver import connect, u32
from accelmig.lab.poolthread import PoolThread

TENANTS = {"reuse": ("reuse-token-00001", "1GiB")}
TOKEN = TENANTS["reuse"][0]
KERNELS = """
__kernel void inc(__global uint *x) { x[get_global_id(0)] += 1u; }
__kernel void add(__global uint *x, uint by) { x[get_global_id(0)] += by; }
"""
N = 16


@pytest.fixture(scope="module")
def pool():
    with PoolThread(tenants=TENANTS) as harness:
        yield harness


@pytest.fixture
def dev(pool):
    with connect(pool.endpoint, TOKEN, agent=False, timeout=60) as device:
        yield device


def counters(dev, buf) -> list[int]:
    return np.frombuffer(dev.read(buf), np.uint32).tolist()


def test_the_same_launch_again_reuses_its_record_and_each_launch_runs_where_it_says(dev):
    prog = dev.build(KERNELS)
    a = dev.upload(np.zeros(N, np.uint32))
    b = dev.upload(np.zeros(N, np.uint32))
    whole, half = (N,), (N // 2,)
    for _ in range(300):
        prog.launch("inc", whole, None, a)
    first = prog.last_launch
    assert first is not None and first[3] == (a,)           # kept for the next one
    for _ in range(200):
        prog.launch("inc", whole, None, a)
    assert prog.last_launch is first                         # reused, not made again
    for _ in range(50):
        prog.launch("inc", whole, None, b)                   # another buffer: another record
    for _ in range(25):
        prog.launch("inc", half, None, b)                    # another size
    for _ in range(5):
        prog.launch("inc", N, None, a)                       # a plain int size
    dev.finish()
    assert counters(dev, a) == [505] * N
    assert counters(dev, b) == [75] * (N // 2) + [50] * (N // 2)


def test_what_may_change_in_place_is_encoded_again_each_time(dev):
    prog = dev.build(KERNELS)
    buf = dev.upload(np.zeros(N, np.uint32))
    size = [N]
    prog.launch("inc", size, None, buf)
    size[0] = N // 2                                         # the same list, now 8 elements
    prog.launch("inc", size, None, buf)
    assert prog.last_launch is None
    by = u32(1)
    prog.launch("add", N, None, buf, by)
    by.value = 10                                            # the same scalar, another value
    prog.launch("add", N, None, buf, by)
    assert prog.last_launch is None
    dev.finish()
    assert counters(dev, buf) == [13] * (N // 2) + [12] * (N // 2)
