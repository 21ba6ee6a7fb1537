"""The guest side on the oldest Python a guest image may bring (3.9), with no
site-packages: every module imports, and a driver and an agent do a rehome
through ``accelmig-agent rehome --stdin`` (the qemu-guest-agent path).

The interpreter: ``$ACCELMIG_GUEST_PYTHON``, ``python3.9`` on the PATH, or
pyenv's 3.9; without one these tests are skipped, loudly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ALICE
from tests.support.oldpython import OLDEST, SKIP_REASON, oldest_python
from tests.support.wait import wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PYTHON = oldest_python()
pytestmark = pytest.mark.skipif(PYTHON is None, reason=SKIP_REASON)


@pytest.fixture
def guest_site(tmp_path):
    """The guest side as an image carries it: accelmig/agent, accelmig/wire and accelmig/runtime."""
    site = tmp_path / "site"
    (site / "accelmig").mkdir(parents=True)
    os.symlink(os.path.join(ROOT, "agent"), site / "accelmig" / "agent")
    os.symlink(os.path.join(ROOT, "wire"), site / "accelmig" / "wire")
    os.symlink(os.path.join(ROOT, "runtime"), site / "accelmig" / "runtime")
    return str(site)


def guest(site: str, *args, **kwargs):
    """Run the old Python with only the guest side on its path (no site-packages)."""
    # no bytecode: the site links to the checkout, which a test must not write into
    env = {"PYTHONPATH": site, "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONDONTWRITEBYTECODE": "1",
           "ACCELMIG_INSECURE": "1"}                 # the suite's pools are plain TCP
    return subprocess.Popen([PYTHON, "-S", *args], env=env, cwd=site, text=True, **kwargs)


def test_every_guest_module_imports(guest_site):
    code = ("import importlib, pkgutil, sys\n"
            "import accelmig.agent.driver, accelmig.agent.daemon\n"
            "import accelmig.agent, accelmig.runtime, accelmig.wire\n"
            "for pkg in (accelmig.agent, accelmig.wire, accelmig.runtime):\n"
            "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
            "        if not m.name.endswith('.__main__'):\n"
            "            importlib.import_module(m.name)\n"
            "print(sys.version_info[:2], len([n for n in sys.modules if n.startswith('accelmig.')]))\n")
    proc = guest(guest_site, "-c", code, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.startswith(str(OLDEST))


DRIVER = textwrap.dedent("""
    import json, sys
    from accelmig.agent.driver import connect, u32
    endpoint, token, agent = sys.argv[1:4]
    dev = connect(endpoint, token, agent=agent, timeout=20)
    prog = dev.build("__kernel void bump(__global uint *x, uint n) { x[get_global_id(0)] += n; }")
    buf = dev.upload(bytes(16))
    prog.launch("bump", 4, None, buf, u32(3))
    print(json.dumps({"sid": dev.sid}), flush=True)
    sys.stdin.readline()                 # after the rehome
    prog.launch("bump", 4, None, buf, u32(4))
    print(json.dumps(dict(dev.describe(), data=list(dev.read(buf)))), flush=True)
    dev.close()
""")


def test_a_driver_and_an_agent_rehome_on_the_oldest_python(guest_site, tmp_path, pool):
    sock = str(tmp_path / "agent.sock")
    agent = guest(guest_site, "-m", "accelmig.agent", "run", "--port", "none", "--socket", sock,
                  "--state-dir", str(tmp_path / "state"), stderr=subprocess.PIPE)
    driver = None
    try:
        wait_for(lambda: os.path.exists(sock) or agent.poll() is not None, what="the agent's socket")
        assert agent.poll() is None, agent.stderr.read()
        driver = guest(guest_site, "-c", DRIVER, pool.endpoint, ALICE, sock,
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        sid = json.loads(driver.stdout.readline())["sid"]
        document = {"migration_id": "m-oldest", "identity": {"host_id": "here", "pool_endpoint": pool.endpoint},
                    "tickets": {}}
        rehome = guest(guest_site, "-m", "accelmig.agent", "rehome", "--stdin", "--socket", sock,
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = rehome.communicate(json.dumps(document), timeout=60)
        assert rehome.returncode == 0, (out, err)
        outcome = json.loads(out)
        assert outcome["ok"] and outcome["sessions"][sid]["ok"], outcome
        status = guest(guest_site, "-m", "accelmig.agent", "status", "--socket", sock,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = status.communicate(timeout=60)
        assert status.returncode == 0, err
        assert [s["sid"] for s in json.loads(out)["sessions"]] == [sid]
        driver.stdin.write("go\n")
        driver.stdin.flush()
        after = json.loads(driver.stdout.readline())
        assert after["state"] == "connected" and after["resumes"] == 1
        assert after["data"] == list((7).to_bytes(4, sys.byteorder) * 4)
        assert driver.wait(30) == 0
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
            driver.wait(10)
        agent.send_signal(signal.SIGTERM)
        try:
            assert agent.wait(15) == 0
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait(10)
