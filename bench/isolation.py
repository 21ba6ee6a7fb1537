"""What keeping tenants apart costs: each tenant's device work in a process
of its own (``device_isolation = "process"``, the default) beside all of it
in the pool's process (``"none"``, the baseline), one real pool process of
each, in one run: opening a tenant's first session (its device process
starts), small round trips, 64 MiB transfers (one more copy, across a
socket pair), pipelined launches.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile

from bench.common import Table, report
from bench.remoting import add_driver_rows, driver_figures, start_pool



def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="bench isolation", description=__doc__.split("\n")[0])
    parser.add_argument("--round-trips", type=int, default=1000)
    parser.add_argument("--bulk-mib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--pipelined", type=int, default=5000)
    args = parser.parse_args(argv)
    results = {}
    for mode in ("none", "process"):
        workdir = tempfile.mkdtemp(prefix="accelmig-bench-")
        # (the baseline builds in the pool's own process: allowed explicitly)
        unconfined = ("--allow-unconfined-builds",) if mode == "none" else ()
        proc, endpoint = start_pool(workdir, "--device-isolation", mode, *unconfined)
        try:
            results[mode] = driver_figures(endpoint, args, insecure=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)
            shutil.rmtree(workdir, ignore_errors=True)
    base, iso = results["none"], results["process"]
    table = Table("device isolation: a process per tenant vs all in the pool's process",
                  "in the pool", "per tenant")
    table.add("first session: open + build", base["first"] * 1e3, iso["first"] * 1e3, "ms")
    add_driver_rows(table, base, iso, args, "pipelined launches")
    report(table, "isolation", {"args": vars(args)})


if __name__ == "__main__":
    main(sys.argv[1:])
