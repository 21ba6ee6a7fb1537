"""Launch batches at a real pool (data-plane protocol 2, ``wire.batch``).

Real pools on loopback, real PoCL, real device processes; a counter kernel
(``x[i] += by``) says how many times each launch ran.  A batch's launches
are the commands they would be alone: a launch re-sent alone is a
duplicate (answered, not run again), another one under its sequence
number a divergence; a batch cut in the middle of its frame and re-sent as
singles by the resuming driver runs every launch once; a hostile batch is
refused with its code and runs nothing; drivers and pools of protocol 1
and 2 work together in both directions.
"""

from __future__ import annotations

import os
import socket
import struct

import numpy as np
import pytest

from accelmig.agent.driver import connect
from accelmig.agent.driver import link as driver_link
from accelmig.lab.cutproxy import CutProxy
from accelmig.lab.poolthread import PoolThread
from accelmig.wire import batch
from accelmig.wire.errors import AccelmigError, ErrorCode
from accelmig.wire.frames import PREFIX_SIZE, FrameReader, encode_frame, encode_prefix_and_header
from tests.support.kernels import COUNTER
from tests.support.wait import wait_for
from tests.support.tenants import ALICE, TENANTS

ELEMENTS = 16
PROG, BUF = 1, 2


def bump_record(by: int = 1, prog: int = PROG, buf: int = BUF) -> bytes:
    return batch.encode_launch(prog, b"bump", [ELEMENTS], None,
                               [batch.buffer_arg(buf), batch.scalar_arg("u32", struct.pack("<I", by))])


class RawSession:
    """A hand-driven connection that opened a session: a counter program
    (handle 1) built, a zeroed buffer (handle 2) of ELEMENTS counters;
    commands 1-3 used.  It says what a driver might not."""

    def __init__(self, endpoint: str, versions=(1, 2)):
        host, port = endpoint.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.reader = FrameReader()
        self.pending: list = []
        self.answered: dict[int, dict] = {}
        self.seq = 0
        self.sock.sendall(encode_frame({"op": "hello", "versions": list(versions)}) + encode_frame(
            {"op": "open", "token": ALICE, "secret": os.urandom(32).hex(), "client": {"name": "raw", "pid": 1}}))
        welcome, opened = self.next_frame(), self.next_frame()
        assert welcome.header["op"] == "welcome" and opened.header["op"] == "opened", opened.header
        self.version = welcome.header["version"]
        self.sid, self.epoch = opened.header["sid"], opened.header["epoch"]
        self.wait(self.command("build", COUNTER.encode(), prog=PROG, options=""))
        self.command("alloc", buf=BUF, size=4 * ELEMENTS)
        self.wait(self.command("write", bytes(4 * ELEMENTS), buf=BUF, offset=0))

    def next_frame(self):
        while not self.pending:
            n = self.sock.recv_into(self.reader.get_buffer())
            assert n, "the pool closed the connection"
            self.pending.extend(self.reader.feed(n))
        return self.pending.pop(0)

    def send(self, header: dict, payload=b"") -> None:
        self.sock.sendall(encode_prefix_and_header(header, len(payload)) + bytes(payload))

    def command(self, op: str, payload=b"", seq: int | None = None, **fields) -> int:
        if seq is None:
            self.seq += 1
            seq = self.seq
        self.send({"op": op, "seq": seq, "epoch": self.epoch, "ack": 0, **fields}, payload)
        return seq

    def launches(self, records: list[bytes], first: int | None = None, **header) -> int:
        first = self.seq + 1 if first is None else first
        self.seq = max(self.seq, first + len(records) - 1)
        self.send({**batch.batch_header(self.epoch, 0, first, first + len(records) - 1), **header},
                  b"".join(records))
        return first + len(records) - 1

    def wait(self, seq: int) -> dict:
        """The reply to ``seq`` (a ``done`` range stands for plain successes)."""
        while seq not in self.answered:
            frame = self.next_frame()
            header = frame.header
            if header["op"] == "done":
                for one in range(header["from"], header["to"] + 1):
                    self.answered[one] = {"ok": True}
            elif header["op"] == "reply":
                self.answered[header["seq"]] = dict(header, payload=bytes(frame.payload))
            else:
                raise AssertionError(f"unexpected {header}")
        reply = self.answered[seq]
        assert reply["ok"], reply
        return reply

    def counters(self) -> list[int]:
        reply = self.wait(self.command("read", buf=BUF, offset=0, size=4 * ELEMENTS))
        return list(np.frombuffer(reply["payload"], dtype=np.uint32))

    def refusal(self) -> dict:
        """The error the pool closes the connection with."""
        while True:
            try:
                frame = self.next_frame()
            except (AssertionError, ConnectionResetError):
                raise AssertionError("the pool closed without an error frame") from None
            if frame.header["op"] == "error":
                with pytest.raises(AssertionError, match="closed"):
                    self.next_frame()            # and then it closes
                return frame.header["error"]

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def pool():
    with PoolThread(TENANTS) as harness:
        yield harness


