"""The Vagrant rig (``vagrant/``), as far as it can be proven here: no
Vagrant, no VM, no root (these machines have no nested virtualisation).

- The demo guest's domain, rendered exactly as ``demo.sh`` renders it (the
  script itself: ``demo.sh render FILE``, with this checkout's real
  ``accelmig domain render``), would reach the pool: a fabric NIC with its
  fixed MAC on hostA's ``fab0``, accelmig's metadata naming it, the agent
  channel, and a kernel command line that gives the guest an address of
  hostA's guest subnet behind hostA's gateway, from where the inventory's
  routes lead to the pool's data plane.
- The rig's three descriptions of itself agree: the Vagrantfile's ``NODES``
  (read from its text), the inventory ``fleet.toml`` and ``demo-vm.args``.
- The Vagrantfile is valid Ruby (``ruby -c``), every script valid bash
  (``bash -n``) with ``set -euo pipefail``.
- ``rig-keys.sh`` makes the rig's keys and known hosts, and a second run
  changes nothing; the inventory loads with the fleet's own loader.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from accelmig.plugin.domain import ACCELMIG_NS, AGENT_CHANNEL_NAME
from accelmig.plugin.domain.model import DomainXML

CHECKOUT = Path(__file__).resolve().parents[2]
RIG = CHECKOUT / "vagrant"
VAGRANTFILE = RIG / "Vagrantfile"
INVENTORY = RIG / "fleet.toml"
DEMO_ARGS = RIG / "demo-vm.args"
#: the accelmig CLI of this environment (dev.sh: .venv/bin/accelmig)
ACCELMIG = Path(sys.executable).with_name("accelmig")
SETUP_HINT = "run ./dev.sh setup (it installs the Debian packages the tests need)"


def need(program: str) -> str:
    """``program``'s path; a missing one fails the test (never a skip: the
    rig's checks must not silently vanish from a run)."""
    path = shutil.which(program)
    if path is None:
        pytest.fail(f"{program} is missing: {SETUP_HINT}")
    return path


# ---------------------------------------------------------------- what the rig says of itself

def vagrant_nodes() -> dict[str, dict]:
    """The Vagrantfile's ``NODES``, read from its text:
    ``"hostA" => { ip: "10.88.0.11", role: "host", ... }`` lines."""
    text = VAGRANTFILE.read_text()
    block = re.search(r"^NODES = \{\n(.*?)^\}", text, re.M | re.S)
    assert block, "the Vagrantfile has no NODES = { ... } block"
    nodes = {}
    for name, body in re.findall(r'"([A-Za-z][A-Za-z0-9-]*)"\s*=>\s*\{([^}]*)\}', block.group(1)):
        nodes[name] = {key: quoted or bare for key, quoted, bare in
                       re.findall(r'(\w+):\s*(?:"([^"]*)"|([^,\s}]+))', body)}
    assert nodes, "no node in the Vagrantfile's NODES"
    return nodes


def vagrant_rig_net() -> ipaddress.IPv4Network:
    match = re.search(r'^RIG_NET = "([^"]+)"', VAGRANTFILE.read_text(), re.M)
    assert match, "the Vagrantfile has no RIG_NET"
    return ipaddress.ip_network(match.group(1))


def inventory() -> dict:
    with open(INVENTORY, "rb") as handle:
        return tomllib.load(handle)


def demo_args() -> list[str]:
    """demo-vm.args' values, as demo.sh reads them (blank and # lines skipped)."""
    return [line for line in DEMO_ARGS.read_text().splitlines() if line and not line.startswith("#")]


def demo_arg(key: str) -> str:
    values = [line.split("=", 1)[1] for line in demo_args() if line.split("=", 1)[0] == key]
    assert values, f"demo-vm.args has no {key}="
    return values[-1]


def endpoint_host(endpoint: str) -> ipaddress.IPv4Address:
    host, _, port = endpoint.rpartition(":")
    assert port.isdigit(), endpoint
    return ipaddress.ip_address(host.strip("[]"))


def pool_endpoint(inv: dict) -> str:
    """The data plane as guests reach it: [pool] endpoint, default the first listen address."""
    return inv["pool"].get("endpoint") or inv["pool"]["listen"].split(",")[0].strip()


def kernel_words(cmdline: str) -> dict[str, str]:
    return dict(word.split("=", 1) for word in cmdline.split() if "=" in word)


