"""What serving every device of a node costs a session's open: one real pool
process serving PoCL's two devices (``POCL_DEVICES="pthread basic"``), its
sessions placed by selector or least loaded, beside the baseline, the same
node's pool serving one of them (``--devices opencl:1``, pthread: the device the
rows with a selector ask for), in one run.

Rows: an open (hello, open, placement, a context on the device, the first
answer of ``info``) and close, the tenant's device processes already
running; the same with a selector of three terms; with a device id.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile

from bench.common import Table, median_of, report
from bench.remoting import start_pool

TOKEN = "bench-token-0001"


def _opens(endpoint: str, repeat: int, device: str | None) -> float:
    from accelmig.agent.driver import connect

    def one():
        with connect(endpoint, TOKEN, agent=False, domain=False, insecure=True, device=device) as dev:
            dev.info()
    for _ in range(2):            # the tenant's device processes start here, not in the figures
        one()
    return median_of(one, repeat)[0]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="bench devices", description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=50, help="opens per row (the median is shown)")
    args = parser.parse_args(argv)
    os.environ["POCL_DEVICES"] = "pthread basic"        # the pools' environment (inherited)
    figures = {}
    for mode, extra in (("one", ("--devices", "opencl:1")), ("all", ())):        # opencl:1: pthread
        workdir = tempfile.mkdtemp(prefix="accelmig-bench-")
        proc, endpoint = start_pool(workdir, *extra)
        try:
            figures[mode] = {"any": _opens(endpoint, args.repeat, None)}
            if mode == "all":
                from accelmig.agent.driver import connect
                with connect(endpoint, TOKEN, agent=False, domain=False, insecure=True,
                             device="name=pthread") as dev:
                    device_id = dev.device_id
                figures[mode]["terms"] = _opens(endpoint, args.repeat, "type=cpu,min_memory=1GiB,name=pthread")
                figures[mode]["id"] = _opens(endpoint, args.repeat, device_id)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)
            shutil.rmtree(workdir, ignore_errors=True)
    one, every = figures["one"], figures["all"]
    table = Table("a node's every device: open + info + close of a session", "one device",
                  "two devices")
    table.add("no selector (least loaded)", one["any"] * 1e3, every["any"] * 1e3, "ms")
    table.add("selector: 3 terms", one["any"] * 1e3, every["terms"] * 1e3, "ms")
    table.add("selector: a device id", one["any"] * 1e3, every["id"] * 1e3, "ms")
    report(table, "devices", {"args": vars(args), "pocl_devices": os.environ["POCL_DEVICES"]})


if __name__ == "__main__":
    main(sys.argv[1:])
