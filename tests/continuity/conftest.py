"""Fixtures of tests/continuity: a pool with two loopback "hosts" (see
:mod:`tests.support.twohosts`) and a fresh domain uuid."""

from __future__ import annotations

import uuid

import pytest

from tests.agent.conftest import agent, agent_on_thread  # noqa: F401 (fixtures: a real agent on a thread)
from tests.support.twohosts import TwoHosts, make_pool


@pytest.fixture
def hosts():
    with make_pool() as pool:
        two = TwoHosts(pool)
        yield two
        two.close()


@pytest.fixture
def domain():
    return str(uuid.uuid4())
