"""Pipelined launches (or idle round trips), one tree against another, in alternating rounds.

    python -m bench.launch_ab --before /path/to/other/clone [--rounds 4] [--workload finish]

Each round runs, in a fresh process of each tree's own ``.venv`` (its own
pool process, its own device process, its own driver), ``--launches``
launches of the trivial counter kernel of ``bench/remoting`` then a finish,
``--repeat`` times, and keeps the median; the trees alternate, so a change
of the machine's load hits both.  Local pyopencl (this tree's
``bench.remoting.local_launch_cost``) is measured in every round too, with
its CPU per launch.  Also CPU per launch: the driver's, the pool's and its
device process's user + system time over the samples, each and summed, and
the rate that CPU allows at best with every core busy (PoCL runs the
kernels on the same cores).  The table (medians of the rounds)
and the JSON go to ``bench/results/launch-ab.*``, with the load average at
the start and the end.  ``--workload finish``: ``--launches`` idle
``finish()`` round trips instead (the session has nothing in flight), the
raw asyncio echo of ``bench/remoting`` measured in every round as the
baseline; the JSON and table go to ``bench/results/finish-ab.*``.  A
benchmark, never a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench.common import Table, median_of, report

#: run inside a tree's own interpreter: prints one JSON line
PROBE = r"""
import json, os, resource, statistics, sys, tempfile, time
import psutil
from bench.remoting import COUNTER, SMALL, start_pool
from accelmig.agent.driver import connect
count, repeat, workload = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
workdir = tempfile.mkdtemp(prefix="accelmig-ab-")
proc, endpoint = start_pool(workdir)
try:
    dev = connect(endpoint, "bench-token-0001", agent=False, insecure=True)
    prog = dev.build(COUNTER)
    small = dev.upload(bytes(SMALL))
    pool = psutil.Process(proc.pid)
    def cpu():
        own = resource.getrusage(resource.RUSAGE_SELF)
        t = pool.cpu_times()
        kids = sum(c.cpu_times().user + c.cpu_times().system for c in pool.children(recursive=True))
        return [own.ru_utime + own.ru_stime, t.user + t.system, kids]
    def launches():
        for _ in range(count):
            prog.launch("bump", 16, None, small)
        dev.finish()
    if workload == "finish":
        def launches():
            for _ in range(count):
                dev.finish()
    launches()                      # warm up (the device process, the kernel)
    back = dev.read(small, 64)
    samples, c0 = [], cpu()
    for _ in range(repeat):
        start = time.perf_counter()
        launches()
        samples.append(time.perf_counter() - start)
    spent = [b - a for a, b in zip(c0, cpu())]
    counter = int.from_bytes(bytes(dev.read(small, 4)), "little")
    ran = (repeat + 1) * count if workload == "launches" else 0
    assert counter == ran, (counter, ran)   # each ran once
    dev.close()
    per = [s / (repeat * count) * 1e6 for s in spent]
    print(json.dumps({"seconds": statistics.median(samples), "cpu_us": sum(per),
                      "driver_us": per[0], "pool_us": per[1], "device_us": per[2]}))
finally:
    proc.terminate(); proc.wait(10)
