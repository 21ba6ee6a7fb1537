"""Talking to a lab guest over its virtio-serial channel (and to its
qemu-ga: ``guest_ping``), and the tiny echo responder the lab puts into
test images to prove that channel works.

The responder is *not* the guest agent (``accelmig.agent`` owns the real
channel protocol): it answers requests in accelmig's line format on the agent's port
so that tests and ``accelmig lab boot-test`` can check the
plumbing — virtio ports named without udev, libvirt's per-domain socket on
each host, the channel after a live migration, and the guest's fabric NIC
(``connect`` opens a TCP connection from inside the guest).  Boot the guest
with ``accelmig.agent=off`` so the agent does not hold the port.
"""

from __future__ import annotations

import json
import math
import os
import time
import xml.etree.ElementTree as ET

from accelmig.plugin.domain import AGENT_CHANNEL_NAME
from accelmig.wire.channel import LineClient
from accelmig.wire.errors import Timeout

from .image import ExtraFile

#: The responder, guest side (standard library only; runs as
#: ``python3 /usr/local/bin/accelmig-echo-responder PORT``).
ECHO_RESPONDER = r'''
"""accelmig lab echo responder: one answer per request on a virtio port, in
accelmig's line format (accelmig.wire.channel: {"type", "id", ...} answered
by {"type": "result", "id", "ok", "result"|"error"}).

types: echo {data} | info | connect {host, port, data, timeout} | run {argv}
(`run` exists for tests that re-address the guest after a migration; this
responder is only ever put into test images).
"""
import errno, json, os, select, socket, subprocess, sys, time

PORT = sys.argv[1]


def handle(req):
    op = req.get("type")
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
            if not line.strip():
                continue
            try:
                req = json.loads(line)
                reply = {"type": "result", "id": req.get("id"), "ok": True, "result": handle(req)}
            except Exception as exc:
                reply = {"type": "result", "id": None, "ok": False,
                         "error": {"code": "INTERNAL", "message": f"{type(exc).__name__}: {exc}"}}
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


#: The memory dirtier, guest side (standard library only; runs as
#: ``python3 /usr/local/bin/accelmig-dirtier MIB RATE``): a guest that keeps
#: rewriting memory makes a live migration's pre-copy go round after round,
#: so the migration lasts seconds (``bench/blackout --dirty``).
MEMORY_DIRTIER = r'''
"""accelmig lab memory dirtier: fills MIB MiB of its own memory at once
(a first pre-copy round that lasts: QEMU sends zero pages almost for
free, these in full), then rewrites them one byte per 4 KiB page (each
page then differs: QEMU must send it again), RATE MiB of pages per
second, forever, spinning in between: a busy guest.  The writes are C
loops over strided slices."""
import os, sys, time

PAGE, SLICE = 4096, 4 << 20


def main():
    mib, rate = int(sys.argv[1]), float(sys.argv[2])
    os.nice(19)         # it keeps the vCPU busy, yet the agent and the application run first
    buf = bytearray(mib << 20)
    buf[::PAGE] = b"\xff" * len(range(0, len(buf), PAGE))
    print("accelmig-dirtier: rewriting %d MiB at %g MiB/s" % (mib, rate), flush=True)
    value, start, done = 1, time.monotonic(), 0.0
    while True:
        for offset in range(0, len(buf), SLICE):
            end = min(offset + SLICE, len(buf))
            buf[offset:end:PAGE] = bytes((value,)) * len(range(offset, end, PAGE))
            done += (end - offset) / (1 << 20)
            due = start + done / rate
            if time.monotonic() < due:
                # busy, never idle: the guest kernels that panicked after a
                # TCG migration were all of idle guests (docs/lab-notes.md)
                while time.monotonic() < due:
                    pass
            elif time.monotonic() - due > 1.0:      # paused (a migration's downtime): no burst
                start, done = time.monotonic(), 0.0
        value = value % 255 + 1


