"""A real guest agent on a thread: its channel a unix socket the test's host end connects to."""

from __future__ import annotations

import threading

import pytest

from accelmig.agent.daemon import Agent


@pytest.fixture
def agent_on_thread(tmp_path):
    """Start an ``Agent`` (options as its constructor's) on a thread; each
    is stopped at the test's end."""
    started = []

    def start(**options):
        options.setdefault("rehome_timeout", 15)
        agent = Agent(str(tmp_path / "channel.sock"), str(tmp_path / "agent.sock"),
                      state_dir=str(tmp_path / "state"), **options)
        agent.open()
        thread = threading.Thread(target=agent.run, daemon=True)
        thread.start()
        started.append((agent, thread))
        return agent
    yield start
    for agent, thread in started:
        agent.stop()
        thread.join(5)


@pytest.fixture
def agent(agent_on_thread):
    return agent_on_thread()
