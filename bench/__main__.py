"""``python -m bench [NAME|all|report] [OPTIONS]``: run benchmarks; OPTIONS go
to the named one (``python -m bench remoting --help``).  After any run,
``bench/results/REPORT.md`` is rebuilt from every result there
(``python -m bench report`` rebuilds it alone)."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = ["remoting", "dataplane", "resume", "storm", "blackout", "isolation", "sandbox", "devices", "placement", "etcd_tls",
              "records"]


def main(argv: list[str]) -> int:
    name, options = (argv[0], argv[1:]) if argv and not argv[0].startswith("-") else ("all", argv)
    if name in ("-h", "--help") or (name == "all" and options[:1] in (["-h"], ["--help"])):
        print(__doc__)
        print(f"benchmarks: {', '.join(BENCHMARKS)}")
        return 0
    if name not in BENCHMARKS + ["all", "report"]:
        print(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}, all, report", file=sys.stderr)
        return 2
    from bench import report
    if name == "report":
        report.main(options)
        return 0
    for one in BENCHMARKS if name == "all" else [name]:
        importlib.import_module(f"bench.{one}").main(options if name != "all" else [])
    report.main([])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
