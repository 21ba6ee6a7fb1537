"""The lab's network: a pool node and two hypervisor hosts, each a network
namespace, joined by veth pairs.

::

                      pool  (10.88.0.1/32 on lo: the pool's service address)
               to-hostA /  \\ to-hostB
          10.88.1.1/30 /    \\ 10.88.2.1/30
                      /      \\
          10.88.1.2/30         10.88.2.2/30
             to-pool            to-pool
              hostA --to-hostB----to-hostA-- hostB
                  10.88.3.1/30   10.88.3.2/30       (migration link)
             fab0 10.89.1.1/24       fab0 10.89.2.1/24
             (guests on A)           (guests on B)

- Every address exists only inside the lab's namespaces: nothing touches the
  machine's own network, and several labs (distinct prefixes) can run at once
  with the same addresses.
- Each host routes its guests' subnet to the pool and the pool routes both
  guest subnets back through the right host, **without NAT**: the pool sees
  the guest's own source address (10.89.1.x from A, 10.89.2.x from B), which
  is what accelmig's host identity and the pool's per-host address checks
  are about.
- Each bridge ``fab0`` gets an **explicit MAC**: a bridge with a random MAC
  takes its first port's MAC, which libvirt derives from the guest MAC, so
  both hosts' bridges ended up with the same MAC and a migrated guest's
  cached gateway entry still "worked" on B with its old address (LAB-NOTES).
- Veths are created inside the namespaces (the peer placed straight into the
  other namespace), never in the root namespace, so names cannot collide
  with anything outside the lab.

Setup and teardown are idempotent: ``up()`` completes a half-built topology,
``down()`` removes whatever part of it exists, after killing any process
still inside (a process holding a namespace would keep its links alive
after the name is gone).
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import ipaddress
import logging
import os
import signal
import threading
import time
from pathlib import Path

from pyroute2 import NetNS, netns
from pyroute2.netlink.exceptions import NetlinkError

LOG = logging.getLogger("accelmig.lab.netns")

NETNS_DIR = Path("/run/netns")

POOL_ADDRESS = "10.88.0.1"
BRIDGE = "fab0"


@dataclasses.dataclass(frozen=True)
class HostPlan:
    """One hypervisor host's addressing."""

    name: str                     # hostA / hostB
    index: int                    # 1 / 2
    uplink: str                   # this host's end of the pool link, CIDR
    pool_side: str                # the pool's end of that link, CIDR
    migration: str                # this host's end of the host<->host link, CIDR
    guest_subnet: str             # the subnet of this host's guests (fab0)
    bridge_mac: str

    @property
    def address(self) -> str:
        """The host's address on the migration link (what ``--migrateuri`` names)."""
        return self.migration.split("/")[0]

    @property
    def uplink_address(self) -> str:
        """The source address the pool sees for this host's own connections."""
        return self.uplink.split("/")[0]

    @property
    def gateway(self) -> str:
        """The guests' default gateway: fab0's address."""
        return str(next(ipaddress.ip_network(self.guest_subnet).hosts()))

    @property
    def gateway_cidr(self) -> str:
        return f"{self.gateway}/{ipaddress.ip_network(self.guest_subnet).prefixlen}"

    def guest_address(self, n: int = 10) -> str:
        """The n-th guest address of this host's subnet, CIDR (10.89.1.10/24)."""
        net = ipaddress.ip_network(self.guest_subnet)
        return f"{net.network_address + n}/{net.prefixlen}"

    def guest_net(self, n: int = 10) -> str:
        """The guest kernel's ``accelmig.net=`` value (address, gateway)."""
        return f"{self.guest_address(n)},{self.gateway}"


HOSTS = (
    HostPlan("hostA", 1, uplink="10.88.1.2/30", pool_side="10.88.1.1/30", migration="10.88.3.1/30",
             guest_subnet="10.89.1.0/24", bridge_mac="02:ac:4d:00:01:01"),
    HostPlan("hostB", 2, uplink="10.88.2.2/30", pool_side="10.88.2.1/30", migration="10.88.3.2/30",
             guest_subnet="10.89.2.0/24", bridge_mac="02:ac:4d:00:02:01"),
)


def _ignore(exc: NetlinkError, *codes) -> bool:
    return exc.code in codes


