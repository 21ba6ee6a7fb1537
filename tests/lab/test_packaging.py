"""The lab is its own distribution: the host wheel (``accelmig``) holds no
lab code, and the lab's wheel (``accelmig-lab``) holds all of it, its guest
files included, and adds ``accelmig lab`` through an entry point.

Both wheels are really built (setuptools' own PEP 517 backend, as pip
would) from a copy of this checkout in the test's temporary directory, so
nothing is written into the checkout itself."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[2]
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build", ".hypothesis",
                                     ".pytest_cache", "results", ".lab")

pytestmark = pytest.mark.slow

BUILD_WHEEL = "import sys, setuptools.build_meta as backend; print(backend.build_wheel(sys.argv[1]))"


def build_wheel(source: Path, out: Path, tmp: Path) -> zipfile.ZipFile:
    out.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, "-c", BUILD_WHEEL, str(out)], cwd=source, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return zipfile.ZipFile(out / done.stdout.strip().splitlines()[-1])


def entry_points(wheel: zipfile.ZipFile) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(delimiters=("=",))
    name = next((n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")), None)
    if name:
        parser.read_string(wheel.read(name).decode())
    return parser


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheels")
    source = tmp / "checkout"
    shutil.copytree(CHECKOUT, source, ignore=NOT_SOURCES, symlinks=True)
    return {"accelmig": build_wheel(source, tmp / "dist", tmp),
            "accelmig-lab": build_wheel(source / "lab", tmp / "dist-lab", tmp)}


def test_the_host_wheel_holds_no_lab_code(wheels):
    names = wheels["accelmig"].namelist()
    assert "accelmig/plugin/cli.py" in names and "accelmig/agent/__init__.py" in names
    assert [n for n in names if n.startswith("accelmig/lab/") or "/lab/" in n] == []
    assert not any(n.endswith("reaper.py") or "/guest/etc/" in n for n in names)
    # every module of the checkout's sides is in it (a package missing from
    # setup.cfg works in an editable install and is absent from the wheel)
    sides = {"wire": "wire", "runtime": "runtime", "agent": "agent", "pool": "pool", "plugin": "plugin", "fleet": "fleet",
             "domain_templates": "domain_templates"}
    modules = {f"accelmig/{side}/{path.relative_to(CHECKOUT / folder).as_posix()}"
               for side, folder in sides.items() for path in (CHECKOUT / folder).rglob("*.py")
               if "__pycache__" not in path.parts}
    assert modules - set(names) == set()
    # the systemd units are package data of their sides (read with importlib.resources)
    assert {"accelmig/pool/data/accelmig-pool.service.in", "accelmig/pool/data/accelmig-pool.sysusers",
            "accelmig/plugin/data/accelmig-hostd.service.in",
            "accelmig/agent/data/accelmig-agent.service.in"} - set(names) == set()
    # and it registers no command of its own in the group the lab uses
    assert not entry_points(wheels["accelmig"]).has_section("accelmig.commands")


def test_the_lab_wheel_holds_the_lab_its_guest_files_and_its_entry_points(wheels):
    names = set(wheels["accelmig-lab"].namelist())
    package = {n for n in names if not n.startswith("accelmig_lab-")}
    expected = {f"accelmig/lab/{m}.py" for m in ("__init__", "accel", "boottest", "certs", "cli", "etcdview", "fresh",
                                                 "guest", "libvirtd", "machine", "netns", "nova", "probe", "reaper",
                                                 "rig", "ssh", "topology", "poolthread", "cutproxy", "pooldemo")}
    expected |= {f"accelmig/lab/image/{m}.py" for m in ("__init__", "apt", "build", "cache", "cpio", "errors",
                                                       "guest_python", "kernel", "qemu_ga")}
    guest = {f"accelmig/lab/image/guest/{p}" for p in (
        "init", "etc/inittab", "etc/passwd", "etc/group", "etc/hosts", "etc/accelmig/lib.sh",
        "etc/accelmig/rc", "etc/accelmig/init.d/45-qemu-ga", "etc/accelmig/init.d/50-agent",
        "etc/accelmig/init.d/60-app")}
    assert package == expected | guest          # nothing of the host plugin, no accelmig/__init__.py
    points = entry_points(wheels["accelmig-lab"])
    assert dict(points["accelmig.commands"]) == {"lab": "accelmig.lab.cli:lab"}
    assert dict(points["console_scripts"]) == {"accelmig-lab": "accelmig.lab.cli:lab"}
