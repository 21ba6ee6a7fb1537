"""One owner per local socket path: a second instance touches nothing, a
stale socket is replaced, anything that is not a socket is never removed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from accelmig.runtime.sockets import OwnedUnixSocket, lock_path
from accelmig.wire.errors import AlreadyRunning, ConfigInvalid


def test_a_second_owner_is_refused_and_the_first_keeps_serving(tmp_path):
    path = str(tmp_path / "svc.sock")
    first = OwnedUnixSocket(path, what="svc")
    first.open()
    inode = os.stat(path).st_ino
    with pytest.raises(AlreadyRunning, match=f"svc already runs on {path} \\(pid {os.getpid()}\\)"):
        OwnedUnixSocket(path, what="svc").open()
    assert os.stat(path).st_ino == inode
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(path)                      # still the first one's socket
    first.close()
    assert not os.path.exists(path) and not os.path.exists(lock_path(path))


def test_a_second_process_is_refused(tmp_path):
    path = str(tmp_path / "svc.sock")
    with OwnedUnixSocket(path, what="svc"):
        code = textwrap.dedent(f"""
            from accelmig.runtime.sockets import OwnedUnixSocket
            from accelmig.wire.errors import AlreadyRunning
            try:
                OwnedUnixSocket({path!r}, what="svc").open()
            except AlreadyRunning as exc:
                print(exc.message)
        """)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
        assert f"(pid {os.getpid()})" in out.stdout, out.stderr


def test_a_socket_left_by_a_dead_owner_is_replaced(tmp_path):
    path = str(tmp_path / "svc.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)                  # bound, never served, owner gone (no lock)
    stale.close()
    with OwnedUnixSocket(path) as owned:
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(path)
        assert owned.sock is not None


def test_a_path_that_is_not_a_socket_is_never_removed(tmp_path):
    path = tmp_path / "svc.sock"
    path.write_text("precious")
    with pytest.raises(ConfigInvalid, match="not a socket"):
        OwnedUnixSocket(str(path)).open()
    assert path.read_text() == "precious"
    assert not os.path.exists(lock_path(str(path)))     # the lock is given back


def test_close_leaves_a_socket_someone_else_put_at_the_path(tmp_path):
    path = str(tmp_path / "svc.sock")
    owned = OwnedUnixSocket(path)
    owned.open()
    os.unlink(path)                   # an operator removed it and another service took the name
    other = socket.socket(socket.AF_UNIX)
    other.bind(path)
    owned.close()
    assert os.path.exists(path)       # not ours: left alone
    other.close()


def test_mode_is_applied(tmp_path):
    path = str(tmp_path / "svc.sock")
    with OwnedUnixSocket(path, mode=0o600):
        assert os.stat(path).st_mode & 0o777 == 0o600
