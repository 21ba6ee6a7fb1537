"""``accelmig guest-bundle``: the guest side as one zipapp.

The bundle is built for real and run on the oldest Python a guest may have
(3.9, see tests/support/oldpython.py) with no site-packages: the agent's
command line, every module, and a driver program that computes on a real
``accelmig-pool`` process (this virtualenv's Python, PoCL) through an agent
run from the same bundle."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from accelmig.plugin import bundle
from accelmig.wire.errors import BadRequest
from tests.conftest import run_cli
from tests.support.oldpython import OLDEST, SKIP_REASON, oldest_python
from tests.support.wait import wait_for

ROOT = Path(__file__).resolve().parents[2]
PYTHON = oldest_python()
needs_39 = pytest.mark.skipif(PYTHON is None, reason=SKIP_REASON)
TOKEN = "bundle-tenant-token-1"


@pytest.fixture(scope="module")
def pyz(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bundle") / "accelmig-agent.pyz"
    bundle.build(str(path))
    return path


def guest_tree(tmp_path: Path) -> dict[str, Path]:
    """A copy of the guest packages, to change or to build from."""
    out = {}
    for package, folder in (("accelmig.agent", "agent"), ("accelmig.wire", "wire"),
                            ("accelmig.runtime", "runtime")):
        out[package] = tmp_path / "src" / folder
        shutil.copytree(ROOT / folder, out[package], ignore=shutil.ignore_patterns("__pycache__"))
    return out


def on_39(*args, env=None, **kwargs) -> subprocess.CompletedProcess:
    """The old Python, isolated: no site-packages, no user site, no PYTHON* variables."""
    return subprocess.run([PYTHON, *args], capture_output=True, text=True, timeout=120,
                          env=env if env is not None else {"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                          **kwargs)


# --------------------------------------------------------------- the archive

def test_the_cli_writes_it_and_says_what_is_in_it(tmp_path):
    out = tmp_path / "accelmig-agent.pyz"
    text = run_cli("accelmig", "guest-bundle", "-o", str(out), timeout=120)
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith(f"wrote {out}: {out.stat().st_size} bytes")
    assert "accelmig.agent.driver.device" in text.stdout and "accelmig.wire.frames" in text.stdout
    assert f"sha256   {hashlib.sha256(out.read_bytes()).hexdigest()}" in text.stdout
    assert os.access(out, os.X_OK) and out.read_bytes().startswith(b"#!/usr/bin/env python3\n")
    report = json.loads(run_cli("accelmig", "guest-bundle", "-o", str(out), "--json", timeout=120).stdout)
    assert report["size"] == out.stat().st_size and report["python"] == "3.9+"
    assert "accelmig.agent.cli" in report["modules"] and report["optional_imports"] == ["pyroute2"]
    assert report["data"] == sorted(f"accelmig/agent/data/{p.name}" for p in (ROOT / "agent" / "data").iterdir()
                                    if p.is_file()) != []
    assert [p.name for p in tmp_path.iterdir()] == ["accelmig-agent.pyz"]      # no partial left
    helped = run_cli("accelmig", "guest-bundle", "--help", timeout=60)
    assert helped.returncode == 0 and "Exit status:" in helped.stdout
    unwritable = run_cli("accelmig", "guest-bundle", "-o", str(tmp_path / "no" / "such" / "b.pyz"), timeout=60)
    assert unwritable.returncode == 1
    assert unwritable.stderr == f"accelmig: {tmp_path / 'no' / 'such'}: no such directory\n"
    assert "Traceback" not in unwritable.stderr


def test_it_holds_the_guest_side_and_nothing_else(pyz):
    with zipfile.ZipFile(pyz) as zf:
        names = zf.namelist()
        main = zf.read("__main__.py").decode()
        meta = zf.read(f"accelmig-{bundle.distribution_version()}.dist-info/METADATA").decode()
    files = [n for n in names if not n.endswith("/")]
    own = {"__main__.py", f"accelmig-{bundle.distribution_version()}.dist-info/METADATA"}
    assert [n for n in files if n not in own and not n.startswith(("accelmig/agent/", "accelmig/wire/",
                                                                              "accelmig/runtime/"))] == []
    expected = {f"accelmig/{p.relative_to(ROOT).as_posix()}" for side in ("agent", "wire", "runtime")
                for p in (ROOT / side).rglob("*") if p.is_file() and "__pycache__" not in p.parts
                and (p.suffix == ".py" or "data" in p.relative_to(ROOT / side).parts[:1])}
    assert set(files) - own == expected
    assert "accelmig/" in names and "accelmig/__init__.py" not in names     # a namespace package, as installed
    assert names == sorted(names) and "from accelmig.agent.cli import main" in main
    assert f"Version: {bundle.distribution_version()}" in meta


def test_package_data_is_what_setup_cfg_ships():
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    declared = {k: v.strip() for k, v in cfg["options.package_data"].items()}
    assert declared["accelmig.agent"] == "/".join((*bundle.PACKAGE_DATA["accelmig.agent"], "*"))
    assert [k for k in declared if k in bundle.PACKAGES] == list(bundle.PACKAGE_DATA)


def test_the_same_tree_gives_the_same_bytes(tmp_path, pyz):
    again = tmp_path / "again.pyz"
    bundle.build(str(again))
    assert again.read_bytes() == pyz.read_bytes()
    # a copy with other timestamps and modes, its files written in another order
    sources = guest_tree(tmp_path)
    for index, path in enumerate(sorted((tmp_path / "src").rglob("*"), reverse=True)):
        os.utime(path, (1_000_000 + index * 7919, 1_700_000_000 - index * 104729))
        if path.is_file():
            path.chmod(0o600 if index % 2 else 0o755)
    copied = tmp_path / "copied.pyz"
    made = bundle.build(str(copied), sources=sources)
    assert copied.read_bytes() == pyz.read_bytes()
    assert made.sha256 == hashlib.sha256(pyz.read_bytes()).hexdigest()
    # and one changed byte is another bundle
    frames = sources["accelmig.wire"] / "frames.py"
    frames.write_text(frames.read_text() + "\n")
    assert bundle.build(str(tmp_path / "changed.pyz"), sources=sources).sha256 != made.sha256


@pytest.mark.parametrize("where, line, words", [
    ("accelmig.wire/channel.py", "import click\n", "wire/channel.py:1: imports click"),
    ("accelmig.agent/driver/link.py", "from accelmig.pool import state\n",
     "agent/driver/link.py:1: imports accelmig.pool"),
    ("accelmig.agent/cli.py", "match 1:\n    case 1:\n        pass\n", "not Python 3.9 syntax: Pattern matching"),
])
def test_anything_outside_the_guest_side_refuses_the_bundle(tmp_path, where, line, words):
    sources = guest_tree(tmp_path)
    package, _, rel = where.partition("/")
    target = sources[package] / rel
    target.write_text(line + target.read_text())
    out = tmp_path / "refused.pyz"
    with pytest.raises(BadRequest) as refused:
        bundle.build(str(out), sources=sources)
    assert words in str(refused.value) and "not be standard-library-only Python 3.9" in str(refused.value)
    assert not out.exists() and not (tmp_path / "refused.pyz.partial").exists()


def test_an_extension_module_refuses_the_bundle(tmp_path):
    sources = guest_tree(tmp_path)
    (sources["accelmig.wire"] / "_speedups.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    with pytest.raises(BadRequest, match="an extension module cannot go into the guest bundle"):
        bundle.build(str(tmp_path / "refused.pyz"), sources=sources)


# --------------------------------------------------------- on Python 3.9

@needs_39
def test_it_runs_the_agent_cli_on_39(pyz):
    helped = on_39("-I", "-S", str(pyz), "--help")
    assert helped.returncode == 0, helped.stderr
    usage = helped.stdout.splitlines()[0]
    assert usage.startswith("usage: accelmig-agent") and all(c in usage for c in ("run", "rehome", "status"))
    run = on_39("-I", "-S", str(pyz), "run", "--help")
    assert run.returncode == 0 and "--port PORT" in run.stdout and "--endpoint HOST:PORT" in run.stdout
    # the version comes from the bundle's own .dist-info (no installed distribution here)
    version = on_39("-I", "-S", "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                    "import importlib.metadata as m; print(m.version('accelmig'))", str(pyz))
    assert version.returncode == 0 and version.stdout.strip() == bundle.distribution_version(), version.stderr
    told = on_39("-I", "-S", str(pyz), "--version")
    assert told.returncode == 0 and told.stdout.split() == ["accelmig-agent", bundle.distribution_version()]
    # a usage error is argparse's, exit 2, no traceback
    wrong = on_39("-I", "-S", str(pyz), "nonsense")
    assert wrong.returncode == 2 and "invalid choice" in wrong.stderr and "Traceback" not in wrong.stderr


@needs_39
def test_every_module_imports_on_39_with_nothing_but_the_standard_library(pyz):
    # -I -S: no site-packages, no user site, no environment; only the bundle is added
    code = textwrap.dedent("""
        import importlib, json, pkgutil, sys, sysconfig
        sys.path.insert(0, sys.argv[1])
        import accelmig.agent, accelmig.runtime, accelmig.wire
        names = []
        for pkg in (accelmig.agent, accelmig.wire, accelmig.runtime):
            for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
                if not m.name.endswith(".__main__"):
                    importlib.import_module(m.name)
                    names.append(m.name)
        stdlib = (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"])
        foreign = sorted(n for n, mod in sys.modules.items() if getattr(mod, "__file__", None)
                         and not mod.__file__.startswith(stdlib + (sys.argv[1],)))
        print(json.dumps({"version": sys.version_info[:2], "imported": names, "foreign": foreign,
                          "driver": accelmig.agent.__path__[0]}))
    """)
    out = on_39("-I", "-S", "-c", code, str(pyz))
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert tuple(seen["version"]) == OLDEST and seen["foreign"] == []
    assert seen["driver"] == f"{pyz}/accelmig/agent"
    with zipfile.ZipFile(pyz) as zf:
        modules = {bundle.module_name(n) for n in zf.namelist()
                   if n.startswith("accelmig/") and n.endswith(".py") and not n.endswith(("__init__.py",
                                                                                          "__main__.py"))}
    assert modules - set(seen["imported"]) == set()
    # the way applications use it: PYTHONPATH, still without site-packages
    app = on_39("-S", "-c", "import accelmig.agent.driver as d; print(d.__file__)",
                env={"PYTHONPATH": str(pyz), "PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    assert app.returncode == 0 and app.stdout.strip() == f"{pyz}/accelmig/agent/driver/__init__.py", app.stderr


@needs_39
def test_the_readme_recipe_a_pth_line_and_a_symlinked_command(pyz, tmp_path):
    # the README's guest recipe: the bundle in /opt, a symlink on PATH, one
    # .pth line in site-packages (here a site dir in tmp_path) so that the
    # system python3 imports the driver and runs 'python3 -m accelmig.agent',
    # which is what hosts run through guest-exec for qemu-guest-agent guests
    opt, bin_dir, site_dir = tmp_path / "opt", tmp_path / "bin", tmp_path / "site-packages"
    for folder in (opt, bin_dir, site_dir):
        folder.mkdir()
    shutil.copy2(pyz, opt / "accelmig-agent.pyz")
    (bin_dir / "accelmig-agent").symlink_to(opt / "accelmig-agent.pyz")
    (site_dir / "accelmig.pth").write_text(f"{opt / 'accelmig-agent.pyz'}\n")
    command = on_39("-I", "-S", str(bin_dir / "accelmig-agent"), "status", "--help")
    assert command.returncode == 0 and command.stdout.startswith("usage: accelmig-agent status"), command.stderr
    module = on_39("-I", "-S", "-c", "import runpy, site, sys; site.addsitedir(sys.argv[1]); "
                   "import accelmig.agent.driver as d; print(d.__file__); sys.argv = ['accelmig-agent', '--help']; "
                   "runpy.run_module('accelmig.agent', run_name='__main__', alter_sys=True)", str(site_dir))
    assert module.returncode == 0, module.stderr
    first, rest = module.stdout.split("\n", 1)
    assert first == f"{opt}/accelmig-agent.pyz/accelmig/agent/driver/__init__.py"
    assert rest.startswith("usage: accelmig-agent")


@needs_39
def test_inside_the_bundle_package_data_reads_and_a_unit_would_run_the_bundle(pyz):
    # importlib.resources reads the agent's data out of the zip; a unit the
    # agent renders from the bundle runs this interpreter on the bundle
    code = textwrap.dedent("""
        import importlib.resources, json, sys
        sys.path.insert(0, sys.argv[1])
        from accelmig.runtime import units
        data = importlib.resources.files("accelmig.agent").joinpath("data")
        print(json.dumps({"data": sorted(p.name for p in data.iterdir()),
                          "argv": units.entry_point("accelmig-agent", "accelmig.agent.cli"),
                          "python": sys.executable}))
    """)
    out = on_39("-I", "-S", "-c", code, str(pyz))
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["data"] == sorted(p.name for p in (ROOT / "agent" / "data").iterdir() if p.is_file())
    assert seen["argv"] == [os.path.abspath(seen["python"]), str(pyz)]
    # and the agent's own unit, rendered from the bundle on 3.9, runs the bundle
    unit = on_39("-I", "-S", str(pyz), "install", "--systemd", "--print", "--port", "none")
    assert unit.returncode == 0, unit.stderr
    assert f"ExecStart={seen['python']} {pyz} run --port none" in unit.stdout.splitlines()


DRIVER = textwrap.dedent("""
    import array, json, sys
    from accelmig.agent.driver import connect, f32, u32
    token, agent = sys.argv[1:3]
    SOURCE = '''
    __kernel void saxpy(float a, __global const float *x, __global float *y) {
        size_t i = get_global_id(0); y[i] = a * x[i] + y[i];
    }
    __kernel void bump(__global uint *v, uint n) { v[get_global_id(0)] += n; }
    '''
    n = 1024
    with connect(token=token, agent=agent, timeout=60) as dev:      # the endpoint: from the agent
        prog = dev.build(SOURCE)
        x = dev.upload(array.array("f", [float(i) for i in range(n)]))
        y = dev.upload(array.array("f", [0.5] * n))
        prog.launch("saxpy", n, None, f32(2.0), x, y)
        counts = dev.upload(bytes(4 * n))
        for step in range(1, 6):
            prog.launch("bump", n, None, counts, u32(step))
        got_y = array.array("f", dev.read(y))
        got_c = array.array("I", dev.read(counts))
        print(json.dumps({"sid": dev.sid, "endpoint": dev.endpoint, "y": list(got_y), "c": list(got_c),
                          "python": sys.version_info[:2]}), flush=True)
        sys.stdin.readline()        # while the test asks the agent
""")


@needs_39
@pytest.mark.slow
def test_a_driver_from_the_bundle_computes_on_a_real_pool_on_39(pyz, tmp_path):
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tenants.bundle]\ntoken = "{TOKEN}"\nquota = "64MiB"\n')
    exe = os.path.join(os.path.dirname(sys.executable), "accelmig-pool")
    pool = subprocess.Popen([exe, "serve", "--listen", "127.0.0.1:0", "--control-listen", "",
                             "--tokens", str(tokens), "--admin-socket", str(tmp_path / "pool.sock"),
                             "--log-format", "json", "--insecure"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    agent = driver = None
    sock = tmp_path / "agent.sock"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "ACCELMIG_INSECURE": "1"}
    try:
        ready = json.loads(pool.stdout.readline())
        assert ready["ready"], ready
        endpoint = ready["data"]
        # the agent from the bundle, as a guest with only qemu-guest-agent runs it
        agent = subprocess.Popen([PYTHON, "-I", "-S", str(pyz), "run", "--port", "none", "--socket", str(sock),
                                  "--state-dir", str(tmp_path / "state"), "--endpoint", endpoint],
                                 env=env, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: sock.exists() or agent.poll() is not None, timeout=30, what="the agent's socket")
        assert agent.poll() is None, agent.stderr.read()
        driver = subprocess.Popen([PYTHON, "-S", "-c", DRIVER, TOKEN, str(sock)], env={**env, "PYTHONPATH": str(pyz)},
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = driver.stdout.readline()
        assert line, driver.communicate(timeout=30)[1]
        seen = json.loads(line)
        assert tuple(seen["python"]) == OLDEST and seen["endpoint"] == endpoint
        assert seen["y"] == [2.0 * i + 0.5 for i in range(1024)]        # exact in float32
        assert seen["c"] == [15] * 1024
        # the driver registered with the agent: its status, from the bundle too
        status = on_39("-I", "-S", str(pyz), "status", "--socket", str(sock))
        assert status.returncode == 0, status.stderr
        assert [s["sid"] for s in json.loads(status.stdout)["sessions"]] == [seen["sid"]]
        _, err = driver.communicate("done\n", timeout=60)
        assert driver.returncode == 0, err
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
            driver.wait(10)
        if agent is not None:
            agent.send_signal(signal.SIGTERM)
            try:
                assert agent.wait(15) == 0
            finally:
                if agent.poll() is None:
                    agent.kill()
                    agent.wait(10)
        pool.send_signal(signal.SIGTERM)
        try:
            pool.wait(15)
        finally:
            if pool.poll() is None:
                pool.kill()
                pool.wait(5)
