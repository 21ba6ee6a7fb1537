"""``python -m bench [NAME|all] [OPTIONS]``: run benchmarks; OPTIONS go to
the named one (``python -m bench remoting --help``)."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = ["remoting", "resume", "storm", "blackout", "isolation", "devices"]


def main(argv: list[str]) -> int:
    name, options = (argv[0], argv[1:]) if argv and not argv[0].startswith("-") else ("all", argv)
    names = BENCHMARKS if name == "all" else [name]
    if name not in BENCHMARKS + ["all"]:
        print(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    for one in names:
        importlib.import_module(f"bench.{one}").main(options if name != "all" else [])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
