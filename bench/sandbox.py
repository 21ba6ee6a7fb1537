"""What confining a tenant's device process costs (``accelmig.pool.devices.sandbox``):
a device process started as the pool starts it, over its socket pair, with
the sandbox and without (``--sandbox off``, the baseline): from spawn to its
``ready`` (namespaces, the new root, Landlock, seccomp, then PoCL's start),
its first build, and a build that names a node file (fails at once).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from accelmig.pool.devices.sandbox import device_environment
from accelmig.pool.devices.worker import PIPE_LIMITS, FrameWriter
from accelmig.wire.frames import FrameReader
from bench.common import Table, report

SOURCE = "__kernel void add(__global uint *a, uint n) { a[get_global_id(0)] += n; }"


class DeviceProcess:
    """``python -m accelmig.pool.devices.worker`` on a socket pair, as the pool runs it."""

    def __init__(self, device: str, sandbox: bool):
        self.directory = tempfile.mkdtemp(prefix="bench-sandbox-")
        os.mkdir(os.path.join(self.directory, "cache"))
        ours, theirs = socket.socketpair()
        flags = ["--sandbox", "required"] if sandbox else ["--sandbox", "off", "--allow-unconfined-builds"]
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "accelmig.pool.devices.worker", "--fd", str(theirs.fileno()),
             "--device", device, "--tenant", "bench", *flags], pass_fds=[theirs.fileno()], cwd=self.directory,
            env=device_environment(os.environ, POCL_CACHE_DIR=os.path.join(self.directory, "cache")),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        theirs.close()
        self.sock, self.writer, self.reader = ours, FrameWriter(ours), FrameReader(PIPE_LIMITS)
        self.frames: list = []
        ready = self.next_frame()
        assert ready.header["op"] == "ready", ready.header
        self.ready_after = time.perf_counter() - self.started
        self.writer.send({"op": "new", "ctx": 1})
        self.calls = 0

    def next_frame(self):
        while not self.frames:
            n = self.sock.recv_into(self.reader.get_buffer())
            if n == 0:
                raise RuntimeError("the device process exited")
            self.frames.extend(self.reader.feed(n))
        return self.frames.pop(0)

    def build(self, source: str) -> tuple[float, bool]:
        self.calls += 1
        start = time.perf_counter()
        self.writer.send({"op": "call", "ctx": 1, "id": self.calls, "m": "build_source",
                          "a": {"prog": self.calls, "options": ""}}, source.encode())
        answer = self.next_frame()
        return time.perf_counter() - start, bool(answer.header.get("ok"))

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(10)
        shutil.rmtree(self.directory, ignore_errors=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="bench sandbox", description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--device", default="opencl:0")
    args = parser.parse_args(argv)
    figures: dict = {}
    # interleaved, so that a busy moment of the machine falls on both alike
    for _ in range(args.repeat):
        for confined in (False, True):
            proc = DeviceProcess(args.device, confined)
            try:
                first, ok = proc.build(SOURCE)
                assert ok, "the first build failed"
                include, ok = proc.build('/**/#include "/etc/hostname"\n' + SOURCE)
                assert not ok, "a build read /etc/hostname"
            finally:
                proc.close()
            for name, value in (("ready", proc.ready_after), ("first", first), ("include", include)):
                figures.setdefault((confined, name), []).append(value)
    median = {key: statistics.median(values) for key, values in figures.items()}
    table = Table("device process sandbox: confined vs not (one tenant's device process)", "unconfined",
                  "confined")
    table.add("spawn to ready", median[False, "ready"] * 1e3, median[True, "ready"] * 1e3, "ms")
    table.add("first build", median[False, "first"] * 1e3, median[True, "first"] * 1e3, "ms")
    table.add("build naming a node file", median[False, "include"] * 1e3, median[True, "include"] * 1e3, "ms")
    report(table, "sandbox", {"args": vars(args)})


if __name__ == "__main__":
    main(sys.argv[1:])
