"""Remoting overhead: small-command round trip and 64 MiB bulk transfer
through the driver and a real pool process, beside a raw asyncio socket
server on the same loopback path (the baseline), in one run.

Then the upload arena's worth (table ``remoting-arena``): the same
writes into a second pool that copies every payload through the tenant's
device-process socket (``--upload-arena 0``, the path before the arena),
samples interleaved with the first pool's.

Then transfers of any size (``--big-gib``, 2 by default): an ``upload()``,
writes and read-backs of a 2 GiB array, which the driver sends in chunks,
checked bit-exact, against the raw socket moving the same bytes in the
same run (table ``remoting-big``), and against the driver's own 64 MiB
transfer, measured in turn with it (table ``remoting-chunked``: is a
chunked transfer as fast per byte as one frame?).

The baseline server is a separate process, like the pool: an asyncio
BufferedProtocol that echoes 64-byte messages, sinks uploads with recv_into
a preallocated buffer and serves downloads from one.  Its client uses a
blocking socket, like the driver.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading

from bench.common import Table, median_of, report

MIB = 1 << 20
SMALL = 64


# -- the baseline: a raw asyncio server -----------------------------------------------
class RawProtocol(asyncio.BufferedProtocol):
    """Messages: b'E' + 63 bytes -> echoed; b'U' + 8-byte size + data -> b'k';
    b'D' + 8-byte size -> that many bytes."""

    def __init__(self, blob: bytearray):
        self.blob = blob
        self.buf = bytearray(64 * MIB + 4096)
        self.view = memoryview(self.buf)
        self.have = 0
        self.upload_left = 0

    def connection_made(self, transport):
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get_buffer(self, sizehint):
        if self.upload_left:
            return self.view[:min(self.upload_left, len(self.buf))]
        return self.view[self.have:]

    def buffer_updated(self, n):
        if self.upload_left:
            self.upload_left -= n
            if not self.upload_left:
                self.transport.write(b"k")
            return
        self.have += n
        out = []
        pos = 0
        while self.have - pos >= SMALL:
            kind = self.buf[pos:pos + 1]
            if kind == b"E":
                out.append(bytes(self.buf[pos:pos + SMALL]))
                pos += SMALL
            elif kind == b"U":
                size = int.from_bytes(self.buf[pos + 1:pos + 9], "big")
                pos += SMALL
                already = min(self.have - pos, size)
                self.upload_left = size - already
                pos += already
                if not self.upload_left:
                    out.append(b"k")
                break
            elif kind == b"D":
                size = int.from_bytes(self.buf[pos + 1:pos + 9], "big")
                pos += SMALL
                if out:
                    self.transport.write(b"".join(out))
                    out = []
                self.transport.write(memoryview(self.blob)[:size])
            else:
                self.transport.close()
                return
        if out:
            self.transport.write(b"".join(out))
        self.buf[:self.have - pos] = self.buf[pos:self.have]
        self.have -= pos


def serve_raw() -> None:
    async def main():
        blob = bytearray(os.urandom(MIB)) * 64
        server = await asyncio.get_running_loop().create_server(lambda: RawProtocol(blob), "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.Event().wait()
    asyncio.run(main())


class RawClient:
    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.small = b"E" + bytes(SMALL - 1)
        self.rx = bytearray(SMALL)

    def _recv_exact(self, view):
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if not n:
                raise EOFError
            got += n

    def round_trip(self):
        self.sock.sendall(self.small)
        self._recv_exact(memoryview(self.rx))

    def upload(self, data):
        self.sock.sendall(b"U" + len(data).to_bytes(8, "big") + bytes(SMALL - 9))
        self.sock.sendall(data)
        self._recv_exact(memoryview(bytearray(1)))

    def download(self, out):
        self.sock.sendall(b"D" + len(out).to_bytes(8, "big") + bytes(SMALL - 9))
        self._recv_exact(memoryview(out))

    def pipelined(self, count):
        reader = threading.Thread(target=self._recv_exact, args=(memoryview(bytearray(SMALL * count)),))
        reader.start()
        for _ in range(count):
            self.sock.sendall(self.small)
        reader.join()


# -- the subject: driver + pool ----------------------------------------------------------
def start_pool(workdir: str, *extra: str, tls: tuple[str, str] | None = None):
    """An ``accelmig-pool serve`` process: plain TCP, or TLS with ``tls``
    (certificate, key)."""
    tokens = os.path.join(workdir, "tokens.toml")
    with open(tokens, "w") as handle:
        handle.write('[tenants.bench]\ntoken = "bench-token-0001"\nquota = "4GiB"\n')
    os.chmod(tokens, 0o600)     # it holds a token: the pool warns about a file others may read
    exe = os.path.join(os.path.dirname(sys.executable), "accelmig-pool")
    proc = subprocess.Popen([exe, "serve", "--listen", "127.0.0.1:0", "--control-listen", "",
                             "--admin-socket", "", "--tokens", tokens, "--log-level", "WARNING",
                             *(["--tls-cert", tls[0], "--tls-key", tls[1]] if tls else ["--insecure"]), *extra],
                            stdout=subprocess.PIPE, text=True)
    return proc, json.loads(proc.stdout.readline())["data"]


COUNTER = "__kernel void bump(__global uint *x) { x[get_global_id(0)] += 1u; }"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="bench remoting", description=__doc__.split("\n")[0])
    parser.add_argument("--round-trips", type=int, default=2000)
    parser.add_argument("--bulk-mib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--pipelined", type=int, default=10000)
    parser.add_argument("--no-tls", action="store_true", help="skip the TLS-versus-plain table")
    parser.add_argument("--big-gib", type=int, default=2,
                        help="size of the chunked transfer rows in GiB (0: skip them; needs about "
                             "3x this in free memory, and a tenant quota of it)")
    parser.add_argument("--big-repeat", type=int, default=3, help="samples of each chunked transfer")
    args = parser.parse_args(argv)
    import numpy as np
    from accelmig.agent.driver import connect

    workdir = tempfile.mkdtemp(prefix="accelmig-bench-")
    raw_proc = subprocess.Popen([sys.executable, "-c", "from bench.remoting import serve_raw; serve_raw()"],
                                stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    raw_port = int(raw_proc.stdout.readline())
    pool_proc, endpoint = start_pool(workdir)
    try:
        raw = RawClient(raw_port)
        dev = connect(endpoint, "bench-token-0001", agent=False, insecure=True)
        prog = dev.build(COUNTER)
        small = dev.upload(bytes(SMALL))
        bulk = np.frombuffer(os.urandom(args.bulk_mib * MIB), dtype=np.uint8)
        dbuf = dev.upload(bulk)
        out = np.empty_like(bulk)
        table = Table(f"remoting overhead (loopback, {args.bulk_mib} MiB bulk)",
                      "raw asyncio", "accelmig")
        n = args.round_trips
        for _ in range(200):     # warm up both paths
            raw.round_trip()
            dev.finish()
        raw_rt, _ = median_of(lambda: [raw.round_trip() for _ in range(n)], args.repeat)
        dev_rt, _ = median_of(lambda: [dev.finish() for _ in range(n)], args.repeat)
        dev_read, _ = median_of(lambda: [dev.read(small, SMALL) for _ in range(n)], args.repeat)
        table.add("small round trip (finish)", raw_rt / n * 1e6, dev_rt / n * 1e6, "us")
        table.add("small round trip (64 B read)", raw_rt / n * 1e6, dev_read / n * 1e6, "us")
        gib = args.bulk_mib / 1024
        raw_up, _ = median_of(lambda: raw.upload(bulk), args.repeat)
        dev_up, _ = median_of(lambda: dev.write(dbuf, bulk), args.repeat)
        table.add(f"upload {args.bulk_mib} MiB", gib / raw_up, gib / dev_up, "GiB/s", "higher")
        raw_down, _ = median_of(lambda: raw.download(out), args.repeat)
        dev_down, _ = median_of(lambda: dev.read_into(dbuf, out), args.repeat)
        assert bytes(out[:4096]) == bytes(bulk[:4096])
        table.add(f"download {args.bulk_mib} MiB", gib / raw_down, gib / dev_down, "GiB/s", "higher")
        count = args.pipelined
        raw_pipe, _ = median_of(lambda: raw.pipelined(count), args.repeat)

        def launches():
            for _ in range(count):
                prog.launch("bump", 16, None, small)
            dev.finish()
        dev_pipe, _ = median_of(launches, args.repeat)
        table.add(f"pipelined small commands ({count})", count / raw_pipe, count / dev_pipe,
                  "ops/s", "higher")
        report(table, "remoting", {"args": vars(args)})
        local_pipe = local_launches(count, args.repeat)
        launch_table = Table(f"pipelined launches of a trivial kernel ({count}, then a finish)",
                             "local pyopencl", "accelmig")
        launch_table.add(f"launches ({count})", count / local_pipe, count / dev_pipe, "ops/s", "higher")
        report(launch_table, "remoting-launches", {"args": vars(args)})
        arena_worth(args, workdir, raw, dev, dbuf, bulk)
        if args.big_gib:
            big_transfers(args, raw, dev, dbuf, bulk)
        dev.close()
        if not args.no_tls:
            plain = {"finish": dev_rt / n, "read": dev_read / n, "upload": dev_up, "download": dev_down,
                     "pipelined": dev_pipe}
            tls_cost(args, workdir, plain)
    finally:
        for proc in (pool_proc, raw_proc):
            proc.send_signal(signal.SIGTERM)
            proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def local_launches(count: int, repeat: int, device: int = 0) -> float:
    """The baseline of pipelined launches: the same kernel on the same
    device (``opencl:N``, the pool's default) through pyopencl in this
    process, as the pool's device process enqueues it (arguments set, then
    an ND-range per launch), then one finish; the median seconds."""
    return local_launch_cost(count, repeat, device)[0]


def local_launch_cost(count: int, repeat: int, device: int = 0) -> tuple[float, float]:
    """``local_launches``: (the median seconds, this process's CPU time
    per launch in µs, the device's own threads included: PoCL runs the
    kernels on this machine's cores)."""
    import resource
    import numpy as np
    import pyopencl as cl
    from accelmig.pool.devices.opencl import _all_devices
    cl_device = _all_devices()[device]
    context = cl.Context([cl_device])
    queue = cl.CommandQueue(context, cl_device)
    kernel = cl.Kernel(cl.Program(context, COUNTER).build(), "bump")
    buf = cl.Buffer(context, cl.mem_flags.READ_WRITE, SMALL)
    cl.enqueue_fill_buffer(queue, buf, np.zeros(1, np.uint8), 0, SMALL)

    def launches():
        for _ in range(count):
            kernel.set_args(buf)
            cl.enqueue_nd_range_kernel(queue, kernel, (16,), None)
        queue.finish()
    launches()      # warm up

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    before = cpu()
    seconds = median_of(launches, repeat)[0]
    return seconds, (cpu() - before) / (repeat * count) * 1e6
def arena_worth(args, workdir: str, raw: RawClient, dev, dbuf, bulk) -> None:
    """Writes of ``--bulk-mib`` and of 4 MiB into ``dev``'s pool (its upload
    arena takes them) and into a second pool with ``--upload-arena 0``
    (copied through the device process's socket), with the raw socket's
    upload, one sample of each per round: the arena's gain in one run."""
    import statistics
    import time
    import numpy as np
    from accelmig.agent.driver import connect
    proc, endpoint = start_pool(workdir, "--upload-arena", "0")
    try:
        other = connect(endpoint, "bench-token-0001", agent=False, insecure=True)
        obuf = other.upload(bulk)
        small = bulk[:4 * MIB]
        rounds: dict = {name: [] for name in ("raw", "arena", "copy", "arena_4", "copy_4")}

        def timed(fn) -> float:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        for _ in range(max(args.repeat, 5)):
            rounds["raw"].append(timed(lambda: raw.upload(bulk)))
            rounds["arena"].append(timed(lambda: dev.write(dbuf, bulk)))
            rounds["copy"].append(timed(lambda: other.write(obuf, bulk)))
            rounds["arena_4"].append(statistics.median(timed(lambda: dev.write(dbuf, small)) for _ in range(5)))
            rounds["copy_4"].append(statistics.median(timed(lambda: other.write(obuf, small)) for _ in range(5)))
        back = np.empty_like(bulk)
        other.read_into(obuf, back)
        if not np.array_equal(back, bulk):
            raise SystemExit("the copy path's read-back differs from what was written")
        dev.read_into(dbuf, back)
        if not np.array_equal(back, bulk):
            raise SystemExit("the arena path's read-back differs from what was written")
        other.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    med = {name: statistics.median(samples) for name, samples in rounds.items()}
    gib = bulk.nbytes / (1 << 30)
    table = Table("write payloads: through the device process's socket vs received into the upload arena",
                  "copy path", "arena")
    table.add(f"write {args.bulk_mib} MiB", gib / med["copy"], gib / med["arena"], "GiB/s", "higher")
    table.add("write 4 MiB", 4 / 1024 / med["copy_4"], 4 / 1024 / med["arena_4"], "GiB/s", "higher")
    # the target: at least 0.7 of the raw socket's upload, measured beside it
    table.add(f"write {args.bulk_mib} MiB / raw upload", med["raw"] / med["copy"], med["raw"] / med["arena"],
              "x", "higher")
    report(table, "remoting-arena", {"args": vars(args), "samples": rounds,
                                     "raw_upload_gib_s": gib / med["raw"]})


def big_transfers(args, raw: RawClient, dev, dbuf, bulk) -> None:
    """``--big-gib`` through the driver (in chunks) and the raw socket, in
    GiB/s, and the driver's one-frame ``--bulk-mib`` transfer (``dbuf``,
    ``bulk``).  The samples are interleaved, one of each per round, so that
    a shared machine's load weighs on all of them alike."""
    import statistics
    import time
    import numpy as np
    size = args.big_gib << 30
    big = np.frombuffer(np.random.default_rng(0).bytes(size), dtype=np.uint8)
    back = np.empty_like(big)
    small_back = np.empty_like(bulk)
    piece = 64 * MIB                      # the raw server serves at most this per request

    def raw_download():
        for start in range(0, size, piece):
            raw.download(memoryview(back)[start:start + piece])

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    start = time.perf_counter()
    buf = dev.upload(big)                 # alloc (a zeroed 2 GiB buffer) + chunked write
    upload = time.perf_counter() - start
    rounds: dict = {"raw_up": [], "raw_down": [], "write": [], "read": [], "write_1": [], "read_1": []}
    for _ in range(args.big_repeat):
        rounds["raw_up"].append(timed(lambda: raw.upload(big)))
        rounds["write"].append(timed(lambda: dev.write(buf, big)))
        rounds["write_1"].append(statistics.median(timed(lambda: dev.write(dbuf, bulk)) for _ in range(3)))
        rounds["raw_down"].append(timed(raw_download))
        back[:] = 0
        rounds["read"].append(timed(lambda: dev.read_into(buf, back)))
        rounds["read_1"].append(statistics.median(timed(lambda: dev.read_into(dbuf, small_back))
                                                  for _ in range(3)))
        if not np.array_equal(back, big):
            raise SystemExit(f"the {args.big_gib} GiB read-back differs from what was uploaded")
    dev.free(buf)
    dev.finish()
    med = {name: statistics.median(samples) for name, samples in rounds.items()}
    gib, small_gib = size / (1 << 30), bulk.nbytes / (1 << 30)
    chunks = -(-size // dev.chunk)
    extra = {"args": vars(args), "chunk": dev.chunk, "samples": rounds, "upload_s": upload}
    table = Table(f"transfers of any size ({args.big_gib} GiB, {chunks} chunks of {dev.chunk // MIB} MiB, "
                  f"bit-exact)", "raw socket", "accelmig")
    table.add(f"upload() {args.big_gib} GiB (1 sample)", gib / med["raw_up"], gib / upload, "GiB/s", "higher")
    table.add(f"write {args.big_gib} GiB", gib / med["raw_up"], gib / med["write"], "GiB/s", "higher")
    table.add(f"read_into {args.big_gib} GiB", gib / med["raw_down"], gib / med["read"], "GiB/s", "higher")
    report(table, "remoting-big", extra)
    rate = Table(f"a chunked {args.big_gib} GiB transfer vs one {args.bulk_mib} MiB frame (the driver, "
                 "interleaved)", f"{args.bulk_mib} MiB", f"{args.big_gib} GiB")
    rate.add("write", small_gib / med["write_1"], gib / med["write"], "GiB/s", "higher")
    rate.add("read_into", small_gib / med["read_1"], gib / med["read"], "GiB/s", "higher")
    report(rate, "remoting-chunked", extra)


def driver_figures(endpoint: str, args, **connect_options) -> dict:
    """A fresh driver against ``endpoint``: its first command (open and a
    build), then the medians of round trips, bulk transfers and pipelined
    launches, in seconds.  Used here for TLS and by bench/isolation.py."""
    import time
    import numpy as np
    from accelmig.agent.driver import connect
    out: dict = {}
    start = time.perf_counter()
    dev = connect(endpoint, "bench-token-0001", agent=False, **connect_options)
    prog = dev.build(COUNTER)            # waits for a device process where there is one
    out["first"] = time.perf_counter() - start
    small = dev.upload(bytes(SMALL))
    bulk = np.frombuffer(os.urandom(args.bulk_mib * MIB), dtype=np.uint8)
    dbuf = dev.upload(bulk)
    back = np.empty_like(bulk)
    n = args.round_trips
    for _ in range(200):
        dev.finish()
    out["finish"] = median_of(lambda: [dev.finish() for _ in range(n)], args.repeat)[0] / n
    out["read"] = median_of(lambda: [dev.read(small, SMALL) for _ in range(n)], args.repeat)[0] / n
    out["upload"] = median_of(lambda: dev.write(dbuf, bulk), args.repeat)[0]
    out["download"] = median_of(lambda: dev.read_into(dbuf, back), args.repeat)[0]
    assert bytes(back) == bytes(bulk), "the download differs from the upload"

    def launches():
        for _ in range(args.pipelined):
            prog.launch("bump", 16, None, small)
        dev.finish()
    out["pipelined"] = median_of(launches, args.repeat)[0]
    dev.close()
    return out


def tls_cost(args, workdir: str, plain: dict) -> None:
    """The same driver measurements against a pool serving TLS (a throwaway
    CA from accelmig.lab.certs), beside the plain-TCP figures just taken."""
    from pathlib import Path
    from accelmig.lab.certs import make_pki
    pki = make_pki(Path(workdir) / "pki", hosts=())
    proc, endpoint = start_pool(workdir, tls=(str(pki.pool.cert), str(pki.pool.key)))
    try:
        got = driver_figures(endpoint, args, cafile=str(pki.ca))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    table = Table("TLS cost: the driver and the pool over TLS vs plain TCP (loopback)", "plain TCP", "TLS")
    add_driver_rows(table, plain, got, args, "pipelined small commands")
    report(table, "remoting-tls", {"args": vars(args)})


def add_driver_rows(table: Table, base: dict, subject: dict, args, pipelined_label: str) -> None:
    """The rows of two ``driver_figures`` results, side by side."""
    gib = args.bulk_mib / 1024
    table.add("small round trip (finish)", base["finish"] * 1e6, subject["finish"] * 1e6, "us")
    table.add("small round trip (64 B read)", base["read"] * 1e6, subject["read"] * 1e6, "us")
    table.add(f"upload {args.bulk_mib} MiB", gib / base["upload"], gib / subject["upload"], "GiB/s", "higher")
    table.add(f"download {args.bulk_mib} MiB", gib / base["download"], gib / subject["download"], "GiB/s",
              "higher")
    table.add(f"{pipelined_label} ({args.pipelined})", args.pipelined / base["pipelined"],
              args.pipelined / subject["pipelined"], "ops/s", "higher")


if __name__ == "__main__":
    main(sys.argv[1:])
