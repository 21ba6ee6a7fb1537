"""The shipped distribution holds no test fixture: no module or package
named ``testing`` (a pool on a thread and a connection cutter are the lab's,
``accelmig.lab.poolthread`` and ``accelmig.lab.cutproxy``)."""

from __future__ import annotations

from tests.house.shipped import SHIPPED, ROOT, package_dirs, rel


def test_no_shipped_module_is_named_testing():
    found = [rel(p) for side in SHIPPED for p in (ROOT / side).rglob("*")
             if p.stem in ("testing", "fixtures", "conftest") and "__pycache__" not in p.parts]
    assert found == []


def test_every_shipped_folder_is_a_package_of_the_distribution():
    """The scans of tests/house/ cover what is shipped: each of its folders
    is one of setup.cfg's packages."""
    folders = {rel(path) for name, path in package_dirs().items() if not name.startswith("accelmig.lab")}
    for side in SHIPPED:
        assert side in folders
    assert "lab" in {rel(path) for path in package_dirs().values()}
