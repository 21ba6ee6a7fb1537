"""``accelmig fleet doctor`` and ``accelmig fleet status``: the sides' own
``doctor``, ``status`` and ``migrations`` run on every node over SSH, in
parallel, gathered into one table (what no single host can say: whether
every node runs the same version, which migrations involve which hosts).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json

from accelmig.fleet import render
from accelmig.fleet.inventory import Inventory, Node
from accelmig.fleet.remote import Remote, Result
from accelmig.wire.errors import AccelmigError

#: doctor's checks, in the table's column order
COLUMNS = ("config", "secret", "hook", "hook runs", "hook seen", "hostd", "pool", "libvirt", "channels")


@dataclasses.dataclass
class NodeCheck:
    node: str
    role: str
    version: str | None = None
    checks: dict = dataclasses.field(default_factory=dict)     # name -> {status, reason, hint}
    data: dict | None = None                                    # status / migrations answers
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None or any(c["status"] == "FAIL" for c in self.checks.values())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"failed": self.failed}


def doctor_argv(inventory: Inventory, node: Node) -> list[str]:
    """``accelmig doctor`` on a host, as deployed (its config, its daemon's pid file)."""
    argv = [inventory.command(node), "doctor", "--config", render.HOST_CONFIG, "--json"]
    if node.libvirtd_pid_file:
        argv += ["--libvirtd-pid-file", node.libvirtd_pid_file]
    return argv


def _json(result: Result) -> dict | None:
    try:
        value = json.loads(result.stdout)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _gather(inventory: Inventory, work) -> list[NodeCheck]:
    def one(node: Node) -> NodeCheck:
        out = NodeCheck(node.name, node.role)
        try:
            with Remote(inventory, node) as remote:
                said = remote.run([inventory.command(node), "--version"])
                out.version = said.text.strip().rsplit(" ", 1)[-1] if said.status == 0 else None
                if out.version is None:
                    out.error = f"accelmig is not installed at {inventory.prefix}/venv ({said.why()})"
                    return out
                work(remote, node, out)
        except AccelmigError as exc:
            out.error = exc.message
        except OSError as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        return out
    with concurrent.futures.ThreadPoolExecutor(len(inventory.nodes)) as workers:
        return list(workers.map(one, inventory.nodes))


def doctor(inventory: Inventory) -> tuple[list[NodeCheck], list[str]]:
    """Every node's checks, and the fleet's own findings (versions)."""
    def work(remote: Remote, node: Node, out: NodeCheck) -> None:
        if node.role == "pool":
            # The admin socket answers only a running pool (root may use it).
            result = remote.run([inventory.command(node), "sessions", "--json"])
            out.checks["pool"] = ({"status": "ok", "reason": "the pool answers on its admin socket"}
                                  if result.status == 0 else
                                  {"status": "FAIL", "reason": result.why(),
                                   "hint": "systemctl status accelmig-pool"})
            return
        result = remote.run(doctor_argv(inventory, node))
        answer = _json(result)
        if answer is None:
            out.error = f"accelmig doctor: {result.why()}"
            return
        for check in answer["checks"]:
            name = "channels" if check["name"].startswith("channel") else check["name"]
            previous = out.checks.get(name)
            if previous is None or _rank(check["status"]) > _rank(previous["status"]):
                out.checks[name] = {k: check.get(k) for k in ("status", "reason", "hint")}

    results = _gather(inventory, work)
    findings = []
    versions = {r.version for r in results if r.version}
    if len(versions) > 1:
        findings.append("versions differ: " + ", ".join(f"{r.node} {r.version}" for r in results if r.version)
                        + ": deploy again (accelmig fleet deploy)")
    return results, findings


def _rank(status: str) -> int:
    return {"ok": 0, "skip": 1, "warn": 2, "FAIL": 3}.get(status, 0)


def status(inventory: Inventory) -> tuple[list[NodeCheck], list[dict]]:
    """Every host's hostd status and the pool's migration records; the
    records merged by migration, with the hosts that report each."""
    def work(remote: Remote, node: Node, out: NodeCheck) -> None:
        command = inventory.command(node)
        argv = ([command, "migrations", "--json"] if node.role == "pool"
                else [command, "status", "--config", render.HOST_CONFIG, "--json"])
        result = remote.run(argv)
        out.data = _json(result)
        if out.data is None or result.status != 0:
            out.error = result.why()

    results = _gather(inventory, work)
    merged: dict[str, dict] = {}
    for result in results:
        data = result.data or {}
        if result.role == "pool":
            records = data.get("records") or data.get("migrations") or []
        else:
            records = ((data.get("hostd") or {}).get("status") or {}).get("records") or []
        for record in records:
            if not isinstance(record, dict) or not record.get("migration_id"):
                continue
            entry = merged.setdefault(record["migration_id"], dict(record, seen_by=[]))
            entry["seen_by"].append(result.node)
    return results, sorted(merged.values(), key=lambda r: str(r.get("opened_at") or r.get("migration_id")))
