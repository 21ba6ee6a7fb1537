"""bench/blackout's long-migration table (``--dirty``): what it makes of
the migrations it measured (the migrations themselves need the lab: the
bench runs them, CI does not)."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from bench import blackout, common


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", str(tmp_path))
    return tmp_path


ARGS = argparse.Namespace(dirty=1024, dirty_memory=1536, dirty_rate=64.0, migrations=3)


def _migration(policy: str, blackout_ms: float, downtime_ms: float, migration_ms: float | None) -> dict:
    return {"policy": policy, "blackout_ms": blackout_ms, "downtime_ms": downtime_ms,
            "migration_ms": migration_ms, "job": {"memory_iteration": 4}, "load": 1.0,
            "timeline": {}, "steps_ms": {"resumed_seen": 100.0, "driver_connected": 200.0}}


def test_start_is_set_against_none_with_downtime_and_migration_time(results, capsys):
    runs = {"none": [_migration("none", b, 150.0, 5000.0) for b in (800.0, 700.0, 900.0)],
            "start": [_migration("start", b, 140.0, 4000.0) for b in (4000.0, 4400.0, 5000.0)]}
    blackout.report_long(runs, ARGS, "TCG")
    saved = json.loads((results / "blackout-long.json").read_text())
    rows = {r["label"]: r for r in saved["rows"]}
    assert (saved["baseline"], saved["subject"]) == ("policy none", "policy start")
    assert rows["accelerator blackout"]["baseline"] == 800.0 and rows["accelerator blackout"]["subject"] == 4400.0
    assert rows["accelerator blackout"]["ratio"] == pytest.approx(5.5)
    assert rows["migration (libvirt's job)"]["baseline"] == 5000.0
    assert saved["shortest_migration_ms"] == 4000.0 and saved["migrations"] == runs
    out = capsys.readouterr().out
    assert "NOTE" not in out                             # every one lasted long enough
    assert "policy none: blackout - VM downtime = 650 ms" in out
    if os.path.exists(results / "blackout-long.png"):    # (matplotlib present)
        assert (results / "blackout-long.png").stat().st_size > 0


def test_a_migration_too_short_to_tell_the_policies_apart_is_said_so(results, capsys):
    runs = {"none": [_migration("none", 500.0, 150.0, 1200.0)],
            "start": [_migration("start", 1500.0, 150.0, None)]}
    blackout.report_long(runs, ARGS, "TCG")
    rows = {r["label"] for r in json.loads((results / "blackout-long.json").read_text())["rows"]}
    assert "migration (libvirt's job)" not in rows       # not every migration has its job's time
    assert "NOTE: a migration took 1.2 s, under the 3 s a long migration should last" in capsys.readouterr().out


def test_other_policies_each_against_their_downtime(results):
    runs = {"none": [_migration("none", 600.0, 200.0, 4000.0)],
            "switchover": [_migration("switchover", 900.0, 300.0, 4000.0)]}
    blackout.report_long(runs, ARGS, "TCG")
    saved = json.loads((results / "blackout-long.json").read_text())
    assert [(r["label"], r["ratio"]) for r in saved["rows"]] == [("pause policy none", 3.0),
                                                                  ("pause policy switchover", 3.0)]
