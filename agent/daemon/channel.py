"""The agent's view of the host end of its channel, as a state machine.

::

    NO_HOST --the host writes--> CONNECTED --sync--> SYNCED --the host goes--> NO_HOST
                                     \\----------the host goes------------------^

The host end disconnects and reconnects across a migration (hostd reopens
the QEMU chardev socket on each host) and synchronises on every connect, as
qemu-guest-agent's ``guest-sync-delimited`` does.  A host may synchronise
again on the same connection (SYNCED -> SYNCED: it gets a fresh hello).
The agent changes the state on its polling thread only.
"""

from __future__ import annotations

import enum

from accelmig.agent.statemachine import StateMachine


class ChannelState(enum.Enum):
    NO_HOST = "no_host"
    CONNECTED = "connected"
    SYNCED = "synced"


class ChannelStateMachine(StateMachine):
    TRANSITIONS = {
        ChannelState.NO_HOST: frozenset({ChannelState.CONNECTED}),
        ChannelState.CONNECTED: frozenset({ChannelState.SYNCED, ChannelState.NO_HOST}),
        ChannelState.SYNCED: frozenset({ChannelState.SYNCED, ChannelState.NO_HOST}),
    }

    def __init__(self) -> None:
        super().__init__(ChannelState.NO_HOST)

    def host_wrote(self) -> None:
        """Bytes came from the host: a host is there (if none was)."""
        if self._state is ChannelState.NO_HOST:
            self.to(ChannelState.CONNECTED)

    def host_synced(self) -> None:
        self.to(ChannelState.SYNCED)

    def host_gone(self) -> None:
        if self._state is not ChannelState.NO_HOST:
            self.to(ChannelState.NO_HOST)
