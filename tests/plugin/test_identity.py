"""Host identity discovery (really, in network namespaces) and guest address leases."""

from __future__ import annotations

import ipaddress
import json
import multiprocessing
import os
import socket
import subprocess
import threading
import uuid

import pytest

from accelmig.lab.netns import IFNAMSIZ, NETNS_DIR
from accelmig.plugin.config import HostConfig
from accelmig.plugin.addresses import LEASES_FILE, GuestAddressAllocator, guest_nic, spare_key
from accelmig.plugin.routes import host_identity, route_towards
from accelmig.wire.errors import BadRequest, ConfigInvalid, Unavailable
from accelmig.wire.identity import HostIdentity
from tests.support.netns import NetnsFactory
from tests.support.wait import wait_for

DOM_A = "7c2f6a4e-1d3b-4c8e-9a5f-0b1c2d3e4f51"
DOM_B = "0e9d8c7b-6a5f-4e3d-8c2b-1a0f9e8d7c62"


# ---------------------------------------------------------------------------
# the allocator (no root)


def allocator(tmp_path, subnet="10.89.1.0/24", gateway=None):
    return GuestAddressAllocator(tmp_path / "state" / LEASES_FILE, subnet, gateway)


def test_allocation_is_stable_and_persisted(tmp_path):
    alloc = allocator(tmp_path)
    a = alloc.allocate(DOM_A)
    b = alloc.allocate(DOM_B)
    assert a != b
    assert alloc.allocate(DOM_A) == a
    assert alloc.allocate(DOM_A.upper()) == a            # the same UUID, written differently
    # A new allocator (a restarted hostd) reads the same leases.
    again = allocator(tmp_path)
    assert again.lookup(DOM_A) == a and again.allocate(DOM_B) == b
    assert again.leases() == {DOM_A: a, DOM_B: b}
    data = json.loads((tmp_path / "state" / LEASES_FILE).read_text())
    assert data["subnet"] == "10.89.1.0/24" and data["leases"] == {DOM_A: a, DOM_B: b}


def test_address_follows_the_uuid_even_without_state(tmp_path):
    first = allocator(tmp_path / "one").allocate(DOM_A)
    second = allocator(tmp_path / "two").allocate(DOM_A)
    assert first == second


def test_never_network_broadcast_or_gateway_and_exhaustion(tmp_path):
    # /29: .0 network, .7 broadcast, .1 gateway -> .2 .. .6 for five guests.
    alloc = allocator(tmp_path, "10.89.1.0/29")
    assert alloc.capacity == 5
    domains = [str(uuid.UUID(int=i + 1)) for i in range(5)]
    got = {alloc.allocate(d) for d in domains}
    assert got == {f"10.89.1.{i}" for i in range(2, 7)}
    with pytest.raises(Unavailable, match=r"a guest address in 10.89.1.0/29 is unavailable: all 5 addresses are leased"):
        alloc.allocate(str(uuid.UUID(int=99)))
    # A release frees exactly that address for the next domain.
    freed = alloc.release(domains[2])
    assert alloc.release(domains[2]) is None
    assert alloc.allocate(str(uuid.UUID(int=99))) == freed


def test_a_domains_spare_address_is_a_lease_of_its_own(tmp_path):
    """hostd's ``rehome_here`` moves a guest's NIC between its address and
    a spare one: the spare is leased like any other (no other guest gets
    it), the same for the same domain, and released by its own key."""
    alloc = allocator(tmp_path)
    assert spare_key(DOM_A) == spare_key(DOM_A.upper()) != spare_key(DOM_B)
    assert spare_key(DOM_A) not in (DOM_A, DOM_B)
    own, spare = alloc.allocate(DOM_A), alloc.allocate(spare_key(DOM_A))
    assert own != spare and alloc.allocate(spare_key(DOM_A)) == spare
    assert alloc.allocate(DOM_B) not in (own, spare)
    assert alloc.release(spare_key(DOM_A)) == spare and alloc.lookup(DOM_A) == own
    with pytest.raises(BadRequest):
        spare_key("not-a-uuid")


def test_gateway_elsewhere_in_the_subnet(tmp_path):
    alloc = allocator(tmp_path, "10.89.1.0/30", gateway="10.89.1.2")
    assert alloc.capacity == 1
    assert alloc.allocate(DOM_A) == "10.89.1.1"


def test_ipv6_subnet(tmp_path):
    alloc = allocator(tmp_path, "fd00:89:1::/126")
    # ::0 is the subnet-router anycast, ::1 the gateway: ::2 and ::3 are left.
    got = {alloc.allocate(DOM_A), alloc.allocate(DOM_B)}
    assert got == {"fd00:89:1::2", "fd00:89:1::3"}


