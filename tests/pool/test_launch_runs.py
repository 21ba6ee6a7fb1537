"""A launch batch taken as one unit (``pool.session.LaunchRun``).

The pool accepts a batch whose launches are all new as one run: their
identities and replies are recorded together, the session's worker hands
the run to the device context in one call, and its plain successes are
answered as one ``done`` range.  These tests pin that this is the same as
the launches taken one by one: the sequence log cannot tell the two apart
(a property test against the per-launch bookkeeping), and on a real pool
each bad launch of a long run still fails alone, under its own sequence
number, wherever it falls among the device process's calls.
"""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from accelmig.lab.poolthread import PoolThread
from accelmig.pool.devices.worker import LAUNCH_BATCH
from accelmig.pool.sequencing import SequenceLog, StoredReply, ok_reply
from accelmig.wire import batch
from accelmig.wire.errors import ErrorCode
from tests.pool.test_launch_batches import BUF, ELEMENTS, PROG, RawSession, bump_record
from tests.support.tenants import TENANTS

# -- the sequence log: a run recorded at once is the same as each launch on its own --------
STEPS = st.lists(st.one_of(
    st.tuples(st.just("run"), st.integers(1, 40)),
    st.tuples(st.just("single"), st.sampled_from(["ok", "error", "payload"])),
    st.tuples(st.just("ack"), st.floats(0, 1)),
), max_size=40)


def _observed(log: SequenceLog) -> dict:
    """Everything the pool reads from a log."""
    seqs = range(log.acked + 1, log.next_seq + 1)
    snapshot = log.snapshot()
    # (what the log's memory is counted for is no behaviour: a run's plain
    # successes hold no reply object, and are counted less)
    del snapshot["reply_bytes"]
    return {
        "snapshot": snapshot,
        "stored": {s: (r.header, bytes(r.payload)) if (r := log.stored_reply(s)) else None for s in seqs},
        "resume": {last: [(r.seq, r.header, bytes(r.payload)) for r in log.check_resume(last)]
                   for last in range(log.acked, log.highest_reply + 1)},
    }


@settings(max_examples=150, deadline=None)
@given(STEPS)
def test_a_run_recorded_at_once_is_indistinguishable_from_its_launches_one_by_one(steps):
    runs, singles = SequenceLog("runs"), SequenceLog("singles")
    for kind, arg in steps:
        seq = runs.next_seq
        if kind == "run":
            digests = [("launch", seq + i) for i in range(arg)]
            runs.accept_run(seq, digests)
            runs.record_ok_run(seq, seq + arg - 1)
            for i, digest in enumerate(digests):
                singles.accept(seq + i, digest)
                singles.record_reply(ok_reply(seq + i))
        elif kind == "single":
            header = {"op": "reply", "seq": seq, "ok": arg != "error"}
            if arg == "error":
                header["error"] = {"code": "DEVICE_ERROR", "message": "no"}
            payload = b"read back" if arg == "payload" else b""
            for log in (runs, singles):
                log.accept(seq, ("read", seq))
                log.record_reply(StoredReply(seq, dict(header), payload))
        else:
            upto = runs.acked + int(arg * (runs.highest_reply - runs.acked))
            # only the replies with a payload matter to the caller (their buffers are reused)
            dropped = [[(r.seq, bytes(r.payload)) for r in log.acknowledge(upto) if r.payload]
                       for log in (runs, singles)]
            assert dropped[0] == dropped[1]
        assert _observed(runs) == _observed(singles)
        assert runs.digests == singles.digests


def test_a_run_out_of_order_is_refused():
    log = SequenceLog()
    log.accept_run(1, ["a", "b"])
    for bad in (lambda: log.accept_run(4, ["c"]), lambda: log.record_ok_run(2, 2),
                lambda: log.record_ok_run(1, 0)):
        try:
            bad()
        except Exception as exc:
            assert exc.code is ErrorCode.PROTOCOL_ERROR
        else:
            raise AssertionError("accepted out of order")
    assert (log.next_seq, log.highest_reply) == (3, 0)


# -- a real pool: bad launches of a long run fail alone, wherever they fall ----------------
def test_each_bad_launch_of_a_run_longer_than_a_device_call_fails_alone():
    """One batch of 700 launches (the device process takes them in calls of
    LAUNCH_BATCH): bad ones in the first, second and last call each get
    their own error under their own seq; every other launch ran once."""
    count = 700
    assert count > 2 * LAUNCH_BATCH
    bad_at = {3, LAUNCH_BATCH + 17, count - 1}
    short = batch.encode_launch(PROG, b"bump", [ELEMENTS], None, [batch.buffer_arg(BUF)])   # an argument short
    records = [short if i in bad_at else bump_record() for i in range(count)]
    with PoolThread(TENANTS) as pool:
        raw = RawSession(pool.endpoint)
        try:
            first = raw.seq + 1
            last = raw.launches(records)
            raw.wait(raw.command("finish"))
            failed = {seq for seq in range(first, last + 1) if not raw.answered[seq]["ok"]}
            assert failed == {first + i for i in bad_at}
            for seq in failed:
                error = raw.answered[seq]["error"]
                assert error["code"] == ErrorCode.DEVICE_ERROR.value and "takes 2 arguments" in error["message"]
            assert raw.counters() == [count - len(bad_at)] * ELEMENTS
            counters = pool.session(raw.sid)["counters"]
            assert counters["launches"] == count - len(bad_at)
            assert counters["batched_launches"] == count
        finally:
            raw.close()


def test_a_long_run_of_one_shape_costs_a_device_call_per_launch_batch():
    """A run's repeats share one shape in each device call (the process
    prepares it once): 1,000 launches of one record are ceil(1000 / 256)
    launch calls, and each launch ran."""
    with PoolThread(TENANTS) as pool:
        raw = RawSession(pool.endpoint)
        try:
            before = pool.call(lambda: _calls_started(pool))
            raw.launches([bump_record(by=2)] * 1000)
            raw.wait(raw.command("finish"))
            calls = pool.call(lambda: _calls_started(pool)) - before
            assert calls == -(-1000 // LAUNCH_BATCH) + 1           # and the finish
            assert raw.counters() == [2000] * ELEMENTS
        finally:
            raw.close()


def _calls_started(pool) -> int:
    session = next(iter(pool.pool.sessions.values()))
    return session.context.process.calls_started

