"""bench/results/REPORT.md is rendered from what the benchmarks saved."""

from __future__ import annotations

import json
import os

import pytest

from bench import common, report


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", str(tmp_path))
    return tmp_path


def _saved(name: str, when: str | None = None, *, plot: bool = False, **rows) -> None:
    table = common.Table(f"{name} title", "raw socket", "accelmig")
    for label, (base, subject) in rows.items():
        table.add(label, base, subject, "µs")
    path = table.save(name, {"args": {"size": "64MiB"}})
    if when:
        with open(path) as handle:
            data = json.load(handle)
        data["when"] = when
        with open(path, "w") as handle:
            json.dump(data, handle)
    if plot:
        open(os.path.join(common.RESULTS, f"{name}.png"), "wb").close()


def test_every_result_is_a_section_with_its_baseline_and_ratio(results):
    _saved("storm", plot=True, rehome=(4.0, 8.0))
    _saved("remoting", round_trip=(7.0, 14.0), upload=(10.0, 5.0))
    text = open(report.write_report(str(results))).read()
    # report order: remoting before storm, whatever the file names sort to
    assert text.index("## remoting:") < text.index("## storm:")
    assert "| round_trip | 7.00 µs | 14.00 µs | 2.00x | lower |" in text
    assert "| upload | 10.00 µs | 5.00 µs | 0.50x | lower |" in text
    assert "| | raw socket | accelmig | ratio | better |" in text
    assert "![storm](storm.png)" in text and "![remoting]" not in text   # only plots that exist
    assert "Options: `size=64MiB`" in text
    assert f"{os.cpu_count()} CPUs" in text


def test_an_old_result_is_flagged_not_passed_off_as_new(results):
    _saved("remoting", round_trip=(7.0, 14.0))
    _saved("storm", when="2020-01-01T00:00:00Z", rehome=(4.0, 8.0))
    text = report.render(report.load_results(str(results)))
    assert "| [storm](#storm) | 2020-01-01T00:00:00Z (older than the rest) |" in text
    assert "(older than the rest)" not in text.split("[remoting]")[1].split("\n")[0]


def test_no_results_says_how_to_make_them(results):
    assert "run `./dev.sh bench`" in report.render(report.load_results(str(results)))


def test_a_foreign_json_file_is_named_in_the_error(results):
    (results / "notes.json").write_text('{"hello": 1}')
    with pytest.raises(report.ResultError, match="notes.json: not a benchmark result"):
        report.load_results(str(results))
    (results / "notes.json").write_text("{")
    with pytest.raises(report.ResultError, match="notes.json: not readable as JSON"):
        report.load_results(str(results))


def test_cells_cannot_break_the_table(results):
    _saved("remoting", **{"a|b\nc": (1.0, 2.0)})
    text = report.render(report.load_results(str(results)))
    assert "| a\\|b c | 1.00 µs | 2.00 µs |" in text


def test_the_command_line_writes_the_report_and_refuses_bad_results(results, capsys):
    _saved("remoting", round_trip=(7.0, 14.0))
    report.main(["--results", str(results)])
    assert (results / "REPORT.md").exists()
    assert "wrote" in capsys.readouterr().out
    (results / "x.json").write_text("[]")
    with pytest.raises(SystemExit) as exit_info:
        report.main(["--results", str(results)])
    assert exit_info.value.code == 1


def test_panels_in_the_same_unit_share_one_y_scale(results, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figures = []
    monkeypatch.setattr(common, "save_figure", lambda fig, name: figures.append(fig) or name)
    table = common.Table("t", "raw", "accelmig")
    table.add("upload", 10.0, 3.0, "GiB/s", "higher")
    table.add("download", 2.0, 1.0, "GiB/s", "higher")
    table.add("round trip", 7.0, 60.0, "µs")
    table.plot("t")
    upload, download, round_trip = figures[0].axes
    assert upload.get_ylim() == download.get_ylim() == (0, 10.0 * 1.15)
    assert round_trip.get_ylim() == (0, 60.0 * 1.15)
    plt.close(figures[0])
