"""accelmig.runtime.units: the plumbing of the three sides' unit installers.

Proven against systemd's own tools: path escaping against systemd-escape,
command-line quoting against systemd-analyze verify (which says "not
executable" when it split a path wrongly)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from accelmig.runtime import units
from accelmig.wire.errors import BadRequest
from tests.support.systemd import directives, needs_analyze, verify


@pytest.mark.skipif(shutil.which("systemd-escape") is None, reason="SKIPPED LOUDLY: no systemd-escape")
@pytest.mark.parametrize("path", ["/dev/virtio-ports/org.accelmig.agent.0", "/dev/vport0p1",
                                  "/dev/virtio-ports/odd name.é", "//dev//x/", "/.hidden/x"])
def test_escape_path_is_systemd_escape_path(path):
    want = subprocess.run(["systemd-escape", "--path", path], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert units.escape_path(path) == want
    assert units.device_unit(path) == want + ".device"


def test_render_refuses_a_missing_or_an_unused_value():
    assert units.render("ExecStart=@EXEC_START@ $MAINPID %S\n", {"EXEC_START": "/x"}) == \
        "ExecStart=/x $MAINPID %S\n"
    with pytest.raises(ValueError, match="missing values \\['USER'\\]"):
        units.render("User=@USER@\n", {})
    with pytest.raises(ValueError, match="unused values \\['USRE'\\]"):
        units.render("User=@USER@\n", {"USER": "a", "USRE": "b"})


@needs_analyze
def test_command_line_quoting_survives_systemd(tmp_path):
    """A script in a directory with a blank, a % and a $ in its name:
    systemd must find the very file (verify checks it is executable).  A
    quote in it systemd refuses outright: so does command_line."""
    with pytest.raises(BadRequest, match="quotes"):
        units.command_line(['/opt/a"b/prog'])
    odd = tmp_path / "with blank 100% $HOME"
    odd.mkdir()
    script = odd / "prog"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    line = units.command_line([str(script), "--config", "/etc/a b.toml", "$HOME", "50%"])
    assert line.endswith(' --config "/etc/a b.toml" "$$HOME" "50%%"')
    unit = tmp_path / "odd.service"
    unit.write_text(f"[Service]\nExecStart={line}\n")
    verify(unit)
    script.chmod(0o644)                     # and the check is real: not executable is reported
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert done.returncode != 0 and "is not executable" in done.stderr


def test_entry_point_is_the_console_script_beside_this_interpreter():
    argv = units.entry_point("accelmig-agent", "accelmig.agent.cli")
    assert argv == [os.path.join(os.path.dirname(os.path.abspath(__import__("sys").executable)),
                                 "accelmig-agent")]
    assert os.access(argv[0], os.X_OK)
    assert units.entry_point("no-such-script-here", "accelmig.agent.cli")[1:] == ["-m", "accelmig.agent.cli"]


def test_install_is_atomic_and_idempotent(tmp_path):
    result = units.install_units({"a.service": "[Service]\nExecStart=/bin/true\n"}, root=str(tmp_path))
    path = tmp_path / "etc/systemd/system/a.service"
    assert result["files"] == [{"path": str(path), "action": "written"}]
    assert result["reload"]["action"] == "skipped"             # an alternate root: never daemon-reload
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    before = (path.stat().st_ino, path.stat().st_mtime_ns)
    again = units.install_units({"a.service": "[Service]\nExecStart=/bin/true\n"}, root=str(tmp_path))
    assert again["files"][0]["action"] == "unchanged" and again["reload"]["action"] == "not needed"
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == before
    changed = units.install_units({"a.service": "[Service]\nExecStart=/bin/false\n"}, root=str(tmp_path))
    assert changed["files"][0]["action"] == "written"
    assert directives(path.read_text())["ExecStart"] == ["/bin/false"]
    assert sorted(os.listdir(path.parent)) == ["a.service"]   # no temporary file left


@pytest.mark.skipif(units.systemd_booted(), reason="systemd is PID 1 here: this would really daemon-reload")
def test_no_daemon_reload_without_systemd_as_pid1():
    """The real unit directory, on a machine whose PID 1 is not systemd:
    nothing is run, and the reason names PID 1 (nothing is written either:
    reload_manager only decides)."""
    decision = units.reload_manager(True, None, units.DEFAULT_UNIT_DIR)
    assert decision["action"] == "skipped"
    assert f"PID 1 is {units.pid1()!r}, not systemd" in decision["reason"]
