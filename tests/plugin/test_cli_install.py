"""``accelmig install`` / ``uninstall``: the hook script, the reload, the record.

The unit tests write into a temporary hooks directory and reload a stand-in
daemon: a shell script *named* ``libvirtd`` (its ``/proc/<pid>/comm`` says
libvirtd) that logs every SIGHUP it gets, so they prove the signal reached
that very pid.  The lab tests do it for real: a real libvirtd (in the lab's
namespaces) that started with an empty ``hooks/qemu.d`` runs the installed
hook after the SIGHUP — the hook's notes arrive at a stand-in hostd socket
the test listens on — and stops running it after ``uninstall``.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from accelmig.plugin.cli import main as cli
from accelmig.plugin.commands import install as inst
from accelmig.plugin.commands.install import hook_script, parse_hook_script
from accelmig.plugin.config import HostdConfig
from accelmig.wire.errors import Unavailable
from tests.conftest import run_cli
from tests.support.hostd import HostdStub
from tests.support.libvirt import FakeLibvirtd, start_paused
from tests.support.hostd import write_host_config as write_config

@pytest.fixture
def fake_libvirtd(tmp_path):
    daemon = FakeLibvirtd(tmp_path / "daemon")
    try:
        yield daemon
    finally:
        daemon.stop()


def invoke(*args):
    """The CLI in-process (click's runner: stdout and stderr apart)."""
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def installed(hooks: Path, name: str = "50-accelmig") -> Path:
    return hooks / "qemu.d" / name


# ---------------------------------------------------------------- the script


def test_install_writes_an_executable_hook_and_is_idempotent(tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()                                   # qemu.d does not exist yet
    config = write_config(tmp_path / "etc")
    result = invoke("install", "--hooks-dir", str(hooks), "--config", str(config), "--no-reload")
    assert result.exit_code == 0, result.output
    script = installed(hooks)
    text = script.read_text()
    assert text.startswith("#!/bin/sh\n")
    assert f'exec {os.path.abspath(sys.executable)} -I -m accelmig.plugin.hook "$@"' in text
    assert parse_hook_script(text) == {"interpreter": os.path.abspath(sys.executable),
                                       "config": str(config), "accelmig": True}
    assert stat.S_IMODE(script.stat().st_mode) == 0o755
    assert f"hook {script}: written" in result.stdout
    assert "not reloaded (--no-reload)" in result.stdout
    assert list((hooks / "qemu.d").iterdir()) == [script]     # no temporary file left
    inode, mtime = script.stat().st_ino, script.stat().st_mtime_ns

    again = invoke("install", "--hooks-dir", str(hooks), "--config", str(config), "--no-reload", "--json")
    assert again.exit_code == 0, again.output
    data = json.loads(again.stdout)
    assert data["action"] == "unchanged" and data["hook"] == str(script)
    assert (script.stat().st_ino, script.stat().st_mtime_ns) == (inode, mtime)

    # a different config is a different script: rewritten, atomically (a new inode)
    other = write_config(tmp_path / "etc2")
    third = invoke("install", "--hooks-dir", str(hooks), "--config", str(other), "--no-reload", "--json")
    assert json.loads(third.stdout)["action"] == "written"
    assert script.stat().st_ino != inode
    assert parse_hook_script(script.read_text())["config"] == str(other)


def test_the_hook_runs_with_only_libvirts_environment(tmp_path):
    """The real console script installs it; the script then runs as libvirt
    would run it: no PYTHONPATH, no venv on PATH, a foreign domain on stdin."""
    hooks = tmp_path / "hooks"
    config = write_config(tmp_path / "etc")
    proc = run_cli("accelmig", "install", "--hooks-dir", str(hooks), "--config", str(config),
                   "--no-reload", timeout=60)
    assert proc.returncode == 0, proc.stderr
    script = installed(hooks)
    interpreter = parse_hook_script(script.read_text())["interpreter"]
    assert interpreter == os.path.join(os.path.dirname(sys.executable), "python3") or \
        os.path.samefile(os.path.dirname(interpreter), os.path.dirname(sys.executable))
    env = {"LC_ALL": "C", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/"}
    foreign = "<domain type='kvm'><name>web1</name><uuid>11111111-2222-4333-8444-555555555555</uuid></domain>"
    run = subprocess.run([str(script), "web1", "started", "begin", "-"], input=foreign, env=env, cwd="/",
                         capture_output=True, text=True, timeout=30)
    assert (run.returncode, run.stdout, run.stderr) == (0, "", "")


def test_only_the_gated_steps_start_python(tmp_path):
    """libvirt runs the hook for every step of every domain: every step but
    migrate begin and restore begin exits 0 from sh, Python never starts —
    proven with an interpreter that does not exist."""
    script = tmp_path / "50-accelmig"
    script.write_text(hook_script("/nonexistent/python3", str(tmp_path / "host.toml")))
    script.chmod(0o755)
    env = {"LC_ALL": "C", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/"}
    xml = "<domain><name>vm1</name><metadata><accelmig:domain/></metadata></domain>"
    for op, sub in (("prepare", "begin"), ("start", "begin"), ("started", "begin"), ("stopped", "end"),
                    ("release", "end"), ("reconnect", "begin"), ("attach", "begin"), ("migrate", "end")):
        run = subprocess.run([str(script), "vm1", op, sub, "-"], input=xml, env=env, capture_output=True,
                             text=True, timeout=30)
        assert (run.returncode, run.stdout, run.stderr) == (0, "", ""), (op, sub, run)
    for op in ("migrate", "restore"):
        run = subprocess.run([str(script), "vm1", op, "begin", "-"], input=xml, env=env, capture_output=True,
                             text=True, timeout=30)
        assert run.returncode != 0 and "/nonexistent/python3" in run.stderr    # it did try Python


def test_missing_config_is_a_warning_and_qemu_d_is_created(tmp_path, monkeypatch):
    hooks = tmp_path / "hooks"                      # neither hooks nor qemu.d exist
    missing = tmp_path / "nowhere" / "host.toml"
    # Without a config, install records into hostd's default state_dir
    # (/var/lib/accelmig): here a directory of the test's own instead.
    state = tmp_path / "state"
    monkeypatch.setattr(inst, "hostd_settings",
                        lambda config: HostdConfig(state_dir=str(state)) if config is None else config.hostd)
    result = invoke("install", "--hooks-dir", str(hooks), "--config", str(missing), "--no-reload")
    assert result.exit_code == 0, result.output
    assert f"warning: config {missing} not found" in result.stderr
    assert installed(hooks).is_file()
    assert parse_hook_script(installed(hooks).read_text())["config"] == str(missing)
    assert f"recorded in {state / 'hook-install.json'}" in result.stdout
    assert str(installed(hooks)) in json.loads((state / "hook-install.json").read_text())["hooks"]


@pytest.mark.parametrize("args, message", [
    (["--name", "../evil"], "hook name '../evil': a plain file name"),
    (["--name", ".hidden"], "a plain file name"),
])
def test_bad_names(tmp_path, args, message):
    result = invoke("install", "--hooks-dir", str(tmp_path), "--no-reload", *args)
    assert result.exit_code == 1
    assert result.stderr.startswith("accelmig: ") and message in result.stderr
    assert "Traceback" not in result.output


def test_hooks_dir_without_libvirt(tmp_path):
    result = invoke("install", "--hooks-dir", str(tmp_path / "no-libvirt" / "hooks"), "--no-reload")
    assert result.exit_code == 1
    assert "does not exist (is libvirt installed?" in result.stderr


# ---------------------------------------------------------------- the reload


def test_install_reloads_the_daemon_and_records_it(tmp_path, fake_libvirtd):
    hooks = tmp_path / "hooks"
    config = write_config(tmp_path / "etc")
    result = invoke("install", "--hooks-dir", str(hooks), "--config", str(config),
                    "--libvirtd-pid-file", str(fake_libvirtd.pid_file), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["reload"]["action"] == "reloaded"
    assert (data["reload"]["pid"], data["reload"]["starttime"]) == (fake_libvirtd.pid, fake_libvirtd.starttime)
    assert fake_libvirtd.hup_count() == 1                    # the signal reached that pid
    state = json.loads((tmp_path / "etc" / "state" / "hook-install.json").read_text())
    record = state["hooks"][str(installed(hooks))]
    assert record["reload"]["pid"] == fake_libvirtd.pid
    assert record["reload"]["starttime"] == fake_libvirtd.starttime
    assert abs(record["reload"]["at"] - time.time()) < 30
    assert record["pid_file"] == str(fake_libvirtd.pid_file)

    # unchanged, and this daemon already reloaded since: nothing to do
    again = invoke("install", "--hooks-dir", str(hooks), "--config", str(config),
                   "--libvirtd-pid-file", str(fake_libvirtd.pid_file))
    assert again.exit_code == 0, again.output
    assert "unchanged" in again.stdout and "already sees this hook, not reloaded" in again.stdout
    assert fake_libvirtd.hup_count() == 1

    # uninstall removes it and reloads again; a second uninstall has nothing to do
    gone = invoke("uninstall", "--hooks-dir", str(hooks), "--config", str(config),
                  "--libvirtd-pid-file", str(fake_libvirtd.pid_file))
    assert gone.exit_code == 0, gone.output
    assert "removed" in gone.stdout and "reloaded (SIGHUP)" in gone.stdout
    assert not installed(hooks).exists()
    assert fake_libvirtd.hup_count() == 2
    state = json.loads((tmp_path / "etc" / "state" / "hook-install.json").read_text())
    assert state["hooks"] == {}
    twice = invoke("uninstall", "--hooks-dir", str(hooks), "--config", str(config), "--json",
                   "--libvirtd-pid-file", str(fake_libvirtd.pid_file))
    assert twice.exit_code == 0 and json.loads(twice.stdout)["action"] == "not installed"
    assert fake_libvirtd.hup_count(settle=0.1) == 2


def test_no_running_daemon_is_a_warning_and_doctor_verifies_the_next_start(tmp_path, fake_libvirtd):
    """Socket activation stops an idle libvirtd: install succeeds (a provisioning
    script under ``set -e`` goes on), and the daemon that starts next has seen
    the hook — which doctor's 'hook seen' check tells by its start time."""
    hooks = tmp_path / "hooks"
    config = write_config(tmp_path / "etc")
    pid_file = tmp_path / "libvirtd.pid"

    pid_file.write_text(f"{os.getpid()}\n")          # a live process, but not libvirtd
    result = invoke("install", "--hooks-dir", str(hooks), "--config", str(config),
                    "--libvirtd-pid-file", str(pid_file))
    assert result.exit_code == 0, result.output
    assert f"names pid {os.getpid()}, which is not libvirtd or virtqemud" in result.stderr
    assert "accelmig: warning: no libvirt daemon is running" in result.stderr
    assert "it reads the hook when it next starts" in result.stderr
    assert "libvirt daemon: not running; the next one to start reads the hook" in result.stdout
    assert installed(hooks).is_file()

    dead = subprocess.Popen(["true"])
    dead.wait()
    pid_file.write_text(f"{dead.pid}\n")
    result = invoke("install", "--hooks-dir", str(hooks), "--config", str(config),
                    "--libvirtd-pid-file", str(pid_file), "--json")
    assert result.exit_code == 0 and "stale pid file" in result.stderr
    assert json.loads(result.stdout)["reload"]["action"] == "not running"

    absent = tmp_path / "absent.pid"
    proc = run_cli("accelmig", "install", "--hooks-dir", str(hooks), "--config", str(config),
                   "--libvirtd-pid-file", str(absent), timeout=60)
    assert proc.returncode == 0 and "absent.pid: no such file" in proc.stderr
    assert "Traceback" not in proc.stderr

    # doctor while none runs: a warning, not a failure
    checks = {c["name"]: c for c in json.loads(invoke(
        "doctor", "--config", str(config), "--hooks-dir", str(hooks), "--libvirtd-pid-file", str(absent),
        "--json").stdout)["checks"]}
    assert checks["hook seen"]["status"] == "warn"
    assert "no libvirt daemon is running" in checks["hook seen"]["reason"]
    # the next start: a daemon that started after the hook was written has seen it
    past = time.time() - 600
    os.utime(installed(hooks), (past, past))
    checks = {c["name"]: c for c in json.loads(invoke(
        "doctor", "--config", str(config), "--hooks-dir", str(hooks),
        "--libvirtd-pid-file", str(fake_libvirtd.pid_file), "--json").stdout)["checks"]}
    assert checks["hook seen"]["status"] == "ok", checks["hook seen"]
    assert "after the hook was written" in checks["hook seen"]["reason"]


def test_uninstall_leaves_a_foreign_script_alone(tmp_path):
    qemu_d = tmp_path / "hooks" / "qemu.d"
    qemu_d.mkdir(parents=True)
    other = qemu_d / "50-accelmig"
    other.write_text("#!/bin/sh\nexit 0\n")
    result = invoke("uninstall", "--hooks-dir", str(tmp_path / "hooks"), "--no-reload")
    assert result.exit_code == 1 and "does not run accelmig's hook: left alone" in result.stderr
    assert other.exists()


def test_help_explains():
    for command in ("install", "uninstall"):
        result = invoke(command, "--help")
        assert result.exit_code == 0
        assert "SIGHUP" in result.stdout and "--hooks-dir" in result.stdout


# ---------------------------------------------------------------- a real libvirt daemon

def saved_domain(lab, name: str, directory: Path) -> str:
    """A real accelmig domain, started paused and saved to a file: its
    ``restore`` is one of the two steps the hook gates (the other is
    ``migrate begin``); every other step starts no Python at all."""
    dom = start_paused(lab, name)
    path = str(directory / f"{name}.save")
    dom.save(path)
    return path


def restore_and_destroy(lab, path: str, host: str = "hostA") -> str:
    conn = lab.connect(host)
    conn.restore(path)
    dom = next(d for d in conn.listAllDomains(0) if d.isActive())
    uuid_ = dom.UUIDString()
    dom.destroy()
    return uuid_


@pytest.mark.root
@pytest.mark.libvirt
@pytest.mark.timeout(180)
def test_real_libvirtd_runs_the_hook_after_install_and_stops_after_uninstall(lab, tmp_path):
    import libvirt
    node = lab.node("hostA")
    assert list(node.hooks_dir.iterdir()) == []          # the daemon started without hooks
    stub = HostdStub(tmp_path / "hostd.sock")
    config = write_config(tmp_path / "etc", socket=stub.path, libvirt_uri=node.uri)
    hooks_dir = node.hooks_dir.parent                      # <node>/etc/libvirt/hooks
    name = "cli-hook-" + uuid.uuid4().hex[:6]
    try:
        # without the reload libvirt does not run the new hook (it looked at start only)
        proc = run_cli("accelmig", "install", "--hooks-dir", str(hooks_dir), "--config", str(config),
                       "--no-reload", timeout=60)
        assert proc.returncode == 0, proc.stderr
        restore_and_destroy(lab, saved_domain(lab, name + "-0", tmp_path))
        assert stub.requests == [], "libvirtd ran a hook it should not know of yet"

        # the real console script, as an operator runs it: the same file, now reloaded
        proc = run_cli("accelmig", "install", "--hooks-dir", str(hooks_dir), "--config", str(config),
                       "--libvirtd-pid-file", str(node.pid_file), "--json", timeout=60)
        assert proc.returncode == 0, proc.stderr
        data = json.loads(proc.stdout)
        assert data["action"] == "unchanged"
        assert data["reload"]["action"] == "reloaded"
        assert data["reload"]["comm"] == "libvirtd"
        assert (data["reload"]["pid"], data["reload"]["starttime"]) == (node.pid, node.pid_starttime)
        time.sleep(0.5)                                    # libvirtd handles SIGHUP asynchronously

        # a start and a stop: every step runs the installed script, none asks hostd
        dom = start_paused(lab, name)
        dom.destroy()
        assert stub.requests == [], f"an ungated step reached hostd: {stub.requests}"
        # a restore: the gated step asks hostd, with the domain's identity, and goes ahead
        dom_uuid = restore_and_destroy(lab, saved_domain(lab, name, tmp_path))
        notes = [(m["op"], m["sub"], m["uuid"], m["name"]) for m in stub.received("hook")]
        assert notes == [("restore", "begin", dom_uuid, name)], \
            f"libvirtd did not run the installed hook once at restore (notes: {stub.requests}); {node.tail()}"
        # hostd refusing the restore (strict mode): libvirt refuses it, with the hook's reason
        stub.answers["hook"] = Unavailable("the pool is unreachable")
        refused = saved_domain(lab, name + "-r", tmp_path)
        with pytest.raises(libvirt.libvirtError, match="accelmig hook: refusing restore"):
            lab.connect("hostA").restore(refused)
        assert not [d for d in lab.connect("hostA").listAllDomains(0) if d.isActive()]
        del stub.answers["hook"]

        # uninstall: removed and reloaded; the next restore runs no accelmig hook
        proc = run_cli("accelmig", "uninstall", "--hooks-dir", str(hooks_dir), "--config", str(config),
                       "--libvirtd-pid-file", str(node.pid_file), "--json", timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["reload"]["pid"] == node.pid
        assert list(node.hooks_dir.iterdir()) == []
        time.sleep(0.5)
        before = len(stub.requests)
        restore_and_destroy(lab, refused)
        assert len(stub.requests) == before, stub.requests[before:]
        assert node.running() and os.kill(node.pid, 0) is None     # SIGHUP did not stop it
    finally:
        stub.close()
        for leftover in node.hooks_dir.iterdir():
            leftover.unlink()
