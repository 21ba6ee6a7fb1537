"""The migration timeline's model (``wire.records``): steps on one clock,
offsets estimated from round trips (NTP's estimate, uncertainty kept),
every remote stamp a bounded claim; the pool record's side of it
(``pool.ledger``) and hostd's assembly of a rehome's steps
(``plugin.hostd.migration.rehome_timeline``)."""

from __future__ import annotations

import math

import pytest

from accelmig.pool.ledger import LedgerRecord
from accelmig.wire.errors import ProtocolError
from accelmig.wire.records import (STEP_NAMES, ClockOffset, PausePolicy, RecordView, Side, Stamp, Timeline)


def test_an_offset_from_a_symmetric_round_trip_is_exact_within_half_the_network_time():
    # the remote is 100 s ahead; 10 ms each way; it works 30 ms in between
    sent = 1000.0
    offset = ClockOffset.from_round_trip(sent, 1100.010, 1100.040, 1000.050)
    assert offset.offset == pytest.approx(100.0)
    assert offset.err == pytest.approx(0.010)          # (50 ms trip - 30 ms busy) / 2
    assert offset.to_local(1100.020) == (pytest.approx(1000.020), pytest.approx(0.010))


def test_an_asymmetric_round_trip_stays_within_the_uncertainty_it_reports():
    # 2 ms out, 38 ms back: the estimate is off, but by no more than its err
    true_offset = -7.5
    sent = 50.0
    remote_received = sent + 0.002 + true_offset
    remote_answered = remote_received + 0.001
    received = sent + 0.002 + 0.001 + 0.038
    offset = ClockOffset.from_round_trip(sent, remote_received, remote_answered, received)
    assert abs(offset.offset - true_offset) <= offset.err + 1e-12
    assert offset.err == pytest.approx(0.020)


def test_remote_stamps_are_claims_clamped_into_their_round_trip():
    offset = ClockOffset.from_round_trip(10.0, 510.0, 510.0, 10.2)
    assert offset.to_local(10_000.0)[0] == 10.2          # never after we heard back
    assert offset.to_local(-1e9)[0] == 10.0              # never before we asked
    # a remote claiming to have worked longer than the round trip lasted
    busy = ClockOffset.from_round_trip(10.0, 500.0, 900.0, 10.2)
    assert busy.err == 0.0 and busy.sent <= busy.to_local(700.0)[0] <= busy.received


@pytest.mark.parametrize("received, answered", [(5.0, 4.0), (math.nan, 1.0), ("1", 2.0), (None, 1.0),
                                                 (True, 2.0), (math.inf, math.inf)])
def test_impossible_or_non_numeric_remote_times_are_protocol_errors(received, answered):
    with pytest.raises(ProtocolError):
        ClockOffset.from_round_trip(0.0, received, answered, 1.0)


def test_carrying_a_stamp_across_two_clocks_adds_both_uncertainties():
    guest = ClockOffset.from_round_trip(100.0, 5100.001, 5100.009, 100.010)   # guest 5000 s ahead of hostd
    pool = ClockOffset.from_round_trip(99.0, 98.002, 98.002, 99.004)         # pool 1 s behind hostd
    stamp = guest.onto(pool, 5100.005, Side.GUEST)
    assert stamp.t == pytest.approx(99.005)
    assert stamp.err == pytest.approx(guest.err + pool.err)
    assert stamp.side is Side.GUEST


def test_a_timeline_knows_only_its_steps_and_orders_them():
    timeline = Timeline({"completed": Stamp(10.3), "switchover": Stamp(10.0),
                         "agent_received": Stamp(10.35, 0.002, Side.GUEST), "opened": Stamp(9.0)})
    rows = timeline.rows()
    assert [r["step"] for r in rows] == ["opened", "switchover", "completed", "agent_received"]
    assert rows[1]["at_ms"] == 0.0 and rows[0]["at_ms"] == -1000.0           # counted from the switchover
    assert rows[2]["step_ms"] == pytest.approx(300.0) and rows[3]["err_ms"] == 2.0
    assert Timeline.from_wire(timeline.to_wire()) == timeline
    assert "agent_received" in timeline.table() and "guest" in timeline.table()
    with pytest.raises(ProtocolError, match="unknown step"):
        Timeline.from_wire({"made_up": {"t": 1.0}})
    for bad in ({"t": "soon"}, {"t": 1.0, "err": -1}, {"t": 1.0, "err": 1e9}, {"t": 1.0, "side": "moon"}, 3):
        with pytest.raises(ProtocolError):
            Timeline.from_wire({"opened": bad})


