"""The data plane against its floors, plain TCP and TLS, in one run.

For each transport (plain TCP, then TLS: the default of every deployment) a
real pool process and a driver are measured beside that transport's floor:
a raw asyncio server (``bench.remoting.RawProtocol``: echo, sink, source)
over the same loopback path, over TLS with the very contexts the pool and
the driver use (``wire.tls.server_context``/``client_context``, so the same
protocol version and cipher; both are recorded in the JSON).  Rounds
alternate transport and subject (floor, accelmig, floor, ...) and each row
is the median of its rounds, so that a shared machine's load weighs on all
of them alike.

Rows and the goals of issue 31 (ratio = accelmig / floor):

* ``finish``, a 64 B ``read`` and a 64 B ``write`` round trip against the
  raw 64 B echo: goal at most 2x;
* a 64 MiB write and a 64 MiB read against the raw upload and download:
  goal at least 0.7x;
* pipelined launches of a trivial kernel against local pyopencl on the same
  device (``bench.remoting.local_launches``): goal at least 0.5x.

Every round's samples stay in ``bench/results/dataplane-{plain,tls}.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import Table, report
from bench.remoting import COUNTER, MIB, SMALL, RawClient, RawProtocol, local_launches, start_pool

# issue 31's goals: (row key, bound, "max" for at most / "min" for at least)
GOALS = {"finish": (2.0, "max"), "read64": (2.0, "max"), "write64": (2.0, "max"),
         "write": (0.7, "min"), "read": (0.7, "min"), "launches": (0.5, "min")}


def serve_raw_floor(certfile: str = "", keyfile: str = "") -> None:
    """The floor's server in its own process (like the pool): plain TCP, or
    TLS with the pool's own server context when given a certificate."""
    from accelmig.wire.tls import server_context
    context = server_context(certfile, keyfile) if certfile else None

    async def main():
        blob = bytearray(os.urandom(MIB)) * 64
        server = await asyncio.get_running_loop().create_server(
            lambda: RawProtocol(blob), "127.0.0.1", 0, ssl=context)
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.Event().wait()
    asyncio.run(main())


class TLSRawClient(RawClient):
    """The floor's client over TLS, with the driver's client context."""

    def __init__(self, port: int, cafile: str):
        from accelmig.wire.tls import client_context
        super().__init__(port)
        self.sock = client_context(cafile).wrap_socket(self.sock, server_hostname="127.0.0.1")

    def describe(self) -> dict:
        return {"version": self.sock.version(), "cipher": self.sock.cipher()[0]}


class Transport:
    """One transport's floor server, floor client, pool and driver."""

    def __init__(self, name: str, workdir: str, bulk, pki=None):
        from accelmig.agent.driver import connect
        self.name = name
        tls = (str(pki.pool.cert), str(pki.pool.key)) if pki else None
        self.raw_proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from bench.dataplane import serve_raw_floor; "
             "serve_raw_floor(*sys.argv[1:])", *(tls or ())],
            stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.pool_proc = None
        try:
            port = int(self.raw_proc.stdout.readline())
            self.raw = TLSRawClient(port, str(pki.ca)) if pki else RawClient(port)
            self.pool_proc, endpoint = start_pool(os.path.join(workdir, name), tls=tls)
            options = {"cafile": str(pki.ca)} if pki else {"insecure": True}
            self.dev = connect(endpoint, "bench-token-0001", agent=False, **options)
            self.prog = self.dev.build(COUNTER)
            self.small = self.dev.upload(bytes(SMALL))
            self.dbuf = self.dev.upload(bulk)
        except BaseException:
            self._stop()            # a floor server (or pool) that started goes with the failure
            raise
        self.security = self.raw.describe() if pki else {"version": "plain TCP"}
        link = getattr(getattr(self.dev, "_session", None), "link", None)
        sock = getattr(link, "sock", None)
        if isinstance(sock, ssl.SSLSocket):
            self.security["driver"] = {"version": sock.version(), "cipher": sock.cipher()[0]}

    def close(self) -> None:
        try:
            self.dev.close()
        finally:
            self._stop()

    def _stop(self) -> None:
        for proc in (self.pool_proc, self.raw_proc):
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(20)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def one_round(t: Transport, args, bulk, back, rounds: dict) -> None:
    """One sample of every row, floor and accelmig alternating."""
    n, count = args.round_trips, args.pipelined
    dev, raw, small, payload = t.dev, t.raw, t.small, bytes(SMALL)

    def launches():
        for _ in range(count):
            t.prog.launch("bump", 16, None, small)
        dev.finish()
    rounds["echo"].append(timed(lambda: [raw.round_trip() for _ in range(n)]) / n)
    rounds["finish"].append(timed(lambda: [dev.finish() for _ in range(n)]) / n)
    rounds["echo"].append(timed(lambda: [raw.round_trip() for _ in range(n)]) / n)
    rounds["read64"].append(timed(lambda: [dev.read(small, SMALL) for _ in range(n)]) / n)
    rounds["echo"].append(timed(lambda: [raw.round_trip() for _ in range(n)]) / n)
    rounds["write64"].append(timed(lambda: [(dev.write(small, payload), dev.finish()) for _ in range(n)]) / n)
    rounds["raw_up"].append(timed(lambda: raw.upload(bulk)))
    rounds["write"].append(timed(lambda: (dev.write(t.dbuf, bulk), dev.finish())))
    rounds["raw_down"].append(timed(lambda: raw.download(back)))
    rounds["read"].append(timed(lambda: dev.read_into(t.dbuf, back)))
    if bytes(back[:4096]) != bytes(bulk[:4096]) or bytes(back[-4096:]) != bytes(bulk[-4096:]):
        raise SystemExit(f"{t.name}: the 64 MiB read-back differs from what was written")
    rounds["local"].append(local_launches(count, 1))
    rounds["launches"].append(timed(launches))


