"""Network namespaces for tests, in the manner of pyroute2's own test fixtures.

Every namespace and link a ``NetnsFactory`` makes has a unique name (several
test runs may share a machine) and is removed at ``cleanup()`` whatever the
test did: processes started with ``popen`` are killed first (a process keeps
its namespace alive), then every namespace is deleted, which takes its veth
ends with it.  Nothing is ever made in, or routed through, the caller's own
namespace.

    factory = NetnsFactory()
    try:
        pool, host = factory.add("pool"), factory.add("host")
        link = factory.link(pool, host, "10.88.0.1/24", "10.88.0.2/24")
        factory.exec(host, ["ping", "-c1", "10.88.0.1"])
        with pool.entered():                    # this thread only
            listener = socket.create_server(("10.88.0.1", 7070))
        seen = host.call(socket.gethostbyname, "localhost")   # a forked child in host
    finally:
        factory.cleanup()

In tests use the ``netns_factory`` fixture (``tests/support/fixtures.py``).
Everything here needs root.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import ipaddress
import itertools
import os
import pickle
import re
import secrets
import select
import signal
import subprocess
import time
import traceback

from pyroute2 import IPRoute, netns as pr_netns

__all__ = ["NS", "Link", "LinkEnd", "NetnsFactory", "run_in_netns", "IFNAMSIZ"]

IFNAMSIZ = 15                    # the kernel's limit on interface names (16 with the NUL)
NETNS_DIR = "/run/netns"
_CLONE_NEWNET = 0x40000000
_IFA_F_NODAD = 0x02
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def run_in_netns(name: str, argv, **kwargs) -> subprocess.CompletedProcess:
    """``ip netns exec NAME argv…`` (which also gives the command its own
    ``/sys`` and ``/etc/netns/NAME`` files).  Defaults: ``check=True``,
    ``capture_output=True``, ``text=True``, ``timeout=60``."""
    kwargs.setdefault("check", True)
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    kwargs.setdefault("timeout", 60)
    return subprocess.run(["ip", "netns", "exec", name, *map(str, argv)], **kwargs)


@dataclasses.dataclass(frozen=True)
class NS:
    """One network namespace a factory made."""

    name: str                    # the real (unique) name under /run/netns
    label: str                   # what the test called it

    @property
    def path(self) -> str:
        return os.path.join(NETNS_DIR, self.name)

    def ipr(self) -> IPRoute:
        """An ``IPRoute`` inside this namespace: use it as ``with ns.ipr() as ipr:``."""
        return IPRoute(netns=self.name, flags=0)

    def exec(self, argv, **kwargs) -> subprocess.CompletedProcess:
        return run_in_netns(self.name, argv, **kwargs)

    @contextlib.contextmanager
    def entered(self):
        """Run the body with the CALLING THREAD in this namespace (Linux keeps
        network namespaces per thread: other threads are not affected).
        Sockets made in the body stay in this namespace after it; threads
        started in the body live in it for good."""
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            target = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(target)
            finally:
                os.close(target)
            try:
                yield self
            finally:
                try:
                    _setns(own)
                except OSError as exc:  # pragma: no cover - nothing sane is left to do
                    raise RuntimeError(f"could not return this thread from netns {self.name}: {exc}")
        finally:
            os.close(own)

    def call(self, func, *args, timeout: float = 60.0, **kwargs):
        """``func(*args, **kwargs)`` in a forked child that joined this
        namespace; its return value (or exception) comes back pickled."""
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never return into pytest
            status = 0
            try:
                os.close(read_fd)
                target = os.open(self.path, os.O_RDONLY)
                _setns(target)
                os.close(target)
                try:
                    payload = pickle.dumps((True, func(*args, **kwargs)))
                except BaseException as exc:  # noqa: BLE001 - everything goes to the parent
                    try:
                        payload = pickle.dumps((False, exc))
                    except Exception:
                        payload = pickle.dumps((False, RuntimeError(
                            f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")))
                with os.fdopen(write_fd, "wb") as out:
                    out.write(payload)
            except BaseException:  # noqa: BLE001
                status = 1
            finally:
                os._exit(status)
        os.close(write_fd)
        chunks = []
        deadline = time.monotonic() + timeout
        try:
            with os.fdopen(read_fd, "rb") as pipe:
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0 or not select.select([pipe], [], [], left)[0]:
                        raise TimeoutError(f"{getattr(func, '__name__', func)!s} in netns {self.name} "
                                           f"did not finish within {timeout} s")
                    chunk = os.read(pipe.fileno(), 1 << 16)
                    if not chunk:
                        break
                    chunks.append(chunk)
        finally:
            if not chunks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        if not chunks:
            raise RuntimeError(f"the child running {func!r} in netns {self.name} died without an answer")
        ok, value = pickle.loads(b"".join(chunks))
        if ok:
            return value
        raise value

    def __str__(self):
        return self.name


@dataclasses.dataclass(frozen=True)
class LinkEnd:
    ns: NS
    ifname: str
    cidr: str | None             # e.g. "10.88.0.1/24"

    @property
    def address(self) -> str | None:
        return str(ipaddress.ip_interface(self.cidr).ip) if self.cidr else None

    @property
    def mac(self) -> str:
        with self.ns.ipr() as ipr:
            return ipr.link("get", ifname=self.ifname)[0].get("IFLA_ADDRESS")

    @property
    def mtu(self) -> int:
        with self.ns.ipr() as ipr:
            return ipr.link("get", ifname=self.ifname)[0].get("IFLA_MTU")


@dataclasses.dataclass(frozen=True)
class Link:
    """A veth pair: ``a`` in one namespace, ``b`` in the other."""

    a: LinkEnd
    b: LinkEnd


class NetnsFactory:
    """Makes namespaces and links with unique names, and removes them all."""

    def __init__(self, prefix: str = "am"):
        self.tag = prefix + secrets.token_hex(3)     # e.g. "am3f9a1c"
        self.namespaces: list[NS] = []
        self.processes: list[subprocess.Popen] = []
        self._ids = itertools.count()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cleanup()

    # -- namespaces --------------------------------------------------------

    def add(self, label: str | None = None) -> NS:
        """A new namespace with ``lo`` up."""
        n = next(self._ids)
        label = label or f"ns{n}"
        safe = re.sub(r"[^A-Za-z0-9_.-]", "-", label)[:24]
        ns = NS(name=f"{self.tag}-{n}-{safe}", label=label)
        pr_netns.create(ns.name)
        self.namespaces.append(ns)          # registered before anything else can fail
        with ns.ipr() as ipr:
            ipr.link("set", index=1, state="up")
        return ns

    def _ifname(self, suffix: str) -> str:
        name = f"v{self.tag[2:]}{next(self._ids)}{suffix}"
        if len(name) > IFNAMSIZ:
            raise ValueError(f"interface name {name!r} is longer than {IFNAMSIZ}")
        return name

    # -- links, addresses, routes ------------------------------------------

    def link(self, ns_a: NS, ns_b: NS, addr_a_cidr: str | None = None, addr_b_cidr: str | None = None,
             *, mtu: int | None = None, mac_a: str | None = None, mac_b: str | None = None) -> Link:
        """A veth pair between two of this factory's namespaces, addressed and up."""
        for ns in (ns_a, ns_b):
            if ns not in self.namespaces:
                raise ValueError(f"{ns!r} is not a namespace of this factory")
        base = self._ifname("")
        if_a, if_b = base + "a", base + "b"
        with ns_a.ipr() as ipr:
            ipr.link("add", ifname=if_a, kind="veth", peer={"ifname": if_b, "net_ns_fd": ns_b.name})
        for ns, ifname, cidr, mac in ((ns_a, if_a, addr_a_cidr, mac_a), (ns_b, if_b, addr_b_cidr, mac_b)):
            self._setup_link(ns, ifname, cidr, mtu, mac)
        return Link(LinkEnd(ns_a, if_a, addr_a_cidr), LinkEnd(ns_b, if_b, addr_b_cidr))

    def _setup_link(self, ns: NS, ifname: str, cidr: str | None, mtu: int | None, mac: str | None):
        with ns.ipr() as ipr:
            index = ipr.link_lookup(ifname=ifname)[0]
            settings = {}
            if mtu is not None:
                settings["mtu"] = mtu
            if mac is not None:
                settings["address"] = mac
            if settings:
                ipr.link("set", index=index, **settings)
            if cidr:
                self._add_address(ipr, index, cidr)
            ipr.link("set", index=index, state="up")

    @staticmethod
    def _add_address(ipr, index: int, cidr: str) -> None:
        iface = ipaddress.ip_interface(cidr)
        extra = {"flags": _IFA_F_NODAD} if iface.version == 6 else {}
        ipr.addr("add", index=index, address=str(iface.ip), prefixlen=iface.network.prefixlen, **extra)

    def address(self, ns: NS, ifname: str, cidr: str) -> None:
        """One more address on an interface (``"lo"`` works too)."""
        with ns.ipr() as ipr:
            self._add_address(ipr, ipr.link_lookup(ifname=ifname)[0], cidr)

    def route(self, ns: NS, dst: str, via: str) -> None:
        """``dst`` (a CIDR, or ``"default"``) through the gateway ``via``."""
        gateway = ipaddress.ip_address(via)
        if dst == "default":
            dst = "0.0.0.0/0" if gateway.version == 4 else "::/0"
        net = ipaddress.ip_network(dst, strict=False)
        with ns.ipr() as ipr:
            ipr.route("add", dst=str(net.network_address), dst_len=net.prefixlen, gateway=str(gateway),
                      family=10 if net.version == 6 else 2)

    def bridge(self, ns: NS, cidr: str | None = None, *, mac: str | None = None,
               mtu: int | None = None, ports: tuple[str, ...] = ()) -> str:
        """A bridge in ``ns`` (set its MAC: a bridge with none takes a port's),
        with ``ports`` (interface names in ``ns``) enslaved; returns its name."""
        name = self._ifname("br")
        with ns.ipr() as ipr:
            ipr.link("add", ifname=name, kind="bridge")
            index = ipr.link_lookup(ifname=name)[0]
            for port in ports:
                ipr.link("set", index=ipr.link_lookup(ifname=port)[0], master=index)
        self._setup_link(ns, name, cidr, mtu, mac)
        return name

    def forwarding(self, ns: NS, enable: bool = True) -> None:
        """IPv4 forwarding in ``ns`` (``/proc/sys/net`` is per namespace)."""
        ns.call(_write, "/proc/sys/net/ipv4/ip_forward", "1" if enable else "0")

    # -- processes ---------------------------------------------------------

    def exec(self, ns: NS, argv, **popen) -> subprocess.CompletedProcess:
        """Run ``argv`` to completion in ``ns`` (see ``run_in_netns``)."""
        return run_in_netns(ns.name, argv, **popen)

    def popen(self, ns: NS, argv, **popen) -> subprocess.Popen:
        """Start ``argv`` in ``ns`` in its own session; killed at cleanup."""
        popen.setdefault("start_new_session", True)
        proc = subprocess.Popen(["ip", "netns", "exec", ns.name, *map(str, argv)], **popen)
        self.processes.append(proc)
        return proc

    # -- teardown ----------------------------------------------------------

    def cleanup(self) -> None:
        """Kill what ``popen`` started, delete every namespace (and so every
        veth end in them).  Safe to call twice; raises at the end if
        something could not be removed."""
        problems = []
        for proc in self.processes:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                problems.append(f"process {proc.pid} ({proc.args!r}) did not die")
        self.processes.clear()
        problems += _kill_processes_inside([ns.path for ns in self.namespaces])
        for ns in reversed(self.namespaces):
            try:
                pr_netns.remove(ns.name)
            except FileNotFoundError:
                pass
            except OSError as exc:
                problems.append(f"netns {ns.name}: {exc}")
        self.namespaces.clear()
        if problems:
            raise RuntimeError("netns cleanup incomplete: " + "; ".join(problems))

    def leftovers(self) -> list[str]:
        """Namespaces with this factory's tag that still exist (should be none after cleanup)."""
        try:
            return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(self.tag + "-"))
        except FileNotFoundError:
            return []


def _kill_processes_inside(paths: list[str], timeout: float = 10.0) -> list[str]:
    """SIGKILL every other process whose network namespace is one of ``paths``
    (however it got there): a process keeps its namespace, and the links in
    it, alive after the name is removed."""
    wanted = set()
    for path in paths:
        with contextlib.suppress(OSError):
            wanted.add(f"net:[{os.stat(path).st_ino}]")

    def inside() -> list[int]:
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{entry}/ns/net") in wanted:
                        pids.append(int(entry))
        return pids

    if not wanted:
        return []
    deadline = time.monotonic() + timeout
    while pids := inside():
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            return [f"processes {pids} would not leave the test namespaces"]
        time.sleep(0.05)
    return []


def _write(path: str, value: str) -> None:
    with open(path, "w") as handle:
        handle.write(value)
