"""A real guest agent on a thread: its channel a unix socket the test's host end connects to."""

from __future__ import annotations

import threading

import pytest

from accelmig.agent.daemon import Agent


@pytest.fixture
def agent(tmp_path):
    agent = Agent(str(tmp_path / "channel.sock"), str(tmp_path / "agent.sock"),
                  state_dir=str(tmp_path / "state"), rehome_timeout=15)
    agent.open()
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    yield agent
    agent.stop()
    thread.join(5)
