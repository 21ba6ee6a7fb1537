"""Real peers for the fuzz and soak tests: an ``accelmig-pool serve``
process and an ``accelmig-agent run`` process (a crash is a failed test,
not a dead test run; their logs are checked for tracebacks, and what they
print that is no JSON log line counts as a problem too), hand-driven
connections that say what no driver would, and what ``/proc`` says of a
process (resident memory, threads, descriptors)."""

from __future__ import annotations

import os
import socket

from accelmig.wire.frames import FrameReader, encode_frame
from tests.support.processes import AgentProcess, LoggedProcess, PoolProcess, tenants_toml
from tests.support.tenants import ALICE, BOB

#: hostA's guests come from IPv4 loopback, hostB's from IPv6 loopback (as in
#: tests/support/twohosts.py: a driver "moves" by reconnecting to [::1])
HOST_SECRETS = {"hostA": "hostA-secret-0123456789", "hostB": "hostB-secret-9876543210"}
HOST_ADDRESSES = {"hostA": "127.0.0.0/8", "hostB": "::1/128"}


def start_pool(directory, *extra, config: str = "") -> PoolProcess:
    """A pool process on loopback, two tenants, hostA as 127.0.0.0/8 and
    hostB as ::1/128, and ``extra`` options (a short grace, so that the
    sessions a fuzz example leaves behind go soon; ``--listen
    127.0.0.1:0,[::1]:0`` for a pool hostB's guests reach).  ``config``: a
    ``[pool]`` TOML table's lines, for settings without a flag."""
    hosts = "".join(f'[hosts.{name}]\nsecret = "{secret}"\naddresses = ["{HOST_ADDRESSES[name]}"]\n'
                    for name, secret in HOST_SECRETS.items())
    if config:
        path = directory / "pool.toml"
        path.write_text("[pool]\n" + config)
        extra = ("--config", path, *extra)
    pool = PoolProcess(directory, tenants_toml(alice=ALICE, bob=BOB), hosts, extra=extra)
    for path in (pool.tokens, pool.hosts):
        os.chmod(path, 0o600)
    return pool


def start_agent(directory, *extra) -> AgentProcess:
    """A guest agent process (``extra``: more ``run`` options, a short
    ``--rehome-timeout``)."""
    return AgentProcess(directory, *extra)


def problems(proc: LoggedProcess) -> list[str]:
    """Log entries of ``proc`` that say a bug was hit (a traceback, an
    internal error), as 'level: message' lines; and what it printed that is
    no log line (``AgentProcess.raw``)."""
    bad = []
    for entry in proc.entries():
        text = entry.get("msg", "") + entry.get("exc", "")
        if entry.get("level") in ("error", "critical") or "Traceback" in text or "internal error" in text \
                or "INTERNAL" in text:
            bad.append(f"{entry.get('level')}: {entry.get('msg')} {entry.get('exc', '')}")
    bad += [f"stderr: {line}" for line in getattr(proc, "raw", [])]
    return bad


def proc_status(pid: int) -> dict:
    """``/proc/PID/status`` of a process: ``rss`` (VmRSS, bytes), ``threads``,
    and ``fds`` (open descriptors)."""
    fields = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return {"rss": int(fields["VmRSS"].split()[0]) * 1024, "threads": int(fields["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs (the pool's device processes)."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except FileNotFoundError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as handle:
                    kids = [int(k) for k in handle.read().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue
            out += kids
            todo += kids
    return out


def dial(endpoint: str, timeout: float = 15) -> socket.socket:
    """A connection to ``HOST:PORT``, ``[v6]:PORT`` or ``unix:PATH``."""
    if endpoint.startswith("unix:"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(endpoint[5:])
        except BaseException:
            sock.close()
            raise
        return sock
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
