"""Accelerator blackout per pause policy vs the VM's own downtime, in real
live migrations.

Brings up a lab (``AccelLab``: pool, two libvirt daemons with hostd and the
hook, in network namespaces; needs root), boots the demo VM on hostA with
its solver computing on the pool, then for each pause policy (none,
switchover, start) live-migrates it ``--migrations`` times back and forth
with ``accelmig migrate --pause-policy P``.  Per migration:

- VM downtime (the baseline): libvirt's completed-job statistics on the
  destination (``downtime``: the guest was paused);
- accelerator blackout (the subject): the pool's migration record, seconds
  from when the session stopped executing (``start``: the record opened;
  ``switchover``/``none``: the source switched over) to the session's resume
  with its ticket on the destination.

Table per policy with medians and the ratio blackout / downtime; plot;
bench/results/blackout.json holds every migration, each with its timeline
(the record's steps on the pool's clock, ``wire.records.TIMELINE_STEPS``).
``blackout-steps.png`` stacks the median time of each step of the blackout
per policy (one y-axis for all).  ``--slow MIB_PER_S`` adds migrations
throttled to that bandwidth (``virsh migrate-setspeed``) so each lasts
seconds: there the policies really differ (``start`` pauses from the
record's opening, ``none`` only the switchover).  Caution, measured on
2026-12-04: under TCG a migration throttled to 30 MiB/s once arrived with
the guest's kernel panicking in an interrupt (the VM rebooted on the
destination, its old session stranded) — not accelmig's doing, but it ends
the run; unthrottled migrations on a loaded machine last 3–7 s already.

``--warm N`` (on by default, 1; 0: not): after each migration of the
first table, N rehomes of the same guest where it now runs, with no
migration (hostd's ``rehome_here``: the same channel, agent and drivers'
resume over new connections, its fabric NIC re-addressed for real between
its lease and a spare address of the host's subnet), each after
``--settle``: the warm guest, whose TCG translations are all made, in the
same run and at the same load as the cold one.  Table ``blackout-warm``
(JSON, PNG): the guest's steps of the rehome, warm against right after a
migration (medians), and how much of ``none``'s blackout over the VM's
downtime is the cold guest's.

``--dirty MIB`` (the issue's long migration, without a bandwidth limit; on
by default, 1024, ``--dirty 0`` skips it): afterwards a second guest
(``--dirty-memory`` MiB) boots with the lab's memory dirtier
(``accelmig.lab.guest.memory_dirtier_files``) rewriting
MIB MiB of its memory at ``--dirty-rate`` MiB/s beside the solver, so
QEMU's pre-copy goes round after round and the migration lasts seconds;
it is migrated ``--migrations`` times per ``--dirty-policies`` (none,
start).  Its own table, ``blackout-long`` (JSON, PNG): policy ``start``
against ``none`` in the same run — accelerator blackout, VM downtime and
the migration's own time (libvirt's job statistics, which the JSON keeps
per migration: pre-copy rounds, bytes, dirty rate).  Should that part
fail (a guest kernel that panicked on arrival: docs/lab-notes.md), the
first table stands and this one is said missing.  The lab goes down at
the end (``--keep`` leaves it up).  Without root, or without libvirt/QEMU,
it says so and measures nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

from bench.common import Table, report

VM = "bench-vm"
DIRTY_VM = "bench-dirty"
POLICIES = ("none", "switchover", "start")
#: the issue's bar for a long migration: it lasts at least this long
LONG_MIGRATION_S = 3.0


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, mounts, two libvirt daemons); run it as root"
    missing = [tool for tool in ("ip", "virsh", "qemu-system-x86_64", "nsenter") if shutil.which(tool) is None]
    if not os.path.exists("/usr/sbin/libvirtd") and shutil.which("libvirtd") is None:
        missing.append("libvirtd")
    if missing:
        return f"missing {', '.join(missing)} (Debian: libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients qemu-system-x86 iproute2; ./dev.sh setup)"
    try:
        import libvirt  # noqa: F401
    except ImportError:
        return "the libvirt Python bindings are not installed in this virtualenv"
    return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench blackout", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--migrations", type=int, default=3, help="migrations per pause policy [3]")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated [none,switchover,start]")
    parser.add_argument("--lab-name", default="benchbo", help="the lab's name [benchbo]")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds of computing between migrations [1]")
    parser.add_argument("--keep", action="store_true", help="leave the lab up afterwards")
    parser.add_argument("--insecure", action="store_true",
                        help="the lab without TLS (plain TCP between guest, hosts and pool): what TLS "
                             "costs the drivers' reconnect, against a run without it [TLS]")
    parser.add_argument("--slow", type=float, default=0.0, metavar="MIB_PER_S",
                        help="also migrate throttled to this bandwidth (a migration of seconds) [off]")
    parser.add_argument("--slow-policies", default="none,start", help="policies of the throttled "
                        "migrations [none,start]")
    parser.add_argument("--warm", type=int, default=1, metavar="N",
                        help="rehomes of the guest where it runs, without a migration, after each "
                             "migration of the first table (the warm baseline, table blackout-warm); "
                             "0: not [1]")
    parser.add_argument("--dirty", type=int, default=1024, metavar="MIB",
                        help="also migrate a guest that rewrites this much of its memory (a migration "
                             "of seconds, table blackout-long); 0: not [1024]")
    parser.add_argument("--dirty-rate", type=float, default=64.0, metavar="MIB_PER_S",
                        help="how fast the dirtier rewrites it after filling it once; near what the "
                             "migration moves per second, pre-copy never ends [64]")
    parser.add_argument("--dirty-memory", type=int, default=0, metavar="MIB",
                        help="the dirty guest's memory [MIB + 512]")
    parser.add_argument("--dirty-policies", default="none,start",
                        help="policies of the dirty guest's migrations [none,start]")
    args = parser.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    slow_policies = [p.strip() for p in args.slow_policies.split(",") if p.strip()] if args.slow else []
    dirty_policies = [p.strip() for p in args.dirty_policies.split(",") if p.strip()] if args.dirty else []
    if any(p not in POLICIES for p in policies + slow_policies + dirty_policies) or args.migrations < 1 \
            or args.warm < 0:
        parser.error(f"policies are {', '.join(POLICIES)}; --migrations >= 1; --warm >= 0")
    args.dirty_memory = args.dirty_memory or args.dirty + 512
    if args.dirty and (args.dirty < 0 or args.dirty_rate <= 0 or args.dirty_memory < args.dirty + 256):
        parser.error("--dirty MIB > 0, --dirty-rate > 0, and --dirty-memory at least MIB + 256 "
                     "(the RAM-only guest's own files and processes)")
    reason = skip_reason()
    if reason:
        print(f"bench blackout: SKIPPED, nothing measured: {reason}", flush=True)
        return

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    from accelmig.lab.accel import AccelLab, demo_command
    from accelmig.lab.guest import DIRTIER_STARTED, dirty_cmdline, memory_dirtier_files
    accel = AccelLab(args.lab_name, **({"insecure": True} if args.insecure else {}))
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    runs.update({slow_label(p, args.slow): [] for p in slow_policies})
    long_runs: dict[str, list[dict]] = {p: [] for p in dirty_policies}
    long_error = None
    warm_runs: list[dict] = []
    t_start = time.monotonic()
    where = "hostA"

    def migrate(vm: str, label: str, policy: str, bandwidth: float | None, into: dict) -> None:
        nonlocal where
        time.sleep(args.settle)
        dst = "hostB" if where == "hostA" else "hostA"
        # the bandwidth a migration may use (MiB/s): slow, or as fast as it goes
        speed = accel.virsh(where, "migrate-setspeed", vm, str(int(bandwidth or 1 << 20)))
        if speed.returncode != 0:
            raise RuntimeError(f"migrate-setspeed on {where}: {speed.stderr.strip()}")
        r = accel.migrate_accelmig(vm, where, dst, "--pause-policy", policy)
        if not r.get("ok"):
            raise RuntimeError(f"migration {where}->{dst} (policy {policy}) failed: "
                               f"{r.get('error') or r.get('cli') or r.get('record')}")
        record = r.get("record") or {}
        downtime = r.get("downtime_ms")
        if downtime is None:
            downtime = (r.get("cli") or {}).get("downtime_ms")
        blackout = max(r["blackout_ms"].values(), default=None)
        if downtime is None or blackout is None:
            raise RuntimeError(f"migration {where}->{dst}: no downtime ({downtime}) or no "
                               f"blackout ({r['blackout_ms']}) measured")
        times = record.get("times") or {}
        phases = {}
        if times.get("switchover") and times.get("completed"):
            # the pool's blackout starts at record open ('start') or at switchover
            stopped = times["opened"] if policy == "start" else times["switchover"]
            resumed_at = stopped + blackout / 1000
            phases = {"switchover_to_complete_ms": round((times["completed"] - times["switchover"]) * 1e3, 1),
                      "complete_to_resume_ms": round((resumed_at - times["completed"]) * 1e3, 1)}
        timeline = (r.get("cli") or {}).get("timeline") or {}
        job = r.get("job") or {}
        into[label].append({"from": where, "to": dst, "downtime_ms": float(downtime),
                            "policy": policy, "bandwidth_mib_s": bandwidth,
                            "timeline": timeline, "steps_ms": blackout_steps(timeline, policy),
                            "blackout_ms": float(blackout), "wall_s": r["wall_s"],
                            "migration_ms": job.get("time_elapsed"), "job": job,
                            "load": os.getloadavg()[0],
                            "sessions": r["sessions"], "resumed": r["resumed"],
                            "bytes_resent": r["bytes_resent"], "rebuilds": r["rebuilds"], **phases,
                            "record_times": {key: round(v - times["opened"], 4)
                                             for key, v in times.items()} if times else {}})
        took = f", migration {job['time_elapsed'] / 1000:.1f} s in {job.get('memory_iteration', '?')} rounds" \
            if "time_elapsed" in job else ""
        log(f"  {label:10} {where}->{dst}: VM downtime {downtime} ms, accelerator blackout "
            f"{blackout:.0f} ms, wall {r['wall_s']:.2f} s{took}, re-sent {r['bytes_resent']} B")
        where = dst

    def rehome_warm(vm: str) -> None:
        """The same guest where it runs, rehomed without a migration: its
        NIC goes to the address it does not have now (after a migration: its
        lease, so the spare first)."""
        time.sleep(args.settle)
        address = "lease" if warm_runs and warm_runs[-1]["address"] == "spare" and \
            warm_runs[-1]["where"] == where else "spare"
        answer = accel.rehome_here(vm, where, address)
        if not answer.get("ok"):
            raise RuntimeError(f"rehome here of {vm} on {where} failed: {answer.get('why')}")
        timeline = answer.get("timeline") or {}
        warm_runs.append({"where": where, "address": address, "timeline": timeline,
                          "steps_ms": path_steps(timeline, GUEST_PATH), "network": answer.get("network"),
                          "sessions": answer.get("sessions"), "guest": answer.get("guest"),
                          "load": os.getloadavg()[0]})
        log(f"  {'warm':10} {where}: rehome here ({address} address): delivering -> answered "
            f"{sum(warm_runs[-1]['steps_ms'].values()):.0f} ms")

    def solver_goes_on(vm: str) -> None:
        """The solver is still computing, on the pool, after every move."""
        last = max(l.get("step", 0) for l in accel.demo_lines(vm))
        line = accel.wait_demo(vm, lambda ls: next((l for l in ls if l.get("step", 0) > last or "done" in l),
                                                   None), timeout=60, what="solver progress after the moves")
        if "done" in line and not line.get("done"):
            raise RuntimeError(f"the solver of {vm} failed: {line}")

    try:
        log(f"blackout: bringing lab {args.lab_name} up ...")
        accel.up()
        # one image for both guests: the dirtier runs only where the command line says so
        image = accel.image(app_command=demo_command(accel.token, 10_000_000, 128, 10, 0.05),
                            extra_files=memory_dirtier_files())
        accel.boot(VM, image, "hostA")
        accel.wait_demo(VM, lambda ls: [l for l in ls if "step" in l], timeout=180,
                        what="the solver's first progress")
        virt = {"qemu": "TCG"}.get(accel.lab.virt_type, accel.lab.virt_type.upper())
        log(f"  lab up, {VM} computing on the pool ({virt}), {time.monotonic() - t_start:.0f} s")
        plan = [(p, p, None) for p in policies] + [(slow_label(p, args.slow), p, args.slow) for p in slow_policies]
        for label, policy, bandwidth in plan:
            for _ in range(args.migrations):
                migrate(VM, label, policy, bandwidth, runs)
                for _ in range(args.warm):
                    rehome_warm(VM)
        solver_goes_on(VM)
        solver_ok = True
        if dirty_policies:
            try:
                # the fast guest goes: the dirty one has the machine's CPU to itself
                accel.virsh(where, "destroy", VM)
                accel.boot(DIRTY_VM, image, where, memory_mib=args.dirty_memory,
                           cmdline_options={"extra": dirty_cmdline(args.dirty, args.dirty_rate)})
                accel.wait_demo(DIRTY_VM, lambda ls: [l for l in ls if "step" in l], timeout=180,
                                what="the dirty guest's solver's first progress")
                accel.wait_demo(DIRTY_VM, lambda ls: any(DIRTIER_STARTED in l for l in accel.console(DIRTY_VM)),
                                timeout=60, what="the memory dirtier")
                log(f"  {DIRTY_VM} computing and rewriting {args.dirty} MiB at {args.dirty_rate:g} MiB/s")
                for policy in dirty_policies:
                    for _ in range(args.migrations):
                        migrate(DIRTY_VM, policy, policy, None, long_runs)
                solver_goes_on(DIRTY_VM)
            except Exception as exc:     # the fast policies' table stands; this one is said missing
                long_error = f"{type(exc).__name__}: {exc}"
                log(f"blackout: the long migrations FAILED, table blackout-long not written: {long_error}")
    finally:
        if args.keep:
            log(f"lab {args.lab_name} left up: accelmig lab down --name {args.lab_name}")
        else:
            accel.down()

    med = statistics.median
    table = Table(f"accelerator blackout vs VM downtime per pause policy ({virt} lab, "
                  f"{args.migrations} accelmig migrations each, median)", "VM downtime", "accel blackout")
    for label in runs:
        rows = runs[label]
        table.add(f"pause policy {label}", med(r["downtime_ms"] for r in rows),
                  med(r["blackout_ms"] for r in rows), "ms")
    extra = {"args": vars(args), "virt_type": accel.lab.virt_type, "migrations": runs,
             "solver_kept_computing": solver_ok, "seconds": round(time.monotonic() - t_start, 1)}
    steps = {label: median_steps(rows) for label, rows in runs.items()}
    extra["median_steps_ms"] = steps
    report(table, "blackout", extra)
    png = plot_steps(steps, f"the accelerator blackout step by step ({virt} lab, median of "
                            f"{args.migrations} migrations per policy)")
    print(steps_table(steps))
    if png:
        print(f"wrote {png}")
    for label in runs:
        rows = runs[label]
        downs = ", ".join(f"{r['downtime_ms']:.0f}" for r in rows)
        blacks = ", ".join(f"{r['blackout_ms']:.0f}" for r in rows)
        gaps = [r["complete_to_resume_ms"] for r in rows if "complete_to_resume_ms" in r]
        gap = f"; record complete -> resume (median) {med(gaps):.0f} ms" if gaps else ""
        walls = ", ".join(f"{r['wall_s']:.1f}" for r in rows)
        print(f"{label:10}: wall {walls} s; downtime {downs} ms; blackout {blacks} ms; re-sent "
              f"{sum(r['bytes_resent'] for r in rows)} B, rebuilds {sum(r['rebuilds'] for r in rows)}{gap}")
    for policy in slow_policies:
        if policy != "start" and "start" in slow_policies:
            fast, slow = runs[slow_label(policy, args.slow)], runs[slow_label("start", args.slow)]
            print(f"throttled to {args.slow:g} MiB/s: 'start' blackout / '{policy}' blackout = "
                  f"{med(r['blackout_ms'] for r in slow) / med(r['blackout_ms'] for r in fast):.1f}x "
                  f"(migrations of {med(r['wall_s'] for r in slow):.1f} s)")
    print(f"(blackout: the pool's record, from when the session stopped executing — record open for "
          f"'start', switchover otherwise — to its resume on the destination; {extra['seconds']:.0f} s in all)")
    if warm_runs:
        report_warm(warm_runs, runs, virt)
    if long_error is not None:
        print(f"\nlong migrations (--dirty): NOT MEASURED: {long_error}")
    elif long_runs:
        report_long(long_runs, args, virt)


def report_long(long_runs: dict, args, virt: str) -> None:
    """The long migrations' own table: ``start`` against ``none`` (the
    baseline: the default policy, measured in the same run)."""
    med = statistics.median
    rows = {label: rows for label, rows in long_runs.items() if rows}
    what = f"a guest rewriting {args.dirty} MiB of its {args.dirty_memory} MiB at {args.dirty_rate:g} MiB/s"
    if "none" in rows and "start" in rows:
        base, subject = rows["none"], rows["start"]
        table = Table(f"long migrations, pause policy start vs none ({virt} lab, {what}, "
                      f"{args.migrations} migrations each, median)", "policy none", "policy start")
        table.add("accelerator blackout", med(r["blackout_ms"] for r in base),
                  med(r["blackout_ms"] for r in subject), "ms")
        table.add("VM downtime", med(r["downtime_ms"] for r in base), med(r["downtime_ms"] for r in subject), "ms")
        timed = [r for r in base + subject if r["migration_ms"] is not None]
        if all(r["migration_ms"] is not None for r in base + subject):
            table.add("migration (libvirt's job)", med(r["migration_ms"] for r in base),
                      med(r["migration_ms"] for r in subject), "ms")
    else:      # not both: each policy's blackout against the VM's own downtime
        if not rows:
            print("\nlong migrations (--dirty): none measured")
            return
        table = Table(f"long migrations ({virt} lab, {what}, {args.migrations} migrations per policy, "
                      f"median)", "VM downtime", "accel blackout")
        for label, only in rows.items():
            table.add(f"pause policy {label}", med(r["downtime_ms"] for r in only),
                      med(r["blackout_ms"] for r in only), "ms")
        timed = [r for only in rows.values() for r in only if r["migration_ms"] is not None]
    shortest = min((r["migration_ms"] for r in timed), default=None)
    extra = {"args": vars(args), "migrations": long_runs, "long_migration_s": LONG_MIGRATION_S,
             "shortest_migration_ms": shortest,
             "median_steps_ms": {label: median_steps(r) for label, r in rows.items()}}
    report(table, "blackout-long", extra)
    print(steps_table(extra["median_steps_ms"]))
    for label, rs in rows.items():
        took = ", ".join(f"{r['migration_ms'] / 1000:.1f}" if r["migration_ms"] else "?" for r in rs)
        rounds = ", ".join(str(r["job"].get("memory_iteration", "?")) for r in rs)
        downs = ", ".join(f"{r['downtime_ms']:.0f}" for r in rs)
        blacks = ", ".join(f"{r['blackout_ms']:.0f}" for r in rs)
        loads = ", ".join(f"{r['load']:.1f}" for r in rs)
        print(f"{label:10}: migration {took} s (pre-copy rounds {rounds}); downtime {downs} ms; "
              f"blackout {blacks} ms; load {loads}")
    if shortest is not None and shortest < LONG_MIGRATION_S * 1000:
        print(f"NOTE: a migration took {shortest / 1000:.1f} s, under the {LONG_MIGRATION_S:g} s a long "
              f"migration should last: raise --dirty or --dirty-rate")
    if "none" in rows:
        none = rows["none"]
        over = med(r["blackout_ms"] - r["downtime_ms"] for r in none)
        print(f"policy none: blackout - VM downtime = {over:.0f} ms (median of each migration's own)")


#: the rehome's steps that a guest takes, migrated or not (hostd's
#: ``delivering`` to its ``answered``, the guest's stamps between): the
#: warm baseline's and the migrations' alike
GUEST_PATH = ("delivering", "agent_received", "nic_readdressed", "driver_connected", "answered")


def path_steps(timeline: dict, path: tuple) -> dict:
    """ms spent reaching each step of ``path`` from the one before (the
    steps the timeline has)."""
    out, before = {}, None
    for step in path:
        stamp = timeline.get(step)
        if stamp is None:
            continue
        if before is not None:
            out[step] = round(max(0.0, stamp["t"] - before) * 1000, 2)
        before = stamp["t"]
    return out


def report_warm(warm: list[dict], runs: dict, virt: str) -> None:
    """Table ``blackout-warm``: each guest step of the rehome, warm (the
    baseline) against right after a migration (policy ``none``'s when it
    ran, else every policy's), medians; then how much of ``none``'s
    blackout over the VM's downtime the cold guest costs."""
    med = statistics.median
    cold_label = "none" if runs.get("none") else None
    cold = runs[cold_label] if cold_label else [r for rows in runs.values() for r in rows]
    cold_steps = [path_steps(r.get("timeline") or {}, GUEST_PATH) for r in cold]
    warm_steps = [r["steps_ms"] for r in warm]
    table = Table(f"the rehome's guest steps, warm guest vs right after a migration ({virt} lab, "
                  f"{len(warm)} rehomes without a migration, {len(cold)} migrations"
                  f"{' (policy none)' if cold_label else ''}, median ms from the step before)",
                  "warm guest", "after migration")
    medians = {}
    for step in GUEST_PATH[1:]:
        w = [s[step] for s in warm_steps if step in s]
        c = [s[step] for s in cold_steps if step in s]
        if w and c:
            medians[step] = (med(w), med(c))
            table.add(f"-> {step}", med(w), med(c), "ms")
    # the part inside the blackout (the pool has the resume before the agent answers)
    inside = [s for s in GUEST_PATH[1:] if s in medians and s != "answered"]
    if inside:
        warm_in = med(sum(s.get(k, 0.0) for k in inside) for s in warm_steps)
        cold_in = med(sum(s.get(k, 0.0) for k in inside) for s in cold_steps)
        table.add(f"delivering -> {inside[-1]}", warm_in, cold_in, "ms")
    extra = {"warm": warm, "cold_label": cold_label or "all", "cold_steps_ms": cold_steps,
             "median_steps_ms": {"warm": {k: v[0] for k, v in medians.items()},
                                 "after migration": {k: v[1] for k, v in medians.items()}}}
    if inside and cold_label:
        excess = med(r["blackout_ms"] - r["downtime_ms"] for r in cold)
        extra.update(excess_over_downtime_ms=round(excess, 1), cold_guest_ms=round(cold_in - warm_in, 1))
    report(table, "blackout-warm", extra)
    if "excess_over_downtime_ms" in extra:
        print(f"policy none: blackout - VM downtime = {extra['excess_over_downtime_ms']:.0f} ms (median); of it "
              f"the cold guest (delivering -> {inside[-1]}, after a migration minus warm) "
              f"{extra['cold_guest_ms']:.0f} ms; the same steps warm {warm_in:.0f} ms")


def slow_label(policy: str, bandwidth: float) -> str:
    return f"{policy}@{bandwidth:g}MiB/s"


#: the steps a blackout goes through, in order: each bar segment is the time
#: from the step before to this one (the pool's clock: wire.records)
BLACKOUT_PATH = ("opened", "switchover", "resumed_seen", "completed", "identity", "delivering",
                 "agent_received", "nic_readdressed", "driver_connected", "resume_received", "resume_answered")


def blackout_steps(timeline: dict, policy: str) -> dict:
    """ms spent reaching each step of the blackout from the one before;
    the blackout starts at the record's opening for 'start', else at the switchover."""
    first = "opened" if policy == "start" else "switchover"
    return path_steps(timeline, BLACKOUT_PATH[BLACKOUT_PATH.index(first):])


def median_steps(rows: list[dict]) -> dict:
    names = [s for s in BLACKOUT_PATH if any(s in r["steps_ms"] for r in rows)]
    return {s: round(statistics.median(r["steps_ms"].get(s, 0.0) for r in rows), 2) for s in names}


def steps_table(steps: dict) -> str:
    labels = list(steps)
    names = [s for s in BLACKOUT_PATH if any(s in steps[l] for l in labels)]
    lines = ["median ms to reach each step from the one before (the pool's clock)",
             f"{'step':18}" + "".join(f"{l:>20}" for l in labels)]
    for name in names:
        lines.append(f"{name:18}" + "".join(f"{steps[l].get(name, 0.0):>20.1f}" for l in labels))
    lines.append(f"{'sum':18}" + "".join(f"{sum(steps[l].values()):>20.1f}" for l in labels))
    return "\n".join(lines)


def plot_steps(steps: dict, title: str) -> str | None:
    """One stacked bar per policy, one y-axis: where each blackout's time goes."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from bench.common import save_figure
    labels = list(steps)
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(labels), 4.6))
    bottoms = [0.0] * len(labels)
    colours = plt.get_cmap("tab20")
    for i, name in enumerate(BLACKOUT_PATH[1:]):
        heights = [steps[l].get(name, 0.0) for l in labels]
        if not any(heights):
            continue
        ax.bar(labels, heights, bottom=bottoms, label=name, color=colours(i))
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_ylabel("ms to reach each step from the one before (median)", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title, fontsize=9)
    return save_figure(fig, "blackout-steps")


if __name__ == "__main__":
    main(sys.argv[1:])
