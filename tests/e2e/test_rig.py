"""The local lab rig, end to end: real namespaces, two real libvirt daemons,
a real QEMU guest (TCG here), a real live migration.

Every lab gets a unique name and is torn down in a ``finally`` even when a
test fails; the last test kills a process halfway through ``up()`` and
checks that ``down()`` from another process still removes everything.
The whole file takes well under a minute here (most of it is one guest
boot under TCG).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytestmark = pytest.mark.root

libvirt = pytest.importorskip("libvirt")

from accelmig.lab import netns, rig  # noqa: E402
from accelmig.lab.boottest import PEER_ECHO_PORT, readdress_argv, start_peer_echo  # noqa: E402
from accelmig.lab.guest import channel_state, echo_responder_files  # noqa: E402
from accelmig.lab.image import ImageSpec, build_image  # noqa: E402
from accelmig.lab.image.kernel import elf_notes  # noqa: E402
from accelmig.lab.libvirtd import same_process  # noqa: E402
from accelmig.lab.rig import Lab, kvm_status  # noqa: E402
from accelmig.lab.topology import POOL_ADDRESS, Topology  # noqa: E402
from accelmig.plugin.domain import AGENT_CHANNEL_NAME  # noqa: E402
from accelmig.plugin.domain.render import render  # noqa: E402
from tests.support.e2e import LAB_LINKS, assert_clean, diagnostics, leftovers, snapshot  # noqa: E402

TOOLS = ["ip", "unshare", "/usr/sbin/libvirtd", "qemu-system-x86_64", "busybox"]
MISSING = [t for t in TOOLS if shutil.which(t) is None and not os.path.exists(t)]
needs_tools = pytest.mark.skipif(bool(MISSING), reason=f"SKIPPED LOUDLY: not installed: {MISSING} "
                                 "(./dev.sh setup installs them)")

RUN_ID = f"{os.getpid() % 100000}"
#: The image's demo-app slot (60-app), proven by the file it leaves.
DEMO_APP = "echo demo-app-ran > /run/demo-app.marker"


def unique(tag: str) -> str:
    return f"e2e{RUN_ID}{tag}"


def in_ns(ns: str, *argv, timeout=10) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- KVM or TCG

def test_virt_type_is_detected_not_assumed(monkeypatch):
    # this machine, as it is: the verdict agrees with what /sys says
    usable, why = kvm_status()
    assert why
    if os.path.isdir("/sys/module/kvm_pvm"):
        assert not usable and "kvm-pvm" in why     # these machines: /dev/kvm, but no stock guests
    assert Lab("e2e-virt", virt_type="qemu").virt_type == "qemu"
    assert not Lab("e2e-virt").dir.exists()
    # each kind of machine kvm_status tells apart, and what "auto" makes of it
    # (an "auto" that always said qemu, or one that trusted /dev/kvm alone, fails here)
    from accelmig.lab import rig
    real_exists, real_isdir = os.path.exists, os.path.isdir

    def machine(files=(), modules=(), opens=True):
        def exists(p):
            return p in files if p == "/dev/kvm" else real_exists(p)

        def isdir(p):
            return p.removeprefix("/sys/module/") in modules if p.startswith("/sys/module/") else real_isdir(p)

        def open_kvm(p, flags, *a):
            if p != "/dev/kvm":
                return real_open(p, flags, *a)
            if not opens:
                raise PermissionError(13, "Permission denied")
            return real_open("/dev/null", os.O_RDONLY)
        monkeypatch.setattr(rig.os.path, "exists", exists)
        monkeypatch.setattr(rig.os.path, "isdir", isdir)
        monkeypatch.setattr(rig.os, "open", open_kvm)
        monkeypatch.delenv("ACCELMIG_LAB_VIRT", raising=False)
        return rig.kvm_status(), Lab("e2e-virt", virt_type="auto").virt_type

    real_open = os.open
    try:
        assert machine() == ((False, "no /dev/kvm"), "qemu")
        (ok, why), virt = machine(files={"/dev/kvm"}, modules={"kvm", "kvm_pvm", "kvm_intel"})
        assert (ok, virt) == (False, "qemu") and "kvm-pvm" in why
        (ok, why), virt = machine(files={"/dev/kvm"}, modules={"kvm"})
        assert (ok, virt) == (False, "qemu") and "neither kvm_intel nor kvm_amd" in why
        (ok, why), virt = machine(files={"/dev/kvm"}, modules={"kvm", "kvm_amd"}, opens=False)
        assert (ok, virt) == (False, "qemu") and "Permission denied" in why
        assert machine(files={"/dev/kvm"}, modules={"kvm", "kvm_intel"}) == ((True, "kvm_intel on /dev/kvm"), "kvm")
        assert machine(files={"/dev/kvm"}, modules={"kvm", "kvm_amd"}) == ((True, "kvm_amd on /dev/kvm"), "kvm")
        monkeypatch.setenv("ACCELMIG_LAB_VIRT", "qemu")     # an explicit setting wins over detection
        assert Lab("e2e-virt", virt_type=None).virt_type == "qemu"
    finally:
        monkeypatch.undo()
    assert not Lab("e2e-virt").dir.exists()


# ---------------------------------------------------------------- (a) topology

@needs_tools
@pytest.mark.timeout(60)
def test_topology_up_down_leaves_nothing():
    before = snapshot()
    topo = Topology(unique("a"))
    dir_state = netns.netns_dir_state()
    try:
        topo.up()
        topo.up()                               # idempotent
        assert sorted(topo.exists()) == sorted(topo.namespaces)
        pool, a, b = topo.pool_ns, topo.host_ns["hostA"], topo.host_ns["hostB"]
        # the links and the explicit bridge MACs
        for ns, plan in ((a, topo.host("hostA")), (b, topo.host("hostB"))):
            with netns.ipr(ns) as ip:
                names = {link.get("ifname") for link in ip.get_links()}
                assert {"to-pool", "fab0"} <= names
                fab = ip.get_links(ifname="fab0")[0]
                assert fab.get("address") == plan.bridge_mac
                assert open_sysctl(ns, "net/ipv4/ip_forward") == "1"
        # real packets: pool -> both guest gateways through the right host, and the host link
        for target in ("10.89.1.1", "10.89.2.1"):
            result = in_ns(pool, "busybox", "ping", "-c", "1", "-W", "2", target)
            assert result.returncode == 0, result.stdout + result.stderr
        result = in_ns(a, "busybox", "ping", "-c", "1", "-W", "2", topo.host("hostB").address)
        assert result.returncode == 0, result.stdout + result.stderr
        result = in_ns(pool, "ip", "route", "get", "10.89.2.77")
        assert "via 10.88.2.2 dev to-hostB" in result.stdout
        # nothing of the lab is in the root namespace
        assert not set(snapshot()["links"]) & LAB_LINKS
    finally:
        topo.down()
        topo.down()                             # idempotent
        netns.restore_netns_dir(dir_state)
    left = leftovers(topo.prefix, before)
    assert left == {"netns": [], "mounts": [], "links": []}, left


def open_sysctl(ns: str, key: str) -> str:
    return in_ns(ns, "cat", f"/proc/sys/{key}").stdout.strip()


# ---------------------------------------------------------------- (b) daemons

@needs_tools
@pytest.mark.libvirt
@pytest.mark.timeout(120)
def test_two_daemons_distinct_identity_and_pool():
    before = snapshot()
    lab = Lab(unique("b"), pool=True)
    pids = []
    try:
        lab.up()
        pids = [(n.pid, n.pid_starttime) for n in lab.nodes.values()] + \
               [(n.reaper_pid, n.reaper_starttime) for n in lab.nodes.values()]
        lab.up()                                # already up: left as it is
        assert pids[:2] == [(n.pid, n.pid_starttime) for n in lab.nodes.values()]
        uuids, hostnames = set(), set()
        for host in lab.HOSTS:
            conn = lab.connect(host)
            caps = ET.fromstring(conn.getCapabilities())
            uuids.add(caps.find("./host/uuid").text)
            hostnames.add(conn.getHostname())
            assert caps.find("./host/uuid").text == lab.node(host).host_uuid
            # the daemon lives in the host's network namespace ...
            assert lab.node(host).pid in lab.topology.pids()[lab.topology.host_ns[host]]
            # ... and its own UTS namespace
            uts = os.readlink(f"/proc/{lab.node(host).pid}/ns/uts")
            assert uts != os.readlink("/proc/self/ns/uts")
            hooks = lab.node(host).hooks_dir
            assert hooks.is_dir() and os.access(hooks, os.W_OK)
        assert len(uuids) == 2, uuids
        assert len(hostnames) == 2, hostnames
        # plain virsh with the URIs env() hands out
        env = lab.env()
        for host in lab.HOSTS:
            result = subprocess.run(["virsh", "-c", env["hosts"][host]["uri"], "hostname"],
                                    capture_output=True, text=True, timeout=20)
            assert result.returncode == 0, result.stderr
        assert env["hosts"]["hostB"]["migrate_uri"] == "tcp://10.88.3.2"
        # the rendered domains pass libvirt's own schema validation
        for values in ({"name": "v1", "kernel": "/k"},
                       {"name": "v2", "kernel": "/k", "fabric_mac": "52:54:00:00:00:02", "vcpus": 2,
                        "fabric_type": "direct", "fabric_source": "eth9", "tenant": "alice",
                        "qemu_guest_agent": True}):
            dom = lab.connect("hostA").defineXMLFlags(render("accelerator-domain.xml.j2", **values),
                                                      libvirt.VIR_DOMAIN_DEFINE_VALIDATE)
            dom.undefine()
        # the pool serves in its namespace and hostA reaches it over its uplink
        assert env["pool"]["running"] and Path(env["pool"]["admin_socket"]).exists()
        code = "import socket; s = socket.create_connection(('10.88.0.1', 7071), 5); print(s.getsockname()[0])"
        result = in_ns(lab.topology.host_ns["hostA"], sys.executable, "-c", code)
        assert result.stdout.strip() == "10.88.1.2", result.stdout + result.stderr
        pids.append((lab.state["processes"]["pool"]["pid"], lab.state["processes"]["pool"]["starttime"]))
    except BaseException:
        print(diagnostics(lab))
        raise
    finally:
        lab.down()
    assert_clean(lab, before, pids)
    lab.down()                                  # idempotent


@needs_tools
@pytest.mark.libvirt
@pytest.mark.timeout(180)
def test_a_pool_of_two_nodes_on_etcd_reaches_both_hosts_and_leaves_nothing(monkeypatch):
    """``Lab(pool_nodes=2)``: etcd and pool2 in namespaces of their own, both
    nodes registered with their own device, each reachable from both hosts
    (and their guests' gateways) under the one lab certificate; up again is
    idempotent and starts a dead node again; down from a fresh ``Lab``
    (``accelmig lab down``) removes all of it; a failed up leaves nothing."""
    if not os.access(rig.ETCD, os.X_OK):
        pytest.skip("SKIPPED LOUDLY: etcd is not installed (Debian: etcd-server; ./dev.sh setup installs it)")
    before = snapshot()
    name = unique("p")
    lab = Lab(name, pool=True, pool_nodes=2)
    pids = []
    try:
        lab.up()
        keys = ("pool", "pool2", "etcd")
        pids = [(lab.state["processes"][k]["pid"], lab.state["processes"][k]["starttime"]) for k in keys]
        lab.up()                                # already up: left as it is
        assert pids == [(lab.state["processes"][k]["pid"], lab.state["processes"][k]["starttime"]) for k in keys]
        topo = lab.topology
        assert sorted(topo.exists()) == sorted([f"{name}-{n}" for n in ("pool", "hostA", "hostB", "pool2", "etcd")])
        # pool2's process lives in its own namespace, etcd in its own
        assert pids[1][0] in topo.pids()[topo.node_ns["pool2"]] and pids[2][0] in topo.pids()[topo.etcd_ns]
        nodes = lab.etcd_nodes()
        assert {n: v["instance"] for n, v in nodes.items()} == {
            n: lab.pool_node_ready(n)["instance"] for n in ("pool", "pool2")}
        assert [nodes[n]["devices"][0]["name"].split("-")[0] for n in ("pool", "pool2")] == ["pthread", "basic"]
        assert nodes["pool2"]["data"] == "10.88.0.2:7070"
        # etcd as deployed: TLS both ways (a pool refuses plain etcd:// unless insecure)
        assert lab.etcd_url.startswith("etcds://")
        for node in ("pool", "pool2"):
            assert lab.pool_node_ready(node)["security"]["cluster"] == "etcd over TLS"
        # each host reaches pool2 on its own link (the address hosts.toml names), both guest
        # gateways and the tenant network's are routed back from pool2
        code = "import socket; s = socket.create_connection(('10.88.0.2', 7071), 5); print(s.getsockname()[0])"
        for host, source in (("hostA", "10.88.4.2"), ("hostB", "10.88.5.2")):
            result = in_ns(topo.host_ns[host], sys.executable, "-c", code)
            assert result.stdout.strip() == source, result.stdout + result.stderr
            assert f'"{source}/32"' in Path(lab.env()["pool"]["hosts_file"]).read_text()
        for target in ("10.89.1.1", "10.89.2.1", "10.90.0.1"):
            result = in_ns(topo.node_ns["pool2"], "busybox", "ping", "-c", "1", "-W", "2", target)
            assert result.returncode == 0, result.stdout + result.stderr
        # no host route to etcd: only the nodes are on the cluster network
        result = in_ns(topo.host_ns["hostA"], "ip", "route", "get", "10.88.8.1")
        assert result.returncode != 0 and "unreachable" in result.stderr, result.stdout + result.stderr
        # pool2 answers TLS under the lab's one certificate (a session of no live instance: lost)
        from accelmig.lab.probe import resume_in
        answer = resume_in(topo.host_ns["hostB"], "10.88.0.2:7070", "s-0000aaaa-1-abcdef", lab.pool_ca)
        assert answer["error"]["code"] == "SESSION_LOST" and answer["node_instance"] == nodes["pool2"]["instance"]
        # a node that died is started again by up(), as a new instance
        dead = lab.kill_pool_node("pool2")
        Lab(name, pool=True).up()
        again = Lab(name)
        assert again.pool_running("pool2") and again.pool_node_ready("pool2")["instance"] != dead["instance"]
        pids.append((again.state["processes"]["pool2"]["pid"], again.state["processes"]["pool2"]["starttime"]))
    except BaseException:
        print(diagnostics(lab))
        raise
    finally:
        Lab(name).down()                        # as `accelmig lab down` would: it learns the rest from the state
    assert_clean(lab, before, pids)
    # an up that fails halfway (pool2 finds no device) tears everything down and says why
    monkeypatch.setitem(rig.NODE_POCL_DEVICES, "pool2", "no-such-device")
    broken = Lab(unique("q"), pool=True, pool_nodes=2)
    with pytest.raises(RuntimeError, match=r"accelmig-pool \(pool2\) exited with 2"):
        broken.up()
    assert_clean(broken, before)


# ---------------------------------------------------------------- (c) + (d) a guest

@pytest.fixture(scope="module")
def guest_lab():
    """A lab with one guest booted on hostA, echo responder on the agent channel."""
    if MISSING:
        pytest.skip(f"SKIPPED LOUDLY: not installed: {MISSING}")
    before = snapshot()
    lab = Lab(unique("c"))
    t0 = time.monotonic()
    image = build_image(ImageSpec(extra_files=echo_responder_files(), app_command=DEMO_APP))
    image_seconds = time.monotonic() - t0
    try:
        lab.up()
        start_peer_echo(lab)
        name = "guest-" + uuid.uuid4().hex[:6]
        a = lab.topology.host("hostA")
        xml = lab.domain_xml(name, image, "hostA", cmdline=image.cmdline(net=a.guest_net(10), agent=False))
        t0 = time.monotonic()
        lab.connect("hostA").createXML(xml, 0)
        try:
            with lab.channel("hostA", name) as ch:
                ch.wait_ready(90)
        except BaseException:
            print(diagnostics(lab, name))
            raise
        boot = time.monotonic() - t0
        print(f"\nimage {image_seconds:.2f} s (build {image.build_seconds}), daemons up "
              f"{lab.timings.get('up', 0):.2f} s, boot to channel {boot:.2f} s")
        yield lab, name, {"boot": boot}
    finally:
        lab.down()
        assert_clean(lab, before)


@pytest.mark.libvirt
@pytest.mark.vm
@pytest.mark.timeout(150)
def test_guest_channel_and_fabric_on_A(guest_lab):
    lab, name, _ = guest_lab
    dom = lab.connect("hostA").lookupByName(name)
    xml = dom.XMLDesc(0)
    assert channel_state(xml) == "connected"     # the guest end is open
    path = lab.channel_path("hostA", name)
    assert path.name == AGENT_CHANNEL_NAME and path.is_socket()
    assert str(path).startswith(str(lab.node("hostA").root))   # per-domain socket in A's own tree
    with lab.channel("hostA", name) as ch:
        assert ch.call("echo", data={"x": [1, 2]})["echo"] == {"x": [1, 2]}
        info = ch.call("info")
        assert "10.89.1.10/24" in info["addrs"], info
        assert "127.0.0.1/8" in info["addrs"], info          # /init brought lo up
        ports = ch.call("run", argv=["ls", "-l", "/dev/virtio-ports"])["stdout"]
        assert f"{AGENT_CHANNEL_NAME} -> ../vport" in ports, ports   # named without udev
        assert ch.call("run", argv=["cat", "/run/demo-app.marker"])["stdout"] == "demo-app-ran\n"
        mounts = ch.call("run", argv=["cat", "/proc/mounts"])["stdout"]
        assert all(f" {m} " in mounts for m in ("/proc", "/sys", "/dev", "/run")), mounts
        # the guest reaches the pool namespace from A's subnet, un-NATed
        reply = ch.call("connect", host=POOL_ADDRESS, port=PEER_ECHO_PORT, timeout=10)
        assert reply["reply"].strip() == "10.89.1.10", reply
        assert reply["local"][0] == "10.89.1.10"
    # the kernel is the uncompressed ELF with its PVH note
    kernel = Path(ET.fromstring(xml).find("./os/kernel").text).read_bytes()
    assert kernel[:4] == b"\x7fELF" and (b"Xen", 18) in elf_notes(kernel)


def guest_on(lab: Lab, name: str, host: str) -> None:
    """Put the guest on ``host`` whatever an earlier test left: found on the
    other host, it is migrated back with the rig's own ``lab.migrate``; found
    on neither, the test fails (never skips: a guest that vanished is a
    failure, not a reason to test nothing)."""
    where = [h for h in lab.HOSTS if name in [d.name() for d in lab.connect(h).listAllDomains()]]
    if where == [host]:
        return
    if len(where) != 1:
        pytest.fail(f"the guest {name} is on {where or 'no host'}, not on one host\n{diagnostics(lab, name)}")
    print(f"\nthe guest is on {where[0]} (an earlier test moved it): migrating it to {host} first")
    lab.migrate(name, where[0], host)
    assert [h for h in lab.HOSTS if name in [d.name() for d in lab.connect(h).listAllDomains()]] == [host]


@pytest.fixture
def guest_on_a(guest_lab):
    lab, name, timings = guest_lab
    guest_on(lab, name, "hostA")
    return lab, name, timings


@pytest.mark.libvirt
@pytest.mark.vm
@pytest.mark.timeout(240)
def test_live_migration_A_to_B(guest_on_a):
    lab, name, _ = guest_on_a
    a, b = lab.connect("hostA"), lab.connect("hostB")
    path_a = lab.channel_path("hostA", name)
    # a hook in B's writable hooks/qemu.d runs for the incoming migration
    hook_log = lab.node("hostB").host_path("/var/log/libvirt/hook-calls.log")
    lab.node("hostB").install_hook(
        "10-record", "#!/bin/sh\necho \"$*\" >> /var/log/libvirt/hook-calls.log\ncat > /dev/null\n")
    # virsh exactly as a person would type it (env() gives the URIs)
    env = lab.env()
    t0 = time.monotonic()
    result = subprocess.run(["virsh", "-c", env["hosts"]["hostA"]["uri"], "migrate", "--live", "--p2p",
                             name, env["hosts"]["hostB"]["p2p_uri"],
                             "--migrateuri", env["hosts"]["hostB"]["migrate_uri"]],
                            capture_output=True, text=True, timeout=120)
    wall = time.monotonic() - t0
    assert result.returncode == 0, result.stdout + result.stderr + diagnostics(lab, name)
    assert name not in [d.name() for d in a.listAllDomains()]      # gone from A
    dom = b.lookupByName(name)
    assert dom.state()[0] == libvirt.VIR_DOMAIN_RUNNING
    stats = dom.jobStats(libvirt.VIR_DOMAIN_JOB_STATS_COMPLETED)
    print(f"\nmigration A->B: {wall:.2f} s wall (virsh), downtime {stats.get('downtime')} ms")
    calls = hook_log.read_text().splitlines()
    assert [c.split()[1:3] for c in calls[:4]] == [["migrate", "begin"], ["prepare", "begin"],
                                                   ["start", "begin"], ["started", "begin"]], calls
    assert all(c.split()[0] == name for c in calls)
    # the channel answers on B, through B's own per-domain socket
    path_b = lab.channel_path("hostB", name)
    assert path_b != path_a and str(path_b).startswith(str(lab.node("hostB").root))
    t0 = time.monotonic()
    with lab.channel("hostB", name) as ch:
        ch.wait_ready(30)
        gap = time.monotonic() - t0
        assert ch.call("echo", data="on B")["echo"] == "on B"
        # the same guest (its uptime continues), re-addressed for B's subnet
        # as a rehome would, reaches the pool from B un-NATed
        assert ch.call("info")["uptime"] > 3
        assert ch.call("run", argv=readdress_argv(lab, "hostB"))["rc"] == 0
        reply = ch.call("connect", host=POOL_ADDRESS, port=PEER_ECHO_PORT, timeout=10)
        assert reply["reply"].strip() == "10.89.2.10", reply
    print(f"channel answered on B {gap * 1000:.0f} ms after the migration returned")
    # and back again, through the rig's own helper (libvirt-python migrateToURI3)
    back = lab.migrate(name, "hostB", "hostA")
    print(f"migration B->A: {back['wall']:.2f} s wall, downtime {back['downtime_ms']} ms")
    with lab.channel("hostA", name) as ch:
        ch.wait_ready(30)


# ---------------------------------------------------------------- (e) crash halfway

CRASH_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from accelmig.lab import libvirtd, rig
    real = libvirtd.LibvirtNode.wait_ready
    def wait_then_die(self, *a, **k):
        if self.name == "hostB":             # A is up, B's daemon just spawned: die here
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *a, **k)
    libvirtd.LibvirtNode.wait_ready = wait_then_die
    rig.Lab(sys.argv[1]).up()
""")


@needs_tools
@pytest.mark.libvirt
@pytest.mark.timeout(90)
def test_down_after_a_crash_halfway_through_up():
    before = snapshot()
    name = unique("e")
    lab = Lab(name)
    try:
        proc = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, name], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        # the crash left things behind, and the state file knows them
        state = json.loads(lab.state_file.read_text())
        assert state["status"] == "starting"
        assert sorted(state["namespaces"]) == sorted(lab.topology.namespaces)
        assert set(lab.topology.exists()) == set(lab.topology.namespaces)
        recorded = [(n.get("reaper_pid"), n.get("reaper_starttime")) for n in state["nodes"].values()]
        assert all(pid for pid, _ in recorded), state["nodes"]
        assert all(same_process(pid, st) for pid, st in recorded)
        libvirtd_a = state["nodes"]["hostA"]
        assert same_process(libvirtd_a["pid"], libvirtd_a["pid_starttime"])
        leftovers = recorded + [(libvirtd_a["pid"], libvirtd_a["pid_starttime"])]
    finally:
        # a fresh object, as `accelmig lab down` would make
        Lab(name).down()
    assert_clean(lab, before, leftovers)
