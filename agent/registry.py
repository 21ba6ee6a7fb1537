"""The driver's side of the guest agent's local socket (filled in by the
guest-agent work): without a running agent a driver works on its own."""

from __future__ import annotations

import os

DEFAULT_AGENT_SOCKET = "/run/accelmig/agent.sock"


def agent_socket_path(agent) -> str | None:
    if agent is False:
        return None
    if isinstance(agent, str):
        return agent
    return os.environ.get("ACCELMIG_AGENT_SOCKET", DEFAULT_AGENT_SOCKET)


class AgentRegistration:
    @classmethod
    def start(cls, device, agent):
        path = agent_socket_path(agent)
        if path is None or not os.path.exists(path):
            return None
        return None


def endpoint_from_agent(agent) -> str | None:
    return None
