"""Rebind storm: N sessions of one domain rehomed at once.

For each N (``--sessions``, default 1, 8, 32, 64): N sessions open on hostA,
each with a built program and ``--state-kib`` of device state written by a
kernel, all bound to one domain.  One migration record hostA->hostB (open,
switchover, complete: N tickets, close), then all N sessions call
``Device.resume(endpoint_of_B, ticket)`` at the same instant from N threads.
Measured per round: the time until the last one resumed (total), each
session's time from the start of the storm to its own resume (p50/p99 over
all rounds), and the control-plane record itself.  Rounds alternate A->B,
B->A.  After every storm each session's state is read back and checked.

Baseline: a single session's resume (N=1), measured in the same run.  A
real pool process (``accelmig-pool serve``); two hosts without root: hostA
is 127.0.0.1, hostB is [::1].  All drivers live in this one Python process
(threads, one GIL), as many applications of one VM would; the pool is a
second process on the same 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid

from bench.common import BENCH_TOKEN, Table, TwoHostPool, migrate_record, save_figure

FILL = "__kernel void fill(__global uint *x, uint tag) { uint i = get_global_id(0); x[i] = tag ^ (i * 2654435761u); }"


def session_state(dev, tag: int, words: int):
    from accelmig.agent.driver import u32
    prog = dev.build(FILL)
    buf = dev.alloc(words * 4)
    prog.launch("fill", words, None, buf, u32(tag))
    dev.finish()
    return buf


def expected_head(tag: int, count: int = 16) -> bytes:
    import numpy as np
    i = np.arange(count, dtype=np.uint32)
    with np.errstate(over="ignore"):
        return (np.uint32(tag) ^ (i * np.uint32(2654435761))).astype("<u4").tobytes()


def storm(devs, tickets, endpoint) -> tuple[float, list[float]]:
    """All ``devs`` resume at once; (total seconds, per-session seconds)."""
    go = threading.Event()
    done = [None] * len(devs)
    errors = []

    def one(index, dev):
        go.wait()
        try:
            dev.resume(endpoint, tickets[dev.sid])
            done[index] = time.perf_counter()
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i, d), daemon=True) for i, d in enumerate(devs)]
    for t in threads:
        t.start()
    time.sleep(0.05)       # every thread is parked on the event
    t0 = time.perf_counter()
    go.set()
    for t in threads:
        t.join(120)
    if errors or None in done:
        raise RuntimeError(f"storm of {len(devs)}: {len(errors)} resume(s) failed: {errors[:3]}")
    per = [d - t0 for d in done]
    return max(per), per


def percentile(samples: list[float], q: float) -> float:
    import numpy as np
    return float(np.percentile(samples, q))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench storm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", default="1,8,32,64", help="comma-separated N [1,8,32,64]")
    parser.add_argument("--rounds", type=int, default=10, help="storms per N (A->B, B->A, ...) [10]")
    parser.add_argument("--baseline-rounds", type=int, default=20, help="rounds for N=1 [20]")
    parser.add_argument("--state-kib", type=int, default=256, help="device state per session [256]")
    args = parser.parse_args(argv)
    counts = sorted({int(v) for v in args.sessions.split(",") if v.strip()} | {1})
    if counts[0] < 1 or args.rounds < 1:
        parser.error("N and --rounds must be >= 1")

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    words = args.state_kib * 256
    workdir = tempfile.mkdtemp(prefix="accelmig-bench-storm-")
    pool = None
    results = {}
    try:
        from accelmig.agent.driver import connect
        # All the bench's "guests" are one loopback address: let that one
        # address resume the whole storm at once (a real evacuation comes
        # from one address per guest, within the default 32 per address).
        config = os.path.join(workdir, "pool.toml")
        with open(config, "w") as handle:
            handle.write(f"[pool]\nmax_unauthenticated_per_peer = {max(counts) + 32}\n")
        pool = TwoHostPool(workdir, extra_args=("--config", config))
        hosts = (pool.host("hostA"), pool.host("hostB"))
        for n in counts:
            domain = str(uuid.uuid4())
            rounds = args.baseline_rounds if n == 1 else args.rounds
            devs, tags = [], {}
            try:
                started = time.perf_counter()
                for k in range(n):
                    dev = connect(hosts[0].endpoint, BENCH_TOKEN, agent=False, timeout=120, insecure=True)
                    devs.append(dev)
                    tags[dev.sid] = (0xA5000000 + n * 1000 + k, session_state(dev, 0xA5000000 + n * 1000 + k, words))
                    hosts[0].call("bind_session", sid=dev.sid, domain_uuid=domain)
                log(f"storm N={n}: {n} session(s) ready in {time.perf_counter() - started:.1f} s; "
                    f"{rounds} rounds")
                totals, per_session, records = [], [], []
                for r in range(rounds):
                    src, dst = hosts[r % 2], hosts[(r + 1) % 2]
                    t0 = time.perf_counter()
                    tickets = migrate_record(domain, src, dst)
                    records.append(time.perf_counter() - t0)
                    if set(tickets) != {d.sid for d in devs}:
                        raise RuntimeError(f"N={n}: {len(tickets)} tickets for {n} sessions")
                    total, per = storm(devs, tickets, dst.endpoint)
                    totals.append(total)
                    per_session += per
                    for dev in devs:
                        tag, buf = tags[dev.sid]
                        if dev.read(buf, 64) != expected_head(tag):
                            raise AssertionError(f"N={n}: session {dev.sid} state differs after the storm")
                counters = [pool.session(d.sid)["counters"] for d in devs]
                results[n] = {"total_s": totals, "per_session_s": per_session, "record_s": records,
                              "p50_s": percentile(per_session, 50), "p99_s": percentile(per_session, 99),
                              "rebuilds": sum(c["builds"] for c in counters) - n}
                log(f"  total median {statistics.median(totals) * 1e3:.1f} ms, per session p50 "
                    f"{results[n]['p50_s'] * 1e3:.1f} ms, p99 {results[n]['p99_s'] * 1e3:.1f} ms, record "
                    f"{statistics.median(records) * 1e3:.1f} ms")
            finally:
                for dev in devs:
                    dev.close()
        for host in hosts:
            host.close()
    finally:
        if pool is not None:
            pool.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    med = statistics.median
    base = med(results[1]["total_s"]) * 1e3
    base_record = med(results[1]["record_s"]) * 1e3
    table = Table(f"rebind storm: N sessions of one domain resume at once ({args.state_kib} KiB state "
                  f"each; median of {args.rounds} storms, p50/p99 over all sessions)",
                  "1 session", "N at once")
    for n in counts:
        if n == 1:
            continue
        r = results[n]
        table.add(f"N={n}: all resumed", base, med(r["total_s"]) * 1e3, "ms")
        table.add(f"N={n}: per session p50", base, r["p50_s"] * 1e3, "ms")
        table.add(f"N={n}: per session p99", base, r["p99_s"] * 1e3, "ms")
        table.add(f"N={n}: record + N tickets", base_record, med(r["record_s"]) * 1e3, "ms")
    print()
    print(table.render())
    print("(1 session: resume %.2f ms, record + ticket %.2f ms; per-session time counts from the "
          "start of the storm)" % (base, base_record))
    for n in counts:
        r = results[n]
        print(f"N={n:3d}: all resumed {med(r['total_s']) * 1e3:8.1f} ms = {med(r['total_s']) * 1e3 / n:6.2f} "
              f"ms/session; p50 {r['p50_s'] * 1e3:7.1f} ms, p99 {r['p99_s'] * 1e3:7.1f} ms; "
              f"rebuilds {r['rebuilds']}")
    extra = {"args": vars(args), "results": {str(n): r for n, r in results.items()}}
    path = table.save("storm", extra)
    png = plot(results, counts)
    print(f"\nwrote {path}" + (f" and {png}" if png else ""))


def plot(results: dict, counts: list[int]) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    med = statistics.median
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(counts, [med(results[n]["total_s"]) * 1e3 for n in counts], "o-", label="all resumed (median)")
    ax.plot(counts, [results[n]["p50_s"] * 1e3 for n in counts], "s--", label="per session p50")
    ax.plot(counts, [results[n]["p99_s"] * 1e3 for n in counts], "^--", label="per session p99")
    ax.plot(counts, [med(results[n]["record_s"]) * 1e3 for n in counts], "x:", label="record + N tickets")
    base = med(results[1]["total_s"]) * 1e3
    ax.plot(counts, [base * n for n in counts], color="#bbbbbb", lw=1, label="N x one resume (serial)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.set_xlabel("sessions rehomed at once (N)")
    ax.set_ylabel("ms")
    ax.set_title("rebind storm", fontsize=10)
    ax.legend(fontsize=8)
    return save_figure(fig, "storm")


if __name__ == "__main__":
    main(sys.argv[1:])
