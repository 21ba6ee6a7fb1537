"""Session continuity on one host: cuts, epochs, divergence, lifetimes."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
import zlib

import numpy as np
import pytest

from accelmig.agent.driver import LinkState, connect, u32
from accelmig.lab.cutproxy import CutProxy
from accelmig.lab.poolthread import PoolThread
from accelmig.wire.errors import Disconnected, SessionExpired, SessionLost, WindowFull
from tests.conftest import ALICE, TENANTS
from tests.support.attest import bind
from tests.support.kernels import COUNTER
from tests.support.twohosts import HOSTS, Raw, TwoHosts
from tests.support.wait import wait_for


def test_cut_connections_resume_on_their_own(pool):
    proxy = CutProxy(pool.endpoint)
    try:
        with connect(proxy.endpoint, ALICE, agent=False, timeout=20) as dev:
            prog = dev.build(COUNTER)
            buf = dev.upload(np.zeros(4, dtype=np.uint32))
            cuts = 0
            for i in range(1, 301):
                prog.launch("bump", 4, None, buf, u32(1))
                if i % 60 == 0:
                    assert proxy.cut() == 1
                    cuts += 1
                elif i % 60 == 30:          # commands go on meanwhile; wait for the resume
                    wait_for(lambda: dev.stats["resumes"] >= cuts, 10, f"the driver's resume after cut {cuts}",
                             interval=0.01)
            assert set(np.frombuffer(dev.read(buf), dtype=np.uint32)) == {300}
            assert dev.stats["resumes"] >= 5
            state = pool.session(dev.sid)
            assert state["counters"]["launches"] == 300 and state["counters"]["duplicates"] == 0
    finally:
        proxy.close()


def test_stale_epoch_is_refused_even_on_a_connection_that_is_still_open(pool):
    old = Raw(pool.endpoint)
    old.open()
    old.send({"op": "finish", "seq": 1, "epoch": 1})
    assert old.recv()["ok"]
    new = Raw(pool.endpoint)
    resumed = new.resume(old.sid, old.secret, 1, 1)
    assert resumed["op"] == "resumed" and resumed["epoch"] == 2 and resumed["expect"] == 2
    fenced = old.recv()
    assert fenced["error"]["code"] == "STALE_EPOCH" and "fenced" in fenced["error"]["message"]
    with pytest.raises((EOFError, ConnectionError)):
        old.send({"op": "finish", "seq": 2, "epoch": 1})
        old.recv()
    # and an old-epoch command on the new connection is refused too
    new.send({"op": "finish", "seq": 2, "epoch": 1})
    refused = new.recv()
    assert refused["error"]["code"] == "STALE_EPOCH"
    assert "epoch 1 refused, the session is at epoch 2" in refused["error"]["message"]


def test_a_resent_command_with_other_content_is_refused_as_diverged(pool):
    raw = Raw(pool.endpoint)
    raw.open()
    raw.send({"op": "alloc", "seq": 1, "epoch": 1, "buf": 1, "size": 8})
    raw.send({"op": "write", "seq": 2, "epoch": 1, "buf": 1, "offset": 0}, b"original")
    assert raw.recv()["ok"] and raw.recv()["ok"]       # replies seen, not acknowledged
    copy = Raw(pool.endpoint)
    resumed = copy.resume(raw.sid, raw.secret, 1, 1)   # a copy that saw only reply 1
    assert resumed["expect"] == 3 and resumed["replay"] == 1
    assert copy.recv()["seq"] == 2                     # the replayed reply
    copy.send({"op": "write", "seq": 2, "epoch": 2, "buf": 1, "offset": 0}, b"another!")
    answer = copy.recv()
    assert answer["error"]["code"] == "SESSION_DIVERGED" and "command 2 (write) differs" in \
        answer["error"]["message"]
    # the pool's state is untouched: the buffer still holds the original
    third = Raw(pool.endpoint)
    third.resume(raw.sid, raw.secret, 2, 2)
    third.send({"op": "read", "seq": 3, "epoch": 3, "buf": 1, "offset": 0, "size": 8})
    frames = []
    while not frames:
        frames = [f for f in third.reader.feed(third.sock.recv_into(third.reader.get_buffer()))
                  if f.op == "reply"]
    assert bytes(frames[0].payload) == b"original"


def _crc32_twin(prefix: bytes, of: bytes) -> bytes:
    """``prefix`` plus four bytes, with the CRC-32 (and the length, for a
    4-byte shorter prefix) of ``of``: CRC-32 is linear, so its last four
    bytes can be solved for (the table's top bytes are all distinct, which
    names each step's index walking back from the target)."""
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0xEDB88320 if c & 1 else 0)
        table.append(c)
    by_top = {entry >> 24: i for i, entry in enumerate(table)}
    indices, c = [], zlib.crc32(of) ^ 0xFFFFFFFF
    for _ in range(4):
        i = by_top[c >> 24]
        indices.append(i)
        c = ((c ^ table[i]) << 8) & 0xFFFFFFFF
    c, tail = zlib.crc32(prefix) ^ 0xFFFFFFFF, bytearray()
    for i in reversed(indices):
        tail.append((c ^ i) & 0xFF)
        c = (c >> 8) ^ table[i]
    return prefix + bytes(tail)


