"""The driver's window and its re-send after a cut (milestone 1 of issue
30): a plain OpenCL program whose connection is cut in the middle of a
48 MiB write, or of a 48 MiB read, resumes on its own (a new connection,
the ownership proof over the pool's challenge, exactly the commands the
pool lacks re-sent) and its output is the one local PoCL gives, byte for
byte: a command run twice (a kernel that adds) or lost would change it."""

from __future__ import annotations

import pytest

from accelmig.pool.testing import CutProxy, PoolThread
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
