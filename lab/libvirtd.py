"""One lab hypervisor host's libvirt daemon: a real ``libvirtd`` in the
host's network namespace plus its own mount and UTS namespace.

Why each piece (measured, docs/lab-notes.md):

- libvirt's state paths are fixed, so every daemon gets its own directories
  bind-mounted over ``/etc/libvirt``, ``/run/libvirt``, ``/var/lib/libvirt``,
  ``/var/cache/libvirt`` and ``/var/log/libvirt`` inside a private mount
  namespace (``unshare --mount --uts --propagation private``).  The mounts
  die with the namespace: stopping the daemon unmounts everything.  Where a
  fixed path is absent (a fresh machine: libvirt-daemon without -system has
  no /run/libvirt, /var/lib/libvirt, ...) the reaper creates it, empty.
- libvirt refuses a migration "to the same host" by host UUID: each daemon
  has its own ``host_uuid``; its own hostname keeps logs readable.
- ``listen_tls = 0`` (else ``--listen`` wants certificates), ``listen_tcp =
  1`` with ``auth_tcp = "none"`` (a test rig inside private namespaces only),
  ``stdio_handler = "file"`` (there is no virtlogd), no cgroups, no QEMU
  namespaces, no security driver, root-owned QEMU.
- Debian's QEMU driver looks up the ``libvirt-qemu`` user before it reads
  qemu.conf: the daemon sees private copies of /etc/passwd and /etc/group
  that have it, so the machine's own files stay untouched.
- The daemon runs under :mod:`accelmig.lab.reaper`, a child subreaper
  that reaps QEMU at once (halves migration time here).
- QEMU's capabilities cache is copied between nodes (daemon start 1.5 s ->
  0.2 s): libvirt validates it and re-probes if QEMU or libvirt changed.

Clients need not enter any namespace: ``qemu+unix:///system?socket=<node
run dir>/libvirt-sock``; per-domain files the daemon names by its own paths
(channel sockets, logs) are found from the root namespace with
:meth:`LibvirtNode.host_path`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid as uuidlib
from pathlib import Path

import libvirt

from accelmig.runtime.files import atomic_write

from . import machine
from .netns import exec_argv

LOG = logging.getLogger("accelmig.lab.libvirtd")

LIBVIRTD = "/usr/sbin/libvirtd"
REAPER = Path(__file__).with_name("reaper.py")

#: libvirt's fixed paths -> the node's own subdirectory.
LIBVIRT_DIRS = {
    "/etc/libvirt": "etc",
    "/run/libvirt": "run",
    "/var/lib/libvirt": "lib",
    "/var/cache/libvirt": "cache",
    "/var/log/libvirt": "log",
}

QEMU_USER = "libvirt-qemu"
QEMU_UID = 64055      # Debian's usual static-looking id; only used in the private copies


def _quiet_libvirt():
    """libvirt-python prints every error to stderr by default; the lab reports
    errors itself (the exceptions carry the same text)."""
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)


_quiet_libvirt()


def proc_starttime(pid: int) -> int | None:
    """A process's start time (clock ticks since boot): with the PID, an
    identity that survives PID reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def same_process(pid: int | None, starttime: int | None) -> bool:
    """True while ``pid`` is still the process we started (not reused, not a zombie)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    if fields[0] == "Z":
        return False
    return starttime is None or int(fields[19]) == starttime


def stop_process(pid: int | None, starttime: int | None, *, timeout: float = 10.0,
                 sig: int = signal.SIGTERM, popen: subprocess.Popen | None = None) -> bool:
    """Stop one process by PID (verified by start time), SIGKILL after
    ``timeout``.  Returns whether it was running."""
    if not same_process(pid, starttime):
        if popen is not None:
            popen.poll()
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if popen is not None and popen.poll() is not None:
            return True
        if not same_process(pid, starttime):
            return True
        time.sleep(0.02)
    LOG.warning("process %d did not stop in %.0f s: SIGKILL", pid, timeout)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if popen is not None:
        popen.wait(5)
    return True


@dataclasses.dataclass
class LibvirtNode:
    """A libvirt daemon for one lab host.

    ``root`` holds the node's directories; ``netns`` is the host's network
    namespace (``None``: the root namespace, then give each node its own
    ``tcp_port``).
    """

    name: str                          # hostA
    root: Path
    netns: str | None
    hostname: str
    host_uuid: str = dataclasses.field(default_factory=lambda: str(uuidlib.uuid4()))
    tcp_port: int = 16509
    migration_ports: tuple[int, int] = (49152, 49215)
    etc_hosts: str | None = None       # a private /etc/hosts for the daemon
    caps_cache: Path | None = None     # shared QEMU capabilities cache
    pid: int | None = None             # libvirtd
    pid_starttime: int | None = None
    reaper_pid: int | None = None
    reaper_starttime: int | None = None
    _popen: subprocess.Popen | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        self.root = Path(self.root)

    # ------------------------------------------------------------ paths

    def dir(self, libvirt_path: str) -> Path:
        """The node's own directory behind one of libvirt's fixed paths."""
        return self.root / LIBVIRT_DIRS[libvirt_path]

    def host_path(self, path: str) -> Path:
        """A path as the daemon (and its QEMUs) see it -> the same file seen
        from the root mount namespace (e.g. a channel socket)."""
        for fixed, sub in LIBVIRT_DIRS.items():
            if path == fixed or path.startswith(fixed + "/"):
                return self.root / sub / os.path.relpath(path, fixed)
        return machine.host_path(self.root, path)

    @property
    def socket(self) -> Path:
        return self.dir("/run/libvirt") / "libvirt-sock"

    @property
    def uri(self) -> str:
        """The URI a client in any namespace uses (plain virsh too)."""
        return f"qemu+unix:///system?socket={self.socket}"

    def tcp_uri(self, address: str) -> str:
        """The URI another node's daemon uses for a peer-to-peer migration."""
        port = "" if self.tcp_port == 16509 else f":{self.tcp_port}"
        return f"qemu+tcp://{address}{port}/system"

    @property
    def hooks_dir(self) -> Path:
        """``/etc/libvirt/hooks/qemu.d`` of this node (where accelmig's hook
        is installed; send SIGHUP via :meth:`reload` after installing one)."""
        return self.dir("/etc/libvirt") / "hooks" / "qemu.d"

    @property
    def log_file(self) -> Path:
        return self.dir("/var/log/libvirt") / "libvirtd.log"

    @property
    def stderr_file(self) -> Path:
        return self.root / "libvirtd.stderr"

    @property
    def pid_file(self) -> Path:
        return self.dir("/run/libvirt") / "libvirtd.pid"

    def qemu_log(self, domain: str) -> Path:
        return self.dir("/var/log/libvirt") / "qemu" / f"{domain}.log"

    # ------------------------------------------------------------ config

    def libvirtd_conf(self) -> str:
        return "\n".join([
            "# accelmig lab node (generated): a test rig inside private namespaces.",
            f'host_uuid = "{self.host_uuid}"',
            "listen_tls = 0",
            "listen_tcp = 1",
            f'tcp_port = "{self.tcp_port}"',
            'auth_tcp = "none"',
            'auth_unix_rw = "none"',
            'auth_unix_ro = "none"',
            'unix_sock_rw_perms = "0700"',
            'log_outputs = "3:file:/var/log/libvirt/libvirtd.log"',
            "",
        ])

    def qemu_conf(self) -> str:
        low, high = self.migration_ports
        return "\n".join([
            "# accelmig lab node (generated).",
            'stdio_handler = "file"',
            'user = "root"',
            'group = "root"',
            "dynamic_ownership = 0",
            "remember_owner = 0",
            'security_driver = "none"',
            "namespaces = [ ]",
            "cgroup_controllers = [ ]",
            f"migration_port_min = {low}",
            f"migration_port_max = {high}",
            "",
        ])

    def prepare(self):
        """Create the node's directories and configuration files."""
        for sub in LIBVIRT_DIRS.values():
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        machine.prepare(self.root)
        (self.dir("/var/log/libvirt") / "qemu").mkdir(exist_ok=True)
        self.hooks_dir.mkdir(parents=True, exist_ok=True)
        etc = self.dir("/etc/libvirt")
        (etc / "libvirtd.conf").write_text(self.libvirtd_conf())
        (etc / "qemu.conf").write_text(self.qemu_conf())
        for name in ("libvirt.conf", "libvirt-admin.conf"):
            if Path("/etc/libvirt", name).is_file() and not (etc / name).exists():
                shutil.copy2(Path("/etc/libvirt", name), etc / name)
        self._write_accounts()
        if self.etc_hosts is not None:
            (self.root / "hosts").write_text(self.etc_hosts)
        if self.caps_cache and self.caps_cache.is_dir():
            target = self.dir("/var/cache/libvirt") / "qemu" / "capabilities"
            target.mkdir(parents=True, exist_ok=True)
            for xml in self.caps_cache.glob("*.xml"):
                shutil.copy2(xml, target / xml.name)

    def _write_accounts(self):
        """Private /etc/passwd and /etc/group with the libvirt-qemu user."""
        passwd = Path("/etc/passwd").read_text()
        group = Path("/etc/group").read_text()
        if not any(line.split(":")[0] == QEMU_USER for line in passwd.splitlines()):
            passwd += f"{QEMU_USER}:x:{QEMU_UID}:{QEMU_UID}:Libvirt Qemu (accelmig lab):/var/lib/libvirt:/usr/sbin/nologin\n"
        names = {line.split(":")[0] for line in group.splitlines() if line}
        for name, gid in ((QEMU_USER, QEMU_UID), ("kvm", QEMU_UID + 1)):
            if name not in names:
                group += f"{name}:x:{gid}:\n"
        # root's home is node-private: the ssh client of this node's daemon
        # (qemu+ssh migrations) keeps its key and known hosts there (lab/ssh.py)
        from .ssh import with_root_home
        (self.root / "passwd").write_text(with_root_home(passwd))
        (self.root / "group").write_text(group)

    # ------------------------------------------------------------ run

    def command(self) -> list[str]:
        # the node's own /etc first (lab/machine.py); libvirt's paths and
        # the account files on top of it
        binds = [(self.root / sub, fixed) for fixed, sub in LIBVIRT_DIRS.items()]
        binds += [(self.root / "passwd", "/etc/passwd"), (self.root / "group", "/etc/group")]
        if self.etc_hosts is not None:
            binds.append((self.root / "hosts", "/etc/hosts"))
        inner = [sys.executable, "-I", "-S", str(REAPER), "--hostname", self.hostname,
                 *machine.reaper_args(self.root, binds)]
        inner += ["--", LIBVIRTD, "--listen", "--pid-file", "/run/libvirt/libvirtd.pid"]
        unshare = ["unshare", "--mount", "--uts", "--propagation", "private", *inner]
        return exec_argv(self.netns, unshare) if self.netns else unshare

    def start(self) -> int:
        """Start the daemon (returns the reaper's PID at once; then
        :meth:`wait_ready`)."""
        if not Path(LIBVIRTD).exists():
            raise RuntimeError(f"{LIBVIRTD} is missing: apt-get install libvirt-daemon libvirt-daemon-driver-qemu")
        self.prepare()
        absent = [fixed for fixed in LIBVIRT_DIRS if not os.path.lexists(fixed)]
        if absent:
            # the reaper creates them right before its bind mounts (lab/reaper.py)
            LOG.info("libvirtd of %s: creating libvirt's absent directories %s (mode 0755, left "
                     "in place, empty)", self.name, ", ".join(absent))
        try:
            self.pid_file.unlink()
        except FileNotFoundError:
            pass
        stderr = open(self.stderr_file, "ab")
        # Its own session: a Ctrl-C meant for the caller's terminal must not
        # take the daemon down halfway; stop() ends it.
        self._popen = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=stderr,
                                       stderr=stderr, start_new_session=True, close_fds=True)
        stderr.close()
        # `ip netns exec` and `unshare` exec (they do not fork): this PID is the reaper's.
        self.reaper_pid = self._popen.pid
        self.reaper_starttime = proc_starttime(self.reaper_pid)
        return self.reaper_pid

    def wait_ready(self, timeout: float = 30.0) -> float:
        """Wait until the daemon answers on its unix socket; seconds waited."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        last = None
        while time.monotonic() < deadline:
            if self._popen is not None and self._popen.poll() is not None:
                raise RuntimeError(f"libvirtd of {self.name} exited with {self._popen.returncode}: "
                                   f"{self.tail()}")
            if self._popen is None and not same_process(self.reaper_pid, self.reaper_starttime):
                raise RuntimeError(f"libvirtd of {self.name} is not running: {self.tail()}")
            if self.socket.exists():
                try:
                    conn = libvirt.open(self.uri)
                except libvirt.libvirtError as exc:
                    last = exc
                else:
                    try:
                        conn.getHostname()
                    finally:
                        conn.close()
                    self._read_pid()
                    return time.monotonic() - t0
            time.sleep(0.02)
        raise TimeoutError(f"libvirtd of {self.name} did not answer within {timeout:.0f} s "
                           f"({last}); {self.tail()}")

    def _read_pid(self):
        for _ in range(100):
            try:
                self.pid = int(self.pid_file.read_text().strip())
                self.pid_starttime = proc_starttime(self.pid)
                return
            except (FileNotFoundError, ValueError):
                time.sleep(0.01)

    def save_caps_cache(self):
        """Copy QEMU's capabilities cache out for the next node to start fast."""
        if not self.caps_cache:
            return
        source = self.dir("/var/cache/libvirt") / "qemu" / "capabilities"
        xmls = list(source.glob("*.xml"))
        if not xmls:
            return
        self.caps_cache.mkdir(parents=True, exist_ok=True)
        for xml in xmls:
            target = self.caps_cache / xml.name
            if not target.exists() or target.read_bytes() != xml.read_bytes():
                tmp = target.with_suffix(f".tmp{os.getpid()}")
                shutil.copy2(xml, tmp)
                os.replace(tmp, target)

    def tail(self, lines: int = 15) -> str:
        out = []
        for path in (self.stderr_file, self.log_file):
            try:
                text = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            if text:
                out.append(f"--- {path}:\n" + "\n".join(text))
        return "\n".join(out) or "(no log)"

    def connect(self) -> libvirt.virConnect:
        return libvirt.open(self.uri)

    def running(self) -> bool:
        return same_process(self.reaper_pid, self.reaper_starttime)

    def reload(self):
        """SIGHUP libvirtd: it re-reads its config and re-detects hooks."""
        if same_process(self.pid, self.pid_starttime):
            os.kill(self.pid, signal.SIGHUP)

    def install_hook(self, name: str, text: str, settle: float = 0.3) -> Path:
        """Install an executable script in this node's hooks/qemu.d and make
        libvirtd see it (it looks for hooks at start and on SIGHUP; the
        reload is handled asynchronously, hence ``settle``)."""
        if "/" in name or name.startswith("."):
            raise ValueError(f"hook name {name!r}: a plain file name")
        self.hooks_dir.mkdir(parents=True, exist_ok=True)
        path = self.hooks_dir / name
        atomic_write(path, text, 0o755, durable=False)     # the lab's: rewritten on every start
        self.reload()
        time.sleep(settle)
        return path

    def stop(self, timeout: float = 15.0):
        """Stop the daemon by PID: SIGTERM libvirtd (the reaper then ends
        leftover QEMUs and exits, taking the mount namespace with it)."""
        t0 = time.monotonic()
        if same_process(self.pid, self.pid_starttime):
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        elif same_process(self.reaper_pid, self.reaper_starttime):
            # libvirtd's PID unknown (a crash before it was recorded): the
            # reaper forwards SIGTERM.
            os.kill(self.reaper_pid, signal.SIGTERM)
        stop_process(self.reaper_pid, self.reaper_starttime, timeout=timeout, sig=0, popen=self._popen)
        if same_process(self.pid, self.pid_starttime):
            stop_process(self.pid, self.pid_starttime, timeout=1.0, sig=signal.SIGKILL)
        if self._popen is not None:
            self._popen.poll()
        LOG.info("libvirtd of %s stopped in %.2f s", self.name, time.monotonic() - t0)

    def state(self) -> dict:
        return {"name": self.name, "root": str(self.root), "netns": self.netns, "hostname": self.hostname,
                "host_uuid": self.host_uuid, "tcp_port": self.tcp_port,
                "pid": self.pid, "pid_starttime": self.pid_starttime,
                "reaper_pid": self.reaper_pid, "reaper_starttime": self.reaper_starttime,
                "uri": self.uri}
