"""What a tenant's memory quota does not see, and input no field check
expected, against a real pool on loopback (issue 14, item 9 and the low
items):

- buffers and programs per session are counted (an empty buffer costs no
  quota but still host memory), and so are sessions per tenant (each has a
  worker thread): one more is refused with QUOTA_EXCEEDED naming the limit;
- deeply nested JSON, numbers that overflow and lone surrogates are refused
  with an error frame, never answered with a traceback (INTERNAL) or a
  silent close.
"""

from __future__ import annotations

import json
import logging
import socket

import pytest

from accelmig.agent.driver import connect
from accelmig.lab.poolthread import PoolThread
from accelmig.wire.errors import QuotaExceeded
from accelmig.wire.frames import MAGIC, PREFIX, FrameReader, encode_frame
from tests.support.kernels import COUNTER
from tests.support.tenants import ALICE, BOB, TENANTS
from tests.support.wait import wait_for


def _dial(endpoint: str) -> socket.socket:
    host, port = endpoint.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _send_raw(sock, header: bytes, payload: bytes = b"") -> None:
    """A frame whose header is these exact bytes (no encoder in between)."""
    sock.sendall(PREFIX.pack(MAGIC, 1, 0, len(header), len(payload)) + header + payload)


def _next_frames(sock, reader: FrameReader) -> list[dict]:
    """The frames of the next read; [] once the pool closed."""
    while True:
        n = sock.recv_into(reader.get_buffer())
        if n == 0:
            return []
        frames = reader.feed(n)
        if frames:
            return [f.header for f in frames]


def _frames_until_closed(sock, reader: FrameReader) -> list[dict]:
    out = []
    while True:
        try:
            got = _next_frames(sock, reader)
        except ConnectionResetError:
            return out
        if not got:
            return out
        out += got


def _opened(endpoint: str):
    """A raw connection with an open session: (socket, reader)."""
    sock, reader = _dial(endpoint), FrameReader()
    sock.sendall(encode_frame({"op": "hello", "versions": [1]}))
    assert _next_frames(sock, reader)[0]["op"] == "welcome"
    sock.sendall(encode_frame({"op": "open", "token": ALICE, "secret": "ab" * 32}))
    assert _next_frames(sock, reader)[0]["op"] == "opened"
    return sock, reader


@pytest.fixture
def pool():
    with PoolThread(TENANTS) as harness:
        yield harness


# -- counts the quota does not see ------------------------------------------------
def test_a_session_may_hold_only_so_many_buffers_and_programs():
    with PoolThread(TENANTS, max_objects_per_session=6) as harness, \
            connect(harness.endpoint, ALICE) as dev:
        program = dev.build(COUNTER)                        # one program ...
        empties = [dev.alloc(0) for _ in range(5)]          # ... and five buffers of 0 bytes
        dev.finish()
        dev.alloc(0)
        with pytest.raises(QuotaExceeded, match=r"already holds 6 buffers and programs.*"
                                                r"max_objects_per_session = 6") as refused:
            dev.finish()
        assert refused.value.code.value == "QUOTA_EXCEEDED"
        with pytest.raises(QuotaExceeded, match="max_objects_per_session = 6"):
            dev.build(COUNTER)
        # what the session holds is intact, and freeing makes room again
        dev.free(empties.pop())
        dev.free_program(program)
        buf = dev.upload(b"room again")
        again = dev.build(COUNTER)
        assert dev.read(buf) == b"room again" and "bump" in again.kernels
        sid = dev.sid
        assert harness.call(lambda: harness.pool.sessions[sid].objects) == 6


def test_a_tenant_may_hold_only_so_many_sessions_and_a_released_one_makes_room():
    with PoolThread(TENANTS, max_sessions_per_tenant=3) as harness:
        held = [connect(harness.endpoint, ALICE) for _ in range(3)]
        try:
            threads = harness.call(lambda: len(harness.pool.sessions))
            with pytest.raises(QuotaExceeded, match=r"tenant alice: 3 live sessions .*"
                                                    r"\(max_sessions_per_tenant = 3\)"):
                connect(harness.endpoint, ALICE, auto_reconnect=False)
            # refused before anything was made: no fourth session, no worker
            assert harness.call(lambda: len(harness.pool.sessions)) == threads == 3
            with connect(harness.endpoint, BOB) as bob:          # another tenant's count is its own
                assert bob.read(bob.upload(b"bob")) == b"bob"
            held.pop().close()
            wait_for(lambda: harness.call(lambda: sum(
                1 for s in harness.pool.sessions.values() if s.tenant.name == "alice")) == 2,
                what="the closed session to be released")
            with connect(harness.endpoint, ALICE) as fourth:
                assert fourth.read(fourth.upload(b"in")) == b"in"
        finally:
            for dev in held:
                dev.close()


def test_a_tenant_of_its_own_may_have_a_higher_session_limit():
    tenants = {"alice": (ALICE, "64MiB", 4), "bob": TENANTS["bob"]}
    with PoolThread(tenants, max_sessions_per_tenant=1) as harness:
        held = [connect(harness.endpoint, ALICE) for _ in range(4)]
        try:
            with pytest.raises(QuotaExceeded, match=r"its max_sessions = 4"):
                connect(harness.endpoint, ALICE, auto_reconnect=False)
            with connect(harness.endpoint, BOB):
                with pytest.raises(QuotaExceeded, match=r"max_sessions_per_tenant = 1"):
                    connect(harness.endpoint, BOB, auto_reconnect=False)
        finally:
            for dev in held:
                dev.close()


