"""A large write copied to the device while its payload arrives (issue 11, item 1).

A write's payload is received into the tenant's upload arena; the device
process copies it from there into the buffer.  Copied only once the last
byte is in, that copy was a write's whole tail (6.5 ms of a 64 MiB write
here, after a transfer as fast as the raw socket's).  A write that may
stream has its payload copied in pieces by the session's worker as they
arrive, and digested piece by piece, so that at the end only the last
piece is left.

Which write may stream: the session's next command (its sequence number is
the log's next), on a session with nothing queued or running, a header that
would be accepted as it is (valid, this epoch, its acknowledgement in
range), a range inside the buffer.  Then, if the whole frame arrives, the
command is accepted as new and runs in order with its pieces already done.

If it never arrives whole (the connection is cut, or closed), the buffer
may hold some of its bytes: a torn write.  Nothing before it was lost, and
the only command that may come at its sequence number now is a write of
the same buffer, offset and length — the same driver re-sending it, or a
copy of that driver writing the same range with other bytes: either
overwrites the whole range.  Anything else there is refused as
``SESSION_DIVERGED`` (``TornWrite``): without streaming the other copy's
command would have been taken, with a torn buffer it would compute on
bytes no history of the session wrote.
"""

from __future__ import annotations

import dataclasses
import logging

import xxhash

from accelmig.wire import dataplane as dp
from accelmig.wire.dataplane import Op
from accelmig.wire.errors import AccelmigError, NoSuchObject, SessionDiverged
from accelmig.wire.values import is_int

LOG = logging.getLogger(__name__)

STREAM_MIN = 16 << 20       # writes at least this large stream
STREAM_PIECE = 8 << 20      # the pieces the worker copies while the rest arrives


@dataclasses.dataclass(frozen=True)
class TornWrite:
    """A write at ``seq`` whose frame never arrived whole after some of its
    pieces were handed to the device: what alone may come at ``seq``."""

    seq: int
    buf: int
    offset: int
    size: int

    def admits(self, op: Op, header: dict, size: int) -> bool:
        return (op is Op.WRITE and header.get("buf") == self.buf and header.get("offset") == self.offset
                and size == self.size)

    def refusal(self, sid: str, op: Op) -> SessionDiverged:
        return SessionDiverged(sid=sid, reason=(
            f"command {self.seq} ({op.value}) is not the write of {self.size} bytes into buffer "
            f"{self.buf} at {self.offset} that was cut half-way under that sequence number (some of "
            f"its bytes reached the device): only that write may come there"),
            details={"seq": self.seq, "torn": dataclasses.asdict(self)})

    def describe(self) -> dict:
        return dataclasses.asdict(self)


class UploadStream:
    """One write's payload on its way to the device.  The loop posts pieces
    (``received``) and, if the frame never comes whole, ``abandon``s it;
    the session's worker copies the pieces in order (``_copy``), then runs
    the command, which writes what is left (``rest``).  ``copied`` and
    ``stopped`` are the worker's alone."""

    def __init__(self, session, header: dict, lease, digest_factory=xxhash.xxh3_64):
        self.session, self.header, self.lease = session, header, lease
        self.seq, self.buf, self.offset = header["seq"], header["buf"], header["offset"]
        self.size = lease.size
        self.posted = 0              # bytes handed to the worker (the loop's)
        self.copied = 0              # bytes the device has, from the first (the worker's)
        self.stopped = False         # (worker) a piece was not copied: the command writes the rest
        self.abandoned = False       # (loop) the frame never came whole
        self._digest = digest_factory()

    # -- the loop -------------------------------------------------------------------
    def received(self, nbytes: int) -> None:
        """``nbytes`` of the payload are in the arena: post the whole pieces."""
        while nbytes - self.posted >= STREAM_PIECE and self.size - self.posted > STREAM_PIECE:
            start, self.posted = self.posted, self.posted + STREAM_PIECE
            self.session.run_on_worker(lambda start=start, end=self.posted: self._copy(start, end))

    def abandon(self) -> None:
        """The frame will not come whole: a torn write if any piece was
        posted; the lease goes back once the pieces before have run."""
        self.abandoned = True
        if not self.posted:
            self.lease.release()
            return
        session = self.session
        session.run_on_worker(self.lease.release)
        if session.log.next_seq != self.seq:
            return      # (a resumed connection's command took its seq already: it overwrites the range)
        session.torn = TornWrite(self.seq, self.buf, self.offset, self.size)
        LOG.warning("session %s: write %d (%d bytes into buffer %d) cut after some of it reached the "
                    "device: only its re-send may come at %d", session.sid, self.seq, self.size, self.buf,
                    self.seq, extra={"sid": session.sid, "seq": self.seq})

    # -- the worker ------------------------------------------------------------------
    def _copy(self, start: int, end: int) -> None:
        session = self.session
        if self.stopped or start != self.copied:
            return
        if self.abandoned or session.paused or session.released_reason is not None:
            self.stopped = True           # (the re-sent write writes it all again)
            return
        try:
            session.context.write_leased(self.buf, self.offset, self.lease, start=start, end=end)
        except (AccelmigError, OSError) as exc:
            # The command writes from here and reports what fails then.
            LOG.info("session %s: a piece of write %d was not copied ahead: %s", session.sid, self.seq, exc)
            self.stopped = True
            return
        self._digest.update(self.lease.view[start:end])
        self.copied = end
        session.counters.streamed_bytes += end - start

    def rest(self) -> int:
        """(the worker, running the command) where the command's own write starts."""
        self.stopped = True
        return self.copied

    def digest(self, start: int) -> int:
        """The whole payload's digest: the pieces copied, then the rest."""
        self._digest.update(self.lease.view[start:])
        return self._digest.intdigest()


def may_stream(conn, header: dict, size: int) -> bool:
    """Whether the write whose header just arrived on ``conn`` may stream
    (see the module's text): checked on the loop, before a byte of it is
    copied anywhere."""
    session = conn.session
    if size < STREAM_MIN or session is None:
        return False
    try:
        dp.validate_command(header, size)
    except AccelmigError:
        return False
    seq, ack = header["seq"], header.get("ack", 0)
    log = session.log
    if header["epoch"] != session.epoch or conn.epoch != session.epoch or seq != log.next_seq:
        return False
    if not is_int(ack, 0, log.highest_reply):
        return False
    if session.in_worker or session.held or session.paused or session.released_reason is not None:
        return False
    torn = session.torn
    if torn is not None and not torn.admits(Op.WRITE, header, size):
        return False
    try:
        # (the session is idle: nothing changes its buffers meanwhile)
        limit = session.context.buffer_size(header["buf"])
    except NoSuchObject:
        return False
    return header["offset"] + size <= limit
