"""bench/launch_ab, both workloads, one tree against itself with tiny
counts: each round runs each tree in its own processes (a real pool, real
PoCL) and the JSON holds what the table says."""

from __future__ import annotations

import json
import os

import pytest

from bench import common, launch_ab

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, ".venv", "bin", "python")),
                    reason="SKIPPED LOUDLY: the tree has no .venv (./dev.sh setup makes it)")
@pytest.mark.parametrize("workload", ["finish", "launches"])
def test_both_workloads_alternate_the_trees_and_report_each_round(workload, tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", str(tmp_path))
    launch_ab.main(["--before", ROOT, "--after", ROOT, "--workload", workload,
                    "--rounds", "2", "--launches", "40", "--repeat", "2"])
    name = "finish-ab" if workload == "finish" else "launch-ab"
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert len(data["rounds"]) == 2
    for one in data["rounds"]:
        for tree in ("before", "after"):
            assert one[tree]["seconds"] > 0 and one[tree]["cpu_us"] > 0
        assert (one["raw"] if workload == "finish" else one["local"]) > 0
    assert data["rows"], data
