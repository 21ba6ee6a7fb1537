"""The guard that the suite writes no real system state.

``tests/conftest.py`` snapshots these paths before the session and fails
the run if any changed after it: every test must point accelmig at its own
``tmp_path`` (hooks dir, config, state dir, sockets, unit dir).  A snapshot
is each entry's type, mode, inode, size and mtime (``lstat``, no reading):
cheap, and an atomic rewrite with the same bytes still counts as a write.

The lab's own working directories (``/run/accelmig-lab``, the image cache
``/var/cache/accelmig-lab``) and libvirt's mount points are not guarded:
they are the lab's documented places, shared by labs running at once.
"""

from __future__ import annotations

import glob
import os

#: Directories accelmig writes by default (tests/plugin/test_system_state_guard.py
#: checks that every default in the code is under one of them).
GUARDED_DIRS = (
    "/var/lib/accelmig",       # [hostd] state_dir: hook-install.json, address leases
    "/run/accelmig",           # hostd.sock, pool.sock, the agent's socket and state_dir
    "/etc/accelmig",           # host.toml, host.secret, tokens.toml, hosts.toml
    "/var/log/accelmig",
    "/etc/libvirt/hooks",      # accelmig install's default --hooks-dir
)
#: accelmig's files in shared system directories (units, sysusers).
GUARDED_GLOBS = (
    "/etc/systemd/system/accelmig*",
    "/run/systemd/system/accelmig*",
    "/usr/local/lib/systemd/system/accelmig*",
    "/etc/sysusers.d/accelmig*",
    "/var/log/accelmig*",
)


def _entry(path: str):
    st = os.lstat(path)
    return (st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns)


def snapshot_path(path: str):
    """``None`` if absent, else {relative path: (mode, inode, size, mtime_ns)} of
    the path and everything under it (symlinks not followed)."""
    try:
        top = {".": _entry(path)}
    except FileNotFoundError:
        return None
    if os.path.isdir(path) and not os.path.islink(path):
        for dirpath, dirnames, filenames in os.walk(path):
            for name in dirnames + filenames:
                full = os.path.join(dirpath, name)
                try:
                    top[os.path.relpath(full, path)] = _entry(full)
                except FileNotFoundError:   # gone between listing and lstat: a change anyway
                    top[os.path.relpath(full, path)] = None
    return top


def snapshot(dirs=GUARDED_DIRS, globs=GUARDED_GLOBS) -> dict:
    paths = set(dirs)
    for pattern in globs:
        paths.update(glob.glob(pattern))
    return {path: snapshot_path(path) for path in sorted(paths)}


def changes(before: dict, after: dict) -> list[str]:
    """One line per guarded path that differs (created, removed, written)."""
    out = []
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path), after.get(path)
        if old == new:
            continue
        if old is None:
            out.append(f"{path}: created")
        elif new is None:
            out.append(f"{path}: removed")
        else:
            touched = [f"{k} {'created' if k not in old else 'removed' if k not in new else 'written'}"
                       for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
            if len(touched) > 1:
                touched = [t for t in touched if not t.startswith(". ")]   # the dir's mtime: implied
            out.append(f"{path}: {', '.join(touched)}")
    return out
