"""Local unix-socket endpoints with one owner per path.

Every side serves a local API on a unix socket: hostd (the hook and the
CLI), the pool (its admin socket), the guest agent (the drivers).  Two
instances on one path are never right: the second takes the path over, and
whichever exits first unlinks the socket the other one still serves.  So a
service claims its path first:

- a lock file beside the socket (``<path>.lock``, ``flock``) says who owns
  it; a second instance gets ``AlreadyRunning`` naming the owner's pid and
  touches nothing;
- a socket left by an owner that died (its lock is free) is replaced; any
  other file at the path is refused, never removed;
- on close, the path is unlinked only if it is still the socket this
  process bound (same inode).

Standard library only (the guest agent uses it).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat

from accelmig.wire.errors import AlreadyRunning, ConfigInvalid


def lock_path(path: str) -> str:
    return path + ".lock"


class OwnedUnixSocket:
    """A listening unix socket at ``path`` that this process owns.

    ::

        owned = OwnedUnixSocket("/run/accelmig/hostd.sock", what="accelmig hostd")
        sock = owned.open()          # AlreadyRunning if another instance has it
        ...
        owned.close()
    """

    def __init__(self, path: str, *, mode: int = 0o600, what: str = "a service", backlog: int = 64):
        self.path = path
        self.mode = mode
        self.what = what
        self.backlog = backlog
        self.sock: socket.socket | None = None
        self._lock_fd: int | None = None
        self._inode: tuple[int, int] | None = None

    def open(self) -> socket.socket:
        """Claim the path, bind and listen; the socket is non-blocking."""
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._claim()
        try:
            self._remove_stale()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(self.path)
                os.chmod(self.path, self.mode)
                sock.listen(self.backlog)
                sock.setblocking(False)
            except OSError:
                sock.close()
                raise
            info = os.stat(self.path)
            self._inode = (info.st_dev, info.st_ino)
            self.sock = sock
            return sock
        except BaseException:
            self._release_lock()
            raise

    def _claim(self) -> None:
        path = lock_path(self.path)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                owner = _read_pid(fd)
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise AlreadyRunning(what=self.what, path=self.path,
                                         pid=owner if owner is not None else "?") from None
                raise
            # The previous owner may have unlinked the lock file between our
            # open and our flock: then we hold a lock nobody else can see.
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def _remove_stale(self) -> None:
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(info.st_mode):
            raise ConfigInvalid(source=self.path, reason=(
                f"{self.what} would listen here, but the path is not a socket "
                "(refusing to replace it: choose another socket path or remove it)"))
        os.unlink(self.path)          # left by an owner that is gone: its lock was free

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()
        if self._inode is not None:
            try:
                info = os.lstat(self.path)
                if (info.st_dev, info.st_ino) == self._inode:
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
            self._inode = None
        self._release_lock()

    def _release_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is None:
            return
        try:
            os.unlink(lock_path(self.path))       # still ours: we hold the lock
        except FileNotFoundError:
            pass
        os.close(fd)

    def __enter__(self) -> "OwnedUnixSocket":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None
