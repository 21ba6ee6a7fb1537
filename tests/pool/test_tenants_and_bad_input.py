"""Two tenants (isolation, quota), and a connection sending garbage while
another session keeps being served."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from accelmig.agent.driver import Device, connect, u32
from accelmig.wire.errors import AuthFailed, NoSuchObject, QuotaExceeded
from accelmig.wire.frames import MAGIC, PREFIX, FrameReader, encode_frame
from tests.conftest import ALICE, BOB
from tests.support.kernels import COUNTER


def test_a_session_never_sees_another_sessions_objects(pool):
    with connect(pool.endpoint, ALICE) as a, connect(pool.endpoint, BOB) as b:
        secret = a.upload(b"alice's weights")
        # Bob's driver numbers its own handles; forge a Buffer with Alice's handle.
        from accelmig.agent.driver import Buffer
        forged = Buffer(b, secret.handle, secret.size)
        with pytest.raises(NoSuchObject, match=f"no buffer with handle {secret.handle}"):
            b.read(forged)
        assert a.read(secret) == b"alice's weights"
        # the same holds between two sessions of one tenant
        with connect(pool.endpoint, ALICE) as a2:
            with pytest.raises(NoSuchObject):
                a2.read(Buffer(a2, secret.handle, secret.size))


def test_quota_is_per_tenant_and_memory_comes_back(pool):
    mib = 1 << 20
    with connect(pool.endpoint, BOB) as b1, connect(pool.endpoint, BOB) as b2:
        first = b1.alloc(40 * mib)
        b1.finish()
        b2.alloc(30 * mib)          # 70 MiB > Bob's 64 MiB, across his two sessions
        with pytest.raises(QuotaExceeded, match="would use 41943040 of its 67108864-byte"):
            b2.finish()
        first.free()
        b1.finish()                 # the free is pipelined: wait before relying on it
        b2.alloc(30 * mib)
        b2.finish()
        with connect(pool.endpoint, ALICE) as a:   # Alice's quota is her own
            a.alloc(200 * mib)
            a.finish()
    # closing the sessions released everything
    used = pool.call(lambda: {t.name: t.used for t in pool.pool.tenants.values()})
    assert used == {"alice": 0, "bob": 0}


def test_bad_token_is_refused(pool):
    with pytest.raises(AuthFailed, match="unknown tenant token"):
        Device(pool.endpoint, "not-a-token", agent=False)


def _raw_session(endpoint: str, token: str = ALICE):
    host, port = endpoint.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(encode_frame({"op": "hello", "versions": [1]}))
    sock.sendall(encode_frame({"op": "open", "token": token, "secret": "ab" * 32}))
    return sock


def _read_frames(sock, until_closed=True):
    reader = FrameReader()
    frames = []
    while True:
        try:
            n = sock.recv_into(reader.get_buffer())
        except (ConnectionResetError, socket.timeout):
            break
        if n == 0:
            break
        frames.extend(f.header for f in reader.feed(n))
        if not until_closed and frames:
            break
    return frames


GARBAGE = [
    ("bad magic", b"XX" + b"\x01" * 14 + b"{}"),
    ("oversized header", PREFIX.pack(MAGIC, 1, 0, 1 << 20, 0)),
    ("oversized payload", PREFIX.pack(MAGIC, 1, 0, 2, 1 << 40) + b"{}"),
    ("not json", PREFIX.pack(MAGIC, 1, 0, 6, 0) + b"\x00\x01\x02{}}"),
    ("unknown op", encode_frame({"op": "teleport", "seq": 1, "epoch": 1})),
    ("bad fields", encode_frame({"op": "alloc", "seq": 1, "epoch": 1, "buf": "x", "size": 1})),
    ("sequence gap", encode_frame({"op": "finish", "seq": 9, "epoch": 1})),
    ("stale epoch", encode_frame({"op": "finish", "seq": 1, "epoch": 0})),
    ("random bytes", bytes(range(256)) * 4),
]


@pytest.mark.parametrize("name, garbage", GARBAGE, ids=[g[0] for g in GARBAGE])
def test_garbage_gets_an_error_and_a_close_and_harms_no_one(pool, name, garbage):
    with connect(pool.endpoint, BOB) as bob:
        prog = bob.build(COUNTER)
        buf = bob.upload(np.zeros(8, dtype=np.uint32))
        stop = threading.Event()
        errors = []

        def keep_bob_busy():
            total = 0
            try:
                while not stop.is_set():
                    prog.launch("bump", 8, None, buf, u32(1))
                    total += 1
                    if total % 50 == 0:
                        assert set(np.frombuffer(bob.read(buf), dtype=np.uint32)) == {total}
            except Exception as exc:  # reported below
                errors.append(exc)

        worker = threading.Thread(target=keep_bob_busy)
        worker.start()
        try:
            sock = _raw_session(pool.endpoint)
            sock.sendall(garbage)
            frames = _read_frames(sock)
            sock.close()
        finally:
            time.sleep(0.2)
            stop.set()
            worker.join(30)
        assert not errors, errors
        assert frames[0]["op"] == "welcome" and frames[1]["op"] == "opened"
        assert frames[-1]["op"] == "error", frames
        assert frames[-1]["error"]["code"] in {
            "BAD_FRAME", "FRAME_TOO_LARGE", "UNKNOWN_OP", "BAD_REQUEST", "PROTOCOL_ERROR", "STALE_EPOCH"}
        assert frames[-1]["error"]["message"]
        # Bob is still served after all that
        assert bob.read(buf, 4) is not None


def test_garbage_before_hello_and_a_silent_half_frame(pool):
    host, port = pool.endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(encode_frame({"op": "open", "token": ALICE, "secret": "00" * 32}))
        frames = _read_frames(sock)
    assert frames[-1]["error"]["code"] == "PROTOCOL_ERROR" and "hello first" in frames[-1]["error"]["message"]
    # A peer that stops half-way through a frame holds only its own connection.
    half = socket.create_connection((host, int(port)), timeout=5)
    half.sendall(encode_frame({"op": "hello", "versions": [1]})[:9])
    with connect(pool.endpoint, ALICE) as dev:
        assert dev.read(dev.upload(b"ok")) == b"ok"
    half.close()


def test_unsupported_protocol_version_is_a_clear_error(pool):
    host, port = pool.endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(encode_frame({"op": "hello", "versions": [42]}))
        frames = _read_frames(sock)
    assert frames[-1]["error"]["code"] == "VERSION_UNSUPPORTED"
    assert "peer offers [42]" in frames[-1]["error"]["message"]


def test_payload_limit_is_enforced_by_driver_and_pool():
    from accelmig.lab.poolthread import PoolThread
    from accelmig.wire.errors import FrameTooLarge
    with PoolThread({"t": ("tenant-token-001", "1GiB")}, max_payload=1 << 20) as small:
        with connect(small.endpoint, "tenant-token-001", timeout=5) as dev:
            buf = dev.alloc(2 << 20)
            # the driver learned the limit at hello: a payload it cannot
            # split is refused before sending; a write goes in chunks
            with pytest.raises(FrameTooLarge, match="2097152 bytes exceeds the limit of 1048576"):
                dev.build_binary(bytes(2 << 20))
            dev.write(buf, b"x" * (2 << 20))
            assert dev.read(buf, 8, (2 << 20) - 8) == b"x" * 8
            assert small.session(dev.sid)["counters"]["commands"] == 1 + 2 + 1   # alloc, two chunks, read
        # a peer that ignores it is cut off by the pool
        sock = _raw_session(small.endpoint, "tenant-token-001")
        sock.sendall(PREFIX.pack(MAGIC, 1, 0, 2, (1 << 20) + 1) + b"{}")
        frames = _read_frames(sock)
        assert frames[-1]["error"]["code"] == "FRAME_TOO_LARGE"
        count = small.call(lambda: small.pool.metrics.frame_errors.labels("FRAME_TOO_LARGE")._value.get())
        assert count == 1
