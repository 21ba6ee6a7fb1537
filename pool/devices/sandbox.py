"""The tenant's device process sees nothing of the pool node (``confine``).

A build runs the device compiler (clang inside PoCL) in the tenant's device
process, and a PoCL kernel is native code there: whatever that process can
open, a tenant can read.  ``#include "/etc/hostname"`` quotes the file's
first line in the build log, and no list of forbidden spellings can be
complete (comments, line continuations, macros, trigraphs, options...).
So the process confines itself before it serves anything, and the node's
files are not there to be named: an existing node path and a missing one
fail the same way, ``file not found``.

Its view of the file system, a root of its own (a tmpfs, ``pivot_root``)::

    /usr (and /bin /lib /lib64 /sbin as on the node)   the node's software, read-only
    the Python environment's directories                read-only (sys.path, prefixes, accelmig)
    /etc          copies of what the loaders need: the OpenCL ICD files,
                  ld.so.cache, os-release (clang's toolchain detection)
    /dev          null zero full random urandom
    /proc         cpuinfo and meminfo only (PoCL sizes the device from them):
                  no process, not even its own
    /sys/devices/system/{cpu,node}   read-only (hwloc: PoCL's compute units)
    /tmp          a tmpfs of its own (64 MiB)
    /tenant       the tenant's directory (kernel cache, working directory)

Nothing else: no /home, /root, /var, /run, /srv, no other tenant's
directory, no file of the pool's (tokens, certificates, keys).  The layers:

1. namespaces: a user namespace (no privilege needed; as root, without one
   if the kernel refuses it), mount (the root above), PID (no other process
   can be named: signalled, traced), network (no network at all: not the
   pool's control plane, not etcd, not other nodes), IPC (not the node's
   System V objects), UTS (a host name of its own; no cgroup namespace:
   with no /proc and no /sys/fs/cgroup there is nothing it would hide);
2. no capabilities (bounding set emptied, securebits locked), no_new_privs;
3. Landlock: reads only of what the view holds, writes only in /tenant and
   /tmp, execution only of the software, no TCP, signals and abstract unix
   sockets only within itself.  A second layer only: an EACCES (``cannot
   open file ...: Permission denied``) would tell a tenant that a path
   exists, so Landlock alone is no sandbox here;
4. seccomp, only to refuse new namespaces (``unshare``, ``setns``, ``clone``
   with namespace flags; ``clone3`` answers ENOSYS so libc falls back to
   ``clone``): a nested user namespace is the way to kernel interfaces
   (netfilter, ...) a process without capabilities cannot otherwise reach.

A PID namespace needs a fork: the process the pool started (the *outer*
one) creates the user and PID namespaces, forks the confined one (PID 1
there), hands it the socket and waits; when the pool kills the outer one
(a call past its time limit), the kernel kills the confined one
(``PR_SET_PDEATHSIG``) and everything it started.

The calls Python 3.11 lacks (``unshare`` is 3.12's, ``mount``,
``pivot_root``, ``capset`` and seccomp none's) go through ctypes: no
library on PyPI does this much and is maintained; bubblewrap would do the
namespaces but not Landlock, and would be one more package on every node.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import errno
import importlib.util
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading

from accelmig.pool.devices import landlock
from accelmig.wire.errors import Unavailable

#: where the tenant's directory is inside: the same for every tenant, so a
#: build log names no path of the node's
TENANT_DIR = "/tenant"
HOSTNAME = "accelmig-device"
#: the private /tmp's size: bounded, it is memory
TMP_SIZE = "64m"
#: the software trees of a distribution, shown as the node has them
#: (a directory: bound read-only; a symbolic link: the same link)
SYSTEM_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
#: files under /etc the loaders read, copied in (never the directory itself)
ETC_FILES = ("ld.so.cache", "os-release", "debian_version")
DEVICES = ("null", "zero", "full", "random", "urandom")
#: what PoCL (hwloc) reads to describe a CPU device: global, about no process
PROC_FILES = ("cpuinfo", "meminfo")
SYS_TREES = ("/sys/devices/system/cpu", "/sys/devices/system/node")
#: where the node's root hangs while the new one is built, then goes
_OLD_ROOT = "/.node"

# <sched.h>, <sys/mount.h>, <linux/prctl.h>, <linux/capability.h>, <linux/securebits.h>
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x2000000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_NAMESPACE_FLAGS = CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER \
    | CLONE_NEWPID | CLONE_NEWNET
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 24, 28, 38
PR_SET_SECCOMP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 22, 47, 4
#: NOROOT, NO_SETUID_FIXUP and KEEP_CAPS, each locked: uid 0 means nothing
_SECUREBITS_LOCKED = 0x2F
_CAPABILITY_VERSION_3 = 0x20080522

#: per architecture: pivot_root's number, seccomp's AUDIT_ARCH, and the
#: numbers of unshare, setns, clone and clone3
_ARCH = {
    "x86_64": {"pivot_root": 155, "audit": 0xC000003E, "unshare": 272, "setns": 308, "clone": 56,
               "clone3": 435, "x32_bit": 0x40000000},
    "aarch64": {"pivot_root": 41, "audit": 0xC00000B7, "unshare": 97, "setns": 268, "clone": 220,
                "clone3": 435, "x32_bit": None},
}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _unavailable(reason: str) -> Unavailable:
    return Unavailable(what="a sandbox for the tenant's device process", reason=reason)


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(),
                       ctypes.c_ulong(flags), data and data.encode()), f"mount {target}")


def _prctl(option: int, arg2: int = 0, arg3=0) -> int:
    # (prctl is variadic: each argument as the unsigned long the kernel reads)
    if isinstance(arg3, int):
        arg3 = ctypes.c_ulong(arg3)
    return _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg2), arg3, ctypes.c_ulong(0),
                              ctypes.c_ulong(0)), f"prctl {option}")


def _arch() -> dict:
    try:
        return _ARCH[os.uname().machine]
    except KeyError:
        raise _unavailable(f"no sandbox for the architecture {os.uname().machine} "
                           f"(its system call numbers are not known here)") from None


@dataclasses.dataclass(frozen=True)
class Confinement:
    """What ``confine`` achieved: the layers in force, and the second
    layers this kernel could not give (each with its reason)."""

    layers: tuple
    missing: tuple = ()

    def to_wire(self) -> dict:
        return {"layers": list(self.layers), "missing": list(self.missing)}

    def describe(self) -> str:
        text = ", ".join(self.layers)
        return text + (f"; without {', '.join(self.missing)}" if self.missing else "")


@dataclasses.dataclass
class View:
    """What the confined process will see, worked out before anything
    changes (the node's paths, and the contents of the files copied in)."""

    tenant_dir: str
    read_only: list = dataclasses.field(default_factory=list)     # node paths shown at the same path
    links: dict = dataclasses.field(default_factory=dict)         # /lib -> usr/lib, as on the node
    etc: dict = dataclasses.field(default_factory=dict)           # relative path under /etc -> bytes

    @classmethod
    def of_this_process(cls, tenant_dir: str) -> "View":
        view = cls(os.path.realpath(tenant_dir))
        for tree in SYSTEM_TREES:
            if os.path.islink(tree):
                view.links[tree] = os.readlink(tree)
            elif os.path.isdir(tree):
                view.read_only.append(tree)
        view._add_python()
        view._read_etc()
        return view

    def _add_python(self) -> None:
        """The interpreter's own directories, the packages' (sys.path) and
        accelmig's (an editable install maps them outside sys.path)."""
        # Resolved once, so that an import after the switch uses the path
        # the sandbox shows (a venv's lib64 is often a link to lib).
        sys.path[:] = [os.path.realpath(p) if p else p for p in sys.path]
        candidates = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, *sys.path]
        for package in ("accelmig.pool", "accelmig.wire"):
            spec = importlib.util.find_spec(package)
            candidates.extend(spec.submodule_search_locations or [])
        for path in candidates:
            path = os.path.realpath(path) if path else ""
            # "/" (or a path that holds the tenant's directory) would show the
            # node itself; the tenant's directory (python -m's sys.path[0]) is at /tenant
            if not path or not os.path.exists(path) or _within(self.tenant_dir, path) \
                    or _within(path, self.tenant_dir):
                continue
            if not any(path == shown or path.startswith(shown + "/") for shown in self.read_only):
                self.read_only = [p for p in self.read_only if not p.startswith(path + "/")] + [path]

    def _read_etc(self) -> None:
        # the ICD loader's list of runtimes: its directory, or the one file
        # OCL_ICD_VENDORS names (the sandbox has only /etc/OpenCL/vendors)
        vendors = os.environ.get("OCL_ICD_VENDORS") or "/etc/OpenCL/vendors"
        files = [os.path.join(vendors, name) for name in sorted(os.listdir(vendors))] \
            if os.path.isdir(vendors) else [vendors]
        for path in files:
            if path.endswith(".icd") and os.path.isfile(path):
                with open(path, "rb") as handle:
                    self.etc[f"OpenCL/vendors/{os.path.basename(path)}"] = handle.read(4096)
        for name in ETC_FILES:
            try:
                with open(os.path.join("/etc", name), "rb") as handle:
                    self.etc[name] = handle.read(1 << 20)
            except OSError:
                pass


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def confine(tenant_dir: str, keep_fds=()) -> Confinement:
    """Confine this process (see the module's text).  Returns in the
    confined process, with the root switched and the working directory
    ``TENANT_DIR``; the outer process never returns (it waits for the
    confined one and exits as it did).  Raises ``Unavailable`` (in the
    outer process) when the kernel or the setup refuses.

    Call it with one thread only (namespaces and Landlock apply to the
    calling thread); ``keep_fds`` go to the confined process alone."""
    if threading.active_count() > 1:
        raise _unavailable("confine() needs a process with one thread")
    arch = _arch()
    try:
        view = View.of_this_process(tenant_dir)
    except OSError as exc:
        raise _unavailable(f"its view cannot be worked out: {exc}") from None
    try:
        user_namespace = _enter_user_and_pid_namespaces()
    except OSError as exc:
        raise _unavailable(f"the kernel gives no namespaces ({os.strerror(exc.errno)}): user namespaces are off "
                           f"(sysctl user.max_user_namespaces or kernel.unprivileged_userns_clone, an "
                           f"AppArmor restriction) or a seccomp filter refuses them (systemd's "
                           f"RestrictNamespaces=)") from None
    # The outer process's end: a pidfd tells the confined one if it is
    # already gone (PR_SET_PDEATHSIG covers only what follows it).
    parent = os.pidfd_open(os.getpid())
    report_r, report_w = os.pipe()
    child = os.fork()
    if child:
        os.close(report_w)
        os.close(parent)
        outcome = _read_all(report_r)
        if outcome != b"ok":
            os.waitpid(child, 0)
            raise _unavailable(outcome.decode(errors="replace") or "the confined process died")
        for fd in keep_fds:
            os.close(fd)
        _wait_and_exit_as(child)
    os.close(report_r)
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if select.select([parent], [], [], 0)[0]:
            os._exit(1)                  # the outer process died before: nobody to serve
        os.close(parent)
        _close_all_but((*keep_fds, 0, 1, 2, report_w))
        confinement = _build(view, arch, user_namespace)
    except OSError as exc:
        os.write(report_w, str(exc).encode()[:4000])
        os._exit(1)
    os.write(report_w, b"ok")
    os.close(report_w)
    return confinement


