"""Transfers of any size: a write or a read larger than one chunk goes as
consecutive commands of at most ``chunk`` bytes each.

A chunk is ``min(TRANSFER_CHUNK, the frame limit the pool negotiated at
hello)``.  Each chunk is a normal sequenced command, so what the session
guarantees for one command holds for each chunk: it stays in the window
until answered, a resume re-sends it only if the pool never accepted it,
the pool executes it once, and a reply lost in a cut is replayed from the
pool's reply log.  A read's chunk lands straight in its slice of the
caller's buffer, replayed or not.  Nothing but the command window and the
pool's reply log is needed: no state of its own to move with the VM.

A few chunks are in flight at once (``IN_FLIGHT_BYTES``): the wire stays
busy while the pool moves a chunk to the device, and since each new chunk
acknowledges the replies before it, the pool's reply log holds at most that
many bytes of a read, never the whole transfer.

Quota is not a chunk's business: ``alloc`` reserved the buffer's bytes, a
write of them reserves nothing more.  The range is checked here, once, for
the whole transfer, before any byte travels.

Standard library only.
"""

from __future__ import annotations

import collections

from accelmig.wire.errors import AccelmigError, OutOfRange

#: the largest chunk: big enough that per-command costs vanish beside the
#: bytes, small enough that a cut re-sends little and the pool's staging
#: and reply buffers stay a few of them
TRANSFER_CHUNK = 64 << 20
#: the chunks of one transfer in flight at once, in bytes
IN_FLIGHT_BYTES = 256 << 20
#: and in chunks, whatever the chunk size (a tiny frame limit must not
#: fill the command window with one transfer)
MAX_IN_FLIGHT = 64


def chunk_size(max_payload: int) -> int:
    """The chunk of a session whose frames carry at most ``max_payload`` bytes."""
    return max(1, min(TRANSFER_CHUNK, int(max_payload)))


def pieces(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each chunk of an ``nbytes`` transfer, in order."""
    return [(start, min(start + chunk, nbytes)) for start in range(0, nbytes, chunk)]


def check_range(what: str, handle: int, size: int, offset: int, nbytes: int) -> None:
    """The whole transfer within the buffer, or OutOfRange before anything is sent."""
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise OutOfRange(what=f"{what} of buffer {handle}", offset=offset, size=nbytes, limit=size)


def run(session, op, nbytes: int, chunk: int, make, what: str, on_done=None) -> int:
    """Send the chunks of one transfer through ``session`` and wait for all.

    ``make(start, end)`` gives a chunk's ``(fields, payload, sink)``;
    ``on_done(cmd, start, end)`` sees each answered chunk, in order.
    Returns the number of chunks.  A chunk the pool refuses stops the
    transfer: the chunks already in flight are waited for (a write's
    payload is the caller's memory: nothing may still need it once this
    returns), and the first refusal is raised once, saying which bytes
    were done.  A pipelined command's earlier failure is raised at the end,
    after the whole transfer.
    """
    depth = max(2, min(MAX_IN_FLIGHT, IN_FLIGHT_BYTES // chunk))
    in_flight: collections.deque = collections.deque()
    parts = pieces(nbytes, chunk)
    try:
        for start, end in parts:
            if len(in_flight) >= depth:
                _settle(session, in_flight.popleft(), on_done, last=False)
            fields, payload, sink = make(start, end)
            cmd = session.submit(op, fields, payload, wait=False, defer=True, sink=sink)
            in_flight.append((start, end, cmd))
        while in_flight:
            _settle(session, in_flight.popleft(), on_done, last=not in_flight)
    except AccelmigError as exc:
        failed = getattr(exc, "chunk", None)
        if failed is not None:
            _drain(session, in_flight)
            start, end = failed
            exc.details.update({"transfer": what, "bytes": nbytes, "chunk": [start, end],
                                "done_bytes": start})
            exc.message = (f"{what} of {nbytes} bytes stopped at bytes {start}-{end} "
                           f"({start} bytes done): {exc.message}")
        raise
    return len(parts)


def _settle(session, entry, on_done, last: bool) -> None:
    start, end, cmd = entry
    try:
        session.wait_reply(cmd, pipelined_errors=last)
    except AccelmigError as exc:
        if cmd.reply is not None and not cmd.reply.get("ok", False):
            exc.chunk = (start, end)        # the pool refused this chunk (not a lost session)
        raise
    if on_done is not None:
        on_done(cmd, start, end)


def _drain(session, in_flight) -> None:
    """Wait for chunks sent after a refused one; their own outcome is moot."""
    while in_flight:
        _start, _end, cmd = in_flight.popleft()
        try:
            session.wait_reply(cmd, pipelined_errors=False)
        except AccelmigError:
            if cmd.reply is None:
                return          # the session itself failed: nothing more will come