# -- input nothing expected ---------------------------------------------------------
def test_deeply_nested_json_gets_an_error_frame_before_and_after_authentication(pool):
    nested = b'{"op":"hello","versions":' + b"[" * 1500 + b"]" * 1500 + b"}"   # < 4 KiB
    with _dial(pool.endpoint) as sock:
        _send_raw(sock, nested)
        frames = _frames_until_closed(sock, FrameReader())
    assert frames and frames[-1]["op"] == "error", frames
    assert frames[-1]["error"] == {"code": "BAD_FRAME",
                                   "message": "malformed frame: header is nested too deeply"}
    sock, reader = _opened(pool.endpoint)
    with sock:
        _send_raw(sock, b'{"op":"info","seq":1,"epoch":1,"x":' + b"[" * 20000 + b"]" * 20000 + b"}")
        frames = _frames_until_closed(sock, reader)
    assert frames[-1]["error"]["code"] == "BAD_FRAME" and "nested too deeply" in frames[-1]["error"]["message"]
    with connect(pool.endpoint, ALICE) as dev:              # and the pool goes on
        assert dev.read(dev.upload(b"fine")) == b"fine"


@pytest.mark.parametrize("field, value, words", [
    ("size", 10 ** 30, "field 'size' must be at most 2**63-1"),
    ("size", "1e400", "number 1e400 overflows"),
    ("size", "-1e400", "number -1e400 overflows"),
    ("size", "Infinity", "Infinity is not JSON"),
    ("size", "NaN", "NaN is not JSON"),
    ("buf", 2 ** 63, "field 'buf' must be at most 2**63-1"),
])
def test_numbers_that_overflow_are_refused_clearly(pool, field, value, words, caplog):
    sock, reader = _opened(pool.endpoint)
    header = {"op": "alloc", "seq": 1, "epoch": 1, "buf": 1, "size": 16}
    text = json.dumps(header).replace(f'"{field}": {header[field]}', f'"{field}": {value}')
    assert str(value) in text
    with caplog.at_level(logging.WARNING), sock:
        _send_raw(sock, text.encode())
        frames = _frames_until_closed(sock, reader)
    error = frames[-1]["error"]
    assert error["code"] in ("BAD_REQUEST", "BAD_FRAME") and words in error["message"], error
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


LAUNCHES = [
    ({"gsize": [10 ** 30]}, "gsize entries must be positive integers"),
    ({"gsize": [4], "lsize": [2 ** 64]}, "lsize entries must be positive integers"),
    ({"args": [{"buf": 1}, {"local": 10 ** 30}]}, "local must be a positive size"),
    ({"kernel": "bu\ud800mp"}, "lone surrogate"),
]


@pytest.mark.parametrize("change, words", LAUNCHES, ids=["gsize", "lsize", "local", "kernel"])
def test_launch_fields_that_overflow_or_hold_lone_surrogates_are_refused(pool, change, words, caplog):
    sock, reader = _opened(pool.endpoint)
    with sock:
        _send_raw(sock, json.dumps({"op": "build", "seq": 1, "epoch": 1, "prog": 1, "options": ""}).encode(),
                  COUNTER.encode())
        assert _next_frames(sock, reader)[0]["ok"] is True
        _send_raw(sock, json.dumps({"op": "alloc", "seq": 2, "epoch": 1, "buf": 1, "size": 16}).encode())
        assert _next_frames(sock, reader)[0]["op"] == "done"
        launch = {"op": "launch", "seq": 3, "epoch": 1, "prog": 1, "kernel": "bump", "gsize": [4],
                  "args": [{"buf": 1}, {"t": "u32", "x": "01000000"}]}
        launch.update(change)
        with caplog.at_level(logging.WARNING):
            _send_raw(sock, json.dumps(launch).encode())     # ASCII: the surrogate as \ud800
            frames = _frames_until_closed(sock, reader)
    error = frames[-1].get("error") or {}
    assert error.get("code") in ("BAD_REQUEST", "BAD_FRAME") and words in error["message"], frames
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_a_lone_surrogate_in_build_options_is_refused_and_a_real_character_is_fine(pool, caplog):
    sock, reader = _opened(pool.endpoint)
    with sock:
        # a pair (U+1F600) is one real character: it reaches the compiler as text
        _send_raw(sock, b'{"op":"build","seq":1,"epoch":1,"prog":1,"options":"-DX=\\ud83d\\ude00"}',
                  COUNTER.encode())
        reply = _next_frames(sock, reader)[0]
        assert reply.get("error", {}).get("code") != "INTERNAL", reply
        with caplog.at_level(logging.WARNING):
            _send_raw(sock, b'{"op":"build","seq":2,"epoch":1,"prog":2,"options":"-D\\ud800"}',
                      COUNTER.encode())
            frames = _frames_until_closed(sock, reader)
    assert frames[-1]["error"]["code"] == "BAD_FRAME"
    assert "lone surrogate" in frames[-1]["error"]["message"]
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_a_hello_offering_an_overflowing_version_is_refused_clearly(pool, caplog):
    with caplog.at_level(logging.WARNING), _dial(pool.endpoint) as sock:
        _send_raw(sock, b'{"op":"hello","versions":[1e400]}')       # was OverflowError, logged
        frames = _frames_until_closed(sock, FrameReader())
    assert frames[-1]["error"]["code"] == "BAD_FRAME", frames
    assert "number 1e400 overflows" in frames[-1]["error"]["message"]
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
