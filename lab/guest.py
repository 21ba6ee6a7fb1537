"""Talking to a lab guest over its virtio-serial channel, and the tiny echo
responder the lab puts into test images to prove that channel works.

The responder is *not* the guest agent (``accelmig.agent`` owns the real
channel protocol): it answers one JSON object per line on the agent's port
so that tests and ``accelmig lab boot-test`` can check the
plumbing — virtio ports named without udev, libvirt's per-domain socket on
each host, the channel after a live migration, and the guest's fabric NIC
(``connect`` opens a TCP connection from inside the guest).  Boot the guest
with ``accelmig.agent=off`` so the agent does not hold the port.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from accelmig.plugin.domain import AGENT_CHANNEL_NAME

from .image import ExtraFile

#: The responder, guest side (standard library only; runs as
#: ``python3 /usr/local/bin/accelmig-echo-responder PORT``).
ECHO_RESPONDER = r'''
"""accelmig lab echo responder: one JSON reply per JSON line on a virtio port.

ops: echo {data} | info | connect {host, port, data, timeout} | run {argv}
(`run` exists for tests that re-address the guest after a migration; this
responder is only ever put into test images).
"""
import errno, json, os, select, socket, subprocess, sys, time

PORT = sys.argv[1]


def handle(req):
    op = req.get("op")
    if op == "echo":
        return {"echo": req.get("data")}
    if op == "info":
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        addrs = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
        return {"hostname": socket.gethostname(), "uptime": uptime, "addrs": addrs}
    if op == "connect":
        t0 = time.monotonic()
        with socket.create_connection((req["host"], int(req["port"])), timeout=req.get("timeout", 5)) as s:
            s.sendall(req.get("data", "hello\n").encode())
            reply = s.recv(4096).decode()
            return {"local": list(s.getsockname()), "reply": reply,
                    "seconds": round(time.monotonic() - t0, 4)}
    if op == "run":
        p = subprocess.run(req["argv"], capture_output=True, text=True, timeout=req.get("timeout", 10))
        return {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
    raise ValueError(f"unknown op {op!r}")


def write_all(fd, data):
    while data:
        try:
            data = data[os.write(fd, data):]
        except BlockingIOError:       # right after a migration or a host reconnect
            time.sleep(0.01)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EINTR):
                time.sleep(0.01)
                continue
            return                    # the host end went away: the reply is lost


def main():
    while not os.path.exists(PORT):
        time.sleep(0.05)
    fd = os.open(PORT, os.O_RDWR | os.O_NONBLOCK)
    with open("/proc/uptime") as f:
        print(f"echo responder on {PORT}, up {f.read().split()[0]} s", flush=True)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    buf = b""
    while True:
        events = poller.poll(1000)
        if not events:
            continue
        mask = events[0][1]
        chunk = b""
        if mask & select.POLLIN:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
        if not chunk:
            # No host end connected: POLLHUP / EOF continuously. Sleep, never spin.
            buf = b""
            time.sleep(0.05)
            continue
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                req = json.loads(line)
                reply = {"id": req.get("id"), "ok": True, **handle(req)}
            except Exception as exc:
                reply = {"id": None, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
                try:
                    reply["id"] = json.loads(line).get("id")
                except Exception:
                    pass
            write_all(fd, (json.dumps(reply) + "\n").encode())


main()
'''

ECHO_INIT = f"""#!/bin/sh
# accelmig lab echo responder on the agent's port (test images only).
. /etc/accelmig/lib.sh
(
    wait_port {AGENT_CHANNEL_NAME} 30 || {{ log "no port {AGENT_CHANNEL_NAME}"; exit 1; }}
    exec python3 /usr/local/bin/accelmig-echo-responder /dev/virtio-ports/{AGENT_CHANNEL_NAME}
) </dev/null >/dev/console 2>&1 &
"""


def echo_responder_files() -> tuple[ExtraFile, ...]:
    """Extra image files that start the echo responder at boot (40-, before
    the agent's 50-: boot such a guest with ``accelmig.agent=off``)."""
    return (
        ExtraFile("/usr/local/bin/accelmig-echo-responder", ECHO_RESPONDER.lstrip().encode(), 0o755),
        ExtraFile("/etc/accelmig/init.d/40-echo-responder", ECHO_INIT.encode(), 0o755),
    )


# ---------------------------------------------------------------- host side

def connect_unix(path: str | os.PathLike, timeout: float | None = None) -> socket.socket:
    """Connect to a unix socket, even one whose path exceeds the 108-byte
    ``sun_path`` limit (libvirt's per-domain channel sockets seen from the
    root namespace easily do): go through ``/proc/self/fd`` of its directory."""
    path = str(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    if len(path.encode()) < 100:
        try:
            sock.connect(path)
            return sock
        except BaseException:
            sock.close()
            raise
    dirfd = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY)
    try:
        sock.connect(f"/proc/self/fd/{dirfd}/{os.path.basename(path)}")
        return sock
    except BaseException:
        sock.close()
        raise
    finally:
        os.close(dirfd)


def channel_source(domain_xml: str, name: str = AGENT_CHANNEL_NAME) -> str:
    """The socket path libvirt chose for a channel, from a live domain XML
    (as the daemon sees it: map it with ``LibvirtNode.host_path``)."""
    root = ET.fromstring(domain_xml)
    for channel in root.iterfind("./devices/channel"):
        target = channel.find("target")
        if target is not None and target.get("name") == name:
            source = channel.find("source")
            if source is not None and source.get("path"):
                return source.get("path")
    raise LookupError(f"the domain has no channel {name} with a socket path (is it running?)")


def channel_state(domain_xml: str, name: str = AGENT_CHANNEL_NAME) -> str | None:
    """``connected``/``disconnected`` as libvirt sees the guest end (live XML)."""
    root = ET.fromstring(domain_xml)
    for channel in root.iterfind("./devices/channel"):
        target = channel.find("target")
        if target is not None and target.get("name") == name:
            return target.get("state")
    return None


class ChannelClient:
    """JSON lines over a domain's channel socket (to the echo responder)."""

    def __init__(self, path: str | os.PathLike, timeout: float = 10.0):
        self.path = Path(path)
        self.sock = connect_unix(self.path, timeout)
        self.buf = b""
        self.ids = itertools.count(1)

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def send(self, op: str, **args) -> int:
        msg_id = next(self.ids)
        self.sock.sendall((json.dumps({"id": msg_id, "op": op, **args}) + "\n").encode())
        return msg_id

    def recv(self, msg_id: int, timeout: float) -> dict:
        """The reply to ``msg_id`` (replies to older requests are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                reply = json.loads(line)
                if reply.get("id") == msg_id:
                    if not reply.get("ok"):
                        raise RuntimeError(f"guest: {reply.get('error')}")
                    return reply
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply to request {msg_id} within {timeout:.1f} s")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                continue
            if not chunk:
                raise ConnectionError("the channel socket closed (the guest's QEMU exited?)")
            self.buf += chunk

    def call(self, op: str, timeout: float = 10.0, **args) -> dict:
        return self.recv(self.send(op, **args), timeout)

    def wait_ready(self, timeout: float = 60.0, interval: float = 0.25) -> float:
        """Ping until the guest answers (it may still be booting); seconds waited.

        Requests sent before the guest opened its port wait in the socket
        and are answered later: replies are matched by id, so stale ones
        are skipped."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        while True:
            msg_id = self.send("echo", data="ping")
            try:
                self.recv(msg_id, min(interval, max(0.01, deadline - time.monotonic())))
                return time.monotonic() - t0
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the guest did not answer on {self.path} within {timeout:.0f} s") from None


#: A TCP server for the pool namespace that answers every connection with
#: the peer address it saw (proves the guest's traffic arrives un-NATed).
PEER_ECHO_SERVER = r'''
import socket, sys
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2])))
srv.listen(16)
print("listening", flush=True)
while True:
    conn, peer = srv.accept()
    with conn:
        conn.settimeout(5)
        try:
            conn.recv(4096)
            conn.sendall(f"{peer[0]}\n".encode())
        except OSError:
            pass
'''


def peer_echo_argv(address: str, port: int) -> list[str]:
    """argv of :data:`PEER_ECHO_SERVER` (run it with ``Lab.spawn(..., "pool", argv)``)."""
    import sys
    return [sys.executable, "-I", "-S", "-c", PEER_ECHO_SERVER, address, str(port)]