def test_a_record_view_carries_its_timeline():
    record = LedgerRecord("d", "m", "hostA", "hostB", PausePolicy.NONE, 30.0, now=100.0)
    record.switchover(100.5)
    record.complete(100.6, ["s1"])
    record.note_resumed("s1", 0.2, now=100.7)
    view = RecordView.from_wire(record.to_wire(now=101.0))
    assert [r["step"] for r in view.timeline.rows()] == ["opened", "switchover", "completed",
                                                          "resume_answered", "rehomed"]
    assert RecordView.from_wire(view.to_wire()).timeline == view.timeline


def test_a_host_adds_only_its_own_steps_and_its_guests_first_stamps_stay():
    record = LedgerRecord("d", "m", "hostA", "hostB", PausePolicy.NONE, 30.0, now=100.0)
    record.switchover(100.5)
    dest = {"resumed_seen": Stamp(100.55, 0.001, Side.DEST),
            "agent_received": Stamp(100.6, 0.003, Side.GUEST),
            "switchover": Stamp(1.0, 0.0, Side.DEST),              # the pool's own step: not the host's
            "suspended_seen": Stamp(100.4, 0.0, Side.SOURCE),      # the other host's step
            "identity": Stamp(100.58, 0.0, Side.GUEST)}            # a host step claimed as a guest's
    assert sorted(record.note_steps(Side.DEST, dest, now=101.0)) == ["agent_received", "resumed_seen"]
    assert record.timeline["switchover"].t == 100.5
    # later stamps of the same steps do not replace the first
    assert record.note_steps(Side.DEST, {"resumed_seen": Stamp(100.9, 0.0, Side.DEST)}, now=101.0) == []
    # the source relays no guest step; its own step it may add
    assert record.note_steps(Side.SOURCE, {"nic_readdressed": Stamp(100.6, 0.0, Side.GUEST),
                                           "suspended_seen": Stamp(100.45, 0.0, Side.SOURCE)},
                             now=101.0) == ["suspended_seen"]
    # a stamp far outside the record's life is dropped
    assert record.note_steps(Side.DEST, {"delivering": Stamp(1e9, 0.0, Side.DEST)}, now=101.0) == []
    assert set(record.to_wire(now=101.0)["timeline"]) <= set(STEP_NAMES)


def test_hostd_puts_a_rehomes_steps_on_the_pools_clock():
    from accelmig.plugin.hostd.migration import rehome_timeline
    # hostd's clock = the pool's + 2 s; the guest's = hostd's - 3600 s (it jumped at migration)
    pool_at = lambda h: h - 2.0
    guest_at = lambda h: h - 3600.0
    clock = {"asked": 1000.000, "answered": 1000.004, "pool_now": pool_at(1000.002),
             "identity": 1000.005, "delivering": 1000.005, "sent": 1000.006, "answer": 1000.300}
    outcome = {"ok": True, "clock": {"received": guest_at(1000.050), "answered": guest_at(1000.298)},
               "times": {"agent_received": guest_at(1000.050), "nic_readdressed": guest_at(1000.060),
                         "driver_connected": guest_at(1000.150)}}
    steps = rehome_timeline(999.990, clock, outcome)
    assert list(steps) == ["resumed_seen", "identity", "delivering", "answered",
                           "agent_received", "nic_readdressed", "driver_connected"]
    expected = {"resumed_seen": 999.990, "identity": 1000.005, "delivering": 1000.005, "answered": 1000.300,
                "agent_received": 1000.050, "nic_readdressed": 1000.060, "driver_connected": 1000.150}
    for step, hostd_t in expected.items():
        stamp = steps[step]
        assert abs(stamp.t - pool_at(hostd_t)) <= stamp.err + 1e-9, step
        assert stamp.side is (Side.GUEST if step in ("agent_received", "nic_readdressed", "driver_connected")
                              else Side.DEST)
    assert steps["agent_received"].err > steps["identity"].err          # two round trips' worth
    # a guest that answers garbage loses its own steps, never hostd's
    hostile = {"clock": {"received": "yesterday", "answered": 1}, "times": {"agent_received": 1e300}}
    assert set(rehome_timeline(999.990, clock, hostile)) == {"resumed_seen", "identity", "delivering", "answered"}
    wild = dict(outcome, times={"agent_received": 1e300, "nic_readdressed": [1], "driver_connected": None})
    steps = rehome_timeline(None, clock, wild)
    assert steps["agent_received"].t == pytest.approx(pool_at(1000.300))       # clamped into the round trip
    assert "nic_readdressed" not in steps and "driver_connected" not in steps and "resumed_seen" not in steps
    # a pool that does not say its clock: nothing to put the steps on
    assert rehome_timeline(999.990, dict(clock, pool_now=None), outcome) == {}
