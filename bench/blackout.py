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
bench/results/blackout.json holds every migration.  The lab goes down at
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
POLICIES = ("none", "switchover", "start")


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
    args = parser.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if any(p not in POLICIES for p in policies) or args.migrations < 1:
        parser.error(f"policies are {', '.join(POLICIES)}; --migrations >= 1")
    reason = skip_reason()
    if reason:
        print(f"bench blackout: SKIPPED, nothing measured: {reason}", flush=True)
        return

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    from accelmig.lab.accel import AccelLab
    accel = AccelLab(args.lab_name)
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    t_start = time.monotonic()
    try:
        log(f"blackout: bringing lab {args.lab_name} up ...")
        accel.up()
        image = accel.demo_image(steps=10_000_000, report=10, pause=0.05)
        accel.boot(VM, image, "hostA")
        accel.wait_demo(VM, lambda ls: [l for l in ls if "step" in l], timeout=180,
                        what="the solver's first progress")
        virt = {"qemu": "TCG"}.get(accel.lab.virt_type, accel.lab.virt_type.upper())
        log(f"  lab up, {VM} computing on the pool ({virt}), {time.monotonic() - t_start:.0f} s")
        where = "hostA"
        for policy in policies:
            for k in range(args.migrations):
                time.sleep(args.settle)
                dst = "hostB" if where == "hostA" else "hostA"
                r = accel.migrate_accelmig(VM, where, dst, "--pause-policy", policy)
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
                runs[policy].append({"from": where, "to": dst, "downtime_ms": float(downtime),
                                     "blackout_ms": float(blackout), "wall_s": r["wall_s"],
                                     "sessions": r["sessions"], "resumed": r["resumed"],
                                     "bytes_resent": r["bytes_resent"], "rebuilds": r["rebuilds"], **phases,
                                     "record_times": {key: round(v - times["opened"], 4)
                                                      for key, v in times.items()} if times else {}})
                log(f"  {policy:10} {where}->{dst}: VM downtime {downtime} ms, accelerator blackout "
                    f"{blackout:.0f} ms, wall {r['wall_s']:.2f} s, re-sent {r['bytes_resent']} B")
                where = dst
        # the solver is still computing, on the pool, after every move
        last = max(l.get("step", 0) for l in accel.demo_lines(VM))
        line = accel.wait_demo(VM, lambda ls: next((l for l in ls if l.get("step", 0) > last or "done" in l),
                                                   None), timeout=60, what="solver progress after the moves")
        if "done" in line and not line.get("done"):
            raise RuntimeError(f"the solver failed: {line}")
        solver_ok = True
    finally:
        if args.keep:
            log(f"lab {args.lab_name} left up: accelmig lab down --name {args.lab_name}")
        else:
            accel.down()

    med = statistics.median
    table = Table(f"accelerator blackout vs VM downtime per pause policy ({virt} lab, "
                  f"{args.migrations} accelmig migrations each, median)", "VM downtime", "accel blackout")
    for policy in policies:
        rows = runs[policy]
        table.add(f"pause policy {policy}", med(r["downtime_ms"] for r in rows),
                  med(r["blackout_ms"] for r in rows), "ms")
    extra = {"args": vars(args), "virt_type": accel.lab.virt_type, "migrations": runs,
             "solver_kept_computing": solver_ok, "seconds": round(time.monotonic() - t_start, 1)}
    report(table, "blackout", extra)
    for policy in policies:
        rows = runs[policy]
        downs = ", ".join(f"{r['downtime_ms']:.0f}" for r in rows)
        blacks = ", ".join(f"{r['blackout_ms']:.0f}" for r in rows)
        gaps = [r["complete_to_resume_ms"] for r in rows if "complete_to_resume_ms" in r]
        gap = f"; record complete -> resume (median) {med(gaps):.0f} ms" if gaps else ""
        print(f"{policy:10}: downtime {downs} ms; blackout {blacks} ms; re-sent "
              f"{sum(r['bytes_resent'] for r in rows)} B, rebuilds {sum(r['rebuilds'] for r in rows)}{gap}")
    print(f"(blackout: the pool's record, from when the session stopped executing — record open for "
          f"'start', switchover otherwise — to its resume on the destination; {extra['seconds']:.0f} s in all)")


if __name__ == "__main__":
    main(sys.argv[1:])