def test_leases_outside_a_changed_subnet_are_dropped(tmp_path):
    old = allocator(tmp_path, "10.89.1.0/24")
    a = old.allocate(DOM_A)
    new = allocator(tmp_path, "10.89.2.0/24")
    assert new.lookup(DOM_A) is None
    b = new.allocate(DOM_A)
    assert ipaddress.ip_address(b) in ipaddress.ip_network("10.89.2.0/24") and b != a
    data = json.loads((tmp_path / "state" / LEASES_FILE).read_text())
    assert data["leases"] == {DOM_A: b}


def test_corrupt_state_is_an_error_not_a_silent_reset(tmp_path):
    path = tmp_path / "state" / LEASES_FILE
    path.parent.mkdir()
    path.write_text("{not json")
    with pytest.raises(ConfigInvalid, match="leases are corrupt"):
        allocator(tmp_path).allocate(DOM_A)
    assert path.read_text() == "{not json"


def test_write_is_atomic_and_leaves_no_temporary_files(tmp_path):
    alloc = allocator(tmp_path)
    for i in range(20):
        alloc.allocate(str(uuid.UUID(int=i + 1)))
    names = sorted(os.listdir(tmp_path / "state"))
    assert names == [LEASES_FILE, LEASES_FILE + ".lock"]


def _allocate_many(path, start):
    alloc = GuestAddressAllocator(path, "10.89.1.0/24")
    return [alloc.allocate(str(uuid.UUID(int=start + i))) for i in range(15)]


def test_concurrent_processes_never_share_an_address(tmp_path):
    path = tmp_path / "state" / LEASES_FILE
    with multiprocessing.get_context("fork").Pool(4) as pool:
        results = pool.starmap(_allocate_many, [(path, 1000 * k) for k in range(4)])
    flat = [a for r in results for a in r]
    assert len(flat) == len(set(flat)) == 60
    assert sorted(GuestAddressAllocator(path, "10.89.1.0/24").leases().values()) == sorted(flat)


def test_bad_arguments(tmp_path):
    with pytest.raises(BadRequest, match="'nope' is not a domain UUID"):
        allocator(tmp_path).allocate("nope")
    with pytest.raises(ConfigInvalid, match="gateway 10.89.2.1 is not in guest subnet"):
        allocator(tmp_path, gateway="10.89.2.1")
    with pytest.raises(ConfigInvalid, match="has host bits set"):
        allocator(tmp_path, "10.89.1.1/24")


def test_guest_nic_from_config():
    cfg = HostConfig.from_toml(
        '[pool]\nendpoint = "10.88.0.1:7070"\n[fabric]\nguest_subnet = "10.89.1.0/24"\nmtu = 1400\n')
    nic = guest_nic(cfg.fabric, "10.89.1.23", "52:54:00:A1:00:01")
    assert nic.to_wire() == {"address": "10.89.1.23", "prefixlen": 24, "gateway": "10.89.1.1",
                             "mtu": 1400, "mac": "52:54:00:a1:00:01", "routes": ["10.88.0.1/32"]}
    plain = HostConfig.from_toml('[pool]\nendpoint = "10.88.0.1:7070"\n')
    with pytest.raises(BadRequest, match="not host-bound"):
        guest_nic(plain.fabric, "10.89.1.23")


# ---------------------------------------------------------------------------
# discovery, really, in network namespaces

HOST_MAC = "02:00:5e:10:00:02"


@pytest.fixture
def rig(netns_factory):
    """host --(mgmt, default route)-- router;  host --(fabric, MTU 1400)-- pool.

    The pool's data-plane address 203.0.113.7 sits on the pool's loopback,
    reached from the host through 198.51.100.1 (a specific route), while
    everything else goes out of the management link."""
    f = netns_factory
    host, router, pool = f.add("host"), f.add("router"), f.add("pool")
    mgmt = f.link(host, router, "192.0.2.2/24", "192.0.2.1/24")
    fab = f.link(host, pool, "198.51.100.2/24", "198.51.100.1/24", mtu=1400, mac_a=HOST_MAC)
    f.address(pool, "lo", "203.0.113.7/32")
    f.route(host, "default", "192.0.2.1")
    f.route(host, "203.0.113.0/24", "198.51.100.1")
    return f, host, router, pool, mgmt, fab


