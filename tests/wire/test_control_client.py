"""The control-plane clients against a scripted peer on a real socket: a call
cancelled or timed out leaves nothing behind, calls are pipelined (the
hook's call never queues behind another), and a frame error closes the
connection while the next call connects again.  (The clients against the
real pool: every test that migrates.)"""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from accelmig.wire import control as wc
from accelmig.wire.errors import FrameError, Unavailable
from accelmig.wire.frames import FrameReader, encode_frame

SECRET = b"scripted-peer-secret-01"


class ScriptedPool:
    """A control-plane peer on a thread: welcomes, checks MACs, and answers
    each call as ``script(call_id, method, args)`` says: a result dict, or
    ("hold", event) to answer only once ``event`` is set, or ("garbage",)."""

    def __init__(self, script):
        self.script = script
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.connections = 0
        self.calls: list[tuple[int, str]] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock):
        reader, challenge = FrameReader(), "c0ffee"
        send = threading.Lock()

        def answer(call_id, body):
            out = {"op": "result", "id": call_id, **body}
            out["mac"] = wc.result_mac(SECRET, challenge, call_id, wc.result_body(out))
            try:
                with send:
                    sock.sendall(encode_frame(out))
            except OSError:
                pass          # the client gave up and closed: nothing to answer

        try:
            while True:
                n = sock.recv_into(reader.get_buffer())
                if not n:
                    return
                for frame in reader.feed(n):
                    h = frame.header
                    if h["op"] == "hello":
                        sock.sendall(encode_frame({"op": "welcome", "version": 1, "challenge": challenge,
                                                   "instance": "scripted"}))
                        continue
                    assert h["mac"] == wc.request_mac(SECRET, challenge, h["id"], h["method"], h["args"])
                    with self._lock:
                        self.calls.append((h["id"], h["method"]))
                    action = self.script(h["id"], h["method"], h["args"])
                    if isinstance(action, tuple) and action[0] == "hold":
                        def later(call_id=h["id"], event=action[1], result=action[2]):
                            event.wait(10)
                            answer(call_id, {"ok": True, "result": result})
                        threading.Thread(target=later, daemon=True).start()
                    elif isinstance(action, tuple) and action[0] == "garbage":
                        with send:
                            sock.sendall(b"XX" + b"\0" * 30)
                    else:
                        answer(h["id"], {"ok": True, "result": action})
        except OSError:
            pass
        finally:
            sock.close()

    def close(self):
        self.listener.close()


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def test_a_cancelled_call_leaves_nothing_behind():
    release = threading.Event()
    peer = ScriptedPool(lambda i, m, a: ("hold", release, {"late": i}) if m == "slow" else {"echo": a})

    async def scenario():
        client = wc.AsyncControlClient(peer.endpoint, "hostA", SECRET)
        try:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.call("slow"), 0.2)      # the hook's budget runs out
            release.set()                                              # ... and its answer comes late
            assert await client.call("fast", n=1) == {"echo": {"n": 1}}
            assert await client.call("fast", n=2) == {"echo": {"n": 2}}
        finally:
            await client.close()

    run(scenario())
    assert peer.connections == 1          # no reconnect was needed: the late answer was dropped by id
    peer.close()


def test_calls_are_pipelined_so_one_never_waits_behind_another():
    release = threading.Event()
    peer = ScriptedPool(lambda i, m, a: ("hold", release, "renewed") if m == "renew" else "opened")

    async def scenario():
        client = wc.AsyncControlClient(peer.endpoint, "hostA", SECRET)
        try:
            renewal = asyncio.ensure_future(client.call("renew"))
            await asyncio.sleep(0)            # let it be written first
            assert await asyncio.wait_for(client.call("open_migration"), 5) == "opened"
            assert not renewal.done()
            release.set()
            assert await renewal == "renewed"
        finally:
            await client.close()

    run(scenario())
    peer.close()


def test_a_timeout_is_reported_as_the_pool_unavailable():
    peer = ScriptedPool(lambda i, m, a: ("hold", threading.Event(), None))

    async def scenario():
        client = wc.AsyncControlClient(peer.endpoint, "hostA", SECRET, timeout=0.2)
        try:
            with pytest.raises(Unavailable, match="no answer to ping within 0.2 s"):
                await client.call("ping")
        finally:
            await client.close()

    run(scenario())
    peer.close()


def test_a_frame_error_closes_the_connection_and_the_next_call_reconnects():
    peer = ScriptedPool(lambda i, m, a: ("garbage",) if m == "bad" else "fine")

    async def scenario():
        client = wc.AsyncControlClient(peer.endpoint, "hostA", SECRET)
        try:
            with pytest.raises((FrameError, Unavailable)):
                await client.call("bad")
            assert await client.call("good") == "fine"
        finally:
            await client.close()

    run(scenario())
    assert peer.connections == 2
    peer.close()


def test_the_blocking_client_skips_a_late_answer_and_reconnects_after_garbage():
    release = threading.Event()

    def script(i, method, args):
        if method == "slow":
            return ("hold", release, "late")
        return ("garbage",) if method == "bad" else {"id": i}

    peer = ScriptedPool(script)
    client = wc.ControlClient(peer.endpoint, "hostA", SECRET, timeout=0.3)
    try:
        with pytest.raises(Unavailable):
            client.call("slow")               # timed out (twice: it retries once on a new connection)
        release.set()
        assert client.call("fast") == {"id": 1}    # a fresh connection: ids start again
        with pytest.raises(FrameError):
            client.call("bad")
        assert client.call("fast") == {"id": 1}
    finally:
        client.close()
    assert peer.connections == 4
    peer.close()


def test_a_long_call_passes_its_own_timeout_argument_through():
    """``wait_record`` has an argument named ``timeout`` (how long the pool
    holds it); the client's own limit is a separate, positional one."""
    peer = ScriptedPool(lambda i, m, a: {"method": m, "args": a})

    async def scenario():
        client = wc.AsyncControlClient(peer.endpoint, "hostA", SECRET, timeout=0.5)
        try:
            answer = await client.call_within(10, "wait_record", migration_id="m1", timeout=7.5)
            assert answer == {"method": "wait_record", "args": {"migration_id": "m1", "timeout": 7.5}}
        finally:
            await client.close()

    run(scenario())
    peer.close()
