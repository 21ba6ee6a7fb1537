"""Kernel arguments on a real OpenCL device (PoCL): scalars are set through
a kernel told their types (``OpenCLContext._typed_kernel``: pyopencl's
untyped ``set_args`` took ~10 µs per scalar, the typed one ~0.5 µs), and
that changes nothing a tenant can see."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from accelmig.pool.devices.base import BufferArg, LocalArg, ScalarArg
from accelmig.pool.devices.opencl import TYPED_SIGNATURES, OpenCLBackend
from accelmig.wire.errors import DeviceError

SOURCE = """
__kernel void add(__global uint *x, uint d) { x[get_global_id(0)] += d; }
__kernel void add3(__global uint *x, uint a, uint b, uint c) { x[get_global_id(0)] += a + b + c; }
__kernel void scale(__global float *x, float f, __local float *scratch) {
    scratch[get_local_id(0)] = x[get_global_id(0)] * f;
    barrier(CLK_LOCAL_MEM_FENCE);
    x[get_global_id(0)] = scratch[get_local_id(0)];
}
"""


@pytest.fixture
def ctx():
    context = OpenCLBackend(0).new_context()
    context.build_source(1, SOURCE, "")
    yield context
    context.release()


def u32(value: int) -> ScalarArg:
    return ScalarArg("u32", struct.pack("<I", value))


def read_u32(ctx, handle: int, count: int) -> list:
    out = bytearray(4 * count)
    ctx.read_into(handle, 0, memoryview(out))
    return list(np.frombuffer(bytes(out), dtype="<u4"))


def typed_kernels(ctx) -> list:
    return [key for key in ctx.kernels if len(key) == 3]


def test_one_kernel_launched_with_two_signatures_in_turn_adds_every_value(ctx):
    ctx.alloc(1, 16)
    ctx.write(1, 0, bytes(16))
    for i in range(1, 21):
        # the same 4 bytes' worth, typed u32 or i32 in turn: two signatures of one kernel
        arg = u32(i) if i % 2 else ScalarArg("i32", struct.pack("<i", i))
        ctx.launch(1, "add", [4], None, [BufferArg(1), arg])
    ctx.finish()
    assert read_u32(ctx, 1, 4) == [210] * 4
    assert sorted(key[2] for key in typed_kernels(ctx)) == [(None, "i32"), (None, "u32")]


def test_floats_and_local_memory_keep_their_meaning(ctx):
    ctx.alloc(1, 16)
    ctx.write(1, 0, np.array([1.5, -2.0, 0.25, 8.0], dtype="<f4").tobytes())
    ctx.launch(1, "scale", [4], [4], [BufferArg(1), ScalarArg("f32", struct.pack("<f", -0.5)), LocalArg(16)])
    ctx.finish()
    out = bytearray(16)
    ctx.read_into(1, 0, memoryview(out))
    assert list(np.frombuffer(bytes(out), dtype="<f4")) == [-0.75, 1.0, -0.125, -4.0]


def test_a_scalar_of_the_wrong_size_is_the_devices_error_as_before(ctx):
    ctx.alloc(1, 16)
    with pytest.raises(DeviceError, match="INVALID_ARG_SIZE"):
        ctx.launch(1, "add", [4], None, [BufferArg(1), ScalarArg("u8", b"\x01")])
    with pytest.raises(DeviceError, match="INVALID_ARG_SIZE"):
        ctx.launch(1, "add", [4], None, [BufferArg(1), ScalarArg("f64", struct.pack("<d", 1.0))])


def test_signatures_past_the_bound_take_the_untyped_kernel_and_stay_exact(ctx):
    """A tenant making up signatures gets at most TYPED_SIGNATURES typed
    kernels per kernel; its other launches still run, exactly: three
    4-byte arguments, each typed u32, i32 or f32 (the same bits), make 27
    signatures of one kernel."""
    import itertools
    ctx.alloc(1, 16)
    ctx.write(1, 0, bytes(16))
    total = 0
    for n, types in enumerate(itertools.product(("u32", "i32", "f32"), repeat=3)):
        values = [n + 1, 2 * n + 1, 3]
        ctx.launch(1, "add3", [4], None,
                   [BufferArg(1)] + [ScalarArg(t, struct.pack("<I", v)) for t, v in zip(types, values)])
        total += sum(values)
    ctx.finish()
    assert read_u32(ctx, 1, 4) == [total] * 4
    assert len(typed_kernels(ctx)) == TYPED_SIGNATURES


def test_freeing_a_program_drops_its_typed_kernels(ctx):
    ctx.alloc(1, 16)
    ctx.launch(1, "add", [4], None, [BufferArg(1), u32(1)])
    ctx.finish()
    assert typed_kernels(ctx)
    ctx.free_program(1)
    assert ctx.kernels == {}