def run_rig_keys(directory: Path) -> subprocess.CompletedProcess:
    need("ssh-keygen")
    nodes = [f"{name}={node['ip']}" for name, node in vagrant_nodes().items()]
    return subprocess.run(["bash", str(RIG / "rig-keys.sh"), str(directory), *nodes],
                          capture_output=True, text=True, timeout=60, check=True)


# ---------------------------------------------------------------- Ruby, bash

def test_the_vagrantfile_is_valid_ruby():
    done = subprocess.run([need("ruby"), "-c", str(VAGRANTFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Syntax OK" in done.stdout, done.stderr or done.stdout


SCRIPTS = sorted(RIG.glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_every_script_is_valid_bash(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    text = script.read_text()
    if script.name != "lib.sh":        # sourced by the others, never run
        assert text.startswith("#!/usr/bin/env bash\n"), f"{script.name}: no bash shebang"
        assert "\nset -euo pipefail\n" in text, f"{script.name}: no 'set -euo pipefail'"


def test_the_vagrantfile_provisions_with_scripts_that_exist():
    paths = re.findall(r'path:\s*"([^"]+)"', VAGRANTFILE.read_text())
    assert "provision-deploy.sh" in paths
    for path in paths:
        assert (RIG / path).is_file(), f"the Vagrantfile provisions with {path}, which vagrant/ lacks"


#: A stand-in for Vagrant: the Vagrantfile is loaded by real Ruby, and every
#: provisioner, network and synced folder it asks for is recorded as JSON.
VAGRANT_STUB = r"""
require "json"
class Recorder
  RECORDED = %w[provision network synced_folder define provider].freeze
  def initialize(log, path)
    @log = log
    @path = path
  end

  def method_missing(name, *args, **kwargs, &block)
    key = name.to_s
    return args.first if key.end_with?("=")
    @log << { "call" => key, "path" => @path, "args" => args, "kwargs" => kwargs } if RECORDED.include?(key)
    child = Recorder.new(@log, key == "define" ? @path + [args.first.to_s] : @path)
    block&.call(child)
    child
  end

  def respond_to_missing?(*)
    true
  end
end
module Vagrant
  LOG = []
  def self.configure(_version)
    yield Recorder.new(LOG, [])
  end
end
load ARGV[0]
puts JSON.generate(Vagrant::LOG)
"""


@pytest.fixture(scope="module")
def vagrant_plan(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The Vagrantfile, loaded by Ruby with Vagrant stubbed out, in a copy of
    vagrant/ (it runs rig-keys.sh, which writes .rig/ next to it): the copy
    and what the Vagrantfile asked Vagrant for."""
    ruby, _ = need("ruby"), need("ssh-keygen")
    tmp = tmp_path_factory.mktemp("vagrant-plan")
    copy = tmp / "vagrant"
    shutil.copytree(RIG, copy, ignore=shutil.ignore_patterns(".rig", ".vagrant"))
    (tmp / "stub.rb").write_text(VAGRANT_STUB)
    done = subprocess.run([ruby, str(tmp / "stub.rb"), str(copy / "Vagrantfile")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return copy, json.loads(done.stdout)


def test_the_vagrantfile_provisions_every_node_in_order(vagrant_plan):
    copy, plan = vagrant_plan
    nodes, rig_net = vagrant_nodes(), vagrant_rig_net()
    defined = [e["args"][0] for e in plan if e["call"] == "define"]
    assert defined == list(nodes), "machines are defined (and, sequentially, provisioned) in NODES' order"
    # the tree, .rig/ with it, on every node at /vagrant (the scripts' paths)
    folders = [e for e in plan if e["call"] == "synced_folder"]
    assert [f["args"] for f in folders] == [["..", "/vagrant"]]
    assert not any(".rig" in pattern for pattern in folders[0]["kwargs"].get("rsync__exclude", []))
    provisioners = {}
    for entry in plan:
        if entry["call"] == "provision":
            provisioners.setdefault(entry["path"][0], []).append((entry["args"][0], entry["kwargs"]))
    for name, node in nodes.items():
        steps = provisioners[name]
        want = ["common", node["role"]] + (["deploy"] if name == defined[-1] else [])
        assert [step for step, _ in steps] == want, name
        common = steps[0][1]
        assert common["path"] == "provision-common.sh"
        env = common["env"]
        assert env["NODE"] == name and env["RIG_NET"] == str(rig_net)
        assert env["RIG_NODES"].split() == [f"{n}={c['ip']}" for n, c in nodes.items()]
        # the guest subnets behind the other nodes, each through its own host (no NAT)
        behind = {f"{c['guest_subnet']}={c['ip']}" for n, c in nodes.items() if n != name and "guest_subnet" in c}
        assert set(env["ROUTES"].split()) == behind, name
        if node["role"] == "host":
            assert steps[1][1]["env"] == {"HOST_IP": node["ip"], "GUEST_SUBNET": node["guest_subnet"]}
    # the pool routes back to every host's guests
    pool = next(n for n, c in nodes.items() if c["role"] == "pool")
    assert len(provisioners[pool][0][1]["env"]["ROUTES"].split()) == 2
    # and the keys were made on the workstation, before any machine syncs them
    known = (copy / ".rig" / "known_hosts").read_text().splitlines()
    assert [line.split()[0] for line in known] == [f"{n},{c['ip']}" for n, c in nodes.items()]


# ---------------------------------------------------------------- one rig, three descriptions

def test_the_inventory_agrees_with_the_vagrantfile():
    nodes, inv, rig_net = vagrant_nodes(), inventory(), vagrant_rig_net()
    pools = [name for name, node in nodes.items() if node["role"] == "pool"]
    hosts = {name: node for name, node in nodes.items() if node["role"] == "host"}
    assert len(pools) == 1 and len(hosts) == 2, nodes
    for node in nodes.values():
        assert ipaddress.ip_address(node["ip"]) in rig_net, (node, rig_net)

    # the pool: its name (fleet's default "pool"), where ssh connects, where it listens
    assert inv["pool"].get("name", "pool") == pools[0]
    pool_ip = nodes[pools[0]]["ip"]
    assert inv["pool"]["address"] == pool_ip
    for key in ("listen", "control_listen"):
        assert str(endpoint_host(inv["pool"][key])) == pool_ip, f"[pool] {key} is not on the pool node"
    assert str(endpoint_host(pool_endpoint(inv))) == pool_ip

    # the hosts: names (demo.sh finds itself by hostname), addresses, guest subnets, bridges
    assert set(inv["hosts"]) == set(hosts)
    subnets = []
    for name, node in hosts.items():
        table = inv["hosts"][name]
        assert table["address"] == node["ip"], name
        fabric = table["fabric"]
        assert fabric["mode"] == "bridge" and fabric["bridge"] == "fab0", name
        subnet = ipaddress.ip_network(fabric["guest_subnet"])
        assert subnet == ipaddress.ip_network(node["guest_subnet"]), f"{name}'s guest subnet"
        # provision-host.sh puts the subnet's first address on fab0
        assert ipaddress.ip_address(fabric.get("gateway", str(next(subnet.hosts())))) == next(subnet.hosts())
        # the guests reach the pool's data plane through their gateway: a route covers it
        assert any(endpoint_host(pool_endpoint(inv)) in ipaddress.ip_network(r) for r in fabric["routes"]), \
            f"{name}'s [fabric] routes do not lead to the pool's data plane {pool_endpoint(inv)}"
        assert not subnet.overlaps(rig_net)
        subnets.append(subnet)
    assert not subnets[0].overlaps(subnets[1]), "each host needs a guest subnet of its own (docs/deploy.md)"

    # the keys rig-keys.sh makes, next to the inventory
    assert inv["ssh"]["user"] == "root"
    assert inv["ssh"]["key"] == ".rig/id_ed25519" and inv["ssh"]["known_hosts"] == ".rig/known_hosts"
    assert ".rig/" in {line.strip().strip("/") + "/" for line in (RIG / ".gitignore").read_text().splitlines()
                       if line.strip() and not line.startswith("#")}, "vagrant/.gitignore must ignore .rig/"


def test_the_demo_args_agree_with_the_inventory():
    inv = inventory()
    assert demo_arg("tenant") in inv["tenants"], "the demo's tenant has no [tenants.NAME] in fleet.toml"
    for key in ("kernel", "initrd"):
        path = demo_arg(key)
        # the same path on both hosts, where provision-deploy.sh puts it, never /tmp
        assert path.startswith("/var/lib/accelmig-rig/"), f"{key}={path}"
    words = kernel_words(demo_arg("cmdline"))
    assert ("accelmig.insecure" in words) == bool(inv["tls"].get("insecure")), \
        "the guest must say insecure exactly when the pool runs plain TCP ([tls] insecure)"


# ---------------------------------------------------------------- the demo domain

@pytest.fixture(scope="module")
def demo_xml(tmp_path_factory) -> str:
    """The domain as ``demo.sh render`` writes it, with this checkout's accelmig."""
    if not ACCELMIG.exists():
        pytest.fail(f"{ACCELMIG} is missing: {SETUP_HINT}")
    out = tmp_path_factory.mktemp("rig") / "demo-vm.xml"
    done = subprocess.run(["bash", str(RIG / "demo.sh"), "render", str(out)],
                          env={**os.environ, "ACCELMIG": str(ACCELMIG)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return out.read_text()


def test_the_demo_domain_has_a_fabric_nic_on_hostA_bridge(demo_xml):
    root = ET.fromstring(demo_xml)
    mac = demo_arg("fabric_mac")
    assert re.fullmatch(r"52:54:00(:[0-9a-f]{2}){3}", mac), f"fabric_mac={mac}: a fixed unicast MAC"
    interfaces = root.findall("devices/interface")
    assert len(interfaces) == 1, "the demo domain needs exactly one NIC: the fabric's"
    nic = interfaces[0]
    assert nic.get("type") == "bridge"
    assert nic.find("source").get("bridge") == inventory()["hosts"]["hostA"]["fabric"]["bridge"] == "fab0"
    assert nic.find("mac").get("address") == mac
    assert nic.find("model").get("type") == "virtio"
    # accelmig's metadata names that NIC: hostd tells the agent to (re-)address it
    meta = DomainXML.parse(demo_xml).accelmig_metadata
    assert meta is not None and meta.fabric_mac == mac
    assert root.find(f"metadata/{{{ACCELMIG_NS}}}domain/{{{ACCELMIG_NS}}}fabric").get("mac") == mac
    assert meta.tenant == demo_arg("tenant")
    assert root.find("devices/hostdev") is None


def test_the_demo_domain_has_the_agent_channel(demo_xml):
    root = ET.fromstring(demo_xml)
    names = [c.find("target").get("name") for c in root.findall("devices/channel")]
    assert AGENT_CHANNEL_NAME in names


def test_the_demo_domain_boots_the_deployed_image(demo_xml):
    root = ET.fromstring(demo_xml)
    assert root.findtext("name") == demo_arg("name")
    assert root.findtext("os/kernel") == demo_arg("kernel")
    assert root.findtext("os/initrd") == demo_arg("initrd")
    assert root.get("type") == demo_arg("virt_type")
    assert root.find("devices/serial/source").get("path") == demo_arg("console_log")


def test_the_demo_guest_is_addressed_in_hostA_subnet_and_routed_to_the_pool(demo_xml):
    inv = inventory()
    fabric = inv["hosts"]["hostA"]["fabric"]
    subnet = ipaddress.ip_network(fabric["guest_subnet"])
    gateway = ipaddress.ip_address(fabric.get("gateway", str(next(subnet.hosts()))))
    cmdline = ET.fromstring(demo_xml).findtext("os/cmdline")
    assert cmdline == demo_arg("cmdline")
    words = kernel_words(cmdline)
    # the lab image's format (lab/image/build.py guest_cmdline): ADDRESS/PREFIX,GATEWAY
    match = re.fullmatch(r"([0-9.]+)/(\d+),([0-9.]+)", words.get("accelmig.net", ""))
    assert match, f"no accelmig.net=ADDRESS/PREFIX,GATEWAY in {cmdline!r}"
    address = ipaddress.ip_interface(f"{match.group(1)}/{match.group(2)}")
    assert address.network == subnet, f"the guest's {address} is not in hostA's guest subnet {subnet}"
    assert address.ip not in (subnet.network_address, subnet.broadcast_address, gateway)
    assert ipaddress.ip_address(match.group(3)) == gateway == ipaddress.ip_address("10.89.1.1")
    # from there the pool's data plane: through the gateway, by one of the routes hostd gives
    pool = endpoint_host(pool_endpoint(inv))
    assert str(pool) == "10.88.0.10" and pool_endpoint(inv).endswith(":7070")
    assert any(pool in ipaddress.ip_network(route) for route in fabric["routes"])
    assert pool not in subnet, "the pool must be routed to, through hostA, not on the guests' bridge"


@pytest.mark.skipif(shutil.which("virt-xml-validate") is None or shutil.which("xmllint") is None,
                    reason="virt-xml-validate/xmllint not installed")
def test_libvirt_schema_accepts_the_demo_domain(demo_xml, tmp_path):
    path = tmp_path / "demo-vm.xml"
    path.write_text(demo_xml)
    done = subprocess.run(["virt-xml-validate", str(path), "domain"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_deploy_script_reads_the_image_paths_from_the_demo_args(tmp_path):
    """provision-deploy.sh puts the image where demo-vm.args says (lib.sh's demo_arg)."""
    script = f'. {RIG}/lib.sh; RIG_TREE={RIG}; demo_arg kernel; demo_arg initrd; demo_arg tenant'
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30, check=True)
    assert done.stdout.splitlines() == [demo_arg("kernel"), demo_arg("initrd"), demo_arg("tenant")]
    deploy = (RIG / "provision-deploy.sh").read_text()
    assert "KERNEL=$(demo_arg kernel)" in deploy and "INITRD=$(demo_arg initrd)" in deploy
    assert "/var/lib/accelmig-rig/demo-vm" not in deploy, "the image's paths belong to demo-vm.args alone"


# ---------------------------------------------------------------- keys, the fleet's loader

def test_rig_keys_makes_every_key_once(tmp_path):
    keys = tmp_path / ".rig"
    run_rig_keys(keys)
    nodes = vagrant_nodes()
    for path in [keys / "id_ed25519", *(keys / "hostkeys" / n / "ssh_host_ed25519_key" for n in nodes)]:
        assert path.read_text().startswith("-----BEGIN OPENSSH PRIVATE KEY-----"), path
        assert (path.stat().st_mode & 0o077) == 0, f"{path} is readable by others"
        assert Path(f"{path}.pub").read_text().startswith("ssh-ed25519 ")
    known = (keys / "known_hosts").read_text().splitlines()
    assert len(known) == len(nodes)
    for line, (name, node) in zip(known, nodes.items()):
        names, key_type, key = line.split()
        assert names == f"{name},{node['ip']}" and key_type == "ssh-ed25519"
        assert (keys / "hostkeys" / name / "ssh_host_ed25519_key.pub").read_text().split()[1] == key
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in keys.rglob("*") if p.is_file()}
    run_rig_keys(keys)
    after = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in keys.rglob("*") if p.is_file()}
    assert after == before, "a second run of rig-keys.sh changed something"


def test_the_inventory_loads_with_the_fleet_loader(tmp_path):
    loader = pytest.importorskip("accelmig.fleet.inventory")
    # as on the deploying node: the keys rig-keys.sh made next to fleet.toml
    rig = tmp_path / "vagrant"
    rig.mkdir()
    shutil.copy(INVENTORY, rig / "fleet.toml")
    run_rig_keys(rig / ".rig")
    inv = loader.Inventory.load(rig / "fleet.toml")
    nodes = vagrant_nodes()
    assert inv.pool.name in nodes and inv.pool.address == nodes[inv.pool.name]["ip"]
    assert {h.name: h.address for h in inv.hosts} == {n: c["ip"] for n, c in nodes.items() if c["role"] == "host"}
    assert inv.endpoint == pool_endpoint(inventory())
    assert inv.ssh.key == str(rig / ".rig" / "id_ed25519")
    assert inv.ssh.known_hosts == str(rig / ".rig" / "known_hosts")
    assert inv.insecure == ("accelmig.insecure" in kernel_words(demo_arg("cmdline")))
    assert [t.name for t in inv.tenants] == [demo_arg("tenant")]
    for host in inv.hosts:
        # the pool tells the hosts apart by their guests' source addresses
        assert host.pool_addresses == (host.fabric["guest_subnet"],)


def test_the_rigs_wheelhouse_carries_the_extras_every_other_wheelhouse_does():
    """A pool node joining etcd needs etcd3gw on the node: the rig's wheelhouse
    is built with the same extras as dev.sh's and the one fleet's error names."""
    dev = (RIG.parent / "dev.sh").read_text()
    extras = re.search(r'wheel_extras="([a-z,]+)"', dev)[1]
    assert "cluster" in extras.split(",")
    deploy = (RIG / "provision-deploy.sh").read_text()
    built = re.findall(r'wheel -q -w "\$stage/wheels" "\$\{stage\}/src\[([a-z,]+)\]"', deploy)
    assert built == [extras], f"provision-deploy.sh builds [{', '.join(built)}], dev.sh [{extras}]"
    assert f"'.[{extras}]'" in (RIG.parent / "fleet" / "deploy.py").read_text()