def _enter_user_and_pid_namespaces() -> bool:
    """A user namespace where this process is root (mapped to its own uid
    outside), and a PID namespace for its next child.  True if the user
    namespace was made; as root without one (the kernel refuses them):
    False, the PID namespace alone."""
    uid, gid = os.geteuid(), os.getegid()
    try:
        _unshare(CLONE_NEWUSER | CLONE_NEWPID)
    except OSError as refused:
        try:
            _unshare(CLONE_NEWPID)       # possible with privilege only
        except OSError:
            raise refused from None
        return False
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as handle:
            handle.write(text)
    return True


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            os.close(fd)
            return b"".join(chunks)
        chunks.append(chunk)


def _wait_and_exit_as(child: int) -> None:
    """The outer process's whole life once the confined one serves: pass
    on a SIGTERM, and end as it ended (a signal as that signal)."""
    signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGTERM))
    signal.signal(signal.SIGINT, signal.SIG_IGN)        # the confined one gets its own
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        import resource
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # its core, if any, was its own
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


def _close_all_but(keep) -> None:
    """No descriptor of the node's may cross into the sandbox (a directory
    one would lead out of it)."""
    start = 0
    for fd in sorted(set(keep)):
        if start < fd:                  # (closerange(n, n) closes everything from n on)
            os.closerange(start, fd)
        start = fd + 1
    os.closerange(start, os.sysconf("SC_OPEN_MAX"))


