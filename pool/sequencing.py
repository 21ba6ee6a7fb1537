"""Per-session sequence bookkeeping on the pool: exactly-once at enqueue.

Pure logic, no I/O, so it can be tested against a model (see
tests/pool/test_sequencing_model.py).  Numbers:

- ``next_seq``: the next new command the session will accept;
- ``acked``: the highest reply sequence the driver acknowledged; replies up
  to it are dropped;
- ``highest_reply``: the highest sequence whose reply exists.

Invariant: ``acked <= highest_reply < next_seq``.  Commands in
``(highest_reply, next_seq)`` are queued or executing; their replies come.

What the log keeps until the driver acknowledges is host memory no quota
sees: it counts it, so the session can bound it.  ``reply_bytes``: every
stored reply (its payload and ``REPLY_BYTES``, or ``RUN_REPLY_BYTES`` for a
plain success of a run); ``command_bytes``: every accepted command's
identity (what ``accept`` is told it costs: ``command_cost``).
"""

from __future__ import annotations

import collections
import dataclasses
import enum

from accelmig.wire.errors import ProtocolError, SessionDiverged


class Verdict(enum.Enum):
    NEW = "new"                # execute it
    DUPLICATE = "duplicate"    # executed (or queued) already; answer from the log
    DIVERGED = "diverged"      # same seq, other content: an older copy of the session
    GAP = "gap"                # a sequence number was skipped: protocol error


@dataclasses.dataclass
class StoredReply:
    seq: int
    header: dict
    payload: bytes | bytearray | memoryview = b""
    #: bytes its header holds beyond a plain reply's (a build's log, an
    #: error's message): counted with it
    extra: int = 0

    @property
    def nbytes(self) -> int:
        return len(self.payload) + REPLY_BYTES + self.extra


#: What the log's host memory is counted as (tracemalloc, CPython 3.11; the
#: measurements: docs/DESIGN.md, "What a tenant costs the pool").
#: A stored reply without payload: its object, header and log entry (386 B measured).
REPLY_BYTES = 512
#: A plain success of a launch run: a log entry, no object (112 B measured).
RUN_REPLY_BYTES = 128
#: An accepted command's identity beyond its header: object, digest, entry.
COMMAND_BYTES = 512
#: A header kept as parsed JSON costs up to ~21 times its length on the wire
#: (``[{},{},...]``: 64 B per 3-byte dict); an ordinary one 5 to 13 times.
#: Counted at the worst, so that no header shape holds more than counted.
HEADER_FACTOR = 24


def command_cost(header_size: int) -> int:
    """What an accepted command whose header was ``header_size`` bytes on the
    wire is counted for until it is acknowledged."""
    return COMMAND_BYTES + HEADER_FACTOR * header_size


def ok_reply(seq: int) -> StoredReply:
    """The reply of a command that succeeded with nothing to say."""
    return StoredReply(seq, {"op": "reply", "seq": seq, "ok": True})


