"""``accelmig fleet`` against real sshd: the lab's two hypervisor hosts and
its pool node, each a machine of its own (its own /etc, /opt, /var/lib,
/run: lab/machine.py) with a real OpenSSH server (lab/ssh.py), reached
from the operator's seat (the pool's network namespace) with paramiko.

In order (one lab for the module; each test builds on the one before):

1. a key the nodes refuse, an unknown host, a forged host key: refused,
   nothing changed anywhere;
2. a host whose libvirt is down: reported, left untouched (no hook, no
   files); the rest deployed, the pool serving the host that is ready;
3. the whole fleet deployed from a wheel; a second run changes nothing and
   says so, ``--dry-run`` too; an inventory change touches only its file;
4. the services started from the units the deploy installed (as far as a
   machine without systemd can: lab/machine.py ``service_command``), then
   ``fleet doctor`` is green on every node and ``fleet status`` gathers them;
5. a jump host: hostB reached only through hostA;
6. what the fleet deployed carries a computing VM: booted on hostA, it
   live-migrates to hostB with plain ``virsh migrate`` and finishes its
   computation there on the deployed pool (TLS, the lab's CA), and
   ``fleet status`` shows the migration from the pool and both hosts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib

import pytest
import tomli_w

from tests.support.fleet import (build_wheel, fleet, fleet_json, in_node, lab_inventory, node_snapshot)
from tests.support.wait import wait_for

pytestmark = [pytest.mark.root, pytest.mark.libvirt, pytest.mark.slow]

NODES = ("hostA", "hostB", "pool")


@pytest.fixture(scope="module")
def lab():
    from accelmig.lab.ssh import available
    missing = available()
    if missing:
        pytest.skip(f"SKIPPED LOUDLY: no sshd for the fleet to reach: {missing}")
    from accelmig.lab.rig import Lab
    with Lab(f"fleet{os.getpid() % 100000}", pool=False) as lab:
        yield lab


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    build_wheel(out)
    return out


@pytest.fixture(scope="module")
def inventory(lab, wheel_dir, tmp_path_factory):
    return lab_inventory(lab, tmp_path_factory.mktemp("inventory"), wheel_dir)


def rewrite(path, change) -> None:
    data = tomllib.loads(path.read_text())
    change(data)
    path.write_bytes(tomli_w.dumps(data).encode())


def by_node(answer: dict) -> dict:
    return {n["node"]: n for n in answer["nodes"]}


def read_in(lab, node: str, path: str) -> str:
    done = in_node(lab, node, "cat", path)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_refused_key_an_unknown_host_and_a_forged_host_key_change_nothing(lab, inventory, tmp_path):
    before = {n: node_snapshot(lab, n) for n in NODES}
    assert before == {n: {} for n in NODES}, before          # fresh machines

    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True, timeout=30)
    refused = tmp_path / "refused" / "fleet.toml"
    refused.parent.mkdir()
    refused.write_text(inventory.read_text())
    rewrite(refused, lambda d: d["ssh"].update(key=str(stranger)))
    status, answer = fleet_json(lab, "deploy", "-i", str(refused))
    assert status == 1
    for name, report in by_node(answer).items():
        assert report["failed"] and "refused the key" in report["error"], report

    # known_hosts without hostB: never trusted on first use
    known = tomllib.loads(inventory.read_text())["ssh"]["known_hosts"]
    lines = open(known).read().splitlines()
    unknown = tmp_path / "unknown_hosts"
    unknown.write_text("".join(line + "\n" for line in lines if not line.startswith("hostB,")))
    forged_key = (tmp_path / "stranger.pub").read_text().split()[:2]
    forged = tmp_path / "forged_hosts"
    forged.write_text("".join((line.split(" ")[0] + " " + " ".join(forged_key) if line.startswith("pool,") else line)
                              + "\n" for line in lines))
    for hosts_file, node, words in ((unknown, "hostB", "not in known_hosts"),
                                    (forged, "pool", "is not the one known_hosts has")):
        other = tmp_path / f"inv-{node}" / "fleet.toml"
        other.parent.mkdir()
        other.write_text(inventory.read_text())
        rewrite(other, lambda d: d["ssh"].update(known_hosts=str(hosts_file)))
        status, answer = fleet_json(lab, "deploy", "-i", str(other), "--only", node)
        assert status == 1
        assert words in by_node(answer)[node]["error"], answer
    assert {n: node_snapshot(lab, n) for n in NODES} == before


def test_a_host_whose_libvirt_is_down_is_reported_and_left_untouched(lab, inventory):
    from accelmig.lab.ssh import LabSsh
    node = lab.nodes["hostB"]
    node.stop()                      # hostB's machine lives on: its sshd holds its namespaces
    try:
        status, answer = fleet_json(lab, "deploy", "-i", str(inventory))
        assert status == 1
        reports = by_node(answer)
        assert reports["hostB"]["failed"] and "no libvirt daemon runs" in reports["hostB"]["error"], reports["hostB"]
        assert "nothing was changed" in reports["hostB"]["error"]
        assert node_snapshot(lab, "hostB") == {}             # no hook, no file, no venv
        assert not reports["hostA"]["failed"] and not reports["pool"]["failed"], answer
        hosts = tomllib.loads(read_in(lab, "pool", "/etc/accelmig/hosts.toml"))["hosts"]
        assert sorted(hosts) == ["hostA"]                    # the pool serves the host that is ready
        left_out = [s for s in reports["pool"]["steps"] if s["name"] == "hosts" and s["action"] == "skipped"]
        assert left_out and "hostB" in left_out[0]["detail"]
    finally:
        # hostB again: its machine is made anew with its daemon (lab/machine.py)
        lab.stop_spawned("sshd-hostB")
        node.start()
        node.wait_ready()
        lab.state["nodes"]["hostB"] = node.state()
        lab._write_state()
        LabSsh(lab).start("hostB")


def test_deploy_installs_every_node_and_a_second_run_changes_nothing(lab, inventory):
    status, answer = fleet_json(lab, "deploy", "-i", str(inventory))
    assert status == 0, answer
    reports = by_node(answer)
    assert reports["hostB"]["changed"] and reports["pool"]["changed"]       # hostB joins the pool
    assert not reports["hostA"]["changed"], reports["hostA"]

    # what is where, with which permissions
    pool_hosts = tomllib.loads(read_in(lab, "pool", "/etc/accelmig/hosts.toml"))["hosts"]
    for host in ("hostA", "hostB"):
        secret = read_in(lab, host, "/etc/accelmig/host.secret").strip()
        assert len(secret) >= 32 and pool_hosts[host]["secret"] == secret
        assert in_node(lab, host, "stat", "-c", "%a %U", "/etc/accelmig/host.secret").stdout.split() == ["600", "root"]
        hook = lab.nodes[host].hooks_dir / "50-accelmig"
        assert "/opt/accelmig/venvs/" in hook.read_text() and os.access(hook, os.X_OK)
        unit = lab.machine_path(host, "/etc/systemd/system/accelmig-hostd.service").read_text()
        assert "ExecStart=/opt/accelmig/venvs/" in unit and "--config /etc/accelmig/host.toml" in unit
    for path in ("/etc/accelmig/hosts.toml", "/etc/accelmig/tokens.toml", "/etc/accelmig/tls/pool.key"):
        assert in_node(lab, "pool", "stat", "-c", "%a %U:%G", path).stdout.split() == ["640", "root:accelmig-pool"], path
    token = tomllib.loads(read_in(lab, "pool", "/etc/accelmig/tokens.toml"))["tenants"]["demo"]["token"]
    assert len(token) >= 32

    snapshots = {n: node_snapshot(lab, n) for n in NODES}
    again = fleet(lab, "deploy", "-i", str(inventory))
    assert again.returncode == 0, again.stderr
    assert "3 node(s), 0 changed, 0 failed; nothing to do" in again.stdout
    status, answer = fleet_json(lab, "deploy", "-i", str(inventory), "--dry-run")
    assert status == 0 and not any(n["changed"] for n in answer["nodes"]), answer
    after = {n: node_snapshot(lab, n) for n in NODES}
    # accelmig install records each run in /var/lib/accelmig; nothing else is written
    strip = lambda snap: {k: v for k, v in snap.items() if not k.startswith("/var/lib/accelmig")}   # noqa: E731
    assert {n: strip(s) for n, s in after.items()} == {n: strip(s) for n, s in snapshots.items()}

    # one change in the inventory: one file on one node, the token kept
    rewrite(inventory, lambda d: d["tenants"]["demo"].update(quota="512MiB"))
    status, answer = fleet_json(lab, "deploy", "-i", str(inventory), "--dry-run")
    assert status == 0
    changed = {n["node"]: [s["name"] for s in n["steps"] if s["action"] == "would change"] for n in answer["nodes"]}
    assert changed == {"hostA": [], "hostB": [], "pool": ["file /etc/accelmig/tokens.toml"]}, changed
    status, answer = fleet_json(lab, "deploy", "-i", str(inventory))
    assert status == 0
    tenants = tomllib.loads(read_in(lab, "pool", "/etc/accelmig/tokens.toml"))["tenants"]
    assert tenants["demo"] == {"token": token, "quota": "512MiB"}


def test_services_from_the_installed_units_then_fleet_doctor_and_status(lab, inventory):
    pool = lab.start_unit("pool", "accelmig-pool.service")
    wait_for(lambda: in_node(lab, "pool", "/opt/accelmig/venv/bin/accelmig-pool", "sessions").returncode == 0,
             timeout=60, what="the deployed pool's admin socket",
             explain=lambda: (lab.dir / "unit-pool-accelmig-pool.service.log").read_text()[-3000:])
    uid = in_node(lab, "pool", "id", "-u", "accelmig-pool").stdout.strip()
    with open(f"/proc/{pool.pid}/status") as status_file:
        uids = next(line for line in status_file if line.startswith("Uid:")).split()[1:]
    assert set(uids) == {uid}, uids                     # the unit's User=, not root
    for host in ("hostA", "hostB"):
        lab.start_unit(host, "accelmig-hostd.service")
    for host in ("hostA", "hostB"):
        wait_for(lambda: '"reachable": true' in in_node(
                     lab, host, "/opt/accelmig/venv/bin/accelmig", "status", "--json").stdout,
                 timeout=60, what=f"{host}'s deployed hostd reaching the pool",
                 explain=lambda: (lab.dir / f"unit-{host}-accelmig-hostd.service.log").read_text()[-3000:])

    status, answer = fleet_json(lab, "doctor", "-i", str(inventory))
    assert status == 0 and answer["ok"] and not answer["findings"], answer
    nodes = by_node(answer)
    for host in ("hostA", "hostB"):
        statuses = {name: check["status"] for name, check in nodes[host]["checks"].items()}
        assert statuses == {"config": "ok", "secret": "ok", "hook": "ok", "hook runs": "ok", "hook seen": "ok", "hostd": "ok",
                            "pool": "ok", "libvirt": "ok", "channels": "ok"}, nodes[host]
    assert nodes["pool"]["checks"]["pool"]["status"] == "ok"
    assert {n["version"] for n in answer["nodes"]} == {"0.1.0"}
    table = fleet(lab, "doctor", "-i", str(inventory))
    assert table.returncode == 0 and table.stdout.splitlines()[0].split()[:4] == ["NODE", "ROLE", "VERSION", "CONFIG"]

    status, answer = fleet_json(lab, "status", "-i", str(inventory))
    assert status == 0, answer
    for report in answer["nodes"]:
        if report["role"] == "host":
            assert report["data"]["hostd"]["status"]["pool"]["reachable"] is True


def test_a_jump_host_reaches_a_host_only_it_can_reach(lab, inventory, tmp_path):
    hidden = lab.topology.host("hostB").address          # the migration link: hostA's neighbour only
    through = tmp_path / "fleet.toml"
    through.write_text(inventory.read_text())
    rewrite(through, lambda d: d["hosts"]["hostB"].update(address=hidden))
    status, answer = fleet_json(lab, "status", "-i", str(through))
    assert status == 1 and by_node(answer)["hostB"]["error"], answer     # not from the operator's seat
    uplink = lab.topology.host("hostA").uplink_address
    rewrite(through, lambda d: d["ssh"].update(jump=f"root@{uplink}"))
    status, answer = fleet_json(lab, "status", "-i", str(through))
    assert status == 0, answer
    assert by_node(answer)["hostB"]["data"]["hostd"]["status"]["host"] == "hostB"


@pytest.mark.vm
def test_the_deployed_install_carries_a_computing_vm_through_a_live_migration(lab, inventory):
    from accelmig.lab.accel import AccelLab, demo_command
    from accelmig.lab.image import ImageSpec, build_image
    token = tomllib.loads(read_in(lab, "pool", "/etc/accelmig/tokens.toml"))["tenants"]["demo"]["token"]
    image = build_image(ImageSpec(app_command=demo_command(token, steps=400, size=64, report=10, pause=0.05)),
                        cache=lab.cache)
    guest = AccelLab(lab.name)             # its console helpers, on this lab's state
    name = "fleetvm"
    xml = lab.domain_xml(name, image, "hostA", guest_index=30)
    assert "accelmig.pool_ca=" in xml                              # the guest checks the deployed pool's certificate
    lab.connect("hostA").createXML(xml, 0)
    first = guest.wait_demo(name, lambda lines: [l for l in lines if "step" in l], timeout=180,
                            what="the demo computing on the deployed pool")
    dest_uri, migrate_uri = lab.migration_uris("hostB")
    moved = subprocess.run(["virsh", "-c", lab.uri("hostA"), "migrate", "--live", "--p2p", name, dest_uri,
                            "--migrateuri", migrate_uri], capture_output=True, text=True, timeout=300)
    assert moved.returncode == 0, moved.stderr
    steps_before = max(l["step"] for l in first)
    guest.wait_demo(name, lambda lines: any(l.get("step", 0) > steps_before + 20 for l in lines), timeout=180,
                    what="the demo going on after the migration")
    done = guest.demo_done(name)
    assert done["done"] is True, done
    # the same solver, never migrated, against the same deployed pool: the same bytes
    from accelmig.lab.topology import POOL_ADDRESS
    reference = subprocess.run(
        ["ip", "netns", "exec", lab.ns_of("hostA"), sys.executable, "-m", "accelmig.agent.demoapp",
         "--endpoint", f"{POOL_ADDRESS}:7070", "--token", token, "--steps", "400", "--size", "64",
         "--report", "400", "--cafile", lab.pki()["ca"]], capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-2000:]
    assert json.loads(reference.stdout.strip().splitlines()[-1])["sha256"] == done["sha256"]
    status, answer = fleet_json(lab, "status", "-i", str(inventory))
    assert status == 0, answer
    moves = [m for m in answer["migrations"] if m.get("source_host") == "hostA" and m.get("dest_host") == "hostB"]
    assert moves and set(moves[-1]["seen_by"]) == {"pool", "hostA", "hostB"}, answer["migrations"]
