"""Network namespaces for tests: a thin layer on the lab's toolkit
(:mod:`accelmig.lab.netns`, pyroute2) that names and tracks what a test makes.

Every namespace and link a ``NetnsFactory`` makes has a unique name (several
test runs may share a machine) and is removed at ``cleanup()`` whatever the
test did: processes started with ``popen`` are killed first, then every
other process still inside (a process keeps its namespace alive), then
every namespace is deleted, which takes its veth ends with it.  Nothing is
ever made in, or routed through, the caller's own namespace.

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

from pyroute2 import IPRoute

from accelmig.lab import netns

__all__ = ["NS", "Link", "LinkEnd", "NetnsFactory", "run_in_netns"]


def run_in_netns(name: str, argv, **kwargs) -> subprocess.CompletedProcess:
    """``ip netns exec NAME argv…``.  Defaults: ``check=True``,
    ``capture_output=True``, ``text=True``, ``timeout=60``."""
    kwargs.setdefault("check", True)
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    kwargs.setdefault("timeout", 60)
    return subprocess.run(netns.exec_argv(name, argv), **kwargs)


@dataclasses.dataclass(frozen=True)
class NS:
    """One network namespace a factory made."""

    name: str                    # the real (unique) name under /run/netns
    label: str                   # what the test called it

    @property
    def path(self) -> str:
        return str(netns.path(self.name))

    def ipr(self) -> IPRoute:
        """An ``IPRoute`` inside this namespace: use it as ``with ns.ipr() as ipr:``."""
        return netns.ipr(self.name)

    def exec(self, argv, **kwargs) -> subprocess.CompletedProcess:
        return run_in_netns(self.name, argv, **kwargs)

    def entered(self):
        """The calling thread in this namespace for the body (see ``netns.entered``)."""
        return netns.entered(self.name)

    def call(self, func, *args, timeout: float = 60.0, **kwargs):
        """``func(*args, **kwargs)`` in a forked child that joined this
        namespace; its return value (or exception) comes back pickled."""
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never return into pytest
            status = 0
            try:
                os.close(read_fd)
                with netns.entered(self.name):
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
        self.namespaces.append(ns)          # registered first: cleanup() removes even a half-made one
        netns.create(ns.name)
        return ns

    def _ifname(self, suffix: str) -> str:
        # veth() checks the length against the kernel's limit
        return f"v{self.tag[2:]}{next(self._ids)}{suffix}"

    # -- links, addresses, routes ------------------------------------------

    def link(self, ns_a: NS, ns_b: NS, addr_a_cidr: str | None = None, addr_b_cidr: str | None = None,
             *, mtu: int | None = None, mac_a: str | None = None, mac_b: str | None = None) -> Link:
        """A veth pair between two of this factory's namespaces, addressed and up."""
        for ns in (ns_a, ns_b):
            if ns not in self.namespaces:
                raise ValueError(f"{ns!r} is not a namespace of this factory")
        base = self._ifname("")
        if_a, if_b = base + "a", base + "b"
        netns.veth(ns_a.name, if_a, ns_b.name, if_b)
        for ns, ifname, cidr, mac in ((ns_a, if_a, addr_a_cidr, mac_a), (ns_b, if_b, addr_b_cidr, mac_b)):
            with ns.ipr() as ipr:
                netns.set_link(ipr, ifname, mtu=mtu, mac=mac, up=False)
                if cidr:
                    netns.address(ipr, ifname, cidr)
                netns.set_link(ipr, ifname)
        return Link(LinkEnd(ns_a, if_a, addr_a_cidr), LinkEnd(ns_b, if_b, addr_b_cidr))

    def address(self, ns: NS, ifname: str, cidr: str) -> None:
        """One more address on an interface (``"lo"`` works too)."""
        with ns.ipr() as ipr:
            netns.address(ipr, ifname, cidr)

    def route(self, ns: NS, dst: str, via: str) -> None:
        """``dst`` (a CIDR, or ``"default"``) through the gateway ``via``."""
        with ns.ipr() as ipr:
            netns.route(ipr, dst, via)

    def forwarding(self, ns: NS, enable: bool = True) -> None:
        """IPv4 forwarding in ``ns``."""
        netns.forwarding(ns.name, enable)

    # -- processes ---------------------------------------------------------

    def exec(self, ns: NS, argv, **popen) -> subprocess.CompletedProcess:
        """Run ``argv`` to completion in ``ns`` (see ``run_in_netns``)."""
        return run_in_netns(ns.name, argv, **popen)

    def popen(self, ns: NS, argv, **popen) -> subprocess.Popen:
        """Start ``argv`` in ``ns`` in its own session; killed at cleanup."""
        popen.setdefault("start_new_session", True)
        proc = subprocess.Popen(netns.exec_argv(ns.name, argv), **popen)
        self.processes.append(proc)
        return proc

    # -- teardown ----------------------------------------------------------

    def cleanup(self) -> None:
        """Kill what ``popen`` started and whatever else is inside, delete
        every namespace (and so every veth end in them).  Safe to call twice;
        raises at the end if something could not be removed."""
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
        stuck = netns.stop_processes_inside([ns.name for ns in self.namespaces], term_timeout=0)
        if stuck:
            problems.append(f"processes {stuck} would not leave the test namespaces")
        for ns in reversed(self.namespaces):
            try:
                netns.remove(ns.name)
            except OSError as exc:
                problems.append(f"netns {ns.name}: {exc}")
        self.namespaces.clear()
        if problems:
            raise RuntimeError("netns cleanup incomplete: " + "; ".join(problems))

    def leftovers(self) -> list[str]:
        """Namespaces with this factory's tag that still exist (should be none after cleanup)."""
        return sorted(n for n in netns.names() if n.startswith(self.tag + "-"))