def tabulate(name: str, rounds: dict, args, security: dict) -> dict:
    med = {key: statistics.median(samples) for key, samples in rounds.items() if samples}
    gib = args.bulk_mib / 1024
    table = Table(f"the data plane over {name} against its floor ({args.rounds} alternating rounds, medians)",
                  f"floor ({name})", "accelmig")
    table.add("finish() round trip", med["echo"] * 1e6, med["finish"] * 1e6, "us")
    table.add("64 B read round trip", med["echo"] * 1e6, med["read64"] * 1e6, "us")
    table.add("64 B write + finish", med["echo"] * 1e6, med["write64"] * 1e6, "us")
    table.add(f"write {args.bulk_mib} MiB", gib / med["raw_up"], gib / med["write"], "GiB/s", "higher")
    table.add(f"read {args.bulk_mib} MiB", gib / med["raw_down"], gib / med["read"], "GiB/s", "higher")
    table.add(f"launches ({args.pipelined}) vs local", args.pipelined / med["local"],
              args.pipelined / med["launches"], "ops/s", "higher")
    verdicts = {}
    for row, key in zip(table.rows, ("finish", "read64", "write64", "write", "read", "launches")):
        bound, kind = GOALS[key]
        met = row["ratio"] <= bound if kind == "max" else row["ratio"] >= bound
        verdicts[key] = {"ratio": row["ratio"], "goal": f"{'<=' if kind == 'max' else '>='} {bound}x", "met": met}
    report(table, f"dataplane-{name.replace(' ', '-').lower()}",
           {"args": vars(args), "security": security, "samples": rounds, "goals": verdicts})
    print("goals: " + ", ".join(f"{key} {v['ratio']:.2f}x ({v['goal']}: {'met' if v['met'] else 'MISSED'})"
                                for key, v in verdicts.items()))
    return verdicts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="bench dataplane", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="alternating rounds (median of each row)")
    parser.add_argument("--round-trips", type=int, default=1000, help="small round trips per sample")
    parser.add_argument("--bulk-mib", type=int, default=64)
    parser.add_argument("--pipelined", type=int, default=10000, help="launches per sample")
    parser.add_argument("--only", choices=("plain", "tls"), help="one transport only")
    args = parser.parse_args(argv)
    import numpy as np
    from pathlib import Path
    from accelmig.lab.certs import make_pki
    workdir = tempfile.mkdtemp(prefix="accelmig-bench-dataplane-")
    transports: list[Transport] = []
    try:
        bulk = np.frombuffer(os.urandom(args.bulk_mib * MIB), dtype=np.uint8)
        back = np.empty_like(bulk)
        pki = make_pki(Path(workdir) / "pki", hosts=())
        for name in ("plain", "tls"):
            if args.only in (None, name):
                os.makedirs(os.path.join(workdir, name))
                transports.append(Transport(name, workdir, bulk, pki if name == "tls" else None))
        rounds = {t.name: {key: [] for key in ("echo", "finish", "read64", "write64", "raw_up", "write",
                                              "raw_down", "read", "local", "launches")} for t in transports}
        for t in transports:                  # warm up every path once
            one_round(t, argparse.Namespace(**{**vars(args), "round_trips": 100, "pipelined": 1000}), bulk,
                      back, {key: [] for key in rounds[t.name]})
        for number in range(args.rounds):
            for t in transports:
                one_round(t, args, bulk, back, rounds[t.name])
            print(f"round {number + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        missed = []
        for t in transports:
            label = "TLS" if t.name == "tls" else "plain TCP"
            verdicts = tabulate(label, rounds[t.name], args, t.security)
            missed += [f"{t.name} {key}" for key, v in verdicts.items() if not v["met"]]
        print("all goals met" if not missed else "goals missed: " + ", ".join(missed))
    finally:
        for t in transports:
            t.close()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
