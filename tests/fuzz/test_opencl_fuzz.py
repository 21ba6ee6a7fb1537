"""Fuzzing data-plane protocols 3 and 4 (``wire.opencl``): its decoders alone
(``validate_command`` with the new commands and arguments, the device
parameters' checks) and a real ``accelmig-pool serve`` process taking
anything a protocol-3 session or a stranger asking for the device listing
may send. Fixed seed, bounded examples (tests/fuzz/strategies.py).

What must hold: the decoders raise accelmig's errors (``BAD_REQUEST``,
``PROTOCOL_ERROR``, ``UNKNOWN_OP``) or accept, nothing else; the pool
answers with frames it may send (never ``INTERNAL``), closes only the
connection that misbehaved, and goes on serving a real driver.
(The C driver's own decoders are fuzzed by libFuzzer: tests/icd.)
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accelmig.agent.driver import connect
from accelmig.wire import dataplane as dp
from accelmig.wire import opencl as wcl
from accelmig.wire.errors import AccelmigError
from tests.fuzz.peers import FrameConn, problems, start_pool
from tests.fuzz.strategies import fuzz_settings, integers, json_values, objects, text
from tests.support.tenants import ALICE, BOB

triples = st.one_of(st.lists(st.integers(0, 70), min_size=3, max_size=3),
                    st.lists(st.one_of(st.integers(-2, 3), st.sampled_from([2**62, 2**63, 2**64]), text,
                                       st.booleans()), max_size=4),
                    json_values)
patterns = st.one_of(st.binary(min_size=1, max_size=130).map(bytes.hex), text, integers)
v3_args = st.lists(st.one_of(
    st.fixed_dictionaries({"raw": st.one_of(st.binary(max_size=40).map(bytes.hex), text,
                                             st.just("00" * (wcl.MAX_RAW_ARG + 1)))}),
    st.fixed_dictionaries({"buf": st.one_of(st.none(), st.sampled_from([1, 2, 3]), integers)}),
    st.fixed_dictionaries({"local": st.one_of(st.sampled_from([4, 64, 0]), integers)}),
    st.dictionaries(text, json_values, max_size=2)), max_size=5)
FIELDS = {
    "buf": st.one_of(st.sampled_from([1, 2, 3, 9]), integers), "src": st.sampled_from([1, 2, 3]),
    "dst": st.sampled_from([1, 2, 3]), "parent": st.one_of(st.sampled_from([1, 2, 3]), integers),
    "offset": st.one_of(st.sampled_from([0, 4, 8, 60]), integers),
    "size": st.one_of(st.sampled_from([0, 4, 8, 64, 1 << 40]), integers), "pattern": patterns,
    "origin": st.one_of(triples, integers), "region": triples, "src_origin": triples, "dst_origin": triples,
    "row_pitch": st.one_of(st.sampled_from([0, 4, 16]), integers), "slice_pitch": st.sampled_from([0, 64, 65]),
    "src_row_pitch": st.sampled_from([0, 8]), "src_slice_pitch": st.sampled_from([0, 64]),
    "dst_row_pitch": st.sampled_from([0, 8]), "dst_slice_pitch": st.sampled_from([0, 64]),
    "prog": st.sampled_from([1, 2]), "kernel": st.one_of(st.sampled_from(["k", "k2", "nope", ""]), text),
    "gsize": st.one_of(st.just([4]), json_values), "args": st.one_of(v3_args, json_values),
    "prof": st.one_of(st.just(True), json_values),
    # protocol 4: a launch's global work offset
    "goffset": st.one_of(st.just([0]), st.just([8]), st.lists(st.one_of(st.integers(-2, 70), st.booleans(),
                                                                        st.just(2**63 - 2)), max_size=4),
                         json_values),
}
OPS = ["fill", "write_rect", "read_rect", "copy_rect", "alloc_sub", "kernel_info", "launch", "read", "write",
       "copy", "finish", "list_devices", "free"]


@st.composite
def commands(draw):
    op = draw(st.sampled_from(OPS))
    header = {**draw(objects(FIELDS)), "op": op}
    payload = draw(st.one_of(st.just(b""), st.binary(max_size=80)))
    return header, payload


@fuzz_settings(300)
@given(commands(), st.sampled_from([1, 2, 3, 4]), integers)
def test_the_decoders_raise_accelmigs_errors_or_accept(command, version, seq):
    header, payload = command
    header = {**header, "seq": seq, "epoch": 1}
    try:
        op = dp.validate_command(header, len(payload), version)
    except AccelmigError as exc:
        assert exc.code.value in ("BAD_REQUEST", "PROTOCOL_ERROR", "UNKNOWN_OP", "FRAME_TOO_LARGE")
        return
    # what is accepted is what the executors can take without surprise
    assert op.value == header["op"]
    if op is dp.Op.FILL:
        assert len(wcl.fill_pattern(header)) in wcl.FILL_PATTERN_SIZES
    if op in (dp.Op.WRITE_RECT, dp.Op.READ_RECT):
        shape = wcl.rect(header, op.value)
        assert 0 <= shape.offset < shape.extent <= wcl.MAX_INT
    assert version >= 3 or (op not in dp.OPENCL_OPS and "prof" not in header)
    if op is dp.Op.LAUNCH and "goffset" in header:
        assert version >= 4
        offset = wcl.global_offset(header, header["gsize"])
        assert offset is None or all(o + g <= wcl.MAX_INT for o, g in zip(offset, header["gsize"]))


@fuzz_settings(300)
@given(st.sampled_from([name for name, _, _ in wcl.DEVICE_PARAMS] + ["CL_NOPE"]), json_values)
def test_parameter_checks_raise_bad_request_or_accept(name, value):
    try:
        wcl.check_param(name, value)
    except AccelmigError as exc:
        assert exc.code.value == "BAD_REQUEST"


# -- a real pool process ------------------------------------------------------------

@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    proc = start_pool(tmp_path_factory.mktemp("fuzz-opencl-pool"), "--grace", "1")
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def probe_done(pool):
    yield
    with connect(pool.endpoint, BOB, agent=False, timeout=30) as dev:
        assert dev.read(dev.upload(b"still serving")) == b"still serving"
    assert problems(pool) == []


ALLOWED = {"welcome", "opened", "reply", "done", "error", "devices"}
KERNELS = b"__kernel void k(__global uint *a, uint n) { }\n" \
          b"__kernel void k2(__global uchar *a, __local uint *l, float f, ulong g) { }\n"


def check(frames: list[dict]) -> None:
    for frame in frames:
        assert frame.get("op") in ALLOWED, frame
        error = frame.get("error") if frame.get("op") == "error" or frame.get("ok") is False else None
        if error is not None:
            assert error.get("code") not in ("INTERNAL", None), frame
            assert "internal error" not in error.get("message", ""), frame


@fuzz_settings(40)
@given(st.lists(commands(), min_size=1, max_size=6), st.sampled_from([3, 4]))
def test_a_protocol_3_session_sending_anything_harms_nothing(pool, probe_done, cmds, version):
    conn = FrameConn(pool.endpoint)
    try:
        conn.send({"op": "hello", "versions": [version]})
        assert conn.next()["version"] == version
        conn.send({"op": "open", "token": ALICE, "secret": "ab" * 32})
        epoch, seq = conn.next()["epoch"], 0
        setup = [({"op": "alloc", "buf": 1, "size": 64}, b""), ({"op": "alloc", "buf": 2, "size": 4096}, b""),
                 ({"op": "build", "prog": 1, "options": "-cl-kernel-arg-info"}, KERNELS)]
        for header, payload in setup + cmds:
            if header["op"] == "list_devices":
                conn.send(header, payload)
                continue
            conn.send({**header, "seq": seq, "epoch": epoch}, payload)
            seq += 1
        conn.send({"op": "finish", "seq": seq, "epoch": epoch})
        answers = []
        while True:
            frame = conn.next()
            if frame is None:
                break
            answers.append(frame)
            if (frame.get("op") == "reply" and frame.get("seq") == seq) or \
                    (frame.get("op") == "done" and frame.get("to") == seq):
                conn.send({"op": "release", "seq": seq + 1, "epoch": epoch})
                break
        check(answers)
    finally:
        conn.close()


@fuzz_settings(40)
@given(st.lists(st.tuples(st.sampled_from(["list_devices", "list_devices", "hello", "open"]),
                          objects({"token": st.sampled_from([ALICE, "nope", ""]),
                                   "versions": st.sampled_from([[3], [1, 2, 3], [2]])})), max_size=4))
def test_strangers_asking_for_the_devices_get_answers_or_a_clean_close(pool, frames):
    conn = FrameConn(pool.endpoint)
    try:
        conn.send({"op": "hello", "versions": [3]})
        for op, fields in frames:
            conn.send({**fields, "op": op})
        conn.done_sending()
        check(conn.until_closed())
    finally:
        conn.close()