"""


def run_tree(tree: str, count: int, repeat: int, workload: str) -> dict:
    python = os.path.join(tree, ".venv", "bin", "python")
    out = subprocess.run([python, "-c", PROBE, str(count), str(repeat), workload], cwd=tree, check=True,
                         capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def alternate(args, workload: str, baseline_key: str, baseline, describe) -> tuple[list, tuple, tuple]:
    """``args.rounds`` rounds of both trees, in turn first, each round with
    its ``baseline()`` under ``baseline_key``: (rounds, load at the start,
    load at the end)."""
    load_start = os.getloadavg()
    rounds = []
    for index in range(args.rounds):
        trees = [("before", args.before), ("after", args.after)]
        if index % 2:
            trees.reverse()
        one = {name: run_tree(tree, args.launches, args.repeat, workload) for name, tree in trees}
        one[baseline_key] = baseline()
        rounds.append(one)
        print(f"round {index + 1}: {describe(one)}", file=sys.stderr)
    return rounds, load_start, os.getloadavg()


def _median(rounds: list, fn) -> float:
    return statistics.median(fn(r) for r in rounds)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="bench.launch_ab", description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the other clone (with its own .venv)")
    parser.add_argument("--after", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="this clone (default)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--launches", type=int, default=10000)
    parser.add_argument("--repeat", type=int, default=5, help="samples per tree per round (median)")
    parser.add_argument("--workload", choices=("launches", "finish"), default="launches",
                        help="pipelined launches then a finish (default), or idle finish() round trips "
                             "against the raw asyncio echo")
    args = parser.parse_args(argv)
    if args.workload == "finish":
        finish_ab(args)
        return
    from bench.remoting import local_launch_cost
    n = args.launches
    rounds, load_start, load_end = alternate(
        args, "launches", "local", lambda: local_launch_cost(n, args.repeat),
        lambda one: f"before {n / one['before']['seconds']:,.0f}/s, after {n / one['after']['seconds']:,.0f}/s, "
                    f"local {n / one['local'][0]:,.0f}/s")
    for one in rounds:
        one["local"], one["local_cpu_us"] = one["local"]

    def med(fn):
        return _median(rounds, fn)
    table = Table(f"pipelined launches ({n}, then a finish): before vs after, {args.rounds} alternating rounds",
                  "before", "after")
    table.add(f"launches ({n})", med(lambda r: n / r["before"]["seconds"]),
              med(lambda r: n / r["after"]["seconds"]), "ops/s", "higher")
    table.add("CPU per launch (3 processes)", med(lambda r: r["before"]["cpu_us"]),
              med(lambda r: r["after"]["cpu_us"]), "us")
    for side in ("driver", "pool", "device"):
        table.add(f"  of which the {side} process", med(lambda r: r["before"][f"{side}_us"]),
                  med(lambda r: r["after"][f"{side}_us"]), "us")
    table.add("local pyopencl, same rounds", med(lambda r: n / r["local"]), med(lambda r: n / r["local"]),
              "ops/s", "higher")
    local_cpu = med(lambda r: r["local_cpu_us"])
    table.add("  its CPU per launch (PoCL's threads too)", local_cpu, local_cpu, "us")
    # What this machine allows at best: every core busy, nothing waiting.
    # PoCL runs the kernels on the same cores as the driver and the pool,
    # so the device's own work (the local run's CPU) is in both figures.
    cores = os.cpu_count() or 1
    bound = {side: cores / med(lambda r: r[side]["cpu_us"]) * 1e6 for side in ("before", "after")}
    table.add(f"at most on {cores} cores (cores / CPU)", bound["before"], bound["after"],
              "ops/s", "higher")
    report(table, "launch-ab", {"args": vars(args), "rounds": rounds,
                                "load": {"start": load_start, "end": load_end},
                                "cpu_bound": bound, "local_cpu_us": local_cpu,
                                "after_vs_local": med(lambda r: r["local"] / r["after"]["seconds"]),
                                "before_vs_local": med(lambda r: r["local"] / r["before"]["seconds"])})
    local = med(lambda r: n / r["local"])
    print(f"after / local pyopencl: {med(lambda r: r['local'] / r['after']['seconds']):.3f}x, "
          f"before / local: {med(lambda r: r['local'] / r['before']['seconds']):.3f}x; "
          f"load {load_start[0]:.1f} -> {load_end[0]:.1f}\n"
          f"the most the after tree's CPU per launch allows on {cores} cores: {bound['after']:,.0f}/s, "
          f"{bound['after'] / local:.2f}x local pyopencl")


def finish_ab(args) -> None:
    """Idle ``finish()`` round trips of each tree, and the raw echo, per round."""
    from bench.remoting import RawClient
    raw_proc = subprocess.Popen([sys.executable, "-c", "from bench.remoting import serve_raw; serve_raw()"],
                                stdout=subprocess.PIPE, text=True,
                                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    n = args.launches
    try:
        raw = RawClient(int(raw_proc.stdout.readline()))
        rounds, load_start, load_end = alternate(
            args, "finish", "raw", lambda: median_of(lambda: [raw.round_trip() for _ in range(n)], args.repeat)[0],
            lambda one: f"before {one['before']['seconds'] / n * 1e6:.1f} us, "
                        f"after {one['after']['seconds'] / n * 1e6:.1f} us, raw echo {one['raw'] / n * 1e6:.1f} us")
    finally:
        raw_proc.terminate()
        raw_proc.wait(10)

    def med(fn):
        return _median(rounds, fn)
    table = Table(f"idle finish() round trips ({n} per sample): before vs after, {args.rounds} alternating rounds",
                  "before", "after")
    table.add("idle finish() round trip", med(lambda r: r["before"]["seconds"] / n * 1e6),
              med(lambda r: r["after"]["seconds"] / n * 1e6), "us")
    table.add("  / raw echo of the same round", med(lambda r: r["before"]["seconds"] / r["raw"]),
              med(lambda r: r["after"]["seconds"] / r["raw"]), "x")
    table.add("CPU per round trip (3 processes)", med(lambda r: r["before"]["cpu_us"]),
              med(lambda r: r["after"]["cpu_us"]), "us")
    for side in ("driver", "pool"):
        table.add(f"  of which the {side} process", med(lambda r: r["before"][f"{side}_us"]),
                  med(lambda r: r["after"][f"{side}_us"]), "us")
    table.add("raw asyncio echo, same rounds", med(lambda r: r["raw"] / n * 1e6), med(lambda r: r["raw"] / n * 1e6),
              "us")
    report(table, "finish-ab", {"args": vars(args), "rounds": rounds,
                                "load": {"start": load_start, "end": load_end}})
    print(f"after / raw echo: {med(lambda r: r['after']['seconds'] / r['raw']):.2f}x, "
          f"before / raw echo: {med(lambda r: r['before']['seconds'] / r['raw']):.2f}x; "
          f"load {load_start[0]:.1f} -> {load_end[0]:.1f}")


if __name__ == "__main__":
    main()