def test_a_launch_resent_alone_is_the_batched_one_and_another_under_its_seq_diverges(pool):
    raw = RawSession(pool.endpoint)
    try:
        assert raw.version == 2
        last = raw.launches([bump_record()] * 5)                     # seq 4..8
        assert last == 8
        raw.command("launch", seq=6, prog=PROG, kernel="bump", gsize=[ELEMENTS],
                    args=[{"buf": BUF}, {"t": "u32", "x": "01000000"}])   # seq 6 again, alone, as JSON
        raw.wait(raw.command("finish"))
        assert raw.counters() == [5] * ELEMENTS                     # five launches, five runs
        counters = pool.session(raw.sid)["counters"]
        assert (counters["launches"], counters["batched_launches"], counters["duplicates"]) == (5, 5, 1)
        # an older copy of the driver: another launch under seq 7
        raw.command("launch", seq=7, prog=PROG, kernel="bump", gsize=[ELEMENTS],
                    args=[{"buf": BUF}, {"t": "u32", "x": "02000000"}])
        error = raw.refusal()
        assert error["code"] == ErrorCode.SESSION_DIVERGED.value and error["details"]["seq"] == 7
    finally:
        raw.close()


def test_a_batch_resent_over_launches_it_carried_runs_none_twice(pool):
    raw = RawSession(pool.endpoint)
    try:
        raw.launches([bump_record()] * 4)                            # seq 4..7
        raw.launches([bump_record()] * 6, first=6)                   # 6, 7 again; 8..11 new
        raw.wait(raw.command("finish", seq=12))
        raw.seq = 12
        assert raw.counters() == [8] * ELEMENTS
        assert pool.session(raw.sid)["counters"]["duplicates"] == 2
    finally:
        raw.close()


def _over_the_limit(raw):
    raw.launches([bump_record()] * (batch.MAX_LAUNCHES + 1))


@pytest.mark.parametrize("hostile, code", [
    (lambda raw: raw.send(batch.batch_header(raw.epoch, 0, 4, 6), (bump_record() * 3)[:-7]), ErrorCode.BAD_REQUEST),
    (lambda raw: raw.send(batch.batch_header(raw.epoch, 0, 4, 6), bump_record() * 2), ErrorCode.BAD_REQUEST),
    (lambda raw: raw.send(batch.batch_header(raw.epoch, 0, 4, 5), bump_record() * 3), ErrorCode.BAD_REQUEST),
    (_over_the_limit, ErrorCode.FRAME_TOO_LARGE),
    (lambda raw: raw.launches([bump_record()] * 3, first=5), ErrorCode.PROTOCOL_ERROR),     # a gap
    (lambda raw: raw.launches([bump_record()] * 3, epoch=raw.epoch + 1), ErrorCode.STALE_EPOCH),
    (lambda raw: raw.launches([bump_record()] * 3, epoch=raw.epoch - 1), ErrorCode.STALE_EPOCH),
    (lambda raw: raw.launches([bump_record()[:-5] + b"\x0c" + bump_record()[-4:]]), ErrorCode.BAD_REQUEST),
], ids=["truncated", "fewer-records-than-seqs", "more-records-than-seqs", "over-the-limit", "seq-gap",
        "later-epoch", "earlier-epoch", "unknown-argument-tag"])
