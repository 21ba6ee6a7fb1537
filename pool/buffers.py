"""Reusable host buffers for bulk payloads.

A 64 MiB ``bytearray`` costs as much to allocate (zero-filled, page by page)
as the network transfer into it.  Write payloads and read replies use
buffers from this free list instead; a buffer comes back once its command
ran on the device (writes) or once the driver acknowledged the reply that
carries it (reads).  Sizes are rounded up to powers of two; the list keeps
at most ``max_free`` bytes.
"""

from __future__ import annotations

import threading


class PayloadBuffers:
    MIN_CLASS = 1 << 16

    def __init__(self, max_free: int = 512 << 20):
        self.max_free = max_free
        self._free: dict[int, list[bytearray]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()
        self.allocated = 0
        self.reused = 0

    @classmethod
    def _class_of(cls, size: int) -> int:
        return max(cls.MIN_CLASS, 1 << (size - 1).bit_length())

    def get(self, size: int) -> memoryview:
        """A writable view of exactly ``size`` bytes (contents undefined)."""
        klass = self._class_of(size)
        with self._lock:
            stack = self._free.get(klass)
            if stack:
                block = stack.pop()
                self._free_bytes -= klass
                self.reused += 1
            else:
                block = None
        if block is None:
            block = bytearray(klass)
            self.allocated += 1
        return memoryview(block)[:size]

    def put(self, view) -> None:
        """Give a view from ``get`` back (anything else is ignored)."""
        if not isinstance(view, memoryview) or not isinstance(view.obj, bytearray):
            return
        block = view.obj
        klass = len(block)
        if klass < self.MIN_CLASS or klass & (klass - 1):
            return
        try:
            view.release()
        except BufferError:      # still exported somewhere: let it go
            return
        with self._lock:
            if self._free_bytes + klass > self.max_free:
                return
            self._free.setdefault(klass, []).append(block)
            self._free_bytes += klass
