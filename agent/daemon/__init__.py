"""``accelmig-agent run``: the guest agent daemon (standard library only).

- ``agent``: ``Agent``, the hub between the host channel and the guest's
  drivers (identity, rehome once per migration, the drivers' registry);
- ``channel``: the host channel's state machine (NO_HOST / CONNECTED / SYNCED);
- ``ports``: the channel's guest end (virtio-serial device, unix socket, none);
- ``netconfig``: the fabric NIC's addressing, applied at a rehome.
"""

from __future__ import annotations

from accelmig.agent.daemon.agent import AGENT_VERSION, Agent
from accelmig.agent.daemon.channel import ChannelState

__all__ = ["Agent", "AGENT_VERSION", "ChannelState"]
