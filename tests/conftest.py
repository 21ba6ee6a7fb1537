"""Shared fixtures.  Tiers (markers): unmarked tests take seconds and need
neither root nor a VM (``./dev.sh test --fast``); ``root`` tests create
network namespaces; ``libvirt``/``vm`` tests run real libvirt daemons and
QEMU guests.  A tier this machine cannot run is skipped with a loud reason."""

from __future__ import annotations

import os
import shutil
import tempfile

import hypothesis  # noqa: F401  (imported first: see below)
import pytest

from accelmig.lab.poolthread import PoolThread
from tests.support import system_state
from tests.support.tenants import ALICE, BOB, TENANTS, run_cli  # noqa: F401  (re-exported)

# hypothesis is imported at the top because Debian's Python 3.11.2 fails with
# "AST constructor recursion depth mismatch" when hypothesis' pytest plugin
# first imports it at the end of a session that never did (CPython gh-106905).

pytest_plugins = ["tests.support.fixtures"]

# Plain TCP between the suite's drivers and pools, said explicitly (the
# driver's ACCELMIG_INSECURE; PoolThread and tests.support's pools pass
# insecure themselves).  TLS tests pass cafile= (tests/pool/test_tls.py).
os.environ["ACCELMIG_INSECURE"] = "1"

# Every temporary file of the run, its own or its subprocesses' (a pool
# killed with SIGKILL cannot remove its device directory), goes under one
# directory of the run's own, removed when the session ends.  pytest's own
# tmp_path stays where it was (kept for a look after a failure).
os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
RUN_TMP = tempfile.mkdtemp(prefix="accelmig-tests-")
os.chmod(RUN_TMP, 0o1777)      # like /tmp: tests run some processes as another user
os.environ["TMPDIR"] = tempfile.tempdir = RUN_TMP


def pytest_unconfigure(config):
    # (here, not in a fixture: a run that collects nothing, or stops early, cleans up too)
    shutil.rmtree(RUN_TMP, ignore_errors=True)


def pytest_report_header(config):
    lines = []
    if os.geteuid() != 0:
        lines.append("!!! NOT ROOT: tests marked 'root', 'libvirt' and 'vm' will be SKIPPED !!!")
    return lines


def pytest_collection_modifyitems(config, items):
    skip = []
    if os.geteuid() != 0:
        skip.append(("root", "needs root (network namespaces)"))
    if shutil.which("ip") is None:
        skip.append(("root", "iproute2's ip is not installed"))
    for item in items:
        for marker, reason in skip:
            if marker in item.keywords or ("vm" in item.keywords and marker == "root"):
                item.add_marker(pytest.mark.skip(reason=f"SKIPPED LOUDLY: {reason}"))


@pytest.fixture
def pool():
    """A real pool (PoCL) on a background thread, two tenants."""
    with PoolThread(TENANTS) as harness:
        yield harness


@pytest.fixture(scope="module")
def shared_pool():
    with PoolThread(TENANTS) as harness:
        yield harness


@pytest.fixture(scope="session", autouse=True)
def no_system_state_written():
    """The suite writes nothing outside its temporary directories: accelmig's
    system paths (tests/support/system_state.py) are the same after the
    session as before, else the run fails naming each path."""
    before = system_state.snapshot()
    yield
    changed = system_state.changes(before, system_state.snapshot())
    if changed:
        pytest.fail("the test session wrote real system state (a test must use its tmp_path):\n  "
                    + "\n  ".join(changed), pytrace=False)
