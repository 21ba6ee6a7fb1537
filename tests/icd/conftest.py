"""The accelmig OpenCL driver's tests: its build (cached), a real pool on
PoCL, and software nobody here wrote (clinfo, the Khronos loader)."""

from __future__ import annotations

import shutil

import pytest

from accelmig.lab.poolthread import PoolThread
from tests.support import icd as icd_support
from tests.support.tenants import TENANTS

MISSING = [tool for tool in ("cmake", "clinfo", "gcc") if shutil.which(tool) is None]
if not icd_support.POCL_ICD.exists():
    MISSING.append("pocl-opencl-icd")


def pytest_collection_modifyitems(config, items):
    if MISSING:
        reason = f"SKIPPED LOUDLY: the OpenCL driver's tests need {', '.join(MISSING)} (./dev.sh setup installs them)"
        for item in items:
            if "tests/icd/" in str(item.fspath):
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def icd():
    return icd_support.normal_build()


@pytest.fixture(scope="module")
def pool():
    """A pool on PoCL (each tenant's device work in a process of its own)."""
    with PoolThread(TENANTS) as harness:
        yield harness
