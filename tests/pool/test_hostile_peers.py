"""Peers that never authenticate, or misbehave after they did, against a
real pool on loopback (issue 14, items 1, 3 and 8).

- Before authentication a frame carries no payload and a small header, so a
  40-byte ``hello`` announcing a 1 GiB payload costs nothing.
- A connection that does not authenticate in time is closed.
- One address may hold only a few unauthenticated connections (the rest
  are refused at once), everyone together a bounded number (past it a
  newcomer evicts the oldest stranger of the most crowded address).
- A session whose connection the *pool* closed (a bad frame after open) is
  detached like any other, so its grace runs out and it is released:
  quota, device memory and worker thread come back.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import numpy as np
import pytest

from accelmig.agent.driver import connect
from accelmig.lab.poolthread import PoolThread
from accelmig.pool.session import SessionState
from accelmig.wire.control import PAGED_ANSWER_MAX, AsyncControlClient, ControlClient
from accelmig.wire.dataplane import Op
from accelmig.wire.errors import OutOfRange
from accelmig.wire.frames import MAGIC, PREFIX, FrameReader, encode_frame
from tests.support.raw_peers import RawPeer
from tests.support.tenants import ALICE, TENANTS
from tests.support.wait import wait_for


def _dial(endpoint: str) -> socket.socket:
    host, port = endpoint.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _frames_until_closed(sock) -> list[dict]:
    """Every frame the pool sends until it closes (the socket's timeout
    bounds a pool that never closes: the test then fails)."""
    reader, frames = FrameReader(), []
    while True:
        try:
            n = sock.recv_into(reader.get_buffer())
        except ConnectionResetError:
            break
        if n == 0:
            break
        frames.extend(f.header for f in reader.feed(n))
    return frames


def _hello(sock) -> dict:
    sock.sendall(encode_frame({"op": "hello", "versions": [1]}))
    reader = FrameReader()
    while True:
        n = sock.recv_into(reader.get_buffer())
        assert n, "the pool closed instead of answering hello"
        frames = reader.feed(n)
        if frames:
            return frames[0].header


@pytest.fixture
def pool():
    with PoolThread(TENANTS) as harness:
        yield harness


def test_a_hello_announcing_a_huge_payload_is_refused_before_anything_is_allocated(pool):
    handed_out = []
    buffers = pool.pool.buffers
    original = buffers.get
    buffers.get = lambda size: handed_out.append(size) or original(size)
    with _dial(pool.endpoint) as sock:
        # 16-byte prefix + a 2-byte header, announcing 1 GiB that never comes
        sock.sendall(PREFIX.pack(MAGIC, 1, 0, 2, 1 << 30) + b"{}")
        frames = _frames_until_closed(sock)
    assert frames and frames[-1]["op"] == "error", frames
    assert frames[-1]["error"]["code"] == "FRAME_TOO_LARGE"
    assert "payload" in frames[-1]["error"]["message"]
    assert handed_out == []               # not one payload buffer for a stranger


def test_a_big_header_before_authentication_is_refused(pool):
    with _dial(pool.endpoint) as sock:
        assert _hello(sock)["op"] == "welcome"
        sock.sendall(encode_frame({"op": "open", "token": ALICE, "secret": "ab" * 32,
                                   "client": {"name": "x" * 8000}}))
        frames = _frames_until_closed(sock)
    assert frames[-1]["error"]["code"] == "FRAME_TOO_LARGE"
    assert "header" in frames[-1]["error"]["message"]


def test_after_authentication_the_full_limits_apply():
    with PoolThread(TENANTS) as harness, connect(harness.endpoint, ALICE) as dev:
        data = np.arange(1 << 18, dtype=np.uint32)          # 1 MiB: one payload
        assert np.array_equal(np.frombuffer(dev.read(dev.upload(data)), dtype=np.uint32), data)


def test_a_connection_that_never_authenticates_is_closed_in_time():
    with PoolThread(TENANTS, handshake_timeout=0.3) as harness:
        # authenticated first: the deadline of the two below is past when they
        # are closed, so this one has outlived its own deadline by then
        with connect(harness.endpoint, ALICE) as dev:
            buf = dev.upload(b"still here")
            with _dial(harness.endpoint) as silent, _dial(harness.endpoint) as greeted:
                assert _hello(greeted)["op"] == "welcome"
                for sock in (silent, greeted):
                    frames = _frames_until_closed(sock)
                    assert frames[-1]["error"]["code"] == "PROTOCOL_ERROR"
                    assert "no open or resume within 0.3 s" in frames[-1]["error"]["message"]
            assert dev.read(buf) == b"still here"
            assert dev.stats["resumes"] == 0       # never cut


def test_unauthenticated_connections_are_capped_per_peer_and_freed_by_authenticating():
    with PoolThread(TENANTS, max_unauthenticated_per_peer=3) as harness:
        pending = [_dial(harness.endpoint) for _ in range(3)]
        try:
            for sock in pending:
                assert _hello(sock)["op"] == "welcome"
            with _dial(harness.endpoint) as fourth:
                frames = _frames_until_closed(fourth)
            assert frames[-1]["error"]["code"] == "UNAVAILABLE"
            assert "3 connections from 127.0.0.1 have not authenticated" in \
                frames[-1]["error"]["message"]
            # one of them authenticates: it no longer counts, a newcomer gets in
            pending[0].sendall(encode_frame({"op": "open", "token": ALICE, "secret": "ab" * 32}))
            reader = FrameReader()
            opened = []
            while not opened:
                n = pending[0].recv_into(reader.get_buffer())
                assert n
                opened = reader.feed(n)
            assert opened[0].header["op"] == "opened"
            with connect(harness.endpoint, ALICE) as dev:
                assert dev.read(dev.upload(b"in")) == b"in"
        finally:
            for sock in pending:
                sock.close()
        metric = harness.call(lambda: harness.pool.metrics.refused_connections._value.get())
        assert metric == 1


def test_past_the_total_a_newcomer_evicts_the_oldest_stranger_of_the_most_crowded_address():
    """At most 3 strangers in all: a fourth, from another address, is not
    refused: the oldest connection of the address holding the most goes."""
    with PoolThread(TENANTS, max_unauthenticated=3) as harness:
        crowd = [RawPeer(harness.endpoint, source="127.0.0.2") for _ in range(2)]
        lone = RawPeer(harness.endpoint, source="127.0.0.3")
        try:
            for peer in crowd + [lone]:
                peer.send({"op": "hello", "versions": [1]})
                assert peer.next_frame()[0]["op"] == "welcome"
            newcomer = RawPeer(harness.endpoint, source="127.0.0.4")
            assert newcomer.open(ALICE)["op"] == "opened"           # it got in
            assert crowd[0].frames_until_closed() == []             # the oldest of 127.0.0.2, at once
            for peer in (crowd[1], lone):                           # the others stay
                peer.send({"op": "open", "token": ALICE, "secret": "ab" * 32})
                assert peer.next_frame()[0]["op"] == "opened"
            newcomer.close()
        finally:
            for peer in crowd + [lone]:
                peer.close()
        assert harness.call(lambda: harness.pool.metrics.evicted_connections._value.get()) == 1
        # closed ones no longer count
        wait_for(lambda: harness.call(lambda: harness.pool.admission.unauthenticated) == 0, timeout=10)
        with connect(harness.endpoint, ALICE) as dev:
            assert dev.read(dev.upload(b"ok")) == b"ok"


def test_control_plane_connections_that_have_not_authenticated_count_too():
    """The control plane held any number of silent connections (300 of them,
    10 s each): now they draw on the same budget as the data plane's."""
    with PoolThread(TENANTS, hosts={"hostA": HOST_SECRET}, max_unauthenticated_per_peer=2) as harness:
        silent = [_dial(harness.control_endpoint) for _ in range(2)]
        try:
            # both are counted once the pool has seen them: the data plane's third waits for that
            wait_for(lambda: harness.call(lambda: harness.pool.admission.unauthenticated_from("127.0.0.1")) == 2,
                     10, "the two silent control connections to be counted")
            with _dial(harness.control_endpoint) as third:
                frames = _frames_until_closed(third)
            assert frames[-1]["error"]["code"] == "UNAVAILABLE"
            assert "2 connections from 127.0.0.1 have not authenticated" in frames[-1]["error"]["message"]
        finally:
            for sock in silent:
                sock.close()
        # closed ones no longer count; an authenticated host is not counted at all
        wait_for(lambda: harness.call(lambda: harness.pool.admission.unauthenticated) == 0, 10, "the count to drop")
        with ControlClient(harness.control_endpoint, "hostA", HOST_SECRET.encode()) as a, \
                ControlClient(harness.control_endpoint, "hostA", HOST_SECRET.encode()) as b, \
                ControlClient(harness.control_endpoint, "hostA", HOST_SECRET.encode()) as c:
            assert [x.call("ping")["caller"] for x in (a, b, c)] == ["hostA"] * 3