def _in_netns(name: str, func):
    """Run ``func()`` in a thread that has entered network namespace ``name``
    (what sysctls under /proc/sys/net need: they belong to the opener's
    namespace).  A thread, so the rest of the process stays where it is."""
    result: dict = {}

    def target():
        try:
            netns.pushns(name)
            try:
                result["value"] = func()
            finally:
                netns.popns()
        except BaseException as exc:   # handed to the caller
            result["error"] = exc

    thread = threading.Thread(target=target, name=f"netns-{name}")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result.get("value")


def _sysctl(values: dict[str, str]):
    for key, value in values.items():
        path = Path("/proc/sys") / key.replace(".", "/")
        if path.exists():
            path.write_text(value)


class Topology:
    """The lab's namespaces and links, named ``<prefix>-pool``,
    ``<prefix>-hostA``, ``<prefix>-hostB``."""

    def __init__(self, prefix: str):
        if not prefix or len(prefix) > 40 or not all(c.isalnum() or c in "-_." for c in prefix):
            raise ValueError(f"lab prefix {prefix!r}: 1-40 characters of [A-Za-z0-9._-]")
        self.prefix = prefix
        self.pool_ns = f"{prefix}-pool"
        self.hosts = {h.name: h for h in HOSTS}
        self.host_ns = {h.name: f"{prefix}-{h.name}" for h in HOSTS}

    @property
    def namespaces(self) -> list[str]:
        return [self.pool_ns, *self.host_ns.values()]

    def host(self, name: str) -> HostPlan:
        return self.hosts[name]

    # ---------------------------------------------------------------- up

    def up(self):
        """Create (or complete) the topology."""
        t0 = time.monotonic()
        existing = set(netns.listnetns())
        for name in self.namespaces:
            if name not in existing:
                netns.create(name)
        for ns_name in self.namespaces:
            _in_netns(ns_name, lambda: _sysctl({
                "net.ipv6.conf.all.disable_ipv6": "1",      # no DAD/RS noise on lab links
                "net.ipv6.conf.default.disable_ipv6": "1",
                "net.ipv4.ip_forward": "0" if ns_name == self.pool_ns else "1",
            }))
        a, b = self.hosts["hostA"], self.hosts["hostB"]
        self._veth(self.pool_ns, "to-hostA", self.host_ns["hostA"], "to-pool")
        self._veth(self.pool_ns, "to-hostB", self.host_ns["hostB"], "to-pool")
        self._veth(self.host_ns["hostA"], "to-hostB", self.host_ns["hostB"], "to-hostA")
        with NetNS(self.pool_ns, flags=0) as ns:
            self._addr(ns, "lo", f"{POOL_ADDRESS}/32")
            self._addr(ns, "to-hostA", a.pool_side)
            self._addr(ns, "to-hostB", b.pool_side)
            for link in ("lo", "to-hostA", "to-hostB"):
                self._link_up(ns, link)
            for host in (a, b):
                self._route(ns, host.guest_subnet, host.uplink_address)
        for host in (a, b):
            other = b if host is a else a
            with NetNS(self.host_ns[host.name], flags=0) as ns:
                self._bridge(ns, BRIDGE, host.bridge_mac)
                self._addr(ns, "to-pool", host.uplink)
                self._addr(ns, f"to-{other.name}", host.migration)
                self._addr(ns, BRIDGE, host.gateway_cidr)
                for link in ("lo", "to-pool", f"to-{other.name}", BRIDGE):
                    self._link_up(ns, link)
                self._route(ns, f"{POOL_ADDRESS}/32", host.pool_side.split("/")[0])
        LOG.info("topology %s up in %.2f s", self.prefix, time.monotonic() - t0)

    @staticmethod
    def _index(ns, ifname: str) -> int | None:
        found = ns.link_lookup(ifname=ifname)
        return found[0] if found else None

    def _veth(self, ns_a: str, if_a: str, ns_b: str, if_b: str):
        with NetNS(ns_a, flags=0) as ns:
            if self._index(ns, if_a) is not None:
                return
            ns.link("add", ifname=if_a, kind="veth", peer={"ifname": if_b, "net_ns_fd": ns_b})

    def _bridge(self, ns, name: str, mac: str):
        if self._index(ns, name) is None:
            ns.link("add", ifname=name, kind="bridge", address=mac)
        else:
            ns.link("set", index=self._index(ns, name), address=mac)

    def _addr(self, ns, ifname: str, cidr: str):
        address, prefixlen = cidr.split("/")
        try:
            ns.addr("add", index=self._index(ns, ifname), address=address, prefixlen=int(prefixlen))
        except NetlinkError as exc:
            if not _ignore(exc, errno.EEXIST):
                raise

    def _link_up(self, ns, ifname: str):
        ns.link("set", index=self._index(ns, ifname), state="up")

    def _route(self, ns, dst: str, gateway: str):
        ns.route("replace", dst=dst, gateway=gateway)

    # ---------------------------------------------------------------- down

    def exists(self) -> list[str]:
        """Which of this lab's namespaces exist now."""
        present = set(netns.listnetns())
        return [n for n in self.namespaces if n in present]

    def pids(self) -> dict[str, list[int]]:
        """PIDs of the processes inside each of this lab's namespaces."""
        by_ns = netns.ns_pids()
        return {n: by_ns.get(n, []) for n in self.namespaces}

    def down(self, kill_timeout: float = 5.0):
        """Remove the topology: processes still inside first, then the
        namespaces (their links and bridges go with them)."""
        t0 = time.monotonic()
        kill_namespace_processes(self.exists(), kill_timeout)
        for name in self.exists():
            try:
                netns.remove(name)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise
        LOG.info("topology %s down in %.2f s", self.prefix, time.monotonic() - t0)

    # ---------------------------------------------------------------- helpers

    def etc_hosts(self) -> str:
        """An /etc/hosts for the host namespaces: the other lab nodes by name
        (the plain names and the prefixed ones)."""
        lines = ["127.0.0.1\tlocalhost", f"{POOL_ADDRESS}\tpool {self.pool_ns}"]
        for host in self.hosts.values():
            lines.append(f"{host.address}\t{host.name} {self.host_ns[host.name]}")
        return "\n".join(lines) + "\n"

    def describe(self) -> dict:
        return {
            "namespaces": {"pool": self.pool_ns, **self.host_ns},
            "pool_address": POOL_ADDRESS,
            "hosts": {h.name: {"namespace": self.host_ns[h.name], "migration_address": h.address,
                               "uplink": h.uplink, "guest_subnet": h.guest_subnet,
                               "gateway": h.gateway, "bridge": BRIDGE, "bridge_mac": h.bridge_mac}
                      for h in self.hosts.values()},
        }


