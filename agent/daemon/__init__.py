"""``accelmig-agent run``: the guest agent daemon (standard library only).

- ``agent``: ``Agent``, the hub between the host channel and the guest's
  drivers, and the wiring of the parts below;
- ``hostchannel``: the host channel's state machine (NO_HOST / CONNECTED /
  SYNCED) and what the host may send;
- ``drivers``: the drivers' links and the registry of their sessions;
- ``driverapi``: what the guest's processes may send on the local socket;
- ``rehome``: a migration's rehome, once per migration id (a state machine);
- ``proofs``: the sessions' binding proofs, relayed to their drivers;
- ``ports``: the channel's guest end (virtio-serial device, unix socket, none);
- ``netconfig``: the fabric NIC's addressing, applied at a rehome (over
  ``rtnetlink``).
"""

from __future__ import annotations

from accelmig.agent.daemon.agent import AGENT_VERSION, Agent
from accelmig.agent.daemon.hostchannel import ChannelState

__all__ = ["Agent", "AGENT_VERSION", "ChannelState"]
