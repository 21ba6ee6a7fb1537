"""Rebind storm: N sessions of one VM rehomed at once, through the whole
control path (issue 11: the control plane at scale).

For each N (``--sessions``, default 1, 64, 256, 1000): a "guest" of N
sessions — ``--procs`` application processes (``bench.guest``) whose
drivers each register with one real guest agent (``accelmig-agent run``
with its channel on a unix socket) — on hostA, every session holding
``--state-bytes`` of device state, each attested to one domain as hostd
does when the agent reports it: a challenge, the proof its driver gives
through the agent on the guest channel, ``bind_sessions``.  The sessions open one
after the other (one process after the other), so each open is measured
alone at the pool's population of the moment: its ``connect`` (hello,
open, registration with the agent), and hostd's attestation of it; then
the whole guest attested at once (what a guest that reports nothing by
itself costs: every driver proves, a page of proofs a round trip).

Then ``--rounds`` migrations, alternating A->B and B->A, the control plane
called as hostd calls it: the destination opens the record (the hook's
``open_migration``), the source switches it over, and the destination
rehomes: ``complete`` (every page of tickets, ``call_all``), then the
rehome over the guest channel (its tickets in pieces when they do not fit
one line: ``wire.channel.rehome_pieces``), answered by the agent once every
driver resumed.  Rehome time: from ``complete`` to that answer (what hostd
logs as the rehome's total); the record is then checked (every session
resumed, once) and every session's state read back.  The largest control
answer and channel line of the round are measured (their limits: 64 KiB
and 256 KiB).

Baseline: N=1 in the same run.  The pool runs as its own process
(``accelmig-pool serve``) as deployed; hostA is 127.0.0.1, hostB [::1].
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

from bench.common import BENCH_TOKEN, Table, TwoHostPool, save_figure, stop_process


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


class Guest:
    """The guest of one N: its application processes (the agent is shared)."""

    def __init__(self, endpoint: str, agent_socket: str, n: int, procs: int, state_bytes: int, domain: str):
        self.procs = []
        share = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
        tag = 1
        for count in share:
            if not count:
                continue
            argv = [sys.executable, "-m", "bench.guest", endpoint, BENCH_TOKEN, agent_socket, str(count),
                    str(state_bytes), str(tag), domain]
            self.procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                               cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
            tag += count
        for proc in self.procs:            # all started before any opens: none slows another's opens
            line = proc.stdout.readline()
            if not line or not json.loads(line).get("ready"):
                raise RuntimeError(f"a guest process did not start (exit {proc.poll()})")

    def ask(self, proc, command: str) -> dict:
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a guest process ended (exit {proc.wait()}) at {command!r}")
        return json.loads(line)

    def open(self) -> tuple[list[str], list[float]]:
        sids, times = [], []
        for proc in self.procs:            # one process after the other: each open alone
            answer = self.ask(proc, "open")
            sids += answer["sids"]
            times += answer["open_s"]
        return sids, times

    def check(self) -> tuple[list[str], list[int]]:
        bad, resumes = [], []
        for proc in self.procs:
            answer = self.ask(proc, "check")
            bad += answer["bad"]
            resumes += answer["resumes"]
        return bad, resumes

    def close(self) -> None:
        for proc in self.procs:
            try:
                self.ask(proc, "close")
            except (RuntimeError, OSError, ValueError):
                pass
            stop_process(proc)


def frame_size(answer) -> int:
    from accelmig.wire.frames import encode_frame
    return len(encode_frame({"op": "result", "id": 1, "ok": True, "result": answer, "mac": "0" * 64}))


def attest(host, channel, domain: str, sids: list) -> None:
    """hostd's attestation of sessions its guest reported: a challenge, the
    drivers' proofs through the agent on the guest channel, the binds."""
    issued = host.call("bind_challenge")
    proven = channel.request("prove", host=host.name, challenges={issued["instance"]: issued["challenge"]},
                             sids=sids)
    if proven["refused"] or set(host.bind_proven(domain, issued["challenge"], proven["proofs"])) != set(sids):
        raise RuntimeError(f"sessions not attested: {proven['refused']}")