def kill_namespace_processes(names, timeout: float = 5.0):
    """SIGTERM, then SIGKILL, every process inside the network namespaces
    ``names`` (found by namespace inode, never by process name)."""
    names = list(names)
    if not names:
        return
    me = os.getpid()

    def pids():
        by_ns = netns.ns_pids()
        return [p for n in names for p in by_ns.get(n, []) if p != me]

    victims = pids()
    for pid in victims:
        LOG.info("SIGTERM %d (still in a lab namespace)", pid)
        _kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while victims and time.monotonic() < deadline:
        time.sleep(0.05)
        victims = [p for p in pids() if _alive(p)]
    for pid in victims:
        LOG.warning("SIGKILL %d (did not stop on SIGTERM)", pid)
        _kill(pid, signal.SIGKILL)


def _kill(pid: int, sig: int):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def netns_dir_state() -> dict:
    """Whether /run/netns exists and is a mount point now (creating the first
    namespace makes it a self bind mount, as ``ip netns`` does)."""
    return {"exists": NETNS_DIR.is_dir(), "mounted": _is_mountpoint(NETNS_DIR)}


def restore_netns_dir(before: dict):
    """Undo what creating the first namespace did to /run/netns, but only when
    it was not there before and no namespace (ours or anyone's) is left."""
    if not NETNS_DIR.is_dir() or any(NETNS_DIR.iterdir()):
        return
    if not before.get("mounted") and _is_mountpoint(NETNS_DIR):
        try:
            _umount(NETNS_DIR)
        except OSError as exc:      # someone created a namespace just now: it is theirs to keep
            LOG.info("leaving %s mounted: %s", NETNS_DIR, exc)
            return
    if not before.get("exists"):
        try:
            NETNS_DIR.rmdir()
        except OSError:
            pass


def _is_mountpoint(path: Path) -> bool:
    target = str(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


def _umount(path: Path):
    libc = ctypes.CDLL(None, use_errno=True)
    while _is_mountpoint(path):
        if libc.umount2(str(path).encode(), 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"umount {path}: {os.strerror(err)}")
