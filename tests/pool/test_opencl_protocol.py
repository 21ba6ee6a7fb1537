"""Data-plane protocol 3 (``wire.opencl``) at a real pool on PoCL, in both
device-isolation modes: the device listing and its parameters as the
runtime answers them, fill, rect transfers, sub-buffers, kernel queries,
by-value and NULL arguments, profiled commands; their bounds; and drivers
of protocols 1 and 2 against a pool of 3 (and back)."""

from __future__ import annotations

import ctypes
import re
import struct

import numpy as np
import pyopencl as cl
import pytest

from accelmig.agent.driver import connect
from accelmig.lab.poolthread import PoolThread
from accelmig.pool.devices import deviceinfo
from accelmig.wire import opencl as wcl
from accelmig.wire.dataplane import Op
from accelmig.wire.errors import BadRequest, OutOfRange
from tests.fuzz.peers import FrameConn
from tests.support.tenants import ALICE, BOB, TENANTS

KERNELS = """
typedef struct { int a; float b; char c[8]; } pair_t;
kernel void scale(global float *x, float by, pair_t p, global int *out) {
    size_t i = get_global_id(0);
    x[i] = x[i] * by + p.b;
    if (i == 0) { out[0] = p.a; out[1] = p.c[7]; }
}
kernel void sums(global const int *in, local int *scratch, global int *out, global int *maybe) {
    size_t l = get_local_id(0), g = get_group_id(0), n = get_local_size(0);
    scratch[l] = in[get_global_id(0)];
    barrier(CLK_LOCAL_MEM_FENCE);
    if (l == 0) { int s = 0; for (size_t k = 0; k < n; k++) s += scratch[k]; out[g] = s + (maybe ? 1000 : 0); }
}
__attribute__((reqd_work_group_size(4, 1, 1)))
kernel void fixed(global int *x) { x[get_global_id(0)] += 1; }
"""


@pytest.fixture(scope="module", params=["process", "none"])
def pool(request):
    # (a pool without device processes builds only when told it may: one trusted tenant)
    with PoolThread(TENANTS, device_isolation=request.param,
                    allow_unconfined_builds=request.param == "none") as harness:
        yield harness


@pytest.fixture
def dev(pool):
    with connect(pool.endpoint, ALICE, agent=False) as device:
        yield device


def submit(dev, op, payload=b"", **fields):
    return dev._submit(op, fields, payload, wait=True)


def local_device():
    return cl.get_platforms()[0].get_devices()[0]


def test_the_listing_carries_every_parameter_the_runtime_answers(pool):
    conn = FrameConn(pool.endpoint)
    try:
        conn.send({"op": "hello", "versions": [1, 2, 3]})
        assert conn.next()["version"] == 3
        conn.send({"op": "list_devices", "token": ALICE})
        answer = conn.next()
        # the connection may still open afterwards
        conn.send({"op": "open", "token": ALICE, "secret": "ab" * 16, "device": answer["devices"][0]["id"]})
        assert conn.next()["op"] == "opened"
    finally:
        conn.close()
    assert answer["op"] == "devices" and len(answer["devices"]) == 1
    device = answer["devices"][0]
    assert device["id"].startswith("cpu-") and device["type"] == "cpu"
    # the same values the runtime gives this process, read independently
    expected = deviceinfo.read_params(local_device().int_ptr)
    assert device["cl"] == expected
    for name, value in device["cl"].items():
        wcl.check_param(name, value)
    assert device["cl"]["CL_DEVICE_NAME"] == local_device().name
    assert device["cl"]["CL_DEVICE_MAX_WORK_ITEM_SIZES"] == list(local_device().max_work_item_sizes)
    assert device["cl"]["CL_DEVICE_GLOBAL_MEM_SIZE"] == local_device().global_mem_size
    assert len(device["cl"]) >= 100


def test_the_listing_needs_a_tenant_token_and_protocol_3(pool):
    conn = FrameConn(pool.endpoint)
    conn.send({"op": "hello", "versions": [1, 2, 3]})
    conn.next()
    conn.send({"op": "list_devices", "token": "not-a-token"})
    frames = conn.until_closed()
    assert frames[0]["error"]["code"] == "AUTH_FAILED"
    old = FrameConn(pool.endpoint)
    old.send({"op": "hello", "versions": [1, 2]})
    assert old.next()["version"] == 2
    old.send({"op": "list_devices", "token": ALICE})
    frames = old.until_closed()
    assert frames[0]["error"]["code"] == "PROTOCOL_ERROR"


