"""A tenant's upload arena: shared memory between the pool and one device process.

Without it a write's payload crosses the pool twice more than it must: the
pool receives it from TCP into a buffer, sends it down the socket pair to
the tenant's device process, which receives it into a buffer of its own
and only then enqueues it to the device.  With it the pool receives the
payload straight into this arena (``recv_into`` a slice of the mapping) and
tells the device process where it lies; the device process enqueues the
write from its own mapping of the same pages.

- **One arena per device process**, so per tenant and device: a memfd the
  pool makes before it spawns the process, mapped read-write here and
  handed to the process read-only (a second descriptor opened through
  ``/proc/self/fd``; it is inherited, nothing travels later).  No tenant's
  process ever holds another tenant's arena.
- **Sealed**: its size can change no more (``F_SEAL_SHRINK``,
  ``F_SEAL_GROW``, ``F_SEAL_SEAL``), so a device process that a tenant's
  kernel took over cannot truncate it and make the pool fault on its own
  mapping.  Its read-only descriptor is a guard against bugs, not a
  boundary: the process runs as the pool's user and could open the file
  again for writing; what it could then change is its own tenant's
  uploads, which it holds anyway.
- **Bounded**: its size is fixed at creation (``upload_arena``, at most
  the tenant's quota).  A payload that does not fit in what is free is
  received the old way (a pool buffer, copied through the socket pair):
  the arena never waits and never grows.
- **Resident only while used**: pages written stay (touching fresh shared
  pages costs ten times the copy into them), until the arena has held
  nothing for ``upload_arena_keep`` seconds; then they go back to the
  system (``MADV_REMOVE``: ~0.1 s for 256 MiB, so on a thread of its own,
  never the loop; payloads meanwhile take the copy path).

Leases are taken on the pool's event loop (the frame reader's payload
sink) and given back from the loop or a session's worker: one lock.
"""

from __future__ import annotations

import bisect
import fcntl
import logging
import mmap
import os
import threading
import time

LOG = logging.getLogger("accelmig.pool.devices")

#: leases start on a page boundary: a device runtime that pins host pages
#: never sees two leases share one
ALIGN = mmap.PAGESIZE


class ArenaLease:
    """``size`` bytes of an arena at ``offset``, writable through ``view``
    until ``release`` (idempotent: the last holder of a payload gives it back)."""

    __slots__ = ("arena", "offset", "size", "view", "_released")

    def __init__(self, arena: "UploadArena", offset: int, size: int):
        self.arena, self.offset, self.size = arena, offset, size
        self.view = memoryview(arena.map)[offset:offset + size]
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.arena._give_back(self)

    def __repr__(self) -> str:
        return f"<ArenaLease {self.size} B at {self.offset}{' released' if self._released else ''}>"


class UploadArena:
    """The pool's side of one arena: the mapping, the allocator, the counts."""

    NAME = "accelmig-upload-arena"

    def __init__(self, size: int, clock=time.monotonic):
        if size < ALIGN:
            raise ValueError(f"an upload arena of {size} bytes holds not one page")
        self.size = size - size % ALIGN
        fd = os.memfd_create(self.NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, self.size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.map = mmap.mmap(fd, self.size)
            self.inode = os.fstat(fd).st_ino     # which memfd it is (status, tests)
            # what the device process inherits: the same pages, read-only
            self.child_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            os.close(fd)
        self._lock = threading.Lock()
        self._free_offsets = [0]            # free runs, sorted by offset, never adjacent
        self._free_sizes = {0: self.size}
        self.in_use = 0
        self.leases = 0                     # payloads received into the arena
        self.fallbacks = 0                  # payloads that did not fit: the copy path took them
        self.clock = clock
        self.last_used = clock()
        self.touched = False                # pages written since the last trim: resident
        self.trimming = False               # its pages are going back: no lease meanwhile
        self.trims = 0

    def close_child_fd(self) -> None:
        """Once the device process holds it: the pool keeps only its mapping."""
        if self.child_fd >= 0:
            os.close(self.child_fd)
            self.child_fd = -1

    def lease(self, nbytes: int) -> ArenaLease | None:
        """A run of ``nbytes`` (first fit), or None when none is free (or
        for nothing: an empty payload needs no place)."""
        if nbytes <= 0:
            return None
        need = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            if self.trimming:
                self.fallbacks += 1
                return None
            for index, offset in enumerate(self._free_offsets):
                have = self._free_sizes[offset]
                if have < need:
                    continue
                del self._free_sizes[offset]
                if have == need:
                    del self._free_offsets[index]
                else:
                    self._free_offsets[index] = offset + need
                    self._free_sizes[offset + need] = have - need
                self.in_use += need
                self.leases += 1
                self.touched = True
                return ArenaLease(self, offset, nbytes)
            self.fallbacks += 1
            return None

    def _give_back(self, lease: ArenaLease) -> None:
        offset, size = lease.offset, -(-lease.size // ALIGN) * ALIGN
        with self._lock:
            self.in_use -= size
            self.last_used = self.clock()
            index = bisect.bisect(self._free_offsets, offset)
            # join the free run after it, then the one before it
            after = offset + size
            if index < len(self._free_offsets) and self._free_offsets[index] == after:
                size += self._free_sizes.pop(after)
                del self._free_offsets[index]
            if index and self._free_offsets[index - 1] + self._free_sizes[self._free_offsets[index - 1]] == offset:
                before = self._free_offsets[index - 1]
                self._free_sizes[before] += size
            else:
                self._free_offsets.insert(index, offset)
                self._free_sizes[offset] = size

    def begin_trim(self, idle_for: float) -> bool:
        """True when nothing was leased for ``idle_for`` seconds and pages
        are resident: the caller must ``end_trim`` (no lease until then)."""
        with self._lock:
            if self.in_use or not self.touched or self.trimming or self.clock() - self.last_used < idle_for:
                return False
            self.trimming = True
            return True

    def end_trim(self) -> int:
        """Give the pages back (without the lock: it takes a while); the bytes."""
        try:
            self.map.madvise(mmap.MADV_REMOVE)
        finally:
            with self._lock:
                self.trimming = False
                self.touched = False
                self.trims += 1
        return self.size

    def free_runs(self) -> list[tuple[int, int]]:
        """(offset, size) of every free run, in order: a view of the free list's
        invariant (sorted, never two runs touching) for checks, not a path
        the pool takes."""
        with self._lock:
            return [(offset, self._free_sizes[offset]) for offset in self._free_offsets]


def map_child_arena(fd: int, size: int) -> memoryview:
    """The device process's side: its inherited descriptor, mapped read-only,
    after checking it is as large as the pool said."""
    have = os.fstat(fd).st_size
    if have != size:
        raise ValueError(f"the upload arena is {have} bytes, the pool said {size}")
    mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    os.close(fd)
    return memoryview(mapping)