def test_a_session_the_pool_disconnects_is_detached_and_released_after_its_grace():
    with PoolThread(TENANTS, grace=30.0) as harness:
        pool = harness.pool
        with _dial(harness.endpoint) as sock:
            assert _hello(sock)["op"] == "welcome"
            sock.sendall(encode_frame({"op": "open", "token": ALICE, "secret": "ab" * 32}))
            sock.sendall(encode_frame({"op": "alloc", "seq": 1, "epoch": 1, "buf": 1,
                                       "size": 4096}))
            # a frame the pool refuses: it answers with an error and closes
            sock.sendall(encode_frame({"op": "teleport", "seq": 2, "epoch": 1}))
            frames = _frames_until_closed(sock)
        assert frames[0]["op"] == "opened" and frames[-1]["op"] == "error"
        sid = frames[0]["sid"]
        session = pool.sessions[sid]
        wait_for(lambda: harness.call(lambda: session.state) is SessionState.DETACHED, timeout=10)
        tenant = session.tenant
        # the alloc runs on (its device process may still be starting), and is held through the grace
        wait_for(lambda: harness.call(lambda: tenant.used) == 4096, timeout=20)
        # at the end of the grace (time handed in, not waited for): released
        harness.call(pool.sweep, time.time() + 31.0)
        assert harness.call(lambda: session.state) is SessionState.RELEASED
        session.wait_released(10)
        assert harness.call(lambda: tenant.used) == 0
        assert not [t for t in threading.enumerate() if t.name == f"session-{sid}"]


