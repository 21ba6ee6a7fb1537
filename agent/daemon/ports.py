"""The guest end of the host<->guest channel.

``VirtioPort``: the virtio-serial character device
(``/dev/virtio-ports/org.accelmig.agent.0``), or any character device such
as a pty in tests.  While no host end is connected the device reports
POLLHUP continuously and ``read()`` returns EOF: the agent must then back
off (poll later), never spin; right after the host (re)connects a write can
fail with EAGAIN: wait until writable and retry.

``UnixPort``: a listening unix socket standing in for the device (tests, a
trial without a VM).  The host end connects to it exactly as hostd connects
to the QEMU chardev socket of a real VM; one host at a time, and when it
goes the port waits for the next.

Both give the agent the same small interface: ``fileno()`` to poll (None
while backing off), ``read()`` -> bytes, ``b""`` for nothing, or ``None`` for
"the host went away", and ``write(data)``.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import stat
import termios
import time
import tty

from accelmig.runtime.sockets import OwnedUnixSocket

LOG = logging.getLogger(__name__)

HANGUP_BACKOFF = 0.2     # s between looks at a port with no host on it
WRITE_TIMEOUT = 5.0


class PortClosed(Exception):
    """The host end is gone: what was being written is lost."""


class VirtioPort:
    def __init__(self, path: str):
        self.path = path
        self.fd: int | None = None
        self.host_connected = False
        self._retry_at = 0.0
        self.write_waits = 0          # writes that met EAGAIN and waited
        self._open()

    def _open(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        if os.isatty(fd):
            tty.setraw(fd, termios.TCSANOW)   # a pty: no echo, no line editing
        self.fd = fd

    def fileno(self) -> int | None:
        if time.monotonic() < self._retry_at:
            return None
        return self.fd

    def next_look_in(self) -> float | None:
        wait = self._retry_at - time.monotonic()
        return wait if wait > 0 else None

    def poll_events(self) -> int:
        return select.POLLIN

    def _hangup(self) -> None:
        if self.host_connected:
            LOG.info("channel: the host end went away")
        self.host_connected = False
        self._retry_at = time.monotonic() + HANGUP_BACKOFF

    def read(self, revents: int = select.POLLIN):
        """Bytes read; b"" when nothing was there; None when no host is there."""
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            if revents & select.POLLHUP:
                self._hangup()
                return None
            return b""
        except OSError as exc:
            if exc.errno in (errno.EIO, errno.ENXIO, errno.EPIPE, errno.ECONNRESET):
                self._hangup()      # a pty whose master closed, a port being torn down
                return None
            raise
        if not data:
            self._hangup()
            return None
        if not self.host_connected:
            LOG.info("channel: the host end is here")
        self.host_connected = True
        return data

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        deadline = time.monotonic() + WRITE_TIMEOUT
        while view:
            try:
                n = os.write(self.fd, view)
                view = view[n:]
            except BlockingIOError:
                # EAGAIN right after a migration or a host reconnect: wait, retry.
                self.write_waits += 1
                if time.monotonic() > deadline:
                    raise PortClosed(f"{self.path}: not writable for {WRITE_TIMEOUT:.0f} s") from None
                poller = select.poll()
                poller.register(self.fd, select.POLLOUT)
                poller.poll(50)
            except OSError as exc:
                if exc.errno in (errno.EIO, errno.ENXIO, errno.EPIPE, errno.ECONNRESET):
                    self._hangup()
                    raise PortClosed(f"{self.path}: {exc.strerror}") from None
                raise

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class UnixPort:
    def __init__(self, path: str):
        self.path = path
        # one agent per path: a second one stops here; a file that is not a socket is never removed
        self._owned = OwnedUnixSocket(path, mode=0o600, what="accelmig-agent (channel port)", backlog=4)
        self.listener = self._owned.open()
        self.conn: socket.socket | None = None

    @property
    def host_connected(self) -> bool:
        return self.conn is not None

    def fileno(self) -> int:
        return self.conn.fileno() if self.conn is not None else self.listener.fileno()

    def next_look_in(self) -> float | None:
        return None

    def poll_events(self) -> int:
        return select.POLLIN

    def read(self, revents: int = select.POLLIN):
        if self.conn is None:
            try:
                conn, _ = self.listener.accept()
            except BlockingIOError:
                return b""
            conn.setblocking(False)
            self.conn = conn
            LOG.info("channel: the host end is here")
            return b""
        try:
            data = self.conn.recv(65536)
        except BlockingIOError:
            return b""
        except OSError:
            data = b""
        if not data:
            LOG.info("channel: the host end went away")
            self.conn.close()
            self.conn = None
            return None
        return data

    def write(self, data: bytes) -> None:
        conn = self.conn
        if conn is None:
            raise PortClosed("no host connected")
        view = memoryview(data)
        deadline = time.monotonic() + WRITE_TIMEOUT
        while view:
            try:
                view = view[conn.send(view):]
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise PortClosed("host not reading") from None
                select.select([], [conn], [], 0.05)
            except OSError as exc:
                raise PortClosed(str(exc)) from None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self._owned.close()             # unlinks the path only while it is still this socket


class NullPort:
    """No channel at all: a VM that has only qemu-guest-agent (what OpenStack
    Nova builds) reaches the agent through ``accelmig-agent rehome --stdin``."""

    host_connected = False
    path = "none"

    def fileno(self):
        return None

    def next_look_in(self):
        return 1.0

    def poll_events(self) -> int:
        return 0

    def read(self, revents: int = 0):
        return None

    def write(self, data: bytes) -> None:
        raise PortClosed("this agent has no host channel")

    def close(self) -> None:
        pass


def open_port(path: str):
    """A VirtioPort for a character device, NullPort for "none", a UnixPort
    for anything else."""
    if path == "none":
        return NullPort()
    if os.path.exists(path) and stat.S_ISCHR(os.stat(path).st_mode):
        return VirtioPort(path)
    return UnixPort(path)