def host_config(tmp_path, endpoint="203.0.113.7:7070", fabric=""):
    return HostConfig.from_toml(f'[host]\nid = "hostA"\n[pool]\nendpoint = "{endpoint}"\n'
                                f'[hostd]\nstate_dir = "{tmp_path}"\n' + fabric)


@pytest.mark.root
def test_identity_discovered_inside_the_namespace(rig, tmp_path):
    f, host, router, pool, mgmt, fab = rig
    cfg = host_config(tmp_path)
    inside = host.call(host_identity, cfg)           # a process that lives in host
    assert isinstance(inside, HostIdentity)
    assert inside.host_id == "hostA" and inside.pool_endpoint == "203.0.113.7:7070"
    assert inside.host_address == "198.51.100.2"
    assert inside.interface == fab.a.ifname and len(fab.a.ifname) <= IFNAMSIZ
    assert inside.mtu == 1400
    assert inside.mac == HOST_MAC
    assert inside.guest_nic is None
    # From outside, naming the namespace: the same answer.
    assert host_identity(cfg, netns=host.name) == inside
    assert HostIdentity.from_wire(inside.to_wire()) == inside


@pytest.mark.root
def test_other_destinations_follow_other_routes(rig):
    f, host, router, pool, mgmt, fab = rig
    route = route_towards("192.0.2.99", netns=host.name)       # on-link on mgmt
    assert (route.source, route.interface, route.gateway) == ("192.0.2.2", mgmt.a.ifname, None)
    route = route_towards("8.8.8.8", netns=host.name)          # the default route
    assert (route.source, route.interface, route.gateway) == ("192.0.2.2", mgmt.a.ifname, "192.0.2.1")
    assert route.mtu == 1500 and route.mac == mgmt.a.mac
    route = route_towards("203.0.113.7", netns=host.name)
    assert (route.interface, route.gateway, route.mtu) == (fab.a.ifname, "198.51.100.1", 1400)


@pytest.mark.root
def test_the_pool_sees_the_discovered_source_address(rig, tmp_path):
    f, host, router, pool, mgmt, fab = rig
    with pool.entered():                                  # a listener inside pool
        listener = socket.create_server(("203.0.113.7", 0))
    port = listener.getsockname()[1]
    seen = {}

    def accept():
        conn, peer = listener.accept()
        seen["peer"] = peer[0]
        conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        def connect():
            with socket.create_connection(("203.0.113.7", port), timeout=5):
                pass
        host.call(connect)
        thread.join(5)
    finally:
        listener.close()
    identity = host_identity(host_config(tmp_path), netns=host.name)
    assert seen["peer"] == identity.host_address == "198.51.100.2"


@pytest.mark.root
def test_host_bound_fabric_guest_nic_from_the_lease(rig, tmp_path):
    f, host, router, pool, mgmt, fab = rig
    cfg = host_config(tmp_path, fabric='[fabric]\nmode = "bridge"\nbridge = "fab0"\n'
                                       'guest_subnet = "10.89.1.0/24"\nmtu = 1400\n')
    allocator = GuestAddressAllocator.for_config(cfg)
    nic = guest_nic(cfg.fabric, allocator.allocate(DOM_A), "52:54:00:a1:00:01")
    leased = GuestAddressAllocator.for_config(cfg).lookup(DOM_A)
    assert leased is not None and nic.address == leased
    assert host_identity(cfg, netns=host.name).guest_nic is None      # the route says nothing of guests
    assert ipaddress.ip_address(nic.address) in ipaddress.ip_network("10.89.1.0/24")
    assert (nic.prefixlen, nic.gateway, nic.mtu, nic.mac, nic.routes) == \
           (24, "10.89.1.1", 1400, "52:54:00:a1:00:01", ("203.0.113.7/32",))
    assert (tmp_path / LEASES_FILE).exists()
    # The same domain asks again (a second migration here, a restarted hostd): the same address.
    assert GuestAddressAllocator.for_config(cfg).allocate(DOM_A) == nic.address


@pytest.mark.root
def test_no_route_is_unavailable(netns_factory, tmp_path):
    lonely = netns_factory.add("lonely")
    with pytest.raises(Unavailable, match=r"a route to the pool at 203.0.113.7 in network namespace .*"
                                          r"Network is unreachable \(errno 101\)"):
        host_identity(host_config(tmp_path), netns=lonely.name)
    with pytest.raises(Unavailable, match="Network is unreachable"):
        lonely.call(route_towards, "203.0.113.7")


@pytest.mark.root
def test_a_missing_namespace_is_unavailable_and_not_created(tmp_path):
    name = f"am-missing-{os.getpid()}"
    with pytest.raises(Unavailable, match=f"network namespace '{name}' is unavailable: it does not exist"):
        host_identity(host_config(tmp_path), netns=name)
    assert not os.path.exists(os.path.join(NETNS_DIR, name))


