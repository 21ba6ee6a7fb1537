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


@pytest.fixture
def guest_agent(tmp_path):
    """Start a real guest agent (``accelmig.agent.daemon.Agent``) on a thread,
    its channel a unix socket the test's host end connects to
    (``GuestChannel(agent.port_path)``); ``domain``: the SMBIOS UUID it
    reads (a file standing for ``/sys/class/dmi/id/product_uuid``; None:
    it reads none).  ``guest_agent.stop(agent)`` stops one and waits until
    it is gone (its socket free for the next); each is stopped at the
    test's end."""
    import threading

    from accelmig.agent.daemon import Agent
    started = []

    def start(domain: str | None = None, name: str = "agent"):
        directory = tmp_path / name
        directory.mkdir(exist_ok=True)
        dmi = directory / "product_uuid"
        if domain is not None:
            dmi.write_text(domain.upper() + "\n")         # (as firmware writes it)
        agent = Agent(str(directory / "channel.sock"), str(directory / "agent.sock"),
                      state_dir=str(directory / "state"), dmi_path=str(dmi), rehome_timeout=20)
        agent.open()
        thread = threading.Thread(target=agent.run, daemon=True)
        thread.start()
        started.append((agent, thread))
        return agent

    def stop(agent) -> None:
        for each, thread in started:
            if each is agent:
                agent.stop()
                thread.join(5)
                assert not thread.is_alive(), "the agent did not stop"
    start.stop = stop
    yield start
    for agent, thread in started:
        agent.stop()
        thread.join(5)
