"""Run a command on this machine as a fresh one would look to it: in a
private mount namespace where libvirt's own directories (/run/libvirt,
/var/lib/libvirt, /var/cache/libvirt, /var/log/libvirt) do not exist, as on
a Debian machine with libvirt's packages installed but no libvirt daemon
ever run.  The real machine is not touched: everything happens in a mount
namespace of the command's own, and is gone with it.

``./dev.sh test`` runs the suite this way (as root), so that the lab and the
e2e tier prove they come up where nothing was ever created by hand::

    python -m accelmig.lab.fresh -- CMD...      (it enters its own mount namespace)

How a directory is made absent: its parent (say /var/lib) gets a fresh
tmpfs, and every other entry of the parent is bind-mounted back from the
original (kept reachable through a bind made first), so only the hidden
entries are missing.  ``unshare`` has no option for "this path absent".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

_INNER = "ACCELMIG_FRESH_INNER"
HIDDEN = ("/run/libvirt", "/var/lib/libvirt", "/var/cache/libvirt", "/var/log/libvirt")


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def _in_own_mount_namespace() -> bool:
    """Whether this process's mount namespace differs from its parent's (the
    caller of ``unshare``; PID 1's may not be readable in a container)."""
    return os.readlink("/proc/self/ns/mnt") != os.readlink(f"/proc/{os.getppid()}/ns/mnt")


def hide(paths=HIDDEN, stash: str | None = None) -> list[str]:
    """Make ``paths`` absent in this mount namespace; the ones hidden.  The
    originals stay reachable under ``stash`` (a new temporary directory)."""
    if not _in_own_mount_namespace():
        # The one guard that matters: never do this to the machine itself.
        raise SystemExit("accelmig.lab.fresh: not in a mount namespace of its own: "
                         "refusing to hide anything")
    by_parent: dict[str, set[str]] = {}
    for path in paths:
        parent, name = os.path.split(path.rstrip("/"))
        by_parent.setdefault(parent, set()).add(name)
    stash = stash or tempfile.mkdtemp(prefix="accelmig-fresh-")
    hidden = []
    for index, (parent, names) in enumerate(sorted(by_parent.items())):
        if not any(os.path.lexists(os.path.join(parent, n)) for n in names):
            continue                        # already absent: nothing to do
        original = os.path.join(stash, str(index))
        os.mkdir(original)
        _mount("--rbind", parent, original)
        mode = os.stat(parent).st_mode & 0o7777
        _mount("-t", "tmpfs", "-o", f"mode={mode:o}", "accelmig-fresh", parent)
        for entry in sorted(os.listdir(original)):
            source, target = os.path.join(original, entry), os.path.join(parent, entry)
            if entry in names:
                hidden.append(target)
                continue
            if os.path.islink(source):
                os.symlink(os.readlink(source), target)
                continue
            # (mount(8) itself may have made one already: /run/mount)
            if os.path.isdir(source):
                os.makedirs(target, exist_ok=True)
            elif not os.path.lexists(target):
                open(target, "w").close()
            _mount("--rbind", source, target)
    return hidden


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m accelmig.lab.fresh",
        description="Run CMD where libvirt's directories are absent, in a mount namespace "
                    "of its own (the machine itself is not touched).  Needs root.")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    if os.environ.get(_INNER) != "1":
        # Into a mount namespace of our own first; there, again, to do the work.
        os.execvpe("unshare", ["unshare", "--mount", "--propagation", "private", sys.executable,
                               "-m", "accelmig.lab.fresh", "--", *command],
                   dict(os.environ, **{_INNER: "1"}))
    os.environ.pop(_INNER)
    stash = tempfile.mkdtemp(prefix="accelmig-fresh-")
    try:
        hidden = hide(stash=stash)
        print(f"accelmig.lab.fresh: hidden for this run: "
              f"{', '.join(hidden) or 'none (already absent)'}", file=sys.stderr, flush=True)
        return subprocess.call(command)
    finally:
        # the binds die with the namespace; the empty directory is ours to remove
        for entry in os.listdir(stash):
            subprocess.run(["umount", "-R", "-l", os.path.join(stash, entry)],
                           stderr=subprocess.DEVNULL, check=False)
            os.rmdir(os.path.join(stash, entry))
        os.rmdir(stash)


if __name__ == "__main__":
    sys.exit(main())