def test_a_hostile_batch_is_refused_and_runs_nothing(pool, hostile, code):
    raw = RawSession(pool.endpoint)
    try:
        hostile(raw)
        assert raw.refusal()["code"] == code.value
    finally:
        raw.close()
    session = pool.session(raw.sid)
    assert session["sequence"]["next_seq"] == 4            # nothing of the batch was accepted
    assert session["counters"]["launches"] == session["counters"]["batched_launches"] == 0


def test_a_connection_of_protocol_1_may_not_send_a_batch(pool):
    raw = RawSession(pool.endpoint, versions=(1,))
    try:
        assert raw.version == 1
        raw.launches([bump_record()] * 2)
        error = raw.refusal()
        assert error["code"] == ErrorCode.PROTOCOL_ERROR.value and "protocol 1" in error["message"]
    finally:
        raw.close()
    assert pool.session(raw.sid)["sequence"]["next_seq"] == 4


# -- real drivers -------------------------------------------------------------------------
def run_launches(dev, count: int) -> list[int]:
    """``count`` launches of ``bump(x, 1)`` on a fresh buffer, then a finish; the counters."""
    prog = dev.build(COUNTER)
    buf = dev.upload(np.zeros(ELEMENTS, dtype=np.uint32))
    for _ in range(count):
        prog.launch("bump", ELEMENTS, None, buf, np.uint32(1))
    dev.finish()
    return list(np.frombuffer(dev.read(buf), dtype=np.uint32))


@pytest.mark.parametrize("driver_versions, pool_versions, batched", [
    (None, None, True),          # both of today's protocol: batches
    (None, (1,), False),         # this driver, a pool from before batches
    ((1,), None, False),         # a driver from before batches, this pool
], ids=["2-2", "driver2-pool1", "driver1-pool2"])
def test_drivers_and_pools_of_either_protocol_work_together(driver_versions, pool_versions, batched):
    with PoolThread(TENANTS, data_versions=pool_versions) as pool:
        with connect(pool.endpoint, ALICE, agent=False, timeout=60, protocol_versions=driver_versions) as dev:
            assert run_launches(dev, 600) == [600] * ELEMENTS
            counters = pool.session(dev.sid)["counters"]
            assert counters["launches"] == 600
            assert counters["batched_launches"] == (600 if batched else 0)
            # (a driver and a pool of today agree on 4, which batches as 2 does)
            assert dev._session.link.version == (4 if driver_versions is None and pool_versions is None
                                                 else 2 if batched else 1)


def test_a_batch_cut_mid_frame_is_resent_as_singles_and_each_launch_runs_once(monkeypatch):
    # The flusher waits long enough for nothing to go before the finish: the
    # batches, the write between them and the finish leave in one send, and
    # the cut below lands inside the second batch's frame.
    monkeypatch.setattr(driver_link, "CORK_DELAY", 2.0)
    with PoolThread(TENANTS) as pool:
        proxy = CutProxy(pool.endpoint)
        try:
            with connect(proxy.endpoint, ALICE, agent=False, timeout=60) as dev:
                prog = dev.build(COUNTER)
                buf = dev.upload(np.zeros(ELEMENTS, dtype=np.uint32))
                other = dev.upload(bytes(64))
                dev.finish()
                session = dev._session
                first, ack = session.window.next_seq, session.window.last_seen
                record = bump_record(prog=prog.handle, buf=buf.handle)
                frame_a = encode_prefix_and_header(batch.batch_header(dev.epoch, ack, first, first + 99),
                                                   100 * len(record))
                write = encode_prefix_and_header({"op": "write", "epoch": dev.epoch, "ack": ack, "buf": other.handle,
                                                  "offset": 0, "seq": first + 100}, 8)
                # a, then the write, then 40 launch records and a half of the second batch
                cut = len(frame_a) + 100 * len(record) + len(write) + 8 + PREFIX_SIZE + 80 + 40 * len(record) + 13
                proxy.cut_after(cut)
                for _ in range(100):
                    prog.launch("bump", ELEMENTS, None, buf, np.uint32(1))
                dev.write(other, b"8 bytes!")
                for _ in range(100):
                    prog.launch("bump", ELEMENTS, None, buf, np.uint32(1))
                dev.finish()                  # the cut, the resume, the re-send: then its reply
                assert proxy.tripped.is_set() and dev.stats["resumes"] == 1
                assert np.frombuffer(dev.read(buf), dtype=np.uint32).tolist() == [200] * ELEMENTS
                counters = pool.session(dev.sid)["counters"]
                assert counters["launches"] == 200                  # each once
                # the premise: the first batch arrived whole, nothing of the
                # second (the cut fell inside its frame), which came alone
                assert counters["batched_launches"] == 100
                assert dev.stats["resent_commands"] == 101          # its 100 launches and the finish
        finally:
            proxy.close()



