"""Network namespaces on pyroute2: the one toolkit of the lab and the tests.

- namespaces: :func:`create` (``lo`` up), :func:`remove`, :func:`names`,
  :func:`path`, and :func:`ipr`, an ``IPRoute`` inside one;
- links, on such an ``IPRoute``: :func:`veth` (its peer put straight into
  another namespace: nothing is ever made in the caller's own), :func:`bridge`,
  :func:`set_link`, :func:`address`, :func:`route` (and :func:`index`,
  :func:`has_link`);
- per-namespace sysctls (:func:`sysctl`, :func:`forwarding`): ``/proc/sys/net``
  belongs to the namespace of whoever opens it;
- entering: :func:`entered` moves the calling thread only (Linux keeps the
  network namespace per thread), :func:`in_thread` runs a function in a
  fresh thread inside; both use pyroute2's own ``setns``;
- the processes inside a namespace, found by namespace inode (never by
  process name): :func:`pids_inside`, :func:`stop_processes_inside` (a
  process keeps its namespace, and the links in it, alive after the name is
  gone);
- ``/run/netns`` itself: creating the first namespace makes it a mount point
  (as ``ip netns add`` does); :func:`netns_dir_state` and
  :func:`restore_netns_dir` undo that.

Every operation is idempotent where the lab needs it to be (``Topology.up()``
completes a half-built topology).  Everything here needs root.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from pyroute2 import IPRoute
from pyroute2 import netns as pr_netns
from pyroute2.netlink.exceptions import NetlinkError

LOG = logging.getLogger("accelmig.lab.netns")

NETNS_DIR = Path("/run/netns")
IFNAMSIZ = 15                    # the kernel's limit on interface names (16 with the NUL)
_IFA_F_NODAD = 0x02              # an IPv6 address usable at once, without duplicate detection


# ---------------------------------------------------------------- namespaces

def path(name: str) -> Path:
    return NETNS_DIR / name


def names() -> list[str]:
    """Every named network namespace on this machine."""
    return pr_netns.listnetns()


def create(name: str) -> None:
    """A new namespace with ``lo`` up."""
    pr_netns.create(name)
    with ipr(name) as handle:
        handle.link("set", index=index(handle, "lo"), state="up")


def remove(name: str) -> None:
    """Remove a namespace (its links and bridges go with it); absent is fine."""
    try:
        pr_netns.remove(name)
    except FileNotFoundError:
        pass


def ipr(name: str) -> IPRoute:
    """An ``IPRoute`` inside namespace ``name``: ``with netns.ipr(name) as ipr:``."""
    return IPRoute(netns=name, flags=0)


def exec_argv(name: str, argv) -> list[str]:
    """``argv`` run inside ``name`` by ``ip netns exec``, which also gives the
    command that namespace's ``/sys`` and ``/etc/netns/NAME`` files."""
    return ["ip", "netns", "exec", name, *map(str, argv)]


# ---------------------------------------------------------------- links

def has_link(handle: IPRoute, ifname: str) -> bool:
    return bool(handle.link_lookup(ifname=ifname))


def index(handle: IPRoute, ifname: str) -> int:
    found = handle.link_lookup(ifname=ifname)
    if not found:
        raise LookupError(f"no interface {ifname!r} in this namespace")
    return found[0]


def veth(ns_a: str, if_a: str, ns_b: str, if_b: str) -> None:
    """A veth pair, ``if_a`` in ``ns_a`` and ``if_b`` in ``ns_b`` (made inside
    ``ns_a``, the peer placed straight into ``ns_b``); kept if ``if_a`` exists."""
    for ifname in (if_a, if_b):
        if len(ifname) > IFNAMSIZ:
            raise ValueError(f"interface name {ifname!r} is longer than {IFNAMSIZ}")
    with ipr(ns_a) as handle:
        if not has_link(handle, if_a):
            handle.link("add", ifname=if_a, kind="veth", peer={"ifname": if_b, "net_ns_fd": ns_b})


def bridge(handle: IPRoute, name: str, *, mac: str | None = None, ports=()) -> int:
    """A bridge (kept if it exists) with ``ports`` enslaved; returns its index.
    Give it a MAC: a bridge without one takes a port's, and two hosts' bridges
    whose ports came from the same guest MAC end up alike (docs/lab-notes.md)."""
    if not has_link(handle, name):
        handle.link("add", ifname=name, kind="bridge")
    bridge_index = index(handle, name)
    if mac is not None:
        handle.link("set", index=bridge_index, address=mac)
    for port in ports:
        handle.link("set", index=index(handle, port), master=bridge_index)
    return bridge_index


def set_link(handle: IPRoute, ifname: str, *, mtu: int | None = None, mac: str | None = None,
             up: bool = True) -> None:
    """MTU and MAC (when given), then the link up."""
    link_index = index(handle, ifname)
    settings = {k: v for k, v in (("mtu", mtu), ("address", mac)) if v is not None}
    if settings:
        handle.link("set", index=link_index, **settings)
    if up:
        handle.link("set", index=link_index, state="up")


