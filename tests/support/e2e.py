"""Helpers shared by the e2e test modules (tests/e2e/*): what a lab may
leave behind, checking that it left nothing, and logs for assertion
messages.  Test modules import these from here, never from each other."""

from __future__ import annotations

import subprocess
from pathlib import Path

from accelmig.lab import netns
from accelmig.lab.libvirtd import same_process
from accelmig.lab.rig import Lab
from accelmig.lab.topology import Topology

#: Interface names the lab uses (inside its namespaces only).
LAB_LINKS = set(Topology.LINKS)


def snapshot() -> dict:
    """What a lab could leave behind in the root namespaces."""
    with open("/proc/self/mountinfo") as f:
        mounts = sorted(line.split()[4] for line in f)
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {"netns": sorted(netns.names()), "mounts": mounts,
            "links": sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines())}


def leftovers(prefix: str, before: dict, lab_dir: Path | None = None) -> dict:
    """What of *this* lab is still there.  Only this lab's names count:
    other test suites on the same machine create namespaces of their own
    at the same time, so the machine's whole state is not ours to compare."""
    after = snapshot()
    new_mounts = set(after["mounts"]) - set(before["mounts"])
    return {
        "netns": [n for n in after["netns"] if n.startswith(prefix)],
        "mounts": sorted(m for m in new_mounts
                         if prefix in m or (lab_dir is not None and m.startswith(str(lab_dir)))),
        "links": sorted((set(after["links"]) - set(before["links"])) & LAB_LINKS
                        | {n for n in after["links"] if n.startswith(prefix)}),
    }


def assert_clean(lab: Lab, before: dict, pids=()):
    left = leftovers(lab.name, before, lab.dir)
    assert left == {"netns": [], "mounts": [], "links": []}, left
    assert not lab.dir.exists(), f"{lab.dir} is still there"
    for pid, starttime in pids:
        assert not same_process(pid, starttime), f"process {pid} is still running"


def diagnostics(lab: Lab, domain: str | None = None) -> str:
    """Console and daemon logs, for assertion messages."""
    out = []
    for host, node in lab.nodes.items():
        out.append(f"== {host}: {node.tail(10)}")
        if domain:
            for path in (lab.console_log(host, domain), node.qemu_log(domain)):
                if path.exists():
                    out.append(f"== {path}:\n{path.read_text(errors='replace')[-2500:]}")
    return "\n".join(out)
