"""The session guard of tests/conftest.py (tests/support/system_state.py):
it notices every kind of write, and it watches every system path the code
writes by default, so a new default cannot slip past it."""

from __future__ import annotations

import dataclasses
import inspect
import os

from accelmig.agent.daemon.agent import Agent
from accelmig.plugin.commands.install import DEFAULT_HOOKS_DIR
from accelmig.plugin.config import DEFAULT_PATH, HostdConfig, PoolEndpoints
from accelmig.pool.config import PoolConfig
from accelmig.runtime import units
from accelmig.wire.channel import DEFAULT_AGENT_SOCKET
from accelmig.wire.localapi import DEFAULT_HOSTD_SOCKET
from tests.support import system_state


def test_the_guard_sees_creation_writes_and_removal(tmp_path):
    state, absent, units_dir = tmp_path / "state", tmp_path / "absent", tmp_path / "units"
    state.mkdir()
    (state / "kept.json").write_text("{}")
    (state / "gone.json").write_text("{}")
    units_dir.mkdir()
    (units_dir / "other.service").write_text("")
    dirs, globs = (str(state), str(absent)), (str(units_dir / "accelmig*"),)
    before = system_state.snapshot(dirs, globs)
    assert system_state.changes(before, system_state.snapshot(dirs, globs)) == []

    (state / "kept.json").write_text('{"a": 1}')
    (state / "gone.json").unlink()
    (state / "new.json").write_text("{}")
    absent.mkdir()
    (units_dir / "accelmig-pool.service").write_text("[Unit]\n")
    (units_dir / "other.service").write_text("not ours")          # not guarded
    assert system_state.changes(before, system_state.snapshot(dirs, globs)) == [
        f"{absent}: created",
        f"{state}: gone.json removed, kept.json written, new.json created",
        f"{units_dir / 'accelmig-pool.service'}: created",
    ]


def test_an_atomic_rewrite_with_the_same_bytes_is_a_write(tmp_path):
    path = tmp_path / "hook-install.json"
    path.write_text("{}")
    before = system_state.snapshot((str(tmp_path),), ())
    tmp = tmp_path / ".hook-install.json.tmp"
    tmp.write_text("{}")
    os.replace(tmp, path)                 # as install's atomic_write does: a new inode
    assert system_state.changes(before, system_state.snapshot((str(tmp_path),), ())) == [
        f"{tmp_path}: hook-install.json written"]


def _guarded(path: str) -> bool:
    if any(path == d or path.startswith(d + "/") for d in system_state.GUARDED_DIRS):
        return True
    return any(os.path.dirname(pattern) == os.path.dirname(path)
               and os.path.basename(path).startswith(os.path.basename(pattern).rstrip("*"))
               for pattern in system_state.GUARDED_GLOBS)


def test_every_default_system_path_of_the_code_is_guarded():
    hostd = HostdConfig()
    pool = {f.name: f.default for f in dataclasses.fields(PoolConfig)}
    secret = {f.name: f.default for f in dataclasses.fields(PoolEndpoints)}["secret_file"]
    defaults = {
        "[hostd] state_dir": hostd.state_dir,
        "[hostd] socket": hostd.socket,
        "the host config": DEFAULT_PATH,
        "[pool] secret_file": secret,
        "the pool's admin socket": pool["admin_socket"],
        "the pool's tokens": pool["tokens"],
        "hostd's local API": DEFAULT_HOSTD_SOCKET,
        "the agent's socket": DEFAULT_AGENT_SOCKET,
        "the agent's state_dir": inspect.signature(Agent).parameters["state_dir"].default,
        "install's hooks dir": os.path.join(DEFAULT_HOOKS_DIR, "qemu.d", "50-accelmig"),
        "a unit": os.path.join(units.DEFAULT_UNIT_DIR, "accelmig-hostd.service"),
        "a sysusers file": os.path.join(units.DEFAULT_SYSUSERS_DIR, "accelmig.conf"),
    }
    unguarded = {what: path for what, path in defaults.items() if not _guarded(path)}
    assert unguarded == {}, "add these to tests/support/system_state.py"
