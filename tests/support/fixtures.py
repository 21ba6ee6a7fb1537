"""pytest fixtures of tests/support, registered by ``pytest_plugins`` in tests/conftest.py.

``netns_factory``: a ``tests.support.netns.NetnsFactory`` (on the lab's
netns toolkit, ``accelmig.lab.netns``) for one test;
``netns_factory_module``: one shared by a test module.  Both remove every
namespace, link and process they made, whatever the test did, and skip
loudly where this is not root.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.support.netns import NetnsFactory


def _need_root():
    if os.geteuid() != 0:
        pytest.skip("SKIPPED LOUDLY: network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("SKIPPED LOUDLY: iproute2's ip is not installed")


@pytest.fixture
def netns_factory():
    _need_root()
    factory = NetnsFactory()
    try:
        yield factory
    finally:
        factory.cleanup()


@pytest.fixture(scope="module")
def netns_factory_module():
    _need_root()
    factory = NetnsFactory()
    try:
        yield factory
    finally:
        factory.cleanup()