def test_fill_and_rect_transfers_match_local_pocl(dev):
    size = 16 * 8 * 3
    buf = dev.alloc(size)
    submit(dev, Op.FILL, buf=buf.handle, offset=8, size=size - 16, pattern="a1b2c3d4")
    rect = {"origin": [3, 2, 1], "region": [5, 3, 2], "row_pitch": 16, "slice_pitch": 128}
    region = bytes(range(30))
    submit(dev, Op.WRITE_RECT, region, buf=buf.handle, **rect)
    got = dev.read(buf)
    back = submit(dev, Op.READ_RECT, buf=buf.handle, **rect).reply_payload
    other = dev.alloc(size)
    submit(dev, Op.COPY_RECT, src=buf.handle, dst=other.handle, src_origin=[3, 2, 1], dst_origin=[0, 0, 0],
           region=[5, 3, 2], src_row_pitch=16, src_slice_pitch=128, dst_row_pitch=0, dst_slice_pitch=0)
    copied = dev.read(other, 30)

    # the same on local PoCL
    ctx = cl.Context([local_device()])
    queue = cl.CommandQueue(ctx)
    ref = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, size)
    cl.enqueue_fill_buffer(queue, ref, np.zeros(1, np.uint8), 0, size)
    cl.enqueue_fill_buffer(queue, ref, np.frombuffer(bytes.fromhex("a1b2c3d4"), np.uint8), 8, size - 16)
    cl.enqueue_copy(queue, ref, region, buffer_origin=(3, 2, 1), host_origin=(0, 0, 0), region=(5, 3, 2),
                    buffer_pitches=(16, 128), host_pitches=(5, 15), is_blocking=True)
    want = bytearray(size)
    cl.enqueue_copy(queue, want, ref, is_blocking=True)
    assert got == bytes(want)
    assert bytes(back) == region
    assert copied == region


def test_sub_buffers_share_their_parent_and_cost_no_quota(pool, dev):
    parent = dev.alloc(4096)
    dev.write(parent, bytes(4096))
    dev.finish()
    used = pool.call(lambda: pool.pool.tenants[ALICE].used)
    sub = dev._session.new_handle()
    submit(dev, Op.ALLOC_SUB, buf=sub, parent=parent.handle, origin=1024, size=512)
    assert pool.call(lambda: pool.pool.tenants[ALICE].used) == used
    submit(dev, Op.WRITE, b"\x07" * 512, buf=sub, offset=0)
    assert dev.read(parent, 514, 1023) == b"\x00" + b"\x07" * 512 + b"\x00"
    with pytest.raises(OutOfRange):
        submit(dev, Op.WRITE, b"x" * 513, buf=sub, offset=0)
    with pytest.raises(BadRequest, match="live sub-buffers"):
        submit(dev, Op.FREE, buf=parent.handle)
    with pytest.raises(BadRequest, match="sub-buffer has none"):
        submit(dev, Op.ALLOC_SUB, buf=dev._session.new_handle(), parent=sub, origin=0, size=16)
    with pytest.raises(OutOfRange):
        submit(dev, Op.ALLOC_SUB, buf=dev._session.new_handle(), parent=parent.handle, origin=4096 - 128, size=256)
    submit(dev, Op.FREE, buf=sub)
    assert pool.call(lambda: pool.pool.tenants[ALICE].used) == used      # a sub-buffer gives back nothing
    submit(dev, Op.FREE, buf=parent.handle)
    assert pool.call(lambda: pool.pool.tenants[ALICE].used) == used - 4096


