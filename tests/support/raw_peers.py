"""Hand-driven peers of a real pool process, for tests that attack it:
``RawPeer`` speaks the data plane frame by frame (TLS or plain, from any
loopback address), doing only what the test says — what a hostile or
broken driver does; ``PoolWatch`` reads the pool's own state through its
admin socket; ``rss`` reads a process's resident memory."""

from __future__ import annotations

import socket
import ssl

from accelmig.wire.control import ControlClient
from accelmig.wire.frames import FrameReader, encode_frame


class RawPeer:
    """One data-plane connection from ``source`` (an address of this
    machine: 127.0.0.2 reaches loopback too), TLS when ``cafile`` is given.
    ``handshake=False``: TCP only, not even a ClientHello (a silent peer)."""

    def __init__(self, endpoint: str, cafile=None, *, source: str = "127.0.0.1", handshake: bool = True,
                 timeout: float = 10.0):
        host, port = endpoint.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout, source_address=(source, 0))
        if cafile is not None and handshake:
            context = ssl.create_default_context(cafile=str(cafile))
            self.sock = context.wrap_socket(self.sock, server_hostname=host)
        self.reader = FrameReader()
        self._frames: list = []

    def send(self, header: dict, payload=b"") -> None:
        self.sock.sendall(encode_frame(header, payload))

    def next_frame(self):
        """The pool's next frame (header, payload); AssertionError when it closes first."""
        while not self._frames:
            n = self.sock.recv_into(self.reader.get_buffer())
            assert n, "the pool closed the connection"
            self._frames.extend(self.reader.feed(n))
        frame = self._frames.pop(0)
        return frame.header, frame.payload

    def frames_until_closed(self) -> list[dict]:
        """Every frame's header until the pool closes (the socket's timeout
        bounds a pool that never does: the test then fails)."""
        out = [f.header for f in self._frames]
        self._frames = []
        while True:
            try:
                n = self.sock.recv_into(self.reader.get_buffer())
            except (ConnectionResetError, ssl.SSLError):
                return out
            if n == 0:
                return out
            out.extend(f.header for f in self.reader.feed(n))

    def open(self, token: str) -> dict:
        """hello + open; the ``opened`` answer."""
        self.send({"op": "hello", "versions": [1]})
        self.send({"op": "open", "token": token, "secret": "ab" * 32})
        welcome, _ = self.next_frame()
        assert welcome["op"] == "welcome", welcome
        opened, _ = self.next_frame()
        assert opened["op"] == "opened", opened
        return opened

    def replies_through(self, seq: int) -> list[dict]:
        """Reply headers until the one of ``seq`` (a "done" range counts)."""
        out = []
        while True:
            header, _ = self.next_frame()
            out.append(header)
            if header.get("op") == "error":
                raise AssertionError(f"the pool closed with {header['error']}")
            if header.get("seq") == seq or (header.get("op") == "done" and header["to"] >= seq):
                return out

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class PoolWatch:
    """The pool's state as its admin socket tells it (each call a fresh connection)."""

    def __init__(self, admin_socket):
        self.admin_socket = str(admin_socket)

    def call(self, method: str, **args) -> dict:
        with ControlClient("unix:" + self.admin_socket, "admin", None) as client:
            return client.call_all(method, **args)

    def sessions(self) -> dict[str, str]:
        """sid -> state of every session the pool still holds."""
        return {s["sid"]: s["state"] for s in self.call("list_sessions")["sessions"]}

    def bytes_in_use(self) -> int:
        """Device memory the pool counts as held, all devices together."""
        return sum(d["bytes_in_use"] for d in self.call("list_devices")["devices"])


def rss(pid: int) -> int:
    """Resident memory of process ``pid``, in bytes."""
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")
