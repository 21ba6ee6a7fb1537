"""Tables, JSON and plots shared by the benchmarks."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def median_of(fn, repeat: int) -> tuple[float, list[float]]:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), samples


class Table:
    """Rows of (label, baseline, accelmig, unit, better) with a ratio column."""

    def __init__(self, title: str, baseline_name: str, subject_name: str):
        self.title = title
        self.baseline_name = baseline_name
        self.subject_name = subject_name
        self.rows: list[dict] = []

    def add(self, label: str, baseline: float, subject: float, unit: str, better: str = "lower"):
        ratio = subject / baseline if baseline else float("inf")
        self.rows.append({"label": label, "baseline": baseline, "subject": subject, "unit": unit,
                          "better": better, "ratio": ratio})

    def render(self) -> str:
        head = f"{'':34} {self.baseline_name:>16} {self.subject_name:>16} {'ratio':>8}"
        lines = [self.title, "=" * len(head), head, "-" * len(head)]
        for r in self.rows:
            lines.append(f"{r['label']:34} {_fmt(r['baseline'], r['unit']):>16} "
                         f"{_fmt(r['subject'], r['unit']):>16} {r['ratio']:>7.2f}x")
        lines.append("(ratio = %s / %s; %s)" % (self.subject_name, self.baseline_name,
                     "; ".join(f"{r['label']}: {r['better']} is better" for r in self.rows[:1])))
        return "\n".join(lines)

    def save(self, name: str, extra: dict | None = None) -> str:
        os.makedirs(RESULTS, exist_ok=True)
        path = os.path.join(RESULTS, f"{name}.json")
        with open(path, "w") as handle:
            json.dump({"title": self.title, "baseline": self.baseline_name,
                       "subject": self.subject_name, "rows": self.rows, "machine": machine(),
                       "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **(extra or {})},
                      handle, indent=2)
        return path

    def plot(self, name: str) -> str | None:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        fig, axes = plt.subplots(1, len(self.rows), figsize=(3.2 * len(self.rows), 3.6))
        if len(self.rows) == 1:
            axes = [axes]
        for ax, row in zip(axes, self.rows):
            bars = ax.bar([self.baseline_name, self.subject_name], [row["baseline"], row["subject"]],
                          color=["#888888", "#2b6cb0"])
            ax.set_title(row["label"], fontsize=9)
            ax.set_ylabel(row["unit"], fontsize=8)
            ax.tick_params(labelsize=8)
            ax.bar_label(bars, labels=[_fmt(row["baseline"], row["unit"]), _fmt(row["subject"], row["unit"])],
                         fontsize=7)
        fig.suptitle(self.title, fontsize=10)
        fig.tight_layout()
        path = os.path.join(RESULTS, f"{name}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def _fmt(value: float, unit: str) -> str:
    if value >= 100:
        return f"{value:,.0f} {unit}"
    if value >= 1:
        return f"{value:.2f} {unit}"
    return f"{value:.4f} {unit}"


def machine() -> dict:
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "node": platform.node(),
            "kernel": platform.release()}


def report(table: Table, name: str, extra: dict | None = None) -> None:
    print()
    print(table.render())
    json_path = table.save(name, extra)
    png = table.plot(name)
    print(f"\nwrote {json_path}" + (f" and {png}" if png else ""))
