"""The driver's command window: every command not yet answered, bounded.

Pure bookkeeping (no sockets), shared by the driver and the model tests.
The driver numbers its commands 1, 2, 3, ...; a command leaves the window
when its reply arrives.  ``last_seen`` is the highest sequence up to which
every reply has arrived: the driver acknowledges it, and presents it when it
resumes, so the pool knows which replies to replay.
"""

from __future__ import annotations

import collections
import dataclasses

from accelmig.wire import batch


@dataclasses.dataclass
class PendingCommand:
    seq: int
    header: dict
    payload: bytes | bytearray | memoryview = b""
    waited: bool = False              # an application thread waits for the reply
    sink: object = None               # where a read's payload should land
    reply: dict | None = None
    reply_payload: object = b""
    resent: int = 0
    #: a launch kept as its batch record (``wire.batch``): ``header`` then
    #: holds only op, epoch, ack and seq
    record: bytes | None = None

    @property
    def nbytes(self) -> int:
        return len(self.payload) + 128

    def wire_header(self) -> dict:
        """The header that sends this command alone (JSON), as on a resume."""
        if self.record is None:
            return self.header
        header = dict(self.header)
        header.update(batch.launch_fields(self.record))
        return header


class CommandWindow:
    def __init__(self, max_commands: int = 4096, max_bytes: int = 512 << 20):
        self.max_commands = max_commands
        self.max_bytes = max_bytes
        self.next_seq = 1
        self.last_seen = 0
        self.pending: collections.OrderedDict[int, PendingCommand] = collections.OrderedDict()
        self.bytes = 0

    def has_room(self, nbytes: int) -> bool:
        if not self.pending:
            return True       # one command always fits, whatever its size
        return len(self.pending) < self.max_commands and self.bytes + nbytes + 128 <= self.max_bytes

    def add(self, header: dict, payload=b"", waited: bool = False, sink=None,
            record: bytes | None = None) -> PendingCommand:
        cmd = PendingCommand(self.next_seq, header, payload, waited, sink, record=record)
        header["seq"] = cmd.seq
        self.next_seq += 1
        self.pending[cmd.seq] = cmd
        self.bytes += cmd.nbytes
        return cmd

    def complete(self, seq: int, reply: dict, payload=b"") -> PendingCommand | None:
        """Match a reply; None for a duplicate (already seen)."""
        if seq <= self.last_seen:
            return None
        if seq != self.last_seen + 1:
            raise ValueError(f"reply {seq} out of order: expected {self.last_seen + 1}")
        self.last_seen = seq
        cmd = self.pending.pop(seq, None)
        if cmd is None:
            raise ValueError(f"reply {seq} for a command not in the window")
        self.bytes -= cmd.nbytes
        cmd.reply = reply
        cmd.reply_payload = payload
        cmd.payload = b""   # nothing to replay any more
        return cmd

    def resend_from(self, expect: int) -> list[PendingCommand]:
        """Commands the pool has not accepted yet, in order."""
        if expect > self.next_seq:
            raise ValueError(f"pool expects {expect}, but only {self.next_seq - 1} were sent")
        return [cmd for seq, cmd in self.pending.items() if seq >= expect]

    def waiting_sink(self, seq: int):
        cmd = self.pending.get(seq)
        return cmd.sink if cmd is not None else None
