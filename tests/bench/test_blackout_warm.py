"""bench/blackout's warm baseline (``--warm``): what it makes of the rehomes
of a guest that stayed and of the migrations of the same run (both need
the lab: the bench runs them, CI does not).  The timelines here have the
shape hostd's ``rehome_here`` answers and a migration record carries."""

from __future__ import annotations

import json
import os

import pytest

from bench import blackout, common


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", str(tmp_path))
    return tmp_path


def _timeline(**gaps_ms) -> dict:
    """A timeline from ``delivering`` at t=100 s, each step ``gaps_ms``
    after the one before (in the order given)."""
    t, out = 100.0, {"delivering": {"t": 100.0, "err": 0.0, "side": "dest"}}
    for step, gap in gaps_ms.items():
        t += gap / 1000
        out[step] = {"t": t, "err": 0.002, "side": "guest" if step != "answered" else "dest"}
    return out


def _warm(agent, nic, driver, answered) -> dict:
    timeline = _timeline(agent_received=agent, nic_readdressed=nic, driver_connected=driver, answered=answered)
    return {"where": "hostB", "address": "spare", "timeline": timeline,
            "steps_ms": blackout.path_steps(timeline, blackout.GUEST_PATH), "load": 1.0}


def _migration(agent, nic, driver, answered, *, blackout_ms, downtime_ms) -> dict:
    timeline = _timeline(agent_received=agent, nic_readdressed=nic, driver_connected=driver, answered=answered)
    # the steps before the guest's, as a record has them
    timeline["switchover"] = {"t": 99.5, "err": 0.0, "side": "pool"}
    return {"policy": "none", "timeline": timeline, "blackout_ms": blackout_ms, "downtime_ms": downtime_ms}


def test_each_guest_step_warm_against_after_a_migration_and_the_cold_guests_share(results, capsys):
    warm = [_warm(2, 30, 60, 25), _warm(3, 40, 70, 30), _warm(2, 35, 65, 20)]
    cold = [_migration(300, 140, 260, 70, blackout_ms=850, downtime_ms=150),
            _migration(330, 120, 270, 80, blackout_ms=900, downtime_ms=160),
            _migration(350, 150, 280, 60, blackout_ms=800, downtime_ms=140)]
    runs = {"none": cold, "start": [_migration(1, 1, 1, 1, blackout_ms=5000, downtime_ms=150)]}
    blackout.report_warm(warm, runs, "TCG")
    saved = json.loads((results / "blackout-warm.json").read_text())
    rows = {r["label"]: r for r in saved["rows"]}
    assert (saved["baseline"], saved["subject"]) == ("warm guest", "after migration")
    # medians per step, from the step before; the 'start' migration is not in them
    assert (rows["-> agent_received"]["baseline"], rows["-> agent_received"]["subject"]) == (2, 330)
    assert (rows["-> nic_readdressed"]["baseline"], rows["-> nic_readdressed"]["subject"]) == (35, 140)
    assert (rows["-> driver_connected"]["baseline"], rows["-> driver_connected"]["subject"]) == (65, 270)
    assert rows["-> answered"]["subject"] == 70 and rows["-> answered"]["ratio"] == pytest.approx(70 / 25)
    # the part inside the blackout: delivering -> driver_connected, the median of each one's sum
    inside = rows["delivering -> driver_connected"]
    assert (inside["baseline"], inside["subject"]) == pytest.approx((102, 720))
    assert saved["cold_label"] == "none" and saved["excess_over_downtime_ms"] == 700.0
    assert saved["cold_guest_ms"] == pytest.approx(618.0)
    assert saved["warm"] == warm and len(saved["cold_steps_ms"]) == 3
    out = capsys.readouterr().out
    assert "blackout - VM downtime = 700 ms (median); of it the cold guest (delivering -> " \
           "driver_connected, after a migration minus warm) 618 ms; the same steps warm 102 ms" in out
    if os.path.exists(results / "blackout-warm.png"):     # (matplotlib present)
        assert (results / "blackout-warm.png").stat().st_size > 0


def test_without_policy_none_every_migration_is_the_cold_side_and_no_share_is_claimed(results, capsys):
    warm = [_warm(2, 30, 60, 25)]
    runs = {"start": [_migration(300, 140, 260, 70, blackout_ms=4000, downtime_ms=150)],
            "switchover": [_migration(320, 150, 250, 70, blackout_ms=900, downtime_ms=150)]}
    blackout.report_warm(warm, runs, "TCG")
    saved = json.loads((results / "blackout-warm.json").read_text())
    assert saved["cold_label"] == "all"
    assert {r["label"]: r["subject"] for r in saved["rows"]}["-> agent_received"] == 310
    # the blackout of 'start' is no measure of the guest: no share of it is said
    assert "excess_over_downtime_ms" not in saved and "of it the cold guest" not in capsys.readouterr().out


def test_a_step_the_guest_did_not_stamp_is_left_out_not_counted_as_zero(results):
    # a guest without a fabric NIC to re-address (no nic_readdressed), warm and cold alike
    timeline = _timeline(agent_received=2, driver_connected=60, answered=20)
    warm = [{"where": "hostA", "address": "lease", "timeline": timeline,
             "steps_ms": blackout.path_steps(timeline, blackout.GUEST_PATH), "load": 1.0}]
    cold_timeline = _timeline(agent_received=300, driver_connected=400, answered=70)
    runs = {"none": [{"policy": "none", "timeline": cold_timeline, "blackout_ms": 900, "downtime_ms": 150}]}
    blackout.report_warm(warm, runs, "TCG")
    rows = {r["label"]: r for r in json.loads((results / "blackout-warm.json").read_text())["rows"]}
    assert "-> nic_readdressed" not in rows
    assert (rows["-> driver_connected"]["baseline"], rows["-> driver_connected"]["subject"]) == (60, 400)