def attest_whole_guest(host, channel, domain: str) -> tuple[float, int]:
    """hostd's attestation of every session its guest holds at once (a
    guest whose agent reports nothing by itself: its drivers prove all of
    them, a page at a time, and the host binds them a batch at a time): the
    seconds, and the round trips to the guest it took."""
    t0 = time.perf_counter()
    issued = host.call("bind_challenge")
    challenges = {issued["instance"]: issued["challenge"]}
    proofs, after, trips = {}, None, 0
    while True:
        page = channel.request("prove", host=host.name, challenges=challenges, **({"after": after} if after else {}))
        trips += 1
        proofs.update(page["proofs"])
        after = page.get("next")
        if not after:
            break
    host.bind_proven(domain, issued["challenge"], proofs)
    return time.perf_counter() - t0, trips


def rehome_round(domain: str, src, dst, channel) -> dict:
    """One migration as the hosts' hostds take it; what it cost."""
    from accelmig.wire import channel as ch
    sizes = []
    record = dst.call("open_migration", domain_uuid=domain)
    sizes.append(frame_size(record))
    sizes.append(frame_size(src.call("switchover", domain_uuid=domain)))
    mid = record["migration_id"]
    started = time.perf_counter()
    # complete, every page (as hostd's pool_call_all does), sizes measured page by page
    page = dst.call("complete", domain_uuid=domain, migration_id=mid)
    sizes.append(frame_size(page))
    tickets, pages = dict(page["tickets"]), 1
    while page.get("next"):
        page = dst.call("complete", domain_uuid=domain, migration_id=mid, cursor=page["next"])
        sizes.append(frame_size(page))
        tickets.update(page["tickets"])
        pages += 1
    completed = time.perf_counter()
    document = {"migration_id": mid, "identity": {"host_id": dst.name, "pool_endpoint": dst.endpoint},
                "tickets": tickets}
    pieces, last = ch.rehome_pieces(document)
    lines = [len(ch.encode({"type": "tickets", "id": 1, **p})) for p in pieces]
    lines.append(len(ch.encode({"type": "rehome", "id": 1, **last})))
    for piece in pieces:
        channel.request("tickets", timeout=60, **piece)
    outcome = channel.request("rehome", timeout=300, **last)
    done = time.perf_counter()
    lines.append(len(ch.encode(ch.result(1, result=outcome))))
    src.call("close", domain_uuid=domain, migration_id=mid)
    final = dst.call("wait_record", domain_uuid=domain, migration_id=mid, until="rehomed", timeout=30)
    sizes.append(frame_size(final))
    rec = final["record"]
    if not outcome.get("ok") or rec["resumed_count"] != len(tickets) or rec["session_count"] != len(tickets):
        raise RuntimeError(f"rehome {mid}: agent ok={outcome.get('ok')}, record resumed "
                           f"{rec['resumed_count']}/{rec['session_count']} of {len(tickets)} tickets: "
                           f"{str(outcome)[:400]}")
    return {"rehome_s": done - started, "complete_s": completed - started, "deliver_s": done - completed,
            "pages": pages, "pieces": len(pieces), "tickets": tickets,
            "max_answer": max(sizes), "max_line": max(lines), "blackout_max_s": rec.get("blackout_max")}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench storm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", default="1,64,256,1000", help="comma-separated N [1,64,256,1000]")
    parser.add_argument("--rounds", type=int, default=4, help="migrations per N (A->B, B->A, ...) [4]")
    parser.add_argument("--procs", type=int, default=4, help="application processes of the guest [4]")
    parser.add_argument("--state-bytes", type=int, default=4096, help="device state per session [4096]")
    args = parser.parse_args(argv)
    counts = sorted({int(v) for v in args.sessions.split(",") if v.strip()} | {1})
    if counts[0] < 1 or args.rounds < 1 or args.procs < 1:
        parser.error("N, --rounds and --procs must be >= 1")

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    workdir = tempfile.mkdtemp(prefix="accelmig-bench-storm-")
    pool = agent = channel = None
    hosts = ()
    results = {}
    try:
        from accelmig.plugin.channel import GuestChannel
        # The pool's defaults: a guest's resumes all come from its one
        # address, within the 32 unauthenticated connections an address may
        # hold (the agent resumes 16 drivers at a time).
        pool = TwoHostPool(workdir)
        hosts = (pool.host("hostA"), pool.host("hostB"))
        channel_path, agent_socket = os.path.join(workdir, "channel.sock"), os.path.join(workdir, "agent.sock")
        agent = subprocess.Popen([sys.executable, "-m", "accelmig.agent", "run", "--port", channel_path,
                                  "--socket", agent_socket, "--state-dir", os.path.join(workdir, "agent"),
                                  "--rehome-timeout", "300", "--log-level", "WARNING"],
                                 stderr=open(os.path.join(workdir, "agent.log"), "ab"))
        channel = GuestChannel(channel_path, connect_timeout=30)
        channel.connect()
        for n in counts:
            domain = str(uuid.uuid4())
            guest = Guest(hosts[0].endpoint, agent_socket, n, min(args.procs, n), args.state_bytes, domain)
            try:
                started = time.perf_counter()
                sids, open_s = guest.open()
                opened = time.perf_counter() - started
                attest_s = []
                for sid in sids:          # hostd, as the agent reports each session opened
                    t0 = time.perf_counter()
                    attest(hosts[0], channel, domain, [sid])
                    attest_s.append(time.perf_counter() - t0)
                whole_s, trips = attest_whole_guest(hosts[0], channel, domain)
                log(f"storm N={n}: {n} session(s) open in {opened:.1f} s (median open "
                    f"{statistics.median(open_s) * 1e3:.2f} ms); {args.rounds} rounds")
                rounds = []
                for r in range(args.rounds):
                    src, dst = hosts[r % 2], hosts[(r + 1) % 2]
                    one = rehome_round(domain, src, dst, channel)
                    if set(one.pop("tickets")) != set(sids):
                        raise RuntimeError(f"N={n}: the tickets are not one per session")
                    bad, resumes = guest.check()
                    if bad or resumes != [r + 1] * n:
                        raise RuntimeError(f"N={n} round {r + 1}: {len(bad)} session(s) lost state; "
                                           f"resumes {sorted(set(resumes))} (each exactly {r + 1})")
                    rounds.append(one)
                    log(f"  round {r + 1}: rehomed in {one['rehome_s'] * 1e3:.1f} ms (complete "
                        f"{one['complete_s'] * 1e3:.1f} ms in {one['pages']} page(s), delivery "
                        f"{one['deliver_s'] * 1e3:.1f} ms, {one['pieces']} ticket piece(s)); largest "
                        f"answer {one['max_answer']} B, line {one['max_line']} B")
                tail = open_s[-min(len(open_s), 64):]      # the opens at the largest population
                results[n] = {"open_s": open_s, "attest_s": attest_s, "attest_all_s": whole_s,
                              "attest_all_trips": trips,
                              "open_median_s": statistics.median(open_s),
                              "open_tail_median_s": statistics.median(tail),
                              "open_p99_s": percentile(open_s, 99),
                              "attest_median_s": statistics.median(attest_s),
                              "rehome_s": [x["rehome_s"] for x in rounds],
                              "complete_s": [x["complete_s"] for x in rounds],
                              "deliver_s": [x["deliver_s"] for x in rounds],
                              "pages": rounds[-1]["pages"], "pieces": rounds[-1]["pieces"],
                              "max_answer": max(x["max_answer"] for x in rounds),
                              "max_line": max(x["max_line"] for x in rounds),
                              "blackout_max_s": [x["blackout_max_s"] for x in rounds]}
            finally:
                guest.close()
    finally:
        if channel is not None:
            channel.close()
        stop_process(agent)
        for host in hosts:
            host.close()
        if pool is not None:
            pool.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    med = statistics.median
    base = results[1]
    table = Table(f"rebind storm: one VM's N sessions rehomed at once (median of {args.rounds} "
                  f"migrations; {args.procs} application processes; open: each alone)",
                  "1 session", "N sessions")
    for n in counts:
        if n == 1:
            continue
        r = results[n]
        table.add(f"N={n}: rehome, all resumed", med(base["rehome_s"]) * 1e3, med(r["rehome_s"]) * 1e3, "ms")
        table.add(f"N={n}: complete (all pages)", med(base["complete_s"]) * 1e3, med(r["complete_s"]) * 1e3,
                  "ms")
        table.add(f"N={n}: open, per session", base["open_median_s"] * 1e3, r["open_tail_median_s"] * 1e3,
                  "ms")
        table.add(f"N={n}: attest, per session", base["attest_median_s"] * 1e3, r["attest_median_s"] * 1e3,
                  "ms")
        table.add(f"N={n}: attest the whole guest at once", base["attest_all_s"] * 1e3, r["attest_all_s"] * 1e3,
                  "ms")
    print()
    print(table.render())
    print("(open, per session: the median of the last 64 opens, at the largest population; "
          "rehome: from complete to the agent's answer that every driver resumed)")
    for n in counts:
        r = results[n]
        print(f"N={n:5d}: rehome {med(r['rehome_s']) * 1e3:8.1f} ms (complete {med(r['complete_s']) * 1e3:6.1f} "
              f"ms, {r['pages']} page(s); delivery {med(r['deliver_s']) * 1e3:7.1f} ms, {r['pieces']} ticket "
              f"piece(s)); open {r['open_tail_median_s'] * 1e3:5.2f} ms (p99 {r['open_p99_s'] * 1e3:5.2f}); "
              f"attest {r['attest_median_s'] * 1e3:5.2f} ms, the whole guest {r['attest_all_s'] * 1e3:6.1f} ms "
              f"({r['attest_all_trips']} prove(s)); largest answer {r['max_answer']} B, "
              f"line {r['max_line']} B")
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
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(counts, [med(results[n]["rehome_s"]) * 1e3 for n in counts], "o-", label="rehome: all resumed")
    left.plot(counts, [med(results[n]["complete_s"]) * 1e3 for n in counts], "s--", label="complete (all pages)")
    base = med(results[1]["rehome_s"]) * 1e3
    left.plot(counts, [base * n for n in counts], color="#bbbbbb", lw=1, label="N x one rehome (serial)")
    left.axhline(1000, color="#cc4444", lw=1, ls=":", label="1 s")
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("sessions in the VM (N)")
    left.set_ylabel("ms")
    left.set_title("rehome", fontsize=10)
    left.legend(fontsize=8)
    right.plot(counts, [results[n]["open_tail_median_s"] * 1e3 for n in counts], "o-", label="open (median)")
    right.plot(counts, [results[n]["open_p99_s"] * 1e3 for n in counts], "^--", label="open (p99)")
    right.plot(counts, [results[n]["attest_median_s"] * 1e3 for n in counts], "x:", label="attest (median)")
    right.axhline(2, color="#cc4444", lw=1, ls=":", label="2 ms")
    right.set_xscale("log")
    right.set_xlabel("sessions open at the pool (N)")
    right.set_ylabel("ms per session")
    right.set_title("session open", fontsize=10)
    right.legend(fontsize=8)
    return save_figure(fig, "storm")


if __name__ == "__main__":
    main(sys.argv[1:])
