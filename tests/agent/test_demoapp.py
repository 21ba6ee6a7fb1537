"""The demo application's output contract (agent/demoapp.py), against a real
pool (PoCL): the lab's tests read it from a guest's console, so what they
rely on is pinned here — the ``opened`` line first (where the session
landed), ``--digest`` lines carrying the iterate's SHA-256 and the sid, a
device selector passed on, and a failure line that says why (and which
session, when one was open)."""

from __future__ import annotations

import contextlib
import io
import json

from accelmig.agent import demoapp
from tests.support.tenants import ALICE


def run_main(*argv) -> tuple[int, list[dict]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        status = demoapp.main(list(argv))
    lines = [json.loads(line.split(" ", 1)[1]) for line in out.getvalue().splitlines()]
    return status, lines


def test_opened_first_then_digests_with_the_sid_then_the_result(pool):
    common = ("--endpoint", pool.endpoint, "--token", ALICE, "--insecure", "--steps", "40", "--size", "16",
              "--report", "10", "--digest", "--prefix", "APP ")
    status, lines = run_main(*common)
    assert status == 0, lines
    opened, steps, done = lines[0], lines[1:-1], lines[-1]
    assert opened["opened"] is True and opened["endpoint"] == pool.endpoint and opened["device"]
    assert opened["sid"].startswith("s-") and opened["instance"]
    assert [s["step"] for s in steps] == [10, 20, 30, 40]
    assert {s["sid"] for s in steps} == {opened["sid"]}
    assert len({s["sha256"] for s in steps}) == 4          # the iterate moves between reports
    assert done["done"] is True and done["sha256"] == steps[-1]["sha256"] and done["sid"] == opened["sid"]
    # asked for that device by its id: placed there, the same iterates step for step
    status, again = run_main(*common, "--device", opened["device"])
    assert status == 0 and again[0]["device"] == opened["device"] and again[0]["sid"] != opened["sid"]
    assert [s["sha256"] for s in again[1:-1]] == [s["sha256"] for s in steps]


def test_without_digest_the_progress_lines_are_as_before(pool):
    status, lines = run_main("--endpoint", pool.endpoint, "--token", ALICE, "--insecure", "--steps", "20",
                             "--size", "16", "--report", "10", "--prefix", "APP ")
    assert status == 0
    assert [set(line) for line in lines[1:-1]] == [{"step", "residual", "t"}] * 2


def test_a_device_no_pool_has_is_a_clear_failure_line_without_a_sid(pool):
    status, lines = run_main("--endpoint", pool.endpoint, "--token", ALICE, "--insecure", "--steps", "20",
                             "--device", "name=no-such-device", "--prefix", "APP ")
    assert status == 1
    assert len(lines) == 1 and lines[0]["done"] is False and "sid" not in lines[0]
    assert lines[0]["error"]["code"] == "NO_SUCH_DEVICE", lines
