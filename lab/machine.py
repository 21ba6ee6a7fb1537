"""A lab node as a machine of its own, for what operators' tools install on
machines (``accelmig fleet deploy``): the fixed paths such a tool writes
are node-private, in the node's own mount namespace, so that nothing lands
on this machine.

- ``/etc``: a copy of this machine's, made when the node starts (3.9 MB
  here; ``cp -a``).  Binding the whole directory rather than single files
  lets tools replace files by rename (``systemd-sysusers`` writes
  ``/etc/passwd+`` and renames it, which a bind-mounted file refuses).
- ``/opt`` (where deployments put their virtual environments): empty.
- ``/run`` and ``/var/lib`` (and on the pool node ``/var/cache``) are the
  node's own (``PRIVATE_PARENTS``: a tmpfs with the machine's entries bound
  back, lab/reaper.py), so that the mount points of absent paths are made
  in the node, never on the machine.  Not ``/var/cache`` on a hypervisor
  host: its QEMUs read the guest image from /var/cache/accelmig-lab, which
  may be built after the node started (a later entry is not bound back); accelmig's state and runtime paths
  (``/var/lib/accelmig``, ``/var/lib/accelmig-pool``,
  ``/var/cache/accelmig-pool``, ``/run/accelmig``) and sshd's
  ``/run/sshd`` are then empty directories of the node's.
- ``/run/systemd``, where it exists: empty, so that a tool inside the node
  never finds systemd as PID 1 (sd_booted) and never talks to this
  machine's systemd.

The node's mounts die with its namespace: nothing to undo.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SUBDIR = "machine"
#: made the node's own before any bind (lab/reaper.py --private-dir)
PRIVATE_PARENTS = ("/run", "/var/lib")
#: the pool node's too (the pool service's cache directory)
POOL_PRIVATE_PARENTS = ("/var/cache",)
POOL_PRIVATE_DIRS = {"/var/cache/accelmig-pool": "var-cache-accelmig-pool"}
#: fixed path -> the node's own directory (under ``root/machine``), bound in this order
PRIVATE_DIRS = {
    "/opt": "opt",
    "/var/lib/accelmig": "var-lib-accelmig",
    "/var/lib/accelmig-pool": "var-lib-accelmig-pool",
    "/run/accelmig": "run-accelmig",
    "/run/sshd": "run-sshd",          # sshd's privilege-separation directory (root's, 0755)
}


def etc_dir(root: Path) -> Path:
    """The node's /etc, seen from here."""
    return Path(root) / SUBDIR / "etc"


def prepare(root: Path) -> None:
    """A fresh copy of /etc and empty private directories (a node that
    starts again starts as a fresh machine)."""
    base = Path(root) / SUBDIR
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    subprocess.run(["cp", "-a", "/etc/.", str(etc_dir(root))], check=True, capture_output=True, timeout=120)
    for sub in _dirs(pool=True).values():
        (base / sub).mkdir(mode=0o755)
    (base / "run-systemd").mkdir(mode=0o755)


def _dirs(pool: bool) -> dict[str, str]:
    return {**PRIVATE_DIRS, **(POOL_PRIVATE_DIRS if pool else {})}


def reaper_args(root: Path, more_binds: list[tuple[Path, str]] = (), *, pool: bool = False) -> list[str]:
    """The reaper's options for a node: private parents, its /etc, then
    ``more_binds`` (libvirt's paths, ...), then accelmig's and sshd's dirs."""
    args = []
    for parent in (*PRIVATE_PARENTS, *(POOL_PRIVATE_PARENTS if pool else ())):
        args += ["--private-dir", parent]
    for source, target in [*binds_first(root), *more_binds, *binds_last(root, pool)]:
        args += ["--bind", f"{source}:{target}"]
    return args


def binds_first(root: Path) -> list[tuple[Path, str]]:
    """Before any other bind of the node (those go on top): its /etc."""
    return [(etc_dir(root), "/etc")]


def binds_last(root: Path, pool: bool = False) -> list[tuple[Path, str]]:
    base = Path(root) / SUBDIR
    out = [(base / sub, fixed) for fixed, sub in _dirs(pool).items()]
    if os.path.isdir("/run/systemd"):
        out.append((base / "run-systemd", "/run/systemd"))
    return out


def host_path(root: Path, path: str) -> Path:
    """A path as the node sees it -> the same file seen from here (for
    these private paths only; others are the machine's own)."""
    base = Path(root) / SUBDIR
    for fixed, sub in _dirs(pool=True).items():
        if path == fixed or path.startswith(fixed + "/"):
            return base / sub / os.path.relpath(path, fixed)
    if path == "/etc" or path.startswith("/etc/"):
        return etc_dir(root) / os.path.relpath(path, "/etc")
    return Path(path)


def service_command(unit_text: str, pid: int) -> tuple[list[str], list[list[str]]]:
    """A systemd unit's service, started in the node whose namespaces
    ``pid`` is in, as far as this machine (no systemd) can: ``(argv,
    preparations)``.  What is applied: ``ExecStart``, ``User``/``Group``
    (setpriv, with the node's own accounts), ``Environment`` (``%S``,
    ``%C`` expanded), ``RuntimeDirectory``/``StateDirectory``/
    ``CacheDirectory`` (made and owned by the user first, as systemd does)
    and ``UMask``.  The sandboxing directives (ProtectSystem=, ...) are
    not: the lab tests what the service does, not systemd."""
    import shlex
    service: dict[str, list[str]] = {}
    section = None
    for line in unit_text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]" and "=" in line:
            key, _, value = line.partition("=")
            service.setdefault(key.strip(), []).append(value.strip())
    expand = {"%S": "/var/lib", "%C": "/var/cache", "%t": "/run", "%%": "%"}

    def expanded(value: str) -> str:
        for token, path in expand.items():
            value = value.replace(token, path)
        return value

    user = (service.get("User") or ["root"])[-1]
    group = (service.get("Group") or [user])[-1]
    enter = ["nsenter", "--target", str(pid), "--mount", "--net", "--uts", "--"]
    preparations = []
    for key, base in (("RuntimeDirectory", "/run"), ("StateDirectory", "/var/lib"), ("CacheDirectory", "/var/cache")):
        for names in service.get(key, []):
            for name in names.split():
                preparations.append([*enter, "install", "-d", "-m", "0755", "-o", user, "-g", group,
                                     f"{base}/{name}"])
    env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    for value in service.get("Environment", []):
        env += [expanded(v) for v in shlex.split(value)]
    exec_start = shlex.split(service["ExecStart"][-1])
    umask = (service.get("UMask") or ["0022"])[-1]
    body = f"umask {umask} && exec \"$@\""
    argv = [*enter, "setpriv", f"--reuid={user}", f"--regid={group}", "--init-groups",
            "env", "-i", *env, "sh", "-c", body, "sh", *exec_start]
    return argv, preparations
