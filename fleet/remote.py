"""One SSH connection to one node of the fleet (paramiko).

As OpenSSH's client would, by default: host keys checked against the
inventory's ``known_hosts`` (an unknown host or a changed key is refused:
never trusted on first use), key authentication only (no password prompt
to hang on), an optional jump host reached first, the node through a
``direct-tcpip`` channel of it (what ``ssh -J`` does).  Commands run as
root: directly when the inventory's user is root, else through ``sudo -n``
(a sudo that would ask for a password fails at once).

Output is bounded (``MAX_OUTPUT`` per stream) and every command has a
deadline: a node that hangs or floods costs the fleet one failed node,
never the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import select
import shlex
import socket
import time
from pathlib import Path

import paramiko

from accelmig.fleet.inventory import Inventory, Node
from accelmig.wire.errors import AccelmigError, ConfigInvalid, ErrorCode, Unavailable

LOG = logging.getLogger("accelmig.fleet")

MAX_OUTPUT = 8 << 20
CHUNK = 256 << 10
OPS_SOURCE = Path(__file__).with_name("remote_ops.py").read_text()


class RemoteFailed(AccelmigError):
    msg_fmt = "%(node)s: %(what)s failed (exit status %(status)s): %(reason)s"
    code = ErrorCode.UNAVAILABLE


@dataclasses.dataclass
class Result:
    status: int
    stdout: bytes
    stderr: bytes

    @property
    def text(self) -> str:
        return self.stdout.decode(errors="replace")

    def why(self) -> str:
        """The last lines of stderr (else stdout): what a failure says."""
        lines = (self.stderr or self.stdout).decode(errors="replace").strip().splitlines()
        return " / ".join(lines[-3:]) or "(no output)"


def _connect_error(node: Node, exc: Exception) -> Unavailable:
    if isinstance(exc, paramiko.BadHostKeyException):
        reason = (f"its host key is not the one known_hosts has for {exc.hostname} (expected "
                  f"{exc.expected_key.get_name()} {exc.expected_key.get_base64()[:16]}..., got "
                  f"{exc.key.get_name()} {exc.key.get_base64()[:16]}...): refused")
    elif isinstance(exc, paramiko.SSHException) and "not found in known_hosts" in str(exc):
        reason = (f"{exc}: its host key is not in known_hosts; add it after checking it "
                  f"(ssh-keyscan, then compare with the node's own ssh-keygen -lf)")
    elif isinstance(exc, paramiko.AuthenticationException):
        reason = f"the node refused the key: {exc}"
    elif isinstance(exc, (socket.timeout, TimeoutError)):
        reason = "connection timed out"
    else:
        reason = str(exc) or type(exc).__name__
    return Unavailable(what=f"{node.name} ({node.user}@{node.address}:{node.port})", reason=reason)


class Remote:
    """A connected node: ``run`` commands as root, ``op`` the remote_ops script."""

    def __init__(self, inventory: Inventory, node: Node):
        self.inventory, self.node = inventory, node
        self.client: paramiko.SSHClient | None = None
        self.jump: paramiko.SSHClient | None = None

    def _client(self) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        ssh = self.inventory.ssh
        if os.path.exists(ssh.known_hosts):
            client.load_host_keys(ssh.known_hosts)
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        return client

    def _auth(self) -> dict:
        ssh = self.inventory.ssh
        if not ssh.key:
            return {"allow_agent": True, "look_for_keys": True}
        # Loaded here, not by connect(): connect() reports a key it could not
        # read as whatever its last key type said, and a refused key the same way.
        try:
            pkey = paramiko.PKey.from_path(ssh.key)
        except (paramiko.PasswordRequiredException, TypeError):
            # (TypeError: cryptography's word for an encrypted PEM key without a password)
            raise ConfigInvalid(source=self.inventory.path, reason=f"ssh.key: {ssh.key} is protected by a "
                                f"passphrase: leave ssh.key out and load it into ssh-agent") from None
        except (paramiko.SSHException, OSError, ValueError) as exc:
            raise ConfigInvalid(source=self.inventory.path, reason=f"ssh.key: cannot read {ssh.key}: {exc}") from None
        return {"pkey": pkey, "allow_agent": False, "look_for_keys": False}

    def connect(self, sock=None) -> "Remote":
        """``sock``: a socket already connected to the node's SSH server (a
        test's socket pair); else TCP, through the jump host if any."""
        ssh, node = self.inventory.ssh, self.node
        try:
            if ssh.jump and sock is None:
                user, host, port = ssh.jump
                self.jump = self._client()
                self.jump.connect(host, port=port, username=user, timeout=ssh.connect_timeout,
                                  banner_timeout=ssh.connect_timeout, auth_timeout=ssh.connect_timeout,
                                  **self._auth())
                sock = self.jump.get_transport().open_channel(
                    "direct-tcpip", (node.address, node.port), ("127.0.0.1", 0), timeout=ssh.connect_timeout)
            self.client = self._client()
            self.client.connect(node.address, port=node.port, username=node.user, sock=sock,
                                timeout=ssh.connect_timeout, banner_timeout=ssh.connect_timeout,
                                auth_timeout=ssh.connect_timeout, **self._auth())
        except (paramiko.SSHException, OSError) as exc:
            self.close()
            if ssh.jump and self.client is None and sock is None:
                raise _connect_error(Node(name=f"jump host for {node.name}", role="jump", address=ssh.jump[1],
                                          port=ssh.jump[2], user=ssh.jump[0]), exc) from None
            raise _connect_error(node, exc) from None
        LOG.debug("%s: connected (%s@%s:%d%s)", node.name, node.user, node.address, node.port,
                  f" via {ssh.jump[1]}" if ssh.jump else "")
        return self

    def close(self) -> None:
        for client in (self.client, self.jump):
            if client is not None:
                client.close()
        self.client = self.jump = None

    def __enter__(self) -> "Remote":
        return self.connect()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ commands

    def command_line(self, argv: list[str]) -> str:
        line = shlex.join(argv)
        return f"sudo -n -- {line}" if self.node.sudo else line

    def run(self, argv: list[str], *, stdin: bytes = b"", timeout: float | None = None,
            check: str | None = None) -> Result:
        """Run ``argv`` as root on the node; ``check``: what it does, to
        raise :class:`RemoteFailed` with when it exits non-zero."""
        timeout = timeout or self.inventory.ssh.command_timeout
        channel = self.client.get_transport().open_session(timeout=self.inventory.ssh.connect_timeout)
        try:
            channel.settimeout(1.0)
            channel.exec_command(self.command_line(argv))
            out, err = bytearray(), bytearray()
            deadline = time.monotonic() + timeout
            view, sent = memoryview(stdin), 0
            if not stdin:
                channel.shutdown_write()
            while True:
                if time.monotonic() > deadline:
                    raise RemoteFailed(node=self.node.name, what=check or argv[0], status="none",
                                       reason=f"no end after {timeout:.0f} s: stopped")
                if sent < len(view) and channel.send_ready():
                    sent += channel.send(view[sent:sent + CHUNK])
                    if sent == len(view):
                        channel.shutdown_write()
                progressed = False
                while channel.recv_ready():
                    out += channel.recv(CHUNK)
                    progressed = True
                while channel.recv_stderr_ready():
                    err += channel.recv_stderr(CHUNK)
                    progressed = True
                if len(out) > MAX_OUTPUT or len(err) > MAX_OUTPUT:
                    raise RemoteFailed(node=self.node.name, what=check or argv[0], status="none",
                                       reason=f"more than {MAX_OUTPUT >> 20} MiB of output: stopped")
                if channel.exit_status_ready() and not channel.recv_ready() and not channel.recv_stderr_ready():
                    break
                if not progressed:
                    select.select([channel], [], [], 0.05)
            result = Result(channel.recv_exit_status(), bytes(out), bytes(err))
        finally:
            with contextlib.suppress(EOFError, OSError, paramiko.SSHException):
                channel.close()          # (a node that flooded may have taken the transport down)
        if check and result.status != 0:
            raise RemoteFailed(node=self.node.name, what=check, status=result.status, reason=result.why())
        return result

    def op(self, *args: str, stdin: bytes = b"") -> dict:
        """One operation of :mod:`accelmig.fleet.remote_ops` (its JSON answer)."""
        result = self.run([self.inventory.python, "-c", OPS_SOURCE, *args], stdin=stdin, check=f"remote_ops {args[0]}")
        try:
            return json.loads(result.stdout.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise RemoteFailed(node=self.node.name, what=f"remote_ops {args[0]}", status=0,
                               reason=f"an answer that is not JSON: {result.text[-300:]!r}") from None