def _build(view: View, arch: dict, user_namespace: bool) -> Confinement:
    """In the confined process (PID 1 of its namespace): the rest."""
    _unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)
    missing = []
    try:
        socket.sethostname(HOSTNAME)
    except OSError as exc:          # a seccomp filter of the pool's (systemd's ProtectHostname=)
        missing.append(f"a host name of its own (sethostname: {exc.strerror})")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)         # nothing of this propagates to the node
    _switch_root(view, arch)
    layers = ["user namespace" if user_namespace else "uid 0 without capabilities",
              "mount namespace with a root of its own", "pid, network, ipc and uts namespaces",
              "no capabilities"]
    _drop_capabilities()
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    version = landlock.abi()
    if version:
        _restrict_with_landlock(view, version)
        layers.append(f"landlock (ABI {version})")
    else:
        missing.append("landlock (not in this kernel)")
    _refuse_new_namespaces(arch)
    layers.append("seccomp: no new namespaces")
    os.environ.update(HOME=TENANT_DIR, TMPDIR="/tmp", PATH="/usr/bin:/bin",
                      POCL_CACHE_DIR=os.path.join(TENANT_DIR, "cache"),
                      XDG_CACHE_HOME=os.path.join(TENANT_DIR, ".cache"))
    os.environ.pop("OCL_ICD_VENDORS", None)              # the copies are in /etc/OpenCL/vendors
    return Confinement(tuple(layers), tuple(missing))


