"""docs/deploy.md keeps to the code: every accelmig command line it shows
names real commands and options, every TOML file it shows loads through
the real loaders, and every page it links to exists."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import click
import pytest

from accelmig.agent import cli as agent_cli
from accelmig.plugin.cli import main as accelmig_main
from accelmig.plugin.config import HostConfig
from accelmig.pool.cli import main as pool_main
from accelmig.pool.config import PoolConfig, load_hosts, load_tenants

DOCS = Path(__file__).resolve().parents[2] / "docs"
GUIDE = DOCS / "deploy.md"
TEXT = GUIDE.read_text()
PROGRAMS = ("accelmig", "accelmig-pool", "accelmig-agent")


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^[ \t]*```{lang}\n(.*?)^[ \t]*```", TEXT, flags=re.S | re.M)


def _command_lines() -> list[str]:
    """accelmig command lines: in sh blocks (one per line, comments cut) and
    in inline code spans of the prose."""
    lines = []
    for block in _blocks("sh"):
        lines += [line.split(" #")[0].strip() for line in block.splitlines()]
    lines += [" ".join(span.split()) for span in re.findall(r"`([^`\n]*(?:\n[^`\n]*)?)`", TEXT)]
    out = []
    for line in lines:
        # an installed entry point, or the guest bundle run by python3
        line = re.sub(r"^\S*/bin/(accelmig\S*)", r"\1", line)
        line = re.sub(r"^python3 \S*accelmig-agent\.pyz", "accelmig-agent", line)
        if line.split(" ", 1)[0] in PROGRAMS:
            out.append(line)
    return out


def _words(line: str) -> list[str]:
    try:
        return shlex.split(line.replace("…", "x"))
    except ValueError:
        return line.split()


def _click_help(group: click.Group, words: list[str]) -> tuple[list[str], str]:
    """The command ``words`` name in ``group`` and its help text."""
    command, path = group, []
    for word in words:
        if not isinstance(command, click.Group) or word.startswith("-"):
            break
        sub = command.get_command(click.Context(command), word)
        if sub is None:
            break
        command, path = sub, path + [word]
    with click.Context(command, info_name=" ".join(path) or "accelmig") as ctx:
        return path, command.get_help(ctx)


def _agent_help(words: list[str]) -> tuple[list[str], str]:
    path = words[:1] if words and not words[0].startswith("-") else []
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        agent_cli.main([*path, "--help"])
    return path, out.getvalue()


def test_the_guide_shows_commands():
    lines = _command_lines()
    assert len(lines) >= 15
    assert {line.split(" ", 1)[0] for line in lines} == set(PROGRAMS)


@pytest.mark.parametrize("line", sorted(set(_command_lines())))
def test_every_command_and_option_in_the_guide_exists(line):
    program, *words = _words(line)
    if program == "accelmig-agent":
        path, help_text = _agent_help(words)
    else:
        path, help_text = _click_help(accelmig_main if program == "accelmig" else pool_main, words)
    subcommands = [w for w in words if not w.startswith("-")][:1]
    if subcommands:
        assert path and path[0] == subcommands[0], f"{line!r}: {program} has no command {subcommands[0]!r}"
    for word in words:
        if word.startswith("--"):
            option = word.split("=", 1)[0]
            assert re.search(rf"(^|[\s,\[]){re.escape(option)}\b", help_text), \
                f"{line!r}: '{program} {' '.join(path)}' has no option {option}"


def _loader(text: str, tmp_path):
    first = re.search(r"^\[([^\]]+)\]", text, flags=re.M).group(1)
    if first == "host":
        return HostConfig.from_toml(text, source="deploy.md")
    path = tmp_path / "file.toml"
    path.write_text(text)
    if first == "pool":
        return PoolConfig.load(str(path))
    if first.startswith("tenants."):
        return load_tenants(str(path))
    if first.startswith("hosts."):
        return load_hosts(str(path))
    pytest.fail(f"a TOML block of deploy.md that no loader reads: [{first}]")


def test_every_toml_file_in_the_guide_loads(tmp_path):
    blocks = _blocks("toml")
    assert len(blocks) >= 2
    loaded = [_loader(re.sub(r"(?m)^ {3}", "", b), tmp_path) for b in blocks]
    host = next(c for c in loaded if isinstance(c, HostConfig))
    pool = next(c for c in loaded if isinstance(c, PoolConfig))
    # the two halves of the guide's layout agree with each other
    assert host.pool.endpoint == pool.listen and host.pool.control == pool.control_listen
    assert host.fabric.host_bound and str(host.fabric.guest_subnet) == "10.89.1.0/24"


def test_every_linked_page_exists():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", TEXT)
    assert "config-reference.md" in links and "systemd.md" in links
    missing = [link for link in links if "://" not in link and not (DOCS / link).exists()]
    assert missing == [], f"deploy.md links to pages that do not exist: {missing}"


def test_every_anchor_in_the_guide_is_a_heading():
    headings = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
                for h in re.findall(r"^#+ (.+)$", TEXT, flags=re.M)}
    anchors = set(re.findall(r"\]\(#([^)]+)\)", TEXT))
    assert anchors and anchors <= headings, anchors - headings
