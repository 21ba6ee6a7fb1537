"""A second copy of a session (issue 30, milestone 2): an unmodified
OpenCL program forks, as a restored snapshot of a guest copies it, and its
children hold copies of its session.  One only lets its objects go:
nothing of it reaches the pool.  The other uses its copy once the parent
has moved on: the pool refuses that resume as diverged, its commands fail
the OpenCL way, and the parent's counter is exactly its own bumps."""

from __future__ import annotations

import logging

from accelmig.lab.poolthread import PoolThread
from tests.support import icd as icd_support
from tests.support.tenants import ALICE, TENANTS


def test_a_forked_copy_is_refused_as_diverged_and_the_original_goes_on(icd, caplog):
    caplog.set_level(logging.INFO, logger="accelmig.pool")
    with PoolThread(TENANTS) as pool:
        done = icd_support.run(icd.program("cl-fork"), icd_support.driver_env(icd, pool.endpoint, ALICE,
                                                                              ACCELMIG_ICD_LOG="info"), timeout=120)
        sessions = pool.call(lambda: {sid: (s.state.value, s.epoch) for sid, s in pool.pool.sessions.items()})
    out = done.stdout.splitlines()
    assert "parent before: 0" in out and "parent moved on: 0 0" in out and "parent after: 0" in out, done.stdout
    assert "first child: let everything go" in out and "first child exited: 0" in out
    copy = next(line for line in out if line.startswith("second child:"))
    assert copy == "second child: bump -5, read -5", done.stdout          # CL_OUT_OF_RESOURCES, both
    assert "second child exited: 0" in out
    assert "counter: 16 everywhere (read 0, expected 16)" in out, done.stdout
    assert "SESSION_DIVERGED" in done.stderr and "a fork's copy, used in the child" in done.stderr, done.stderr
    # the pool: one resume, refused as diverged; none taken; the session released at the parent's end
    said = [r.getMessage() for r in caplog.records]
    refused = [line for line in said if line.startswith("resume of ") and " refused: " in line]
    assert len(refused) == 1 and "SESSION_DIVERGED" in refused[0], said
    assert not [line for line in said if " resumed at epoch " in line]
    assert sessions == {}                       # the parent released it: nothing left over