def _switch_root(view: View, arch: dict) -> None:
    """A tmpfs becomes the root (mounted over /tmp, which every node has, and
    moved to / by pivot_root); the node's old root hangs at ``_OLD_ROOT``
    while the view is bound from it, then is detached for good."""
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=8m,nr_inodes=8192")
    os.mkdir("/tmp" + _OLD_ROOT)
    _check(_libc.syscall(ctypes.c_long(arch["pivot_root"]), b"/tmp", ("/tmp" + _OLD_ROOT).encode()),
           "pivot_root")
    os.chdir("/")
    # what the sandbox makes of its own first: a path of the software under
    # one of them (a venv in /tmp) is then bound into it, not hidden by it
    os.makedirs("/tmp")
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={TMP_SIZE}")
    os.makedirs("/proc")
    _mount("tmpfs", "/proc", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0555,size=64k")
    for name in PROC_FILES:
        _bind(f"/proc/{name}", f"/proc/{name}", read_only=True)
    for name in DEVICES:
        if os.path.exists(f"{_OLD_ROOT}/dev/{name}"):
            _bind(f"/dev/{name}", f"/dev/{name}", read_only=False)
    for relative, content in view.etc.items():
        os.makedirs(os.path.dirname(os.path.join("/etc", relative)), exist_ok=True)
        with open(os.path.join("/etc", relative), "wb") as handle:
            handle.write(content)
    for tree in SYS_TREES:
        if os.path.isdir(_OLD_ROOT + tree):
            _bind(tree, tree, read_only=True)
    for link, target in view.links.items():
        os.symlink(target, link)
    for path in view.read_only:
        _bind(path, path, read_only=True)
    # the tenant's directory: nosuid and nodev, but not noexec (PoCL maps its kernels from the cache)
    _bind(view.tenant_dir, TENANT_DIR, read_only=False)
    _mount(None, TENANT_DIR, None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | _locked_flags(TENANT_DIR))
    _mount(None, _OLD_ROOT, None, MS_REC | MS_PRIVATE)
    _check(_libc.umount2(_OLD_ROOT.encode(), ctypes.c_int(MNT_DETACH)), "umount the node's root")
    os.rmdir(_OLD_ROOT)
    _mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(TENANT_DIR)


def _locked_flags(path: str) -> int:
    """The flags a bind mount inherits and a user namespace may not clear
    (a remount without them is refused)."""
    flags = os.statvfs(path).f_flag
    out = 0
    for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                   (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
                   (os.ST_RELATIME, MS_RELATIME), (os.ST_RDONLY, MS_RDONLY)):
        if flags & st:
            out |= ms
    return out


def _bind(node_path: str, target: str, read_only: bool) -> None:
    """``node_path`` of the node at ``target`` in the new root.  Not
    recursive: a mount beneath the node's path stays unseen."""
    source = _OLD_ROOT + node_path
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w"):
            pass
    _mount(source, target, None, MS_BIND)
    if read_only:
        _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | _locked_flags(target))


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_capabilities() -> None:
    """None left, none to be had again (an execve as uid 0 would give them
    back without the locked securebits)."""
    _prctl(PR_SET_SECUREBITS, _SECUREBITS_LOCKED)
    for cap in range(64):
        try:
            _prctl(PR_CAPBSET_DROP, cap)
        except OSError as exc:
            if exc.errno == errno.EINVAL:       # past the kernel's last capability
                break
            raise
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(_CapHeader(_CAPABILITY_VERSION_3, 0)), data), "capset")


