"""The driver's window and its re-send after a cut (milestone 1 of issue
30): a plain OpenCL program whose connection is cut in the middle of a
48 MiB write, or of a 48 MiB read, resumes on its own (a new connection,
the ownership proof over the pool's challenge, exactly the commands the
pool lacks re-sent) and its output is the one local PoCL gives, byte for
byte: a command run twice (a kernel that adds) or lost would change it."""

from __future__ import annotations

import pytest

from accelmig.lab.cutproxy import CutProxy
from accelmig.lab.poolthread import PoolThread
from tests.support import icd as icd_support
from tests.support.tenants import ALICE, TENANTS


@pytest.fixture(scope="module")
def local_output(icd, tmp_path_factory):
    return icd_support.run(icd.program("cl-checks"), icd_support.local_env(tmp_path_factory.mktemp("local"))).stdout


@pytest.mark.parametrize("direction", ["up", "down"])
def test_a_cut_in_the_middle_of_a_transfer_changes_nothing(icd, local_output, direction):
    with PoolThread(TENANTS) as pool, CutProxy(pool.endpoint) as proxy:
        # 20 MiB into the program's traffic that way: inside its 48 MiB write
        # (up) or read (down); everything before them is a few MiB
        proxy.cut_after(20 << 20, direction)
        env = icd_support.driver_env(icd, proxy.endpoint, ALICE, ACCELMIG_ICD_LOG="info")
        ours = icd_support.run(icd.program("cl-checks"), env)
        assert proxy.tripped.is_set() and proxy.cuts >= 1
        left = pool.call(lambda: (pool.pool.tenants[ALICE].used, pool.pool.tenants[ALICE].live_sessions))
    assert ours.stdout == local_output
    assert "connection lost" in ours.stderr and "resumed at" in ours.stderr, ours.stderr
    assert left == (0, 0)


def _run_through_an_outage(icd, endpoint: str, env_extra: dict, take_away) -> tuple[str, str]:
    """cl-outage: compute, then (while the test takes the pool away) wait,
    then compute again; its output and log."""
    import subprocess
    env = icd_support.driver_env(icd, endpoint, ALICE, **env_extra)
    proc = subprocess.Popen([str(icd.program("cl-outage"))], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stdout:             # (the program says when it is ready: no sleep)
            lines.append(line)
            if line == "ready\n":
                break
        take_away()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return "".join(lines) + out, err


def test_a_pool_gone_longer_than_the_timeout_fails_the_sessions_commands_clearly(icd):
    pool = PoolThread(TENANTS).start()
    try:
        out, err = _run_through_an_outage(icd, pool.endpoint, {"ACCELMIG_TIMEOUT": "1.5"}, pool.stop)
    finally:
        pool.stop()
    assert "before: 0" in out
    assert "finish: -5" in out and "its event: failed" in out and "read after: -5" in out, out   # CL_OUT_OF_RESOURCES
    assert "notified: the session ended" in out and out.endswith("done\n")
    assert "no connection to the pool within 1.5 s" in err, err


def test_a_pool_restarted_loses_the_session_and_says_so(icd):
    with PoolThread(TENANTS) as pool:
        out, err = _run_through_an_outage(icd, pool.endpoint, {}, pool.restart)
    assert "finish: -5" in out and "its event: failed" in out, out
    assert "SESSION_LOST" in err and "the pool restarted" in err, err


def test_reads_past_the_pools_reply_bound_come_back_whole(icd, local_output):
    """A pool that keeps at most 4 MiB of a session's replies unacknowledged
    (and so cuts transfers into 4 MiB chunks, all sent at once): the pool
    holds each next read until the driver acknowledges the replies before
    it, which it does as they land; the 48 MiB round trip and every other
    check are local PoCL's, byte for byte.  (How long it takes is
    bench/'s: with only the idle acknowledgement each chunk waited 100 ms.)"""
    with PoolThread(TENANTS, max_reply_bytes=4 << 20) as pool:
        ours = icd_support.run(icd.program("cl-checks"), icd_support.driver_env(icd, pool.endpoint, ALICE))
    assert ours.stdout == local_output