def test_route_lookup_needs_an_address():
    with pytest.raises(BadRequest, match="'pool.example' is not an IP address"):
        route_towards("pool.example")


# ---------------------------------------------------------------------------
# the namespace helpers themselves


@pytest.mark.root
def test_factory_removes_everything_even_when_the_test_fails():
    factory = NetnsFactory()
    with pytest.raises(ZeroDivisionError):
        with factory:
            a, b = factory.add("a"), factory.add("b")
            link = factory.link(a, b, "10.0.0.1/30", "10.0.0.2/30")
            proc = factory.popen(b, ["sleep", "300"])
            # One the factory does not know of: it must not keep a namespace alive either.
            stray = subprocess.Popen(["ip", "netns", "exec", a.name, "sleep", "300"])
            inode = f"net:[{os.stat(a.path).st_ino}]"
            wait_for(lambda: os.readlink(f"/proc/{stray.pid}/ns/net") == inode, 5,
                     f"the stray process to be in netns {a.name}", interval=0.01)
            assert sorted(factory.leftovers()) == sorted([a.name, b.name])
            1 / 0
    assert factory.leftovers() == []
    assert proc.poll() is not None
    assert stray.wait(5) == -9
    from pyroute2 import IPRoute
    with IPRoute() as ipr:                       # nothing leaked into our own namespace
        assert not ipr.link_lookup(ifname=link.a.ifname)
        assert not ipr.link_lookup(ifname=link.b.ifname)


@pytest.mark.root
def test_entered_affects_only_this_thread(netns_factory):
    ns = netns_factory.add("t")
    own = os.readlink("/proc/thread-self/ns/net")
    seen = {}
    inside_now, release = threading.Event(), threading.Event()

    def worker():
        with ns.entered():
            seen["worker"] = os.readlink("/proc/thread-self/ns/net")
            child = threading.Thread(target=lambda: seen.setdefault(
                "child", os.readlink("/proc/thread-self/ns/net")))
            child.start()
            child.join()
            inside_now.set()
            release.wait(10)
        seen["after"] = os.readlink("/proc/thread-self/ns/net")

    thread = threading.Thread(target=worker)
    thread.start()
    assert inside_now.wait(10)
    assert os.readlink("/proc/thread-self/ns/net") == own      # this thread never moved
    release.set()
    thread.join(10)
    assert seen["worker"] == f"net:[{os.stat(ns.path).st_ino}]" != own
    assert seen["child"] == seen["worker"]                      # threads started inside live there
    assert seen["after"] == own                                 # and the worker came back


@pytest.mark.root
def test_exec_and_call_run_inside(netns_factory):
    f = netns_factory
    a, b = f.add("a"), f.add("b")
    link = f.link(a, b, "10.0.0.1/30", "10.0.0.2/30", mtu=1280)
    out = f.exec(a, ["ip", "-o", "addr", "show", "dev", link.a.ifname]).stdout
    assert "10.0.0.1/30" in out
    assert link.b.mtu == 1280
    assert b.call(lambda: socket.if_nametoindex(link.b.ifname)) > 1
    with pytest.raises(OSError):
        a.call(socket.if_nametoindex, link.b.ifname)   # b's end is not in a
    f.forwarding(a)
    assert f.exec(a, ["cat", "/proc/sys/net/ipv4/ip_forward"]).stdout.strip() == "1"


@pytest.mark.root
def test_a_route_change_is_announced_and_the_identity_follows_it(rig, tmp_path):
    """hostd keeps its identity cached and refreshes it when the kernel says
    a route changed (``RouteChanges``), never on a rehome's path."""
    import select

    from accelmig.plugin.routes import RouteChanges
    f, host, router, pool, mgmt, fab = rig
    cfg = host_config(tmp_path)
    with host.entered():                 # the socket belongs to the namespace it was made in
        changes = RouteChanges()
    try:
        before = host_identity(cfg, netns=host.name)
        assert before.interface == fab.a.ifname
        assert changes.drain() == 0                       # nothing has changed since it was made
        host.exec(["ip", "route", "del", "203.0.113.0/24"])   # the pool now only by the default route
        readable, _, _ = select.select([changes], [], [], 30)
        assert readable and changes.drain() >= 1
        after = host_identity(cfg, netns=host.name)
        assert (after.interface, after.host_address, after.mtu) == (mgmt.a.ifname, "192.0.2.2", 1500)
    finally:
        changes.close()
