"""What the fleet runs on a node where no installed command does it yet:
``python3 -c SOURCE OP ARGS...`` (this file's text), before accelmig is
there.  Standard library only, Python 3.9+ (whatever python3 the node has:
``probe`` is what tells the fleet whether it is recent enough).

Operations (each prints one JSON object):

- ``probe PATH...``: the interpreter, systemd, the libvirt daemons, and
  for each PATH whether it exists, its sha256, mode, owner and link target.
- ``put PATH MODE OWNER GROUP [--check]``: stdin becomes PATH, atomically
  (temporary file + rename in the same directory), unless it already holds
  exactly these bytes with this mode and owner: ``unchanged``.  ``--check``
  says what it would do and writes nothing.
- ``read PATH``: the file's text (a secret the fleet keeps using), or null.
- ``link TARGET PATH``: PATH becomes a symlink to TARGET, atomically.
- ``prune DIR KEEP...``: removes the entries of DIR not named in KEEP.
"""

import grp
import hashlib
import json
import os
import pwd
import shutil
import sys
import tempfile

#: The libvirt daemons that run qemu hooks, and their usual pid files.
DAEMONS = {"libvirtd": ("/run/libvirtd.pid", "/var/run/libvirtd.pid"),
           "virtqemud": ("/run/virtqemud.pid", "/var/run/virtqemud.pid")}


def describe(path):
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    out = {"mode": info.st_mode & 0o7777, "uid": info.st_uid, "gid": info.st_gid,
           "link": os.readlink(path) if os.path.islink(path) else None, "dir": os.path.isdir(path)}
    if os.path.isfile(path) and not out["link"]:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        out["sha256"] = digest.hexdigest()
    return out


def daemon_running(pid_files):
    for pid_file in pid_files:
        try:
            with open(pid_file) as handle:
                pid = int(handle.read().strip())
            with open("/proc/%d/comm" % pid) as handle:
                comm = handle.read().strip()
        except (OSError, ValueError):
            continue
        if comm in DAEMONS:
            return {"pid": pid, "comm": comm, "pid_file": pid_file}
    return None


def probe(paths, pid_files):
    try:
        with open("/proc/1/comm") as handle:
            pid1 = handle.read().strip()
    except OSError:
        pid1 = "?"
    pid_files = pid_files or [f for files in DAEMONS.values() for f in files]
    return {
        "python": list(sys.version_info[:3]),
        "executable": sys.executable,
        "venv": _has_module("ensurepip") and _has_module("venv"),
        "uid": os.geteuid(),
        "systemd": os.path.isdir("/run/systemd/system") and pid1 == "systemd",
        "libvirt": daemon_running(pid_files),
        "hostname": os.uname().nodename,
        "paths": {path: describe(path) for path in paths},
    }


def _has_module(name):
    import importlib.util
    return importlib.util.find_spec(name) is not None


def ids(owner, group):
    return pwd.getpwnam(owner).pw_uid, grp.getgrnam(group).gr_gid


def put(path, mode, owner, group, check):
    data = sys.stdin.buffer.read()
    uid, gid = ids(owner, group)
    now = describe(path)
    if now and now.get("sha256") == hashlib.sha256(data).hexdigest() and now["mode"] == mode \
            and now["uid"] == uid and now["gid"] == gid:
        return {"path": path, "action": "unchanged"}
    action = "updated" if now else "created"
    if now and now.get("sha256") == hashlib.sha256(data).hexdigest():
        action = "mode or owner fixed"
    if check:
        return {"path": path, "action": action, "checked": True}
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o755, exist_ok=True)
    # By hand, not accelmig.runtime.files.atomic_write: this file runs as
    # source text on a node where accelmig is not installed yet.  It also
    # sets the owner before any byte is in.
    fd, tmp = tempfile.mkstemp(prefix=".fleet-", dir=directory)
    try:
        # Mode and owner before the data is in: a secret is never readable by others.
        os.fchmod(fd, mode)
        os.fchown(fd, uid, gid)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return {"path": path, "action": action, "bytes": len(data)}


def read(path):
    try:
        with open(path, encoding="utf-8") as handle:
            return {"path": path, "text": handle.read(1 << 20)}
    except FileNotFoundError:
        return {"path": path, "text": None}


def link(target, path):
    if os.path.islink(path) and os.readlink(path) == target:
        return {"path": path, "action": "unchanged"}
    tmp = "%s.fleet-%d" % (path, os.getpid())
    os.symlink(target, tmp)
    os.replace(tmp, path)
    return {"path": path, "action": "updated", "target": target}


def prune(directory, keep):
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        names = []
    for name in sorted(names):
        if name not in keep:
            full = os.path.join(directory, name)
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full)
            else:
                os.unlink(full)
            removed.append(name)
    return {"dir": directory, "removed": removed}


def main(argv):
    op, args = argv[0], argv[1:]
    if op == "probe":
        split = args.index("--pid-files") if "--pid-files" in args else len(args)
        result = probe(args[:split], args[split + 1:])
    elif op == "put":
        result = put(args[0], int(args[1], 8), args[2], args[3], "--check" in args[4:])
    elif op == "read":
        result = read(args[0])
    elif op == "link":
        result = link(args[0], args[1])
    elif op == "prune":
        result = prune(args[0], set(args[1:]))
    else:
        raise SystemExit("unknown operation %r" % op)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