def _restrict_with_landlock(view: View, version: int) -> None:
    ruleset = landlock.Ruleset(version)
    ruleset.allow("/", landlock.READABLE)
    for path in view.read_only:
        ruleset.allow(path, landlock.READABLE | landlock.EXECUTE)
    for path in (TENANT_DIR, "/tmp"):
        ruleset.allow(path, landlock.WRITABLE)
    for name in DEVICES:
        if os.path.exists(f"/dev/{name}"):
            ruleset.allow(f"/dev/{name}", landlock.READ_FILE | landlock.WRITE_FILE)
    ruleset.restrict()


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _refuse_new_namespaces(arch: dict) -> None:
    """A classic-BPF seccomp filter: unshare and setns fail with EPERM,
    clone with a namespace flag too, clone3 with ENOSYS (its flags are in
    memory a filter cannot read; libc then uses clone); any other ABI on
    this CPU (x32, i386) is refused whole.  Hand-assembled: fifteen
    instructions, no libseccomp binding in the standard library."""
    ld_abs, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    # CLONE_NEWTIME (0x80) is left out: in clone()'s flags those bits are the exit signal
    clone_ns = _NAMESPACE_FLAGS
    x32 = arch["x32_bit"] or 0xFFFFFFFF
    program = [
        (ld_abs, 0, 0, 4),                       # seccomp_data.arch
        (jeq, 1, 0, arch["audit"]),
        (ret, 0, 0, eperm),
        (ld_abs, 0, 0, 0),                       # seccomp_data.nr
        (jge, 7, 0, x32),                        # x32's numbers: refused
        (jeq, 6, 0, arch["unshare"]),
        (jeq, 5, 0, arch["setns"]),
        (jeq, 6, 0, arch["clone3"]),
        (jeq, 1, 0, arch["clone"]),
        (ret, 0, 0, allow),
        (ld_abs, 0, 0, 16),                      # seccomp_data.args[0], low half: clone's flags
        (jset, 0, 1, clone_ns),
        (ret, 0, 0, eperm),
        (ret, 0, 0, allow),
        (ret, 0, 0, enosys),
    ]
    # jump offsets above count instructions after the jump
    filters = (_SockFilter * len(program))(*[_SockFilter(*insn) for insn in program])
    prog = _SockFprog(len(program), filters)
    _prctl(PR_SET_SECCOMP, 2, ctypes.byref(prog))      # SECCOMP_MODE_FILTER


