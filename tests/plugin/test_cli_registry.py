"""``accelmig``'s command registry: the built-in commands, plus those other
installed distributions add through entry points of ``accelmig.commands``.
``accelmig lab`` exists only where accelmig-lab is installed."""

from __future__ import annotations

import re
from importlib.metadata import EntryPoint, distribution

from click.testing import CliRunner

from accelmig.plugin.cli import COMMANDS, COMMANDS_GROUP, LazyGroup
from tests.conftest import run_cli

LAB = EntryPoint(name="lab", value="accelmig.lab.cli:lab", group=COMMANDS_GROUP)
#: its row in --help (the column's width follows the longest command name)
LAB_ROW = re.compile(r"^  lab +A local lab: two libvirt hosts, a pool, a VM\.$", re.M)


def accelmig(entry_points) -> LazyGroup:
    """The ``accelmig`` group, with these entry points as the installed ones."""
    return LazyGroup(name="accelmig", entry_points=entry_points)


def listed(result) -> list[str]:
    section = result.output.split("Commands:", 1)[1]
    return [line.split()[0] for line in section.splitlines() if line.strip()]


def test_without_the_entry_point_there_is_no_lab():
    cli = accelmig([])
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0, result.output
    assert listed(result) == list(COMMANDS)
    assert "lab" not in COMMANDS
    missing = CliRunner().invoke(cli, ["lab", "--help"])
    assert missing.exit_code == 2 and "No such command 'lab'" in missing.output


def test_with_the_entry_point_lab_is_listed_and_runs():
    cli = accelmig([LAB])
    result = CliRunner().invoke(cli, ["--help"])
    assert listed(result) == [*COMMANDS, "lab"]
    assert LAB_ROW.search(result.output)
    lab = CliRunner().invoke(cli, ["lab", "--help"])
    assert lab.exit_code == 0, lab.output
    assert "accelmig lab demo" in lab.output and "boot-test" in lab.output


def test_an_entry_point_cannot_take_a_built_in_name():
    cli = accelmig([EntryPoint(name="hook", value="accelmig.lab.cli:lab", group=COMMANDS_GROUP)])
    assert listed(CliRunner().invoke(cli, ["--help"])) == list(COMMANDS)
    hook = CliRunner().invoke(cli, ["hook", "--help"]).output
    assert "DOMAIN OPERATION SUB-OPERATION" in hook and "accelmig lab demo" not in hook


def test_the_installed_lab_distribution_adds_the_command():
    # dev.sh installs both distributions; only accelmig-lab declares the command
    assert [ep.name for ep in distribution("accelmig-lab").entry_points.select(group=COMMANDS_GROUP)] == ["lab"]
    assert not distribution("accelmig").entry_points.select(group=COMMANDS_GROUP)
    result = run_cli("accelmig", "--help", timeout=60)
    assert result.returncode == 0, result.stderr
    assert LAB_ROW.search(result.stdout)
    lab = run_cli("accelmig", "lab", "--help", timeout=60)
    assert lab.returncode == 0 and "accelmig lab demo" in lab.stdout
