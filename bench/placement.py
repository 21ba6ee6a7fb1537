"""Placement: what opening a session through a pool of two nodes on etcd
costs, beside opening it at a single node with no etcd (the baseline), in
one run: a real etcd (Debian's etcd-server) and real ``accelmig-pool
serve`` processes on loopback.

- open at a single node (no cluster) vs open at a cluster node that keeps
  the session (an etcd read on the way);
- the same baseline vs an open redirected to the other node (an etcd read,
  a second connection and handshake);
- a storm of N sessions opened at one node of two: how placement spreads
  them (reported in the JSON; the time of the storm against N direct opens).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from bench.common import Table, median_of, report
from tests.support.etcd import EtcdServer  # the tests' one etcd toolkit

TOKEN = "bench-token-0001"


class Node:
    def __init__(self, workdir: str, name: str, *cluster: str):
        directory = os.path.join(workdir, name)
        os.makedirs(directory)
        tokens = os.path.join(directory, "tokens.toml")
        with open(tokens, "w") as handle:
            handle.write(f'[tenants.bench]\ntoken = "{TOKEN}"\nquota = "16GiB"\nmax_sessions = 4096\n')
        exe = os.path.join(os.path.dirname(sys.executable), "accelmig-pool")
        self.proc = subprocess.Popen([exe, "serve", "--listen", "127.0.0.1:0", "--control-listen", "",
                                      "--admin-socket", "", "--insecure", "--tokens", tokens,
                                      "--device-isolation", "none", "--log-level", "WARNING", *cluster],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"pool {name} did not start ({self.proc.wait()})")
        self.ready = json.loads(line)
        self.endpoint = self.ready["data"]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench placement", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=30, help="opens per measurement [30]")
    parser.add_argument("--sessions", type=int, default=1000, help="sessions in the storm [1000: issue 12 asks a storm of 1,000 across two nodes]")
    args = parser.parse_args(argv)
    os.environ["ACCELMIG_INSECURE"] = "1"
    from accelmig.agent.driver import connect

    workdir = tempfile.mkdtemp(prefix="accelmig-bench-placement-")
    etcd = EtcdServer(workdir).start()
    nodes = []
    try:
        single = Node(workdir, "single")
        nodes.append(single)
        cluster = ("--cluster", f"etcd://{etcd.endpoint}", "--cluster-ttl", "10")
        n2 = Node(workdir, "n2", *cluster, "--node-name", "n2")
        nodes.append(n2)
        # n2, alone yet, keeps 3 sessions: from now on every open at n1 stays
        # there and every open at n2 goes to n1 (whose load is 0 or 1, one
        # session at a time, however late etcd shows it)
        holders = [connect(n2.endpoint, TOKEN, agent=False, auto_reconnect=False) for _ in range(3)]
        n1 = Node(workdir, "n1", *cluster, "--node-name", "n1")
        nodes.append(n1)

        def open_close(endpoint: str, expect: str):
            dev = connect(endpoint, TOKEN, agent=False, auto_reconnect=False)
            assert dev.endpoint == expect, (dev.endpoint, expect)
            dev.close()

        direct, _ = median_of(lambda: open_close(single.endpoint, single.endpoint), args.repeat)
        kept, _ = median_of(lambda: open_close(n1.endpoint, n1.endpoint), args.repeat)
        redirected, _ = median_of(lambda: open_close(n2.endpoint, n1.endpoint), args.repeat)
        for holder in holders:
            holder.close()

        def storm(endpoint: str) -> tuple[float, dict]:
            start = time.perf_counter()
            devs = [connect(endpoint, TOKEN, agent=False, auto_reconnect=False) for _ in range(args.sessions)]
            elapsed = time.perf_counter() - start
            spread: dict[str, int] = {}
            for dev in devs:
                spread[dev.endpoint] = spread.get(dev.endpoint, 0) + 1
                dev.close()
            return elapsed, spread

        storm_direct, _ = storm(single.endpoint)
        storm_placed, spread = storm(n1.endpoint)
        names = {n1.endpoint: "n1", n2.endpoint: "n2"}
        table = Table("Placement: opening a session through two pool nodes on etcd", "single node",
                      "two-node pool")
        table.add("open, kept at the node reached", direct * 1e6, kept * 1e6, "µs")
        table.add("open, redirected once", direct * 1e6, redirected * 1e6, "µs")
        table.add(f"storm of {args.sessions} opens", storm_direct, storm_placed, "s")
        report(table, "placement", {"args": vars(args),
                                    "storm_spread": {names.get(k, k): v for k, v in spread.items()}})
        print("storm spread:", {names.get(k, k): v for k, v in spread.items()})
    finally:
        for node in nodes:
            node.stop()
        etcd.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