def test_a_resent_write_with_the_same_length_and_crc32_but_other_bytes_is_diverged(pool):
    """The pool's payload digest is not CRC-32 alone: a copy of the driver
    whose write under a sequence number has other bytes of the same length
    and the same CRC-32 is still told it diverged, and its bytes never land."""
    original = b"original-pay"
    twin = _crc32_twin(b"forged!!", original)
    assert len(twin) == len(original) and zlib.crc32(twin) == zlib.crc32(original) and twin != original
    raw = Raw(pool.endpoint)
    raw.open()
    raw.send({"op": "alloc", "seq": 1, "epoch": 1, "buf": 1, "size": len(original)})
    raw.send({"op": "write", "seq": 2, "epoch": 1, "buf": 1, "offset": 0}, original)
    assert raw.recv()["ok"] and raw.recv()["ok"]
    copy = Raw(pool.endpoint)
    copy.resume(raw.sid, raw.secret, 1, 1)
    assert copy.recv()["seq"] == 2                     # the replayed reply
    copy.send({"op": "write", "seq": 2, "epoch": 2, "buf": 1, "offset": 0}, twin)
    assert copy.recv()["error"]["code"] == "SESSION_DIVERGED"
    third = Raw(pool.endpoint)
    third.resume(raw.sid, raw.secret, 2, 2)
    third.send({"op": "read", "seq": 3, "epoch": 3, "buf": 1, "offset": 0, "size": len(original)})
    frames = []
    while not frames:
        frames = [f for f in third.reader.feed(third.sock.recv_into(third.reader.get_buffer()))
                  if f.op == "reply"]
    assert bytes(frames[0].payload) == original


def test_the_same_command_resent_is_answered_from_the_log_not_run_twice(pool):
    raw = Raw(pool.endpoint)
    raw.open()
    raw.send({"op": "alloc", "seq": 1, "epoch": 1, "buf": 1, "size": 4})
    assert raw.recv()["ok"]
    again = Raw(pool.endpoint)
    again.resume(raw.sid, raw.secret, 1, 0)
    assert again.recv()["seq"] == 1           # replayed
    again.send({"op": "alloc", "seq": 1, "epoch": 2, "buf": 1, "size": 4})
    dup = again.recv()
    assert dup["seq"] == 1 and dup["ok"]       # an ObjectExists would mean it ran twice
    state = pool.session(raw.sid)
    assert state["counters"]["duplicates"] == 1 and state["counters"]["commands"] == 1


def test_a_resume_that_saw_less_than_was_acknowledged_is_refused(pool):
    raw = Raw(pool.endpoint)
    raw.open()
    for seq in (1, 2, 3):
        raw.send({"op": "finish", "seq": seq, "epoch": 1})
        raw.recv()
    raw.send({"op": "ack", "ack": 3})               # no reply: wait until the pool took it
    wait_for(lambda: pool.session(raw.sid)["sequence"]["acked"] == 3, 5, "the pool to record the ack of 3")
    copy = Raw(pool.endpoint)
    answer = copy.resume(raw.sid, raw.secret, 1, 1)
    assert answer["error"]["code"] == "SESSION_DIVERGED"
    assert "seen replies up to 1, but the driver already acknowledged up to 3" in answer["error"]["message"]
    raw.send({"op": "finish", "seq": 4, "epoch": 1})
    assert raw.recv()["ok"]                    # the original is unharmed