def test_kernel_info_and_by_value_null_and_local_arguments(dev):
    prog = dev.build(KERNELS, "-cl-kernel-arg-info")
    info = submit(dev, Op.KERNEL_INFO, prog=prog.handle, kernel="scale").reply["kernel"]
    assert info["num_args"] == 4
    assert [a["name"] for a in info["args"]] == ["x", "by", "p", "out"]
    assert [a["address"] for a in info["args"]] == [0x119B, 0x119E, 0x119E, 0x119B]   # global/private
    assert info["work_group"]["size"] >= 1
    fixed = submit(dev, Op.KERNEL_INFO, prog=prog.handle, kernel="fixed").reply["kernel"]
    assert fixed["work_group"]["compile_size"] == [4, 1, 1]

    x = dev.upload(np.arange(8, dtype=np.float32).tobytes())
    out = dev.alloc(8)
    pair = struct.pack("<if8s", 42, 0.5, b"abcdefg\x05")
    submit(dev, Op.LAUNCH, prog=prog.handle, kernel="scale", gsize=[8],
           args=[{"buf": x.handle}, {"raw": struct.pack("<f", 2.0).hex()}, {"raw": pair.hex()},
                 {"buf": out.handle}])
    assert np.frombuffer(dev.read(x), np.float32).tolist() == [i * 2.0 + 0.5 for i in range(8)]
    assert struct.unpack("<ii", dev.read(out)) == (42, 5)

    ints = dev.upload(np.arange(16, dtype=np.int32).tobytes())
    sums = dev.alloc(16)
    submit(dev, Op.LAUNCH, prog=prog.handle, kernel="sums", gsize=[16], lsize=[4],
           args=[{"buf": ints.handle}, {"local": 16}, {"buf": sums.handle}, {"buf": None}])
    assert np.frombuffer(dev.read(sums), np.int32).tolist() == [6, 22, 38, 54]


def test_a_launch_with_a_global_offset_runs_those_work_items_only(dev):
    """Protocol 4: clEnqueueNDRangeKernel's global_work_offset, in one and
    two dimensions, as the runtime runs it."""
    assert dev._session.link.version == 4
    prog = dev.build("kernel void inc(global int *x) { x[get_global_id(0)] += 1; }\n"
                     "kernel void mark(global int *x) { x[get_global_id(1) * 8 + get_global_id(0)] = 1; }")
    ints = dev.upload(np.zeros(32, dtype=np.int32).tobytes())
    submit(dev, Op.LAUNCH, prog=prog.handle, kernel="inc", gsize=[8], goffset=[16], args=[{"buf": ints.handle}])
    submit(dev, Op.LAUNCH, prog=prog.handle, kernel="inc", gsize=[4], lsize=[2], goffset=[2],
           args=[{"buf": ints.handle}])
    expected = [0] * 32
    for i in list(range(16, 24)) + list(range(2, 6)):
        expected[i] += 1
    assert np.frombuffer(dev.read(ints), np.int32).tolist() == expected
    grid = dev.upload(np.zeros(64, dtype=np.int32).tobytes())
    submit(dev, Op.LAUNCH, prog=prog.handle, kernel="mark", gsize=[2, 3], goffset=[5, 4], args=[{"buf": grid.handle}])
    marked = np.frombuffer(dev.read(grid), np.int32).reshape(8, 8)
    assert sorted(zip(*np.nonzero(marked))) == [(y, x) for y in (4, 5, 6) for x in (5, 6)]


def test_profiled_commands_answer_when_done_with_ordered_times(dev):
    prog = dev.build(KERNELS, "-cl-kernel-arg-info")
    x = dev.upload(np.ones(1 << 16, dtype=np.float32).tobytes())
    out = dev.alloc(8)
    pair = struct.pack("<if8s", 1, 0.0, bytes(8))
    reply = submit(dev, Op.LAUNCH, prog=prog.handle, kernel="scale", gsize=[1 << 16], prof=True,
                   args=[{"buf": x.handle}, {"raw": struct.pack("<f", 3.0).hex()}, {"raw": pair.hex()},
                         {"buf": out.handle}]).reply
    queued, submitted, started, ended = reply["times"]
    assert queued <= submitted <= started <= ended
    read = submit(dev, Op.READ, buf=x.handle, offset=0, size=16, prof=True)
    assert len(read.reply["times"]) == 4 and bytes(read.reply_payload) == struct.pack("<4f", 3, 3, 3, 3)


RECT = {"origin": [0, 0, 0], "region": [4, 4, 1], "row_pitch": 0, "slice_pitch": 0}


