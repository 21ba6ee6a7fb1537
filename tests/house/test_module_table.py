"""docs/DESIGN.md's table "The code, package by package" matches the code:
every module of every package is named in its package's row (or, for a
subpackage without a row of its own, in its parent's, beside ``name/``),
and every module name in a row exists.

In a row, a module is a name in backticks made of lower-case letters,
digits and ``_`` (``frames``), a subpackage one ending in ``/``
(``devices/``); anything else in backticks (``ControlSession``,
``accelmig guest-bundle``) is not taken for a module."""

from __future__ import annotations

import re

import pytest

from tests.house.shipped import ROOT, modules, package_dirs

HEADING = "## The code, package by package"
ROW = re.compile(r"^\| `(accelmig(?:\.[a-z_]+)+)` \| (.*) \|$")
NAME = re.compile(r"`([a-z][a-z0-9_]*/?)`")


def table() -> dict[str, set[str]]:
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    section = text[text.index(HEADING):]
    section = section[:section.index("\n## ", 1)]
    rows = {}
    for line in section.splitlines():
        match = ROW.match(line)
        if match:
            assert match.group(1) not in rows, f"two rows for {match.group(1)}"
            rows[match.group(1)] = set(NAME.findall(match.group(2)))
    return rows


def row_of(package: str, rows: dict) -> str:
    """The row that names ``package``'s modules: its own, or its parent's
    (there a subpackage's modules are named by their own names)."""
    name = package
    while name not in rows:
        assert "." in name, f"{package}: no row in DESIGN's module table, nor for a package above it"
        name = name.rsplit(".", 1)[0]
    return name


PACKAGES = package_dirs()


@pytest.mark.parametrize("package", sorted(p for p, folder in PACKAGES.items() if modules(folder)))
def test_every_module_is_named_in_its_row(package):
    rows = table()
    row = row_of(package, rows)
    if row != package:      # a subpackage named in its parent's row: its name, then its modules
        assert f"{package.rsplit('.', 1)[1]}/" in rows[row], f"{row}'s row does not name {package}"
    missing = sorted(modules(PACKAGES[package]) - rows[row]
                     - {f"{p.rsplit('.', 1)[1]}/" for p in PACKAGES if p.startswith(package + ".") and p in rows})
    assert missing == [], f"DESIGN's row {row} does not name {package}'s {missing}"


def test_every_name_in_the_table_exists():
    rows = table()
    assert set(rows) <= set(PACKAGES), f"rows for no package: {sorted(set(rows) - set(PACKAGES))}"
    for row, names in rows.items():
        real = set()
        for package, folder in PACKAGES.items():
            if package == row or (package.startswith(row + ".") and row_of(package, rows) == row):
                real |= modules(folder)
        assert sorted(names - real) == [], f"DESIGN's row {row} names what is not in it"


def test_the_table_is_read():
    rows = table()
    assert {"accelmig.wire", "accelmig.runtime", "accelmig.pool"} <= set(rows) and "frames" in rows["accelmig.wire"]
