"""Fixtures of tests/plugin: a real pool that knows hostA, and one lab per
test module (helpers in :mod:`tests.support.hostd` and :mod:`tests.support.libvirt`)."""

from __future__ import annotations

import pytest

from accelmig.lab.poolthread import PoolThread
from tests.support.hostd import SECRET
from tests.support.libvirt import lab_for_module
from tests.support.tenants import TENANTS


@pytest.fixture
def pool_a():
    with PoolThread(TENANTS, {"hostA": (SECRET, ["127.0.0.0/8"])}) as pool:
        yield pool


@pytest.fixture(scope="module")
def lab(request):
    """One lab per test module (two real libvirt daemons in namespaces) and the guest image."""
    yield from lab_for_module(request.module.__name__)
