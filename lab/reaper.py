"""A tiny init for one lab libvirt daemon: run as ``python3 -I -S reaper.py
[--hostname NAME] [--private-dir DIR]... [--bind SRC:DST]... -- COMMAND...`` inside
``ip netns exec NS unshare --mount --uts --propagation private``.

Why it exists:

- **Namespaces, set up by the process that lives in them.**  It sets the
  UTS namespace's hostname and bind-mounts the node's own directories over
  libvirt's fixed paths (/etc/libvirt, /run/libvirt, ...), then execs
  nothing: the mounts live exactly as long as this namespace, so the daemon's
  end unmounts everything without anyone having to.  A fixed path that does
  not exist (a fresh machine) is created first, empty, and left there.
- **Immediate zombie reaping.**  It is a child subreaper
  (``prctl(PR_SET_CHILD_SUBREAPER)``): QEMU processes, which libvirt
  daemonises, become its children and are reaped the moment they exit.  PID 1
  on these machines reaps orphans only every 1–2 s, and libvirt treats an
  unreaped QEMU as alive, which added 1–2 s to every destroy and to the source
  side of every migration (docs/lab-notes.md: migration 2.4–2.8 s -> 1.1–1.3 s).
- **A clean stop.**  SIGTERM/SIGINT/SIGHUP go to the daemon; when the daemon
  has exited, every remaining child (guests libvirt left running) gets
  SIGTERM, then SIGKILL, before the reaper exits with the daemon's status.

Standard library only, no accelmig imports: it runs with ``-I -S``.
"""

import ctypes
import os
import signal
import socket
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
MS_BIND = 4096
MS_REC = 16384


def log(message):
    sys.stderr.write(f"accelmig-lab-reaper[{os.getpid()}]: {message}\n")
    sys.stderr.flush()


def make_mount_point(source, target):
    """A bind mount needs its target to exist, and a fresh machine with
    libvirt-daemon (not -system) has no /run/libvirt, /var/lib/libvirt,
    /var/cache/libvirt or /var/log/libvirt: create what is missing (mode 0755,
    whatever the umask; an empty file for a file source such as /etc/hosts).
    Left in place at the end: removing a directory that is a mount point in
    another namespace detaches that mount there (Linux >= 3.18), which would
    pull the paths from under every other lab daemon using it."""
    if os.path.lexists(target):
        return False
    if os.path.isdir(source):
        os.makedirs(target, 0o755, exist_ok=True)   # exist_ok: another daemon, the same moment
        os.chmod(target, 0o755)
    else:
        os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
        with open(target, "a"):
            pass
        os.chmod(target, 0o644)
    log(f"created the mount point {target} (it was absent)")
    return True


def private_dir(libc, parent):
    """Make ``parent`` (/run, /var/lib, ...) this namespace's own: a tmpfs
    over it, and every entry it had bound back from the original (reached
    through a descriptor opened before, /proc/self/fd/N: no stash
    directory).  New entries (mount points of the node's own) then land in
    the tmpfs, never on the machine; entries the machine adds later are not
    seen here."""
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        mode = os.fstat(fd).st_mode & 0o7777
        if libc.mount(b"accelmig-node", parent.encode(), b"tmpfs", 0, ("mode=%o" % mode).encode()) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"tmpfs on {parent}: {os.strerror(err)}")
        for entry in sorted(os.listdir(fd)):
            source, target = f"/proc/self/fd/{fd}/{entry}", os.path.join(parent, entry)
            if os.path.islink(source):
                os.symlink(os.readlink(source), target)
                continue
            if os.path.isdir(source):
                os.mkdir(target)
            else:
                open(target, "w").close()
            bind_mount(libc, source, target)
    finally:
        os.close(fd)


def bind_mount(libc, source, target):
    if libc.mount(source.encode(), target.encode(), None, MS_BIND | MS_REC, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bind mount {source} -> {target}: {os.strerror(err)}")


def children():
    """PIDs whose parent is this process (orphans adopted as subreaper)."""
    me = str(os.getpid())
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            out.append(int(entry))
    return out


def reap_all():
    """Reap every exited child; return the PIDs reaped."""
    reaped = []
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped.append(pid)


def main(argv):
    hostname, binds, private = None, [], []
    args = list(argv)
    while args and args[0] != "--":
        opt = args.pop(0)
        if opt == "--hostname":
            hostname = args.pop(0)
        elif opt == "--private-dir":
            private.append(args.pop(0))
        elif opt == "--bind":
            source, _, target = args.pop(0).partition(":")
            binds.append((source, target))
        else:
            log(f"unknown option {opt}")
            return 2
    if not args or len(args) < 2:
        log("usage: reaper.py [--hostname NAME] [--private-dir DIR]... [--bind SRC:DST]... -- COMMAND...")
        return 2
    command = args[1:]

    libc = ctypes.CDLL(None, use_errno=True)
    if hostname:
        socket.sethostname(hostname)
    try:
        for parent in private:
            private_dir(libc, parent)
        for source, target in binds:
            make_mount_point(source, target)
            bind_mount(libc, source, target)
    except OSError as exc:
        log(str(exc))            # one line in the node's stderr file, which wait_ready shows
        return 1
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log(f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}")
        return 1

    main_pid = os.posix_spawnp(command[0], command, os.environ)
    log(f"started {command[0]} as {main_pid}")

    def forward(signum, _frame):
        try:
            os.kill(main_pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)

    status = 0
    while True:
        try:
            pid, wstatus = os.waitpid(-1, 0)   # reaps QEMUs the moment they exit
        except ChildProcessError:
            break
        if pid == main_pid:
            status = os.waitstatus_to_exitcode(wstatus)
            log(f"{command[0]} exited with {status}")
            break

    # The daemon is gone: end what it left running (QEMU guests), reaping as we go.
    for signum, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        left = children()
        if not left:
            break
        for pid in left:
            log(f"sending {signal.Signals(signum).name} to leftover child {pid}")
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and children():
            reap_all()
            time.sleep(0.02)
    reap_all()
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