def address(handle: IPRoute, ifname: str, cidr: str) -> None:
    """Add ``cidr`` (``10.88.0.1/24``, ``fd00::1/64``) to ``ifname``; already there is fine."""
    iface = ipaddress.ip_interface(cidr)
    extra = {"flags": _IFA_F_NODAD} if iface.version == 6 else {}
    try:
        handle.addr("add", index=index(handle, ifname), address=str(iface.ip),
                    prefixlen=iface.network.prefixlen, **extra)
    except NetlinkError as exc:
        if exc.code != errno.EEXIST:
            raise


def route(handle: IPRoute, dst: str, via: str) -> None:
    """``dst`` (a CIDR, or ``"default"``) through the gateway ``via`` (replacing any)."""
    gateway = ipaddress.ip_address(via)
    if dst == "default":
        dst = "0.0.0.0/0" if gateway.version == 4 else "::/0"
    net = ipaddress.ip_network(dst, strict=False)
    handle.route("replace", dst=str(net.network_address), dst_len=net.prefixlen, gateway=str(gateway),
                 family=10 if net.version == 6 else 2)


# ---------------------------------------------------------------- entering

@contextlib.contextmanager
def entered(name: str):
    """Run the body with the CALLING THREAD in namespace ``name`` (other
    threads are not affected).  Sockets made in the body stay in that
    namespace after it; threads started in the body live in it for good."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        pr_netns.setns(str(path(name)), flags=0)
        try:
            yield
        finally:
            try:
                pr_netns.setns(own)
            except OSError as exc:  # pragma: no cover - nothing sane is left to do
                raise RuntimeError(f"could not return this thread from netns {name}: {exc}") from exc
    finally:
        os.close(own)


def in_thread(name: str, func, *args):
    """``func(*args)`` in a fresh thread inside namespace ``name``; its value
    or its exception comes back.  The caller's own thread never moves."""
    result: dict = {}

    def target():
        try:
            with entered(name):
                result["value"] = func(*args)
        except BaseException as exc:   # handed to the caller
            result["error"] = exc

    thread = threading.Thread(target=target, name=f"netns-{name}")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result.get("value")


def _write_sysctls(values: dict[str, str]) -> None:
    for key, value in values.items():
        sysctl_path = Path("/proc/sys") / key.replace(".", "/")
        if sysctl_path.exists():
            sysctl_path.write_text(value)


def sysctl(name: str, values: dict[str, str]) -> None:
    """Set ``net.*`` sysctls of namespace ``name`` (those this kernel has)."""
    in_thread(name, _write_sysctls, values)


def forwarding(name: str, enable: bool = True) -> None:
    """IPv4 forwarding in namespace ``name``."""
    sysctl(name, {"net.ipv4.ip_forward": "1" if enable else "0"})


# ---------------------------------------------------------------- processes inside

def _alive(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def pids_inside(namespaces) -> list[int]:
    """Every other living process whose network namespace is one of
    ``namespaces`` (names), however it got there: found by namespace inode."""
    wanted = set()
    for name in namespaces:
        with contextlib.suppress(OSError):
            st = os.stat(path(name))
            wanted.add((st.st_dev, st.st_ino))
    if not wanted:
        return []
    me = os.getpid()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        with contextlib.suppress(OSError):
            st = os.stat(f"/proc/{entry}/ns/net")
            if (st.st_dev, st.st_ino) in wanted and _alive(int(entry)):
                pids.append(int(entry))
    return pids


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def stop_processes_inside(namespaces, *, term_timeout: float = 5.0, kill_timeout: float = 10.0) -> list[int]:
    """SIGTERM every process inside ``namespaces``, SIGKILL what is left after
    ``term_timeout`` (0: SIGKILL at once), and wait up to ``kill_timeout`` for
    them to go.  Returns the PIDs that would not leave (none, normally)."""
    namespaces = list(namespaces)
    victims = pids_inside(namespaces)
    if term_timeout > 0:
        for pid in victims:
            LOG.info("SIGTERM %d (still inside %s)", pid, ", ".join(namespaces))
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + term_timeout
        while victims and time.monotonic() < deadline:
            time.sleep(0.05)
            victims = pids_inside(namespaces)
        if victims:
            LOG.warning("SIGKILL %s (did not stop on SIGTERM)", victims)
    deadline = time.monotonic() + kill_timeout
    while victims:
        for pid in victims:
            _signal(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            return victims
        time.sleep(0.05)
        victims = pids_inside(namespaces)
    return []


# ---------------------------------------------------------------- /run/netns

def _is_mountpoint(target: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(target) for line in f)


def netns_dir_state() -> dict:
    """Whether /run/netns exists and is a mount point now."""
    return {"exists": NETNS_DIR.is_dir(), "mounted": _is_mountpoint(NETNS_DIR)}


def restore_netns_dir(before: dict) -> None:
    """Undo what creating the first namespace did to /run/netns, but only when
    it was not there before and no namespace (ours or anyone's) is left."""
    if not NETNS_DIR.is_dir() or any(NETNS_DIR.iterdir()):
        return
    if not before.get("mounted"):
        while _is_mountpoint(NETNS_DIR):   # a self bind mount can be stacked
            done = subprocess.run(["umount", str(NETNS_DIR)], capture_output=True, text=True)
            if done.returncode != 0:       # someone created a namespace just now: theirs to keep
                LOG.info("leaving %s mounted: %s", NETNS_DIR, done.stderr.strip())
                return
    if not before.get("exists"):
        with contextlib.suppress(OSError):
            NETNS_DIR.rmdir()
