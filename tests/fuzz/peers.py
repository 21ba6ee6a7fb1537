"""Real peers for the fuzz tests: an ``accelmig-pool serve`` process (a
crash is a failed test, not a dead test run; its log is checked for
tracebacks), and hand-driven connections that say what no driver would."""

from __future__ import annotations

import os
import socket

from accelmig.wire.frames import FrameReader, encode_frame
from tests.support.processes import LoggedProcess, PoolProcess, tenants_toml
from tests.support.tenants import ALICE, BOB

HOST_SECRETS = {"hostA": "hostA-secret-0123456789"}


def start_pool(directory, *extra) -> PoolProcess:
    """A pool process on loopback, two tenants, hostA as 127.0.0.0/8, and
    ``extra`` options (a short grace, so that the sessions a fuzz example
    leaves behind go soon)."""
    pool = PoolProcess(directory, tenants_toml(alice=ALICE, bob=BOB),
                       f'[hosts.hostA]\nsecret = "{HOST_SECRETS["hostA"]}"\naddresses = ["127.0.0.0/8"]\n',
                       extra=extra)
    for path in (pool.tokens, pool.hosts):
        os.chmod(path, 0o600)
    return pool


def problems(proc: LoggedProcess) -> list[str]:
    """Log entries of ``proc`` that say a bug was hit (a traceback, an
    internal error), as 'level: message' lines."""
    bad = []
    for entry in proc.entries():
        text = entry.get("msg", "") + entry.get("exc", "")
        if entry.get("level") in ("error", "critical") or "Traceback" in text or "internal error" in text \
                or "INTERNAL" in text:
            bad.append(f"{entry.get('level')}: {entry.get('msg')} {entry.get('exc', '')}")
    return bad


def dial(endpoint: str, timeout: float = 15) -> socket.socket:
    host, port = endpoint.rsplit(":", 1)
    return socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)


class FrameConn:
    """A data-plane or control-plane connection driven frame by frame."""

    def __init__(self, endpoint: str, timeout: float = 15):
        self.sock = dial(endpoint, timeout)
        self.reader = FrameReader()
        self.frames: list[dict] = []
        self.closed = False

    def send(self, header: dict, payload: bytes = b"") -> None:
        self.sendraw(encode_frame(header, payload))

    def sendraw(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            self.closed = True          # the peer already closed: what it sent is still to be read

    def done_sending(self) -> None:
        """Half-close: the peer handles what came, then closes.  It may have
        closed already (what it sent before is still to be read)."""
        if self.closed:
            return
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:            # ENOTCONN: the peer's close came first
            self.closed = True

    def _more(self) -> bool:
        try:
            n = self.sock.recv_into(self.reader.get_buffer())
        except ConnectionResetError:
            n = 0
        if n == 0:
            self.closed = True
            return False
        self.frames += [f.header for f in self.reader.feed(n)]
        return True

    def next(self) -> dict | None:
        """The next frame, None once the peer closed (the socket's timeout
        bounds a peer that does neither: the test then fails)."""
        while not self.frames:
            if not self._more():
                return None
        return self.frames.pop(0)

    def until_closed(self) -> list[dict]:
        """Every frame until the peer closes."""
        out = []
        while True:
            frame = self.next()
            if frame is None:
                return out
            out.append(frame)

    def close(self) -> None:
        self.sock.close()
