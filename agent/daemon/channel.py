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

from accelmig.runtime.statemachine import StateMachine


class ChannelState(enum.Enum):
    NO_HOST = "no_host"
    CONNECTED = "connected"
    SYNCED = "synced"


class ChannelEvent(enum.Enum):
    HOST_WROTE = "host_wrote"      # bytes came from the host
    HOST_SYNCED = "host_synced"    # the host synchronised (guest-sync-delimited)
    HOST_GONE = "host_gone"        # the host end hung up


class ChannelStateMachine(StateMachine):
    INITIAL = ChannelState.NO_HOST
    TABLE = {
        ChannelEvent.HOST_WROTE: {ChannelState.NO_HOST: ChannelState.CONNECTED},
        # a sync arrives in bytes, which say a host is there: never from NO_HOST
        ChannelEvent.HOST_SYNCED: {ChannelState.CONNECTED: ChannelState.SYNCED,
                                   ChannelState.SYNCED: ChannelState.SYNCED},
        ChannelEvent.HOST_GONE: {ChannelState.CONNECTED: ChannelState.NO_HOST,
                                 ChannelState.SYNCED: ChannelState.NO_HOST},
    }
    REPEATS = {
        ChannelEvent.HOST_WROTE: frozenset({ChannelState.CONNECTED, ChannelState.SYNCED}),
        ChannelEvent.HOST_GONE: frozenset({ChannelState.NO_HOST}),
    }

    def host_wrote(self) -> None:
        """Bytes came from the host: a host is there (if none was)."""
        self.fire(ChannelEvent.HOST_WROTE)

    def host_synced(self) -> None:
        self.fire(ChannelEvent.HOST_SYNCED)

    def host_gone(self) -> None:
        self.fire(ChannelEvent.HOST_GONE)