@pytest.mark.parametrize("op, fields, payload, words", [
    ("fill", {"offset": 0, "size": 64, "pattern": "abc"}, b"", "pattern"),
    ("fill", {"offset": 0, "size": 64, "pattern": "00" * 3}, b"", "pattern"),
    ("fill", {"offset": 0, "size": 64, "pattern": "00" * 256}, b"", "pattern"),
    ("fill", {"offset": 2, "size": 64, "pattern": "0000aaaa"}, b"", "multiples"),
    ("write_rect", dict(RECT, row_pitch=2), b"x" * 16, "row pitch"),
    ("write_rect", dict(RECT, slice_pitch=17), b"x" * 16, "slice pitch"),
    ("write_rect", RECT, b"x" * 15, "packed"),
    ("read_rect", dict(RECT, origin=[0, 0, 1 << 40], region=[1 << 20, 1 << 20, 1 << 20]), b"", "2\\*\\*63"),
    ("read_rect", dict(RECT, origin=[0, 0]), b"", "three integers"),
    ("read_rect", dict(RECT, region=[0, 1, 1]), b"", "three integers"),
    ("read_rect", dict(RECT, row_pitch=-1), b"", "row_pitch"),
    ("copy_rect", {"src": 1, "dst": 1, "src_origin": [0, 0, 0], "dst_origin": [0, 0, True], "region": [1, 1, 1],
                   "src_row_pitch": 0, "src_slice_pitch": 0, "dst_row_pitch": 0, "dst_slice_pitch": 0}, b"",
     "three integers"),
    ("alloc_sub", {"parent": 1, "origin": 0, "size": 0}, b"", "size"),
    ("kernel_info", {"prog": 1, "kernel": ""}, b"", "kernel must be"),
    ("launch", {"prog": 1, "kernel": "k", "gsize": [1], "args": [{"raw": "00" * (wcl.MAX_RAW_ARG + 1)}]}, b"",
     "raw must be"),
    ("launch", {"prog": 1, "kernel": "k", "gsize": [1], "args": [{"raw": ""}]}, b"", "raw must be"),
    ("finish", {"prof": True}, b"", "prof"),
    ("read", {"offset": 0, "size": 1, "prof": 1}, b"", "prof"),
])
def test_malformed_commands_close_their_connection_with_bad_request(pool, op, fields, payload, words):
    """What the driver must check before it sends (the C driver answers the
    application with OpenCL's code): the pool refuses it as malformed."""
    conn = FrameConn(pool.endpoint)
    try:
        conn.send({"op": "hello", "versions": [3]})
        conn.next()
        conn.send({"op": "open", "token": BOB, "secret": "cd" * 16})
        opened = conn.next()
        header = {"op": op, "seq": 1, "epoch": opened["epoch"], "buf": 1, **fields}
        conn.send(header, payload)
        frames = conn.until_closed()
    finally:
        conn.close()
    assert frames[-1]["op"] == "error" and frames[-1]["error"]["code"] == "BAD_REQUEST", frames
    assert re.search(words, frames[-1]["error"]["message"]), frames[-1]["error"]["message"]


@pytest.mark.parametrize("op, fields, payload", [
    (Op.FILL, {"offset": 0, "size": 68, "pattern": "00"}, b""),
    (Op.WRITE_RECT, {"origin": [0, 15, 0], "region": [4, 2, 1], "row_pitch": 4, "slice_pitch": 0}, b"x" * 8),
    (Op.READ_RECT, {"origin": [0, 0, 0], "region": [64, 64, 64], "row_pitch": 0, "slice_pitch": 0}, b""),
    (Op.COPY_RECT, {"src_origin": [60, 0, 0], "dst_origin": [0, 0, 0], "region": [8, 1, 1], "src_row_pitch": 0,
                    "src_slice_pitch": 0, "dst_row_pitch": 0, "dst_slice_pitch": 0}, b""),
])
def test_out_of_range_commands_fail_alone(dev, op, fields, payload):
    buf = dev.alloc(64)
    fields = dict(fields)
    if op is Op.COPY_RECT:
        fields.update(src=buf.handle, dst=buf.handle)
    else:
        fields["buf"] = buf.handle
    with pytest.raises(OutOfRange):
        dev._submit(op, fields, payload, wait=True)
    assert dev.read(buf, 4) == bytes(4)        # the session goes on