main()
'''

DIRTIER_INIT = """#!/bin/sh
# accelmig lab memory dirtier (bench images only): accelmig.dirty=MIB,RATE
# on the kernel command line starts it; without it nothing runs.
. /etc/accelmig/lib.sh
load_settings
[ -n "${ACCELMIG_DIRTY:-}" ] || exit 0
mib=${ACCELMIG_DIRTY%%,*}; rate=${ACCELMIG_DIRTY#*,}
case "$ACCELMIG_DIRTY" in
    *[!0-9.,]*|,*|*,|*,*,*|*.*,*) log "dirtier: bad accelmig.dirty=$ACCELMIG_DIRTY (MIB,RATE)"; exit 0;;
    *,*) ;;
    *) log "dirtier: bad accelmig.dirty=$ACCELMIG_DIRTY (MIB,RATE)"; exit 0;;
esac
(
    exec python3 /usr/local/bin/accelmig-dirtier "$mib" "$rate"
) </dev/null >/dev/console 2>&1 &
"""

#: the dirtier's first line on the console, once it runs
DIRTIER_STARTED = "accelmig-dirtier: rewriting"


def memory_dirtier_files() -> tuple[ExtraFile, ...]:
    """Extra image files for the memory dirtier; it runs only in a guest
    booted with ``dirty_cmdline(...)`` on its kernel command line."""
    return (
        ExtraFile("/usr/local/bin/accelmig-dirtier", MEMORY_DIRTIER.lstrip().encode(), 0o755),
        ExtraFile("/etc/accelmig/init.d/55-dirtier", DIRTIER_INIT.encode(), 0o755),
    )


def dirty_cmdline(mib: int, rate: float) -> str:
    """The kernel command line word that starts the dirtier: ``mib`` MiB
    rewritten at ``rate`` MiB/s."""
    if not (isinstance(mib, int) and mib > 0 and rate > 0):
        raise ValueError(f"dirty: {mib} MiB at {rate} MiB/s: both must be positive (MiB a whole number)")
    return f"accelmig.dirty={mib},{rate:g}"


# ---------------------------------------------------------------- host side

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


def guest_ping(domain, timeout: float = 5.0) -> float:
    """qemu-ga's ``guest-ping`` through libvirt (``domain``: a libvirt
    domain): seconds the round trip took; ``accelmig.plugin.qga``'s errors
    (``QgaUnavailable`` when qemu-ga is not there).  Tests wait with it
    for a guest's qemu-ga; hostd never pings, it runs its command."""
    from accelmig.plugin import qga          # libvirt's Python bindings: only where asked for
    t0 = time.monotonic()
    qga.agent_command(domain, json.dumps({"execute": "guest-ping"}), timeout=max(1, math.ceil(timeout)))
    return time.monotonic() - t0


def agent_status(domain, *, command: tuple | None = None, socket: str | None = None,
                 timeout: float = 15.0) -> dict:
    """``accelmig-agent status`` run in the guest through qemu-ga's
    ``guest-exec`` (a guest without the accelmig channel): what its agent
    knows (its identity, the sessions its drivers registered, its rehomes),
    for tests to check.  hostd asks such a guest only for rehomes and
    binding proofs (``accelmig.plugin.qga``)."""
    from accelmig.plugin import qga
    argv = (*(command or qga.DEFAULT_COMMAND), "status", *(("--socket", socket) if socket else ()))
    _pid, status = qga.guest_exec(domain, argv, timeout=timeout)
    if status.exit_code != qga.EXIT_OK:
        raise RuntimeError(f"accelmig-agent status in the guest: exit status {status.exit_code}: "
                           f"{status.stderr.strip()[-500:] or 'no stderr'}")
    return json.loads(status.stdout)


class ResponderChannel(LineClient):
    """A domain's channel socket, to the echo responder of a test image."""

    def __init__(self, path: str | os.PathLike, timeout: float = 10.0):
        super().__init__(str(path), timeout=timeout, what=f"the guest channel {path}", name="lab-channel")

    def wait_ready(self, timeout: float = 60.0, interval: float = 0.25) -> float:
        """Ping until the guest answers (it may still be booting); seconds waited.

        Requests sent before the guest opened its port wait in the socket
        and are answered later: answers are matched by id, so stale ones
        are skipped."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        while True:
            try:
                self.call("echo", timeout=min(interval, max(0.01, deadline - time.monotonic())), data="ping")
                return time.monotonic() - t0
            except Timeout:
                if time.monotonic() >= deadline:
                    raise Timeout(what=f"the guest on {self.path}", timeout=timeout) from None


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