#: the pool's environment variables a device process gets (nothing else:
#: the pool's environment may hold secrets, and a kernel can read its own)
_PASSED_ENV = ("PATH", "HOME", "LANG", "TZ", "TMPDIR", "XDG_CACHE_HOME", "LD_LIBRARY_PATH")
_PASSED_ENV_PREFIXES = ("LC_", "PYTHON", "POCL_", "OCL_ICD_", "OPENCL_")


def device_environment(environ, **extra) -> dict:
    """The environment of a device process: from ``environ`` (the pool's)
    only what runtimes and Python read, plus ``extra``."""
    env = {k: v for k, v in environ.items() if k in _PASSED_ENV or k.startswith(_PASSED_ENV_PREFIXES)}
    env.update(extra)
    return env


_probed: dict = {}


def probe(directory: str) -> tuple[Confinement | None, str]:
    """Can a device process be confined here?  (Confinement, "") or (None,
    why not): a throwaway process (``--check``) goes through ``confine``
    as a device process would, in an empty directory under ``directory``.
    Once per pool process: the kernel's answer does not change."""
    if "result" not in _probed:
        import tempfile
        scratch = tempfile.mkdtemp(prefix="sandbox-check-", dir=directory)
        try:
            done = subprocess.run([sys.executable, "-m", "accelmig.pool.devices.sandbox", "--check", scratch],
                                  env=device_environment(os.environ), stdin=subprocess.DEVNULL, cwd=scratch,
                                  capture_output=True, text=True, timeout=60)
            lines = done.stdout.strip().splitlines()
            answer = json.loads(lines[-1]) if lines else {}
            if done.returncode == 0 and answer.get("confined"):
                result = (Confinement(tuple(answer["layers"]), tuple(answer["missing"])), "")
            else:
                result = (None, answer.get("reason") or done.stderr.strip()[-2000:]
                          or f"the check exited with status {done.returncode}")
        except (OSError, subprocess.SubprocessError, ValueError, KeyError) as exc:
            result = (None, f"the check failed: {exc}")
        finally:
            import shutil
            shutil.rmtree(scratch, ignore_errors=True)
        _probed["result"] = result
    return _probed["result"]


def _check_from_inside() -> list[str]:
    """What the confined process itself finds wrong (nothing, normally)."""
    problems = []
    for path in ("/etc/hostname", "/etc/passwd", "/root", "/home", "/var", "/run", "/proc/self", "/proc/1"):
        if os.path.lexists(path):
            problems.append(f"{path} is visible")
    if socket.gethostname() != HOSTNAME:
        problems.append("the host name is the node's")
    probe_file = os.path.join(TENANT_DIR, ".sandbox-check")
    with open(probe_file, "w") as handle:
        handle.write("ok")
    os.unlink(probe_file)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m accelmig.pool.devices.sandbox",
        description="Check that a tenant's device process can be confined on this node: go through "
                    "the same steps in a throwaway process and print, as one JSON line, the layers "
                    "it got or why it could not.")
    parser.add_argument("--check", metavar="DIRECTORY", required=True,
                        help="an empty directory that stands for a tenant's (it is bound at /tenant)")
    args = parser.parse_args(argv)
    try:
        confinement = confine(args.check, keep_fds=(1, 2))
    except Unavailable as exc:
        print(json.dumps({"confined": False, "reason": exc.kwargs["reason"]}), flush=True)
        return 1
    problems = _check_from_inside()
    if problems:
        print(json.dumps({"confined": False, "reason": "; ".join(problems)}), flush=True)
        return 1
    print(json.dumps({"confined": True, **confinement.to_wire()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