def test_the_read_of_a_huge_rect_costs_no_reply_buffer(dev):
    buf = dev.alloc(64)
    with pytest.raises(OutOfRange):
        submit(dev, Op.READ_RECT, buf=buf.handle, origin=[0, 0, 0], region=[1 << 30, 1 << 10, 1],
               row_pitch=0, slice_pitch=0)
    assert dev.read(buf, 4) == bytes(4)      # the session goes on


def test_old_drivers_keep_working_against_a_pool_of_protocol_3(pool):
    for versions in ((1,), (2,), (1, 2)):
        with connect(pool.endpoint, BOB, agent=False, protocol_versions=versions) as dev:
            assert dev._session.link.version == max(versions)
            prog = dev.build("kernel void inc(global int *x) { x[get_global_id(0)] += 1; }")
            buf = dev.upload(np.arange(64, dtype=np.int32).tobytes())
            for _ in range(3):
                prog.launch("inc", 64, None, buf)
            assert np.frombuffer(dev.read(buf), np.int32).tolist() == list(range(3, 67))
    # a driver of 3 and a pool of 2 agree on 2, and work as before
    with PoolThread(TENANTS, data_versions=(1, 2)) as old_pool:
        with connect(old_pool.endpoint, ALICE, agent=False) as dev:
            assert dev._session.link.version == 2
            assert dev.read(dev.upload(b"abcd")) == b"abcd"


@pytest.mark.parametrize("versions", [[1], [2], [1, 2]])
@pytest.mark.parametrize("header, code", [
    ({"op": "fill", "buf": 1, "offset": 0, "size": 4, "pattern": "00"}, "PROTOCOL_ERROR"),
    ({"op": "kernel_info", "prog": 1, "kernel": "k"}, "PROTOCOL_ERROR"),
    ({"op": "read", "buf": 1, "offset": 0, "size": 4, "prof": True}, "PROTOCOL_ERROR"),
    ({"op": "launch", "prog": 1, "kernel": "k", "gsize": [1], "args": [{"raw": "01000000"}]}, "BAD_REQUEST"),
    ({"op": "launch", "prog": 1, "kernel": "k", "gsize": [1], "args": [{"buf": None}]}, "BAD_REQUEST"),
])
def test_protocol_3_is_refused_on_an_older_connection(pool, versions, header, code):
    _refused(pool, versions, header, code)


@pytest.mark.parametrize("versions", [[1, 2, 3], [3]])
def test_a_global_offset_is_refused_on_a_connection_of_protocol_3(pool, versions):
    _refused(pool, versions, {"op": "launch", "prog": 1, "kernel": "k", "gsize": [1], "goffset": [4],
                              "args": []}, "PROTOCOL_ERROR")


def _refused(pool, versions, header, code):
    conn = FrameConn(pool.endpoint)
    try:
        conn.send({"op": "hello", "versions": versions})
        assert conn.next()["version"] == max(versions)
        conn.send({"op": "open", "token": BOB, "secret": "cd" * 16})
        opened = conn.next()
        conn.send({**header, "seq": 1, "epoch": opened["epoch"]})
        frames = conn.until_closed()
    finally:
        conn.close()
    assert frames[-1]["error"]["code"] == code, frames


def test_parameter_kinds_decode_as_the_runtime_lays_them_out():
    assert deviceinfo.decode("uint", struct.pack("<I", 7)) == 7
    assert deviceinfo.decode("bool", struct.pack("<I", 1)) is True
    assert deviceinfo.decode("ulong", struct.pack("<I", 5)) == 5        # a bit field answered as cl_uint
    assert deviceinfo.decode("size", b"\x01\x00") is None               # does not fit: left out
    assert deviceinfo.decode("str", b"abc\0junk") == "abc"
    assert deviceinfo.decode("sizes", struct.pack("<3Q", 1, 2, 3)) == [1, 2, 3]
    assert deviceinfo.decode("props", struct.pack("<2q", 0x1086, 0)) == [0x1086, 0]
    pair = struct.pack("<I64s", 0x400000, b"cl_khr_fp64")
    assert deviceinfo.decode("versions", pair * 2) == [[0x400000, "cl_khr_fp64"]] * 2
    assert deviceinfo.decode("versions", pair[:-1]) is None
    assert ctypes.sizeof(ctypes.c_size_t) == 8          # (the kinds' sizes are the 64-bit ABI's)