FORK_SCRIPT = textwrap.dedent("""
    import os, sys, json
    import numpy as np
    from accelmig.agent.driver import connect, u32
    from accelmig.wire.errors import AccelmigError
    endpoint, token, source = sys.argv[1], sys.argv[2], sys.stdin.read()
    dev = connect(endpoint, token, agent=False, timeout=10)
    prog = dev.build(source)
    buf = dev.upload(np.zeros(4, dtype=np.uint32))
    for _ in range(10):
        prog.launch("bump", 4, None, buf, u32(1))
    dev.finish()
    # Copy the driver's memory, as a snapshot of the guest would: hold its
    # locks so the copy is consistent, fork, then let both copies go.
    moved_on, told = os.pipe()          # the original says when it has moved on
    with dev._session.link.send_lock, dev._session.cond:
        pid = os.fork()
    if pid == 0:
        # The copy: its threads are gone, its socket is the parent's.  Drop it
        # (close, never shutdown: that would cut the original too) and wait
        # until the original has moved on, then try to resume.
        os.close(dev._session.link.sock.detach())
        dev._session.link.sock = None
        os.close(told)
        if os.read(moved_on, 1) != b"m":
            print(json.dumps({"copy": "NO_SIGNAL"}), flush=True)
            os._exit(1)
        try:
            dev.resume()
            print(json.dumps({"copy": "ACCEPTED"}), flush=True)
        except AccelmigError as exc:
            print(json.dumps({"copy": exc.code.value, "message": str(exc)}), flush=True)
        os._exit(0)
    for _ in range(20):
        prog.launch("bump", 4, None, buf, u32(1))
    dev.finish()
    dev.resume()            # the original moves on (new epoch) ...
    os.close(moved_on)
    os.write(told, b"m")    # ... tells the copy so ...
    os.close(told)
    _, status = os.waitpid(pid, 0)      # ... and waits for the copy's answer
    assert os.waitstatus_to_exitcode(status) == 0, status
    for _ in range(5):      # ... and keeps working after the copy was refused
        prog.launch("bump", 4, None, buf, u32(1))
    print(json.dumps({"original": np.frombuffer(dev.read(buf), dtype=np.uint32).tolist()}), flush=True)
    dev.close()
""")


