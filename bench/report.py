"""``python -m bench report``: ``bench/results/REPORT.md`` from the results
the benchmarks left in ``bench/results`` (``NAME.json`` as
``Table.save`` writes it, ``NAME.png`` beside it).

Every table keeps the baseline that was measured in the same run, with its
ratio, and says when and on what machine it was measured: a result older
than the others is visible as such, never passed off as today's.
``python -m bench all`` writes the report after its last benchmark.
"""

from __future__ import annotations

import argparse
import calendar
import json
import os
import sys
import time

from accelmig.runtime.files import atomic_write
from bench import common

#: the order of the report (others, if any, follow by name)
ORDER = ["remoting", "remoting-launches", "remoting-big", "remoting-chunked", "remoting-tls", "resume", "storm",
         "blackout", "blackout-long", "isolation", "sandbox", "devices", "placement", "etcd_tls"]
#: how many hours older than the newest result one may be before it is flagged
STALE_HOURS = 24.0


class ResultError(ValueError):
    """A results file that is not what ``Table.save`` writes."""


def load_results(directory: str) -> list[dict]:
    """Every ``*.json`` in ``directory`` with its name and plot, in report
    order; a file that is not a benchmark's result is an error naming it."""
    found = []
    for entry in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if not entry.endswith(".json"):
            continue
        name = entry[:-len(".json")]
        path = os.path.join(directory, entry)
        try:
            with open(path) as handle:
                data = json.load(handle)
        except (OSError, ValueError) as exc:
            raise ResultError(f"{path}: not readable as JSON: {exc}") from None
        missing = [key for key in ("title", "baseline", "subject", "rows", "when") if key not in data]
        if missing or not isinstance(data.get("rows"), list):
            raise ResultError(f"{path}: not a benchmark result (missing {', '.join(missing) or 'rows'})")
        png = os.path.join(directory, name + ".png")
        found.append({"name": name, "data": data, "plot": name + ".png" if os.path.exists(png) else None})
    rank = {name: i for i, name in enumerate(ORDER)}
    found.sort(key=lambda r: (rank.get(r["name"], len(ORDER)), r["name"]))
    return found


def _when(data: dict) -> float:
    try:
        return calendar.timegm(time.strptime(data["when"], "%Y-%m-%dT%H:%M:%SZ"))
    except (KeyError, TypeError, ValueError):
        return 0.0


def _number(value: float, unit: str) -> str:
    return common._fmt(float(value), unit)


def _ratio(row: dict) -> str:
    ratio = row.get("ratio")
    if ratio is None or ratio == float("inf"):
        return "—"
    return common._fmt_ratio(float(ratio))


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _machine(data: dict) -> str:
    m = data.get("machine") or {}
    parts = [f"{m['cpus']} CPUs" if "cpus" in m else None,
             f"Python {m['python']}" if "python" in m else None,
             f"kernel {m['kernel']}" if "kernel" in m else None,
             f"host `{m['node']}`" if "node" in m else None]
    return ", ".join(p for p in parts if p) or "unknown machine"


def render(results: list[dict], generated: float | None = None) -> str:
    """The report as Markdown."""
    generated = time.time() if generated is None else generated
    lines = ["# accelmig benchmarks", "",
             f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(generated))} by "
             "`./dev.sh bench` (`python -m bench report` rebuilds it from `bench/results/`).",
             "Every ratio is against a baseline measured in the same run, on the same machine; "
             "speed is never asserted in tests.", ""]
    if not results:
        lines += ["No results yet: run `./dev.sh bench` (or `./dev.sh bench NAME`).", ""]
        return "\n".join(lines)
    newest = max(_when(r["data"]) for r in results)
    lines += ["| benchmark | measured | machine | rows |", "|---|---|---|---|"]
    for r in results:
        d = r["data"]
        stale = " (older than the rest)" if newest - _when(d) > STALE_HOURS * 3600 else ""
        lines.append(f"| [{_cell(r['name'])}](#{r['name']}) | {_cell(d['when'])}{stale} | "
                     f"{_cell(_machine(d))} | {len(d['rows'])} |")
    lines.append("")
    for r in results:
        d = r["data"]
        lines += [f"<a id=\"{r['name']}\"></a>", f"## {_cell(r['name'])}: {_cell(d['title'])}", "",
                  f"Measured {d['when']} on {_machine(d)}.", ""]
        args = d.get("args")
        if isinstance(args, dict) and args:
            lines += ["Options: " + ", ".join(f"`{k}={v}`" for k, v in sorted(args.items())), ""]
        baseline, subject = _cell(d["baseline"]), _cell(d["subject"])
        lines += [f"| | {baseline} | {subject} | ratio | better |", "|---|---:|---:|---:|---|"]
        for row in d["rows"]:
            unit = str(row.get("unit", ""))
            lines.append(f"| {_cell(row.get('label', ''))} | {_number(row.get('baseline', 0), unit)} | "
                         f"{_number(row.get('subject', 0), unit)} | {_ratio(row)} | "
                         f"{_cell(row.get('better', ''))} |")
        lines += ["", f"ratio = {subject} / {baseline}.", ""]
        if r["plot"]:
            lines += [f"![{_cell(r['name'])}]({r['plot']})", ""]
    return "\n".join(lines)


def write_report(directory: str = common.RESULTS) -> str:
    """Render the results in ``directory`` into ``directory/REPORT.md``
    (atomically); return its path."""
    text = render(load_results(directory))
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "REPORT.md")
    atomic_write(path, text, durable=False)      # a report is rebuilt from the results
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=common.RESULTS,
                        help="the directory of the results (default: bench/results)")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.results)
    except ResultError as exc:
        print(f"bench report: {exc}", file=sys.stderr)
        sys.exit(1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
