"""Data-plane schema: validation, scalars, digests, versions, errors, and the
guest side's standard-library-only promise."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
from hypothesis import given, strategies as st

from accelmig.wire import dataplane as dp
from accelmig.wire.errors import (AccelmigError, BadRequest, BuildFailed, ErrorCode, SessionDiverged,
                                  UnknownOp, VersionUnsupported, from_wire)


def launch(**over):
    h = {"op": "launch", "seq": 1, "epoch": 1, "prog": 1, "kernel": "k", "gsize": [64], "args": []}
    h.update(over)
    return h


@pytest.mark.parametrize("header, words", [
    ({"op": "frobnicate", "seq": 1, "epoch": 1}, "unknown operation"),
    ({"op": "hello"}, "not a sequenced command"),
    (launch(seq=-1), "'seq' must be a non-negative integer"),
    (launch(seq=True), "'seq' must be a non-negative integer"),
    (launch(epoch="1"), "'epoch'"),
    (launch(prog="1"), "field 'prog' must be int"),
    (launch(gsize=[]), "1 to 3 dimensions"),
    (launch(gsize=[1, 2, 3, 4]), "1 to 3 dimensions"),
    (launch(gsize=[0]), "positive integers"),
    (launch(lsize=[1, 1]), "differ in dimensions"),
    (launch(args=[5]), "must be an object"),
    (launch(args=[{"buf": "x"}]), "buf must be an integer"),
    (launch(args=[{"local": 0}]), "local must be a positive size"),
    (launch(args=[{"t": "f128", "x": "00"}]), "unknown scalar type"),
    (launch(args=[{"t": "f32", "x": "00"}]), "needs 4 bytes"),
    (launch(args=[{"t": "f32", "x": "zz"}]), "not hex"),
    (launch(args=[{"what": 1}]), "none of buf/local/scalar"),
    (launch(goffset=[1, 2]), "goffset must list as many integers as gsize"),
    (launch(goffset=[-1]), "goffset must list"),
    (launch(goffset=[True]), "goffset must list"),
    (launch(goffset=[(1 << 63) - 64]), "at most 2\\*\\*63-1"),
    ({"op": "alloc", "seq": 1, "epoch": 1, "buf": 1, "size": -5}, "must not be negative"),
])
def test_invalid_commands_are_refused_clearly(header, words):
    with pytest.raises((BadRequest, UnknownOp), match=words):
        dp.validate_command(header, 0)


def test_a_global_offset_needs_protocol_4():
    from accelmig.wire.errors import ProtocolError
    assert dp.validate_command(launch(goffset=[8]), 0) is dp.Op.LAUNCH
    assert dp.validate_command(launch(goffset=[0]), 0, version=4) is dp.Op.LAUNCH
    with pytest.raises(ProtocolError, match="goffset on a connection that agreed to protocol 3"):
        dp.validate_command(launch(goffset=[8]), 0, version=3)


def test_payload_only_where_the_op_takes_one():
    with pytest.raises(BadRequest, match="carries no payload"):
        dp.validate_command({"op": "finish", "seq": 1, "epoch": 1}, 10)
    assert dp.validate_command({"op": "write", "seq": 1, "epoch": 1, "buf": 1, "offset": 0}, 10) is dp.Op.WRITE


@given(st.floats(width=32, allow_nan=False))
def test_f32_scalars_are_bit_exact(value):
    arg = dp.encode_scalar("f32", value)
    import struct
    assert struct.unpack("<f", dp.decode_scalar(arg))[0] == value or math.isnan(value)


def test_nan_and_integer_bounds():
    import struct
    raw = dp.decode_scalar(dp.encode_scalar("f64", float("nan")))
    assert math.isnan(struct.unpack("<d", raw)[0])
    with pytest.raises(BadRequest, match="cannot hold"):
        dp.encode_scalar("u8", 256)


def test_identity_ignores_what_a_resend_changes_and_nothing_else():
    identity = dp.CommandIdentity
    a = launch(seq=5, epoch=1, ack=3)
    b = launch(seq=5, epoch=7, ack=4)
    assert identity(a) == identity(b)
    assert identity(a) != identity(launch(kernel="other"))
    w = {"op": "write", "seq": 2, "buf": 1, "offset": 0}
    assert identity(w, b"abc") != identity(w, b"abd")
    assert identity(w, b"abc") != identity(w, b"abcd")
    assert identity(w, bytearray(b"abc")) == identity(w, memoryview(b"abc"))


def test_version_negotiation():
    assert dp.negotiate([1, 2, 3, 4, 99]) == 4
    assert dp.negotiate([3, 4], supported=(1, 2, 3)) == 3   # the OpenCL driver and a pool without global offsets
    assert dp.negotiate([1, 2, 3, 99]) == 3
    assert dp.negotiate([1, 2, 99]) == 2               # a driver from before the OpenCL additions
    assert dp.negotiate([1, 99]) == 1                  # a driver from before launch batches
    assert dp.negotiate([1, 2], supported=(1,)) == 1   # a pool from before them
    assert dp.negotiate([1, 2, 3], supported=(1, 2)) == 2
    assert dp.offered_versions([2, 1, 1]) == (1, 2)
    for bad in ([], [5], [1, 7], "x", [None]):          # a driver offers only what it speaks
        with pytest.raises(BadRequest):
            dp.offered_versions(bad)
    with pytest.raises(VersionUnsupported, match="peer offers"):
        dp.negotiate([7])
    with pytest.raises(VersionUnsupported):
        dp.negotiate("nonsense")


@pytest.mark.parametrize("text, expected", [
    ("10.0.0.1:7070", ("10.0.0.1", 7070)),
    ("pool.example:1", ("pool.example", 1)),
    ("[fd00::1]:7070", ("fd00::1", 7070)),
])
def test_endpoints(text, expected):
    assert dp.parse_endpoint(text) == expected


@pytest.mark.parametrize("text, why", [
    ("", "is not HOST:PORT"), ("nohost", "has no port"), (":7070", "has no host"),
    ("h:port", "'port' is not a number"), ("h:70000", "70000 is not in 1-65535"),
    ("h:0", "0 is not in 1-65535"), ("h: 80", "is not a number"), ("h:+80", "is not a number"),
    ("fd00::1:7070", "an IPv6 address goes in brackets"), ("[fd00::1", "is not [IPv6]:PORT"),
    ("[pool]:7070", "'pool' is not an IPv6 address"), ("a b:80", "is not a host name or address"),
])
def test_bad_endpoints(text, why):
    with pytest.raises(BadRequest, match=re.escape(why)):
        dp.parse_endpoint(text)


def test_a_listening_address_may_take_any_free_port_and_lists_of_them():
    assert dp.parse_endpoint("127.0.0.1:0", listen=True) == ("127.0.0.1", 0)
    assert dp.parse_listen_list("0.0.0.0:7070, [::]:0") == [("0.0.0.0", 7070), ("::", 0)]
    for text in ("", " , ", "0.0.0.0:7070,nonsense", "h:65536"):
        with pytest.raises(BadRequest):
            dp.parse_listen_list(text)


def test_errors_round_trip_through_the_wire():
    exc = BuildFailed(reason="syntax", details={"log": "line 3: error"})
    back = from_wire(exc.to_wire())
    assert type(back) is BuildFailed and back.build_log == "line 3: error"
    assert back.code is ErrorCode.BUILD_FAILED
    div = from_wire(SessionDiverged(sid="s-1", reason="x").to_wire())
    assert isinstance(div, SessionDiverged) and "older copy" in str(div)
    unknown = from_wire({"code": "FUTURE_CODE", "message": "from a newer pool"})
    assert isinstance(unknown, AccelmigError) and unknown.details["unknown_code"] == "FUTURE_CODE"


def test_ownership_proof_is_bound_to_challenge_session_and_epoch():
    secret = os.urandom(32)
    proof = dp.ownership_proof(secret, "c1", "s-1", 3)
    assert dp.check_ownership_proof(secret, "c1", "s-1", 3, proof)
    assert not dp.check_ownership_proof(secret, "c2", "s-1", 3, proof)
    assert not dp.check_ownership_proof(secret, "c1", "s-1", 4, proof)
    assert not dp.check_ownership_proof(os.urandom(32), "c1", "s-1", 3, proof)
    assert not dp.check_ownership_proof(secret, "c1", "s-1", 3, None)


def test_guest_side_imports_only_the_standard_library(tmp_path):
    """accelmig.agent, accelmig.wire and accelmig.runtime must run in a bare guest Python."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pkg = tmp_path / "accelmig"
    pkg.mkdir()
    os.symlink(os.path.join(root, "agent"), pkg / "agent")
    os.symlink(os.path.join(root, "wire"), pkg / "wire")
    os.symlink(os.path.join(root, "runtime"), pkg / "runtime")
    code = (
        "import sys, importlib, pkgutil\n"
        "import accelmig.agent, accelmig.runtime, accelmig.wire\n"
        "for pkg in (accelmig.agent, accelmig.wire, accelmig.runtime):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        if not m.name.endswith('.__main__'):\n"
        "            importlib.import_module(m.name)\n"
        "std = set(sys.stdlib_module_names)\n"
        "bad = sorted({n.split('.')[0] for n in sys.modules} - std - {'accelmig', '__main__'})\n"
        "print(','.join(bad))\n")
    # -S: no site-packages, as in a bare guest; a third-party import fails here
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path,
                         env={"PYTHONPATH": str(tmp_path)}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"guest side imports non-stdlib modules: {out.stdout}"
