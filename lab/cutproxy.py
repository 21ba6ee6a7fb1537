"""A TCP relay that cuts or holds its connections on demand (``CutProxy``):
a test fixture, not production code, for tests, benchmarks and demos that
lose a driver's connection for real without touching either end.
"""

from __future__ import annotations

import socket
import struct
import threading

from accelmig.wire.dataplane import parse_endpoint


class CutProxy:
    """A TCP relay whose connections can be cut on demand (with a reset), to
    lose a driver's connection for real without touching either end; or
    held (``hold()``: what the client sends waits in the relay until
    ``release()``), to make the far end slow for real.  ``record``: keep
    every byte relayed, both ways, in ``recorded`` (a passive tap).
    ``relayed`` counts the bytes relayed each way (``"up"``: client to
    target, ``"down"``: back); ``cut_after`` arms a cut at an exact byte
    count, to cut in the middle of a transfer without a race."""

    def __init__(self, target: str, listen: str = "127.0.0.1:0", *, record: bool = False):
        self.target = parse_endpoint(target)
        host, port = parse_endpoint(listen, listen=True)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family)
        bound_host, bound_port = self._listener.getsockname()[:2]
        self.endpoint = f"[{bound_host}]:{bound_port}" if ":" in bound_host else f"{bound_host}:{bound_port}"
        self._pairs: list = []
        self._lock = threading.Lock()
        self.recorded: bytearray | None = bytearray() if record else None
        self.cuts = 0
        self._closed = False
        self._flowing = threading.Event()
        self._flowing.set()
        self.relayed = {"up": 0, "down": 0}
        self._trip: tuple[str, int] | None = None      # (direction, cut when relayed reaches this)
        self.tripped = threading.Event()
        threading.Thread(target=self._accept, name="cut-proxy", daemon=True).start()

    def cut_after(self, nbytes: int, direction: str = "up") -> None:
        """Cut every connection once ``nbytes`` more bytes went ``direction``
        (``"up"`` or ``"down"``): that many are relayed, not a byte more,
        then a reset (which may lose the last of them still in the socket);
        ``tripped`` is set then."""
        if direction not in self.relayed:
            raise ValueError(f"direction {direction!r} is not 'up' or 'down'")
        with self._lock:
            self.tripped.clear()
            self._trip = (direction, self.relayed[direction] + nbytes)

    def hold(self) -> None:
        """Stop forwarding what clients send (their bytes wait here)."""
        self._flowing.clear()

    def release(self) -> None:
        self._flowing.set()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, upstream))
            for a, b, gate, way in ((client, upstream, self._flowing, "up"), (upstream, client, None, "down")):
                threading.Thread(target=self._pump, args=(a, b, gate, way), daemon=True).start()

    def _pump(self, src, dst, gate: threading.Event | None, way: str) -> None:
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        try:
            while True:
                n = src.recv_into(buf)
                if n == 0:
                    break
                if gate is not None:
                    gate.wait()
                with self._lock:
                    trip = self._trip
                    if trip is not None and trip[0] == way:
                        n = min(n, trip[1] - self.relayed[way])   # up to the trip, not a byte more
                    self.relayed[way] += n
                    if self.recorded is not None:
                        self.recorded += view[:n]
                dst.sendall(view[:n])
                if trip is not None and trip[0] == way and self.relayed[way] >= trip[1]:
                    with self._lock:
                        self._trip = None
                    self.cut()
                    self.tripped.set()
                    break
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(2)
            except OSError:
                pass

    def cut(self) -> int:
        """Reset every relayed connection; return how many were cut."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for s in pair:
                try:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        self.cuts += len(pairs)
        return len(pairs)

    def close(self) -> None:
        self._closed = True
        try:
            # close() alone leaves a thread blocked in accept() accepting
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self.cut()

    def __enter__(self) -> "CutProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