def test_a_read_past_the_end_is_refused_before_its_reply_is_allocated(pool):
    handed_out = []
    buffers = pool.pool.buffers
    original = buffers.get
    buffers.get = lambda size: handed_out.append(size) or original(size)
    with connect(pool.endpoint, ALICE) as dev:
        buf = dev.upload(b"sixteen bytes..!")
        with pytest.raises(OutOfRange, match="read of buffer"):
            dev.read(buf, 1 << 30)          # (the driver checks a chunked read's range itself)
        with pytest.raises(OutOfRange, match="read of buffer"):
            # what a driver that does not check sends: one read of a frame's size
            dev._submit(Op.READ, {"buf": buf.handle, "offset": 0, "size": dev.chunk}, wait=True)
        assert not [size for size in handed_out if size >= dev.chunk]
        assert dev.read(buf) == b"sixteen bytes..!"      # the session goes on


# -- the control plane ---------------------------------------------------------------
HOST_SECRET = "control-secret-of-host-a"


def test_a_control_hello_announcing_a_huge_payload_is_refused_at_once():
    with PoolThread(TENANTS, hosts={"hostA": HOST_SECRET}) as harness:
        with _dial(harness.control_endpoint) as sock:
            sock.sendall(PREFIX.pack(MAGIC, 1, 0, 2, 255 << 20) + b"{}")
            frames = _frames_until_closed(sock)
        assert frames[-1]["error"]["code"] == "FRAME_TOO_LARGE"


def test_a_silent_control_connection_is_closed_in_time():
    with PoolThread(TENANTS, hosts={"hostA": HOST_SECRET}, handshake_timeout=0.3) as harness:
        with _dial(harness.control_endpoint) as sock:
            frames = _frames_until_closed(sock)
        assert "no hello within 0.3 s" in frames[-1]["error"]["message"]
        with ControlClient(harness.control_endpoint, "hostA", HOST_SECRET.encode()) as client:
            assert client.call("ping") is not None


def test_a_quiet_control_connection_is_closed_unless_a_wait_of_its_is_pending():
    """A host's connection that sends nothing for idle_timeout is closed,
    without an error frame (the client reconnects at its next call); one
    that waits for a record (``accelmig migrate``) is not, however long."""
    with PoolThread(TENANTS, hosts={"hostA": HOST_SECRET}, idle_timeout=1.5) as harness:
        idle_cuts = lambda: harness.call(lambda: harness.pool.metrics.idle_connections._value.get())  # noqa: E731
        with ControlClient(harness.control_endpoint, "hostA", HOST_SECRET.encode()) as client:
            waited = time.monotonic()
            assert client.call("wait_record", domain_uuid="no-such-domain", timeout=4.5)["reached"] is False
            assert time.monotonic() - waited >= 4.5 and idle_cuts() == 0      # three idle timeouts long
            wait_for(lambda: idle_cuts() == 1, 10, "the quiet connection to be closed")
            assert client.call("ping")["caller"] == "hostA"                   # on a new connection


def test_a_listing_over_64_kib_comes_in_pages_through_both_clients():
    """260 sessions are ~80 KiB of descriptions: list_sessions answers them a
    page at a time, each answer within PAGED_ANSWER_MAX, and both clients
    follow the pages to the whole list (issue 11: no answer grows with the
    number of sessions)."""
    # (the sessions come from hostA's network: a host lists its own)
    with PoolThread(TENANTS, hosts={"hostA": (HOST_SECRET, ["127.0.0.0/8"])}, max_sessions_per_tenant=300) \
            as harness:
        sockets = []
        try:
            for _ in range(260):                  # ~300 bytes a session: > 64 KiB in all
                sock = _dial(harness.endpoint)
                sockets.append(sock)
                _hello(sock)
                sock.sendall(encode_frame({"op": "open", "token": ALICE, "secret": "ab" * 32}))
            wait_for(lambda: harness.call(lambda: len(harness.pool.sessions)) == 260, timeout=30)
            with ControlClient(harness.control_endpoint, "hostA", HOST_SECRET.encode()) as client:
                first = client.call("list_sessions")
                assert first["next"] and len(encode_frame({"op": "result", "result": first})) <= PAGED_ANSWER_MAX
                listed = client.call_all("list_sessions")
                assert len(json.dumps(listed)) > 65536 and listed["next"] is None
                assert len({s["sid"] for s in listed["sessions"]}) == 260
                assert client.call("ping") is not None   # the connection is still in step

            async def from_the_async_client():
                client = AsyncControlClient(harness.control_endpoint, "hostA", HOST_SECRET.encode())
                try:
                    return len((await client.call_all("list_sessions"))["sessions"]), await client.call("ping")
                finally:
                    await client.close()

            count, pong = asyncio.run(from_the_async_client())
            assert count == 260 and pong is not None
        finally:
            for sock in sockets:
                sock.close()
