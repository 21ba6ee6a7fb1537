"""`accelmig fleet` against the lab: the inventory of a lab's three nodes,
the wheelhouse, and the operator's command line, run where an operator's
machine would be (the pool's network namespace reaches every node's sshd;
lab/ssh.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import tomli_w

REPO = Path(__file__).resolve().parents[2]
#: the dependencies' wheels, made by ./dev.sh setup (lab nodes reach no index)
DEPENDENCY_WHEELS = Path(sys.prefix) / "wheelhouse"
ACCELMIG = Path(sys.executable).with_name("accelmig")


def build_wheel(out: Path) -> Path:
    """accelmig's wheel from this checkout (no index needed: setuptools is
    in the virtual environment)."""
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                           "--no-cache-dir", "-w", str(out), str(REPO)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    wheels = list(out.glob("accelmig-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def lab_inventory(lab, directory: Path, wheel_dir: Path, *, hosts=("hostA", "hostB"), ssh: dict | None = None,
                  host_overrides: dict | None = None, tenants: dict | None = None) -> Path:
    """An inventory of ``lab``'s nodes (TLS with the lab's PKI), written
    to ``directory/fleet.toml``."""
    from accelmig.lab.ssh import LabSsh
    from accelmig.lab.topology import POOL_ADDRESS
    operator = LabSsh(lab).operator_dir
    pki = lab.pki()
    data = {
        "ssh": {"key": str(operator / "id_ed25519"), "known_hosts": str(operator / "known_hosts"),
                "connect_timeout": 10, **(ssh or {})},
        "install": {"wheelhouse": [str(wheel_dir), str(DEPENDENCY_WHEELS)]},
        "tls": {"ca": pki["ca"]},
        "pool": {"address": POOL_ADDRESS, "listen": f"{POOL_ADDRESS}:7070",
                 "control_listen": f"{POOL_ADDRESS}:7071", "cert": pki["pool"]["cert"], "key": pki["pool"]["key"],
                 "settings": {"log_format": "text"}},
        "tenants": tenants or {"demo": {"quota": "256MiB"}},
        "hosts": {},
    }
    for host in hosts:
        plan = lab.topology.host(host)
        table = {"address": plan.uplink_address, "cert": pki["hosts"][host]["cert"], "key": pki["hosts"][host]["key"],
                 # the lab's libvirtd writes its pid file under its private /run/libvirt
                 "libvirtd_pid_file": "/run/libvirt/libvirtd.pid",
                 "pool_addresses": [plan.guest_subnet, f"{plan.uplink_address}/32"],
                 "fabric": {"mode": "bridge", "bridge": "fab0", "guest_subnet": plan.guest_subnet,
                            "gateway": plan.gateway}}
        table.update((host_overrides or {}).get(host, {}))
        data["hosts"][host] = table
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "fleet.toml"
    path.write_bytes(tomli_w.dumps(data).encode())
    return path


def fleet(lab, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``accelmig fleet ARGS`` from the operator's seat (the pool's netns)."""
    argv = ["ip", "netns", "exec", lab.topology.pool_ns, str(ACCELMIG), "fleet", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def fleet_json(lab, *args: str, timeout: float = 600) -> tuple[int, dict]:
    done = fleet(lab, *args, "--json", timeout=timeout)
    try:
        return done.returncode, json.loads(done.stdout)
    except ValueError:
        raise AssertionError(f"not JSON (exit {done.returncode}): {done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def in_node(lab, node: str, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """A command run as on ``node``'s machine (its namespaces)."""
    from accelmig.lab.ssh import LabSsh
    pid = LabSsh(lab).machine_pid(node)
    return subprocess.run(["nsenter", "--target", str(pid), "--mount", "--net", "--uts", "--", *argv],
                          capture_output=True, text=True, timeout=timeout)


def node_snapshot(lab, node: str) -> dict:
    """What a deploy writes on ``node`` (paths, modes, owners, sizes), as the
    node sees them."""
    listing = in_node(lab, node, "sh", "-c",
                      "find /etc/accelmig /opt/accelmig /var/lib/accelmig /etc/systemd/system "
                      "/etc/libvirt/hooks -mindepth 1 -maxdepth 3 -printf '%p %m %u:%g %s %T@\\n' 2>/dev/null; true")
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in listing.stdout.splitlines()
            if "accelmig" in line}