def test_a_batch_of_repeated_shapes_runs_each_launch_and_fails_each_bad_one_alone():
    """The device process prepares each distinct launch (program, kernel,
    sizes, arguments) once a batch: launches of the same shapes interleaved,
    a bad shape among them, all in one batch, fail and run one by one."""
    with PoolThread(TENANTS) as pool:
        with connect(pool.endpoint, ALICE, agent=False, timeout=60) as dev:
            prog = dev.build(COUNTER)
            a = dev.upload(np.zeros(ELEMENTS, dtype=np.uint32))
            b = dev.upload(np.zeros(ELEMENTS, dtype=np.uint32))
            dev.finish()
            for i in range(60):
                prog.launch("bump", ELEMENTS, None, a, np.uint32(1))
                prog.launch("bump", ELEMENTS, None, b, np.uint32(2))
                if i % 3 == 0:
                    prog.launch("bump", ELEMENTS, None, a)                    # one argument short
                    prog.launch("no_such_kernel", ELEMENTS, None, b, np.uint32(5))
            with pytest.raises(AccelmigError) as failed:
                dev.finish()
            assert failed.value.code is ErrorCode.DEVICE_ERROR and "takes 2 arguments" in str(failed.value)
            assert failed.value.details["more_errors"] == 2 * 20 - 1    # each bad launch its own error
            assert np.frombuffer(dev.read(a), np.uint32).tolist() == [60] * ELEMENTS
            assert np.frombuffer(dev.read(b), np.uint32).tolist() == [120] * ELEMENTS
            counters = pool.session(dev.sid)["counters"]
            assert counters["launches"] == 120 and counters["batched_launches"] == 160


def test_a_full_batch_goes_at_once_and_the_tail_of_a_burst_waits_for_the_flusher(monkeypatch):
    """The driver sends a batch the moment it holds DRIVER_LAUNCHES launches
    (the pool's run as long as it may be), without waiting for the flusher;
    the rest of a burst waits for the flusher (or a waiting call)."""
    monkeypatch.setattr(driver_link, "CORK_DELAY", 3600.0)     # the flusher never comes first
    with PoolThread(TENANTS) as pool:
        with connect(pool.endpoint, ALICE, agent=False, timeout=60) as dev:
            prog = dev.build(COUNTER)
            buf = dev.upload(np.zeros(ELEMENTS, dtype=np.uint32))
            dev.finish()
            for _ in range(batch.DRIVER_LAUNCHES + 44):
                prog.launch("bump", ELEMENTS, None, buf, np.uint32(1))
            wait_for(lambda: pool.session(dev.sid)["counters"]["launches"] == batch.DRIVER_LAUNCHES,
                     what="the full batch to run")
            session = pool.session(dev.sid)
            assert session["sequence"]["next_seq"] - 1 == dev._session.window.next_seq - 1 - 44   # the tail waits
            dev.finish()                                                   # which sends the tail
            assert np.frombuffer(dev.read(buf), dtype=np.uint32).tolist() == \
                [batch.DRIVER_LAUNCHES + 44] * ELEMENTS
            assert pool.session(dev.sid)["counters"]["batched_launches"] == batch.DRIVER_LAUNCHES + 44