class SequenceLog:
    def __init__(self, sid: str = "?"):
        self.sid = sid
        self.next_seq = 1
        self.acked = 0
        self.highest_reply = 0
        self.digests: dict[int, object] = {}   # seq -> CommandIdentity (or any ==-comparable)
        # seq -> its reply; None for a plain success recorded in a run (made on demand: ok_reply)
        self.replies: collections.OrderedDict[int, StoredReply | None] = collections.OrderedDict()
        self.reply_bytes = 0
        self.command_bytes = 0
        self._costs: collections.deque = collections.deque()   # (last seq, bytes) in order, until acked

    # -- commands ----------------------------------------------------------------
    def classify(self, seq: int, digest) -> Verdict:
        if seq == self.next_seq:
            return Verdict.NEW
        if seq > self.next_seq:
            return Verdict.GAP
        if seq <= self.acked:
            # The driver acknowledged this reply: a copy that sends it again
            # is not the copy the pool has been talking to.
            return Verdict.DIVERGED
        return Verdict.DUPLICATE if self.digests.get(seq) == digest else Verdict.DIVERGED

    def accept(self, seq: int, digest, cost: int = 0) -> None:
        """``cost``: the host memory its identity holds until acknowledged."""
        if seq != self.next_seq:
            raise ProtocolError(reason=f"accept of seq {seq}, expected {self.next_seq}")
        self.digests[seq] = digest
        self.next_seq += 1
        if cost:
            self._costs.append((seq, cost))
            self.command_bytes += cost

    def accept_run(self, first: int, digests: list, cost: int = 0) -> None:
        """New commands ``first``, ``first + 1``, ...: ``accept`` of each
        (a launch batch's run, all of it new: each ``classify`` would say so);
        ``cost``: all of theirs, counted until the last is acknowledged."""
        if first != self.next_seq:
            raise ProtocolError(reason=f"accept of seq {first}, expected {self.next_seq}")
        self.digests.update(zip(range(first, first + len(digests)), digests))
        self.next_seq += len(digests)
        if cost:
            self._costs.append((self.next_seq - 1, cost))
            self.command_bytes += cost

    @property
    def unacked_commands(self) -> int:
        return self.next_seq - 1 - self.acked

    # -- replies -----------------------------------------------------------------
    def record_reply(self, reply: StoredReply) -> None:
        if reply.seq != self.highest_reply + 1:
            raise ProtocolError(reason=f"reply {reply.seq} out of order after {self.highest_reply}")
        self.highest_reply = reply.seq
        self.replies[reply.seq] = reply
        self.reply_bytes += reply.nbytes

    def record_ok_run(self, first: int, last: int) -> None:
        """Plain successes ``first``..``last`` (``record_reply`` of each,
        without a StoredReply each until one is asked for: a launch run's)."""
        if first != self.highest_reply + 1 or last < first:
            raise ProtocolError(reason=f"replies {first}..{last} out of order after {self.highest_reply}")
        self.highest_reply = last
        self.replies.update(dict.fromkeys(range(first, last + 1)))
        self.reply_bytes += (last - first + 1) * RUN_REPLY_BYTES

    def stored_reply(self, seq: int) -> StoredReply | None:
        if seq not in self.replies:
            return None
        return self.replies[seq] or ok_reply(seq)

    def acknowledge(self, upto: int) -> list[StoredReply]:
        """Drop replies up to ``upto``; return them (their buffers are free)."""
        if upto > self.highest_reply:
            raise ProtocolError(reason=f"ack {upto} of a reply not yet sent "
                                       f"(highest reply is {self.highest_reply})")
        dropped = []
        while self.replies:
            seq = next(iter(self.replies))
            if seq > upto:
                break
            reply = self.replies.popitem(last=False)[1]
            if reply is None:                    # a plain success of a run
                self.reply_bytes -= RUN_REPLY_BYTES
            else:
                self.reply_bytes -= reply.nbytes
                dropped.append(reply)
        for seq in range(self.acked + 1, upto + 1):
            self.digests.pop(seq, None)
        costs = self._costs
        while costs and costs[0][0] <= upto:
            self.command_bytes -= costs.popleft()[1]
        self.acked = max(self.acked, upto)
        return dropped

    # -- resume ------------------------------------------------------------------
    def check_resume(self, last_seen: int, next_seq: int | None = None) -> list[StoredReply]:
        """Replies a resuming driver missed, or SessionDiverged.

        ``next_seq`` is the next sequence number the resuming driver would
        use: if the pool accepted commands beyond it, they came from another
        copy of the driver.  Changes nothing: the caller acknowledges
        ``last_seen`` once every other check of the resume has passed.
        """
        if next_seq is not None and next_seq < self.next_seq:
            raise SessionDiverged(sid=self.sid, reason=(
                f"the pool accepted commands up to {self.next_seq - 1}, the resuming copy "
                f"sent only up to {next_seq - 1}"),
                details={"next_seq": next_seq, "accepted": self.next_seq - 1})
        if last_seen < self.acked:
            raise SessionDiverged(sid=self.sid, reason=(
                f"the resuming copy has seen replies up to {last_seen}, but the driver "
                f"already acknowledged up to {self.acked}"),
                details={"last_seen": last_seen, "acked": self.acked})
        if last_seen > self.highest_reply:
            raise SessionDiverged(sid=self.sid, reason=(
                f"the resuming copy claims replies up to {last_seen}, the pool produced "
                f"only {self.highest_reply}"),
                details={"last_seen": last_seen, "highest_reply": self.highest_reply})
        return [r or ok_reply(s) for s, r in self.replies.items() if s > last_seen]

    def snapshot(self) -> dict:
        return {"next_seq": self.next_seq, "acked": self.acked,
                "highest_reply": self.highest_reply, "stored_replies": len(self.replies),
                "reply_bytes": self.reply_bytes, "command_bytes": self.command_bytes}