def test_a_forked_driver_is_refused_as_diverged_and_the_original_goes_on(pool):
    out = subprocess.run([sys.executable, "-c", FORK_SCRIPT, pool.endpoint, ALICE], input=COUNTER,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    import json
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    copy = next(line for line in lines if "copy" in line)
    original = next(line for line in lines if "original" in line)
    assert copy["copy"] == "SESSION_DIVERGED", copy
    assert "older copy" in copy["message"]
    assert original["original"] == [35, 35, 35, 35]


def test_grace_expiry_releases_device_memory():
    with PoolThread(TENANTS, grace=0.4) as pool:
        dev = connect(pool.endpoint, ALICE, agent=False, timeout=3, auto_reconnect=False)
        dev.alloc(8 << 20)
        dev.finish()
        assert pool.call(lambda: pool.pool.tenants[ALICE].used) == 8 << 20
        dev._session.link.sock.shutdown(socket.SHUT_RDWR)          # the connection dies
        wait_for(lambda: not pool.call(lambda: len(pool.pool.sessions)), 5, "the pool to expire the session",
                 interval=0.1)
        assert pool.call(lambda: pool.pool.tenants[ALICE].used) == 0
        with pytest.raises(SessionExpired, match="expired and its device memory was released"):
            dev.resume()
        assert dev.state is LinkState.FAILED


def test_parked_sessions_outlive_the_grace_period():
    with PoolThread(TENANTS, HOSTS, listen="127.0.0.1:0,[::1]:0", grace=0.3) as pool:
        hosts = TwoHosts(pool)
        dev = connect(hosts.a.endpoint, ALICE, agent=False, timeout=3, auto_reconnect=False)
        buf = dev.upload(b"kept while saved")
        bind(hosts.a, dev, "dom-saved")
        parked = hosts.a.call("park", domain_uuid="dom-saved", retention=30)
        assert parked["parked"] == [dev.sid]
        # a witness, not parked, whose connection dies at the same moment: once
        # the pool has expired it, the grace period is over for both
        witness = connect(hosts.a.endpoint, ALICE, agent=False, timeout=3, auto_reconnect=False)
        witness.finish()
        dev._session.link.sock.shutdown(socket.SHUT_RDWR)     # the guest is frozen in a save image
        witness._session.link.sock.shutdown(socket.SHUT_RDWR)
        wait_for(lambda: witness.sid not in pool.call(lambda: set(pool.pool.sessions)), 10,
                 "the pool to expire the unparked witness session (the grace period over)")
        assert pool.session(dev.sid)["state"] == "parked"
        hosts.a.call("unpark", domain_uuid="dom-saved")
        dev.resume()
        assert dev.read(buf) == b"kept while saved"
        dev.close()
        hosts.close()


def test_a_pool_restart_is_reported_as_session_lost_never_a_new_session():
    with PoolThread(TENANTS) as pool:
        dev = connect(pool.endpoint, ALICE, agent=False, timeout=3, auto_reconnect=False)
        dev.upload(b"state")
        dev.finish()
        pool.restart()
        with pytest.raises(SessionLost, match="the pool restarted"):
            dev.resume()
        assert dev.state is LinkState.FAILED
        with pytest.raises(SessionLost):
            dev.finish()


def test_auto_reconnect_reports_session_lost_after_a_restart():
    with PoolThread(TENANTS) as pool:
        dev = connect(pool.endpoint, ALICE, agent=False, timeout=10)
        dev.finish()
        pool.restart()
        wait_for(lambda: dev.state is LinkState.FAILED, 10, "the driver's reconnect to fail (FAILED)")
        with pytest.raises(SessionLost):
            dev.finish()


def test_calls_while_disconnected_block_then_fail_clearly_and_nothing_is_lost(pool):
    proxy = CutProxy(pool.endpoint)
    dev = connect(proxy.endpoint, ALICE, agent=False)
    prog = dev.build(COUNTER)     # the first build waits for the tenant's device process
    buf = dev.upload(np.zeros(4, dtype=np.uint32))
    dev.timeout = 1.0
    prog.launch("bump", 4, None, buf, u32(1))
    dev.finish()
    proxy.close()                                   # the pool is unreachable now
    wait_for(lambda: dev.state is not LinkState.CONNECTED, 5, "the driver to see its connection gone")
    start = time.monotonic()
    with pytest.raises(Disconnected, match="no connection to the pool within 1.0 s"):
        prog.launch("bump", 4, None, buf, u32(1))
    assert time.monotonic() - start >= 0.9
    dev.resume(pool.endpoint)                       # the way back
    prog.launch("bump", 4, None, buf, u32(1))
    assert set(np.frombuffer(dev.read(buf), dtype=np.uint32)) == {2}
    dev.close()


def test_a_full_window_blocks_the_caller(hosts, domain):
    dev = connect(hosts.a.endpoint, ALICE, agent=False, window_commands=8)
    prog = dev.build(COUNTER)     # the first build waits for the tenant's device process
    buf = dev.upload(np.zeros(4, dtype=np.uint32))
    dev.timeout = 0.5
    bind(hosts.a, dev, domain)
    hosts.a.call("register_intent", domain_uuid=domain, policy="start", dest_host="hostB")
    record = hosts.b.call("open_migration", domain_uuid=domain)     # pauses execution
    with pytest.raises(WindowFull, match="command window stayed full"):
        for _ in range(20):
            prog.launch("bump", 4, None, buf, u32(1))
    hosts.a.call("abort", domain_uuid=domain, migration_id=record["migration_id"])
    dev.finish()
    assert set(np.frombuffer(dev.read(buf), dtype=np.uint32)) == {8}   # exactly the accepted ones
    dev.close()
