"""pyopencl's own test suite, unmodified (``test_wrapper.py``,
``test_enqueue_copy.py``, ``test_array.py``, ``test_algorithm.py`` at the
installed pyopencl's version), through the accelmig OpenCL driver against
a real pool, side by side with the same run on local PoCL
(``tests/support/pyopencl_suite.py``; its table is in ``icd/README.md``):
every test that fails through the driver and not on local PoCL is either a
defect or listed, with its reason, in ``pyopencl_suite.KNOWN``.

The suite is not this project's: give a checkout of its source in
``ACCELMIG_PYOPENCL_CHECKOUT`` (``icd/README.md`` says how to get one);
without one the test is skipped, loudly.  Slow: both runs take ~40
minutes on two cores."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import pyopencl_suite as suite

pytestmark = pytest.mark.slow

CHECKOUT = os.environ.get("ACCELMIG_PYOPENCL_CHECKOUT", "")


@pytest.fixture(scope="module")
def checkout():
    if not CHECKOUT:
        pytest.skip("SKIPPED LOUDLY: pyopencl's test suite needs a checkout of its source "
                    "(ACCELMIG_PYOPENCL_CHECKOUT; icd/README.md says how to get one)")
    path = Path(CHECKOUT)
    if not (path / "test" / suite.FILES[0]).exists():
        pytest.fail(f"ACCELMIG_PYOPENCL_CHECKOUT={CHECKOUT} is no pyopencl checkout (no test/{suite.FILES[0]})")
    done = subprocess.run([suite.PYTHON, "-c", "import pyopencl, pytest; print(pyopencl.VERSION_TEXT)"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"SKIPPED LOUDLY: {suite.PYTHON} has no pyopencl or pytest "
                    f"(apt-get install python3-pyopencl python3-pytest)")
    version = done.stdout.strip()
    tagged = subprocess.run(["git", "-C", str(path), "describe", "--tags", "--exact-match"], capture_output=True,
                            text=True).stdout.strip()
    if tagged and tagged != f"v{version}":
        pytest.fail(f"the checkout is at {tagged}, the installed pyopencl is {version}: check out v{version}")
    return path


# (both runs, each bounded by the runner's own limit: setup.cfg's 300 s would cut the first)
@pytest.mark.timeout(2 * suite.RUN_TIMEOUT + 600)
def test_pyopencl_suite_through_the_driver_fails_only_where_local_pocl_does(checkout, tmp_path):
    outcomes = suite.run_both(checkout, tmp_path)
    pocl, ours = outcomes["pocl"], outcomes["accelmig"]
    print(suite.table(outcomes))
    assert len(ours.tests) >= len(pocl.tests) > 200, "the suite did not run whole"
    worse = suite.unexplained(pocl, ours)
    assert not worse, "\n".join(f"{test}: local PoCL {a}, accelmig {b}: {message[:300]}"
                                for test, (a, b, message) in worse.items())
    # what KNOWN lists still differs (else it is stale)
    differing = suite.differences(pocl, ours)
    stale = [known for known in suite.KNOWN
             if not any(test == known or test.split("[")[0] == known for test in differing)]
    assert not stale, f"KNOWN lists tests that no longer differ: {stale}"
