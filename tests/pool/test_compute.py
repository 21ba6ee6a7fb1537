"""Real kernels on a real OpenCL device (PoCL on this CPU) through pool + driver."""

from __future__ import annotations

import numpy as np
import pytest

from accelmig.agent.driver import LocalMemory, connect, f32, i32, u32
from accelmig.wire.errors import BadRequest, BuildFailed, DeviceError, NoSuchObject, OutOfRange
from tests.conftest import ALICE
from tests.support.kernels import COUNTER

SAXPY = """
__kernel void saxpy(float a, __global const float *x, __global float *y) {
    int i = get_global_id(0);
    y[i] = a * x[i] + y[i];
}
"""

MATMUL = """
__kernel void matmul(int n, __global const float *a, __global const float *b, __global float *c,
                     __local float *scratch) {
    int row = get_global_id(0), col = get_global_id(1);
    float acc = 0.0f;
    for (int k = 0; k < n; k++) acc += a[row * n + k] * b[k * n + col];
    c[row * n + col] = acc;
}
"""

def test_saxpy_computes_the_known_result(shared_pool):
    n = 1 << 16
    x = np.arange(n, dtype=np.float32)
    y = np.full(n, 3.0, dtype=np.float32)
    with connect(shared_pool.endpoint, ALICE) as dev:
        prog = dev.build(SAXPY)
        assert prog.kernels == ["saxpy"]
        bx, by = dev.upload(x), dev.upload(y)
        prog.launch("saxpy", n, 64, f32(2.5), bx, by)
        got = np.frombuffer(dev.read(by), dtype=np.float32)
    np.testing.assert_array_equal(got, np.float32(2.5) * x + y)


def test_matrix_multiply_matches_numpy(shared_pool):
    n = 64
    rng = np.random.default_rng(7)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    with connect(shared_pool.endpoint, ALICE) as dev:
        prog = dev.build(MATMUL)
        ba, bb, bc = dev.upload(a), dev.upload(b), dev.alloc(a.nbytes)
        prog.launch("matmul", (n, n), (8, 8), i32(n), ba, bb, bc, LocalMemory(256))
        out = np.empty_like(a)
        dev.read_into(bc, out)
    np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-4)


def test_ten_thousand_pipelined_launches_then_one_read(shared_pool):
    with connect(shared_pool.endpoint, ALICE) as dev:
        prog = dev.build(COUNTER)
        buf = dev.upload(np.zeros(32, dtype=np.uint32))
        for i in range(10_000):
            prog.launch("bump", 32, None, buf, u32(i % 7))
        got = np.frombuffer(dev.read(buf), dtype=np.uint32)
        state = dev.describe()
    expected = sum(i % 7 for i in range(10_000))
    assert (got == expected).all()
    assert state["pending"] == 0 and state["replies"] == state["next_seq"] - 1


def test_buffers_copy_partial_io_and_free(shared_pool):
    with connect(shared_pool.endpoint, ALICE) as dev:
        a = dev.upload(b"0123456789")
        b = dev.alloc(10)
        dev.write(b, b"..........")
        dev.copy(a, b, 4, src_offset=2, dst_offset=5)
        assert dev.read(b) == b".....2345."
        assert dev.read(a, 3, offset=7) == b"789"
        a.free()
        with pytest.raises(NoSuchObject, match="no buffer with handle"):
            dev.read(a)
        with pytest.raises(OutOfRange, match="outside 10 bytes"):
            dev.read(b, 5, offset=8)
        assert dev.read(b, 1) == b"."        # the session goes on after errors


def test_large_buffers_round_trip_bit_exact(shared_pool):
    data = np.random.default_rng(1).integers(0, 255, 24 << 20, dtype=np.uint8)
    with connect(shared_pool.endpoint, ALICE) as dev:
        buf = dev.upload(data)               # zero-copy, synchronous path
        back = np.empty_like(data)
        dev.read_into(buf, back)
        assert np.array_equal(back, data)
        assert dev.read(buf, 1000, offset=5 << 20) == data[5 << 20:(5 << 20) + 1000].tobytes()


def test_build_failure_returns_the_build_log(shared_pool):
    with connect(shared_pool.endpoint, ALICE) as dev:
        with pytest.raises(BuildFailed) as info:
            dev.build("__kernel void broken(__global float *x) { x[0] = undefined_name; }")
        assert "undefined_name" in info.value.build_log
        assert dev.build(SAXPY).kernels == ["saxpy"]     # and the session still builds


def test_build_from_device_binary(shared_pool):
    with connect(shared_pool.endpoint, ALICE) as dev:
        binary = dev.build(COUNTER).binary()
        assert len(binary) > 100
        prog = dev.build_binary(binary)
        buf = dev.upload(np.zeros(4, dtype=np.uint32))
        prog.launch("bump", 4, None, buf, u32(5))
        assert list(np.frombuffer(dev.read(buf), dtype=np.uint32)) == [5, 5, 5, 5]


def test_pipelined_errors_surface_at_the_next_waiting_call(shared_pool):
    with connect(shared_pool.endpoint, ALICE) as dev:
        prog = dev.build(COUNTER)
        buf = dev.upload(np.zeros(4, dtype=np.uint32))
        prog.launch("no_such_kernel", 4, None, buf, u32(1))
        with pytest.raises(NoSuchObject, match="no_such_kernel") as info:
            dev.finish()
        assert info.value.details["op"] == "launch"
        prog.launch("bump", 4, None, buf, u32(1), u32(2))   # wrong argument count
        with pytest.raises(DeviceError, match="takes 2 arguments, 3 given"):
            dev.finish()
        dev.finish()                                          # raised once, then clear


def test_untyped_python_numbers_are_refused(shared_pool):
    with connect(shared_pool.endpoint, ALICE) as dev:
        prog = dev.build(COUNTER)
        buf = dev.alloc(16)
        with pytest.raises(BadRequest, match=r"typed scalar \(i32\(3\)"):
            prog.launch("bump", 4, None, buf, 3)
        prog.launch("bump", 4, None, buf, np.uint32(3))      # numpy scalars carry their type
        dev.finish()


def test_device_info(shared_pool):
    with connect(shared_pool.endpoint, ALICE) as dev:
        info = dev.info()
    assert info["backend"] == "opencl" and info["global_mem_size"] > 0 and info["spec"] == "opencl:0"
