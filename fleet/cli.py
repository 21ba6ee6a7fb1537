"""``accelmig fleet``: deploy, doctor and status over SSH, from an inventory."""

from __future__ import annotations

import json
import sys
import threading

import click

from accelmig.runtime.cli import exit_codes_epilog
from accelmig.wire.errors import AccelmigError

INVENTORY_HELP = ("The fleet's inventory (TOML): [ssh], [install], [tls], [pool], [tenants.NAME], "
                  "[hosts.NAME]; see docs/fleet.md.")


def inventory_option(func):
    return click.option("--inventory", "-i", "inventory_path", required=True, metavar="FILE",
                        envvar="ACCELMIG_FLEET_INVENTORY", show_envvar=True, help=INVENTORY_HELP)(func)


def json_option(func):
    return click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")(func)


def _load(inventory_path: str):
    from accelmig.fleet.inventory import Inventory
    try:
        return Inventory.load(inventory_path)
    except AccelmigError as exc:
        _fail(exc.message, 2)


def _fail(message: str, code: int = 1):
    click.echo(f"accelmig fleet: {message}", err=True)
    sys.exit(code)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


@click.group("fleet", context_settings={"help_option_names": ["-h", "--help"]},
             epilog=exit_codes_epilog(click=True))
def fleet():
    """Deploy and check every node of a deployment over SSH.

    Run from a workstation or an admin node with 'pip install
    accelmig[fleet]'.  Nodes are reached as root (or a user with
    passwordless sudo), by key, their host keys checked against the
    inventory's known_hosts: an unknown or changed key is refused.
    """


@fleet.command()
@inventory_option
@click.option("--dry-run", is_flag=True, help="Say what would change on each node; change nothing.")
@click.option("--only", multiple=True, metavar="NODE", help="Deploy only this node (repeatable).")
@json_option
def deploy(inventory_path, dry_run, only, as_json):
    """Install, configure and start accelmig on every node.

    \b
    On each node, in this order:
      probe     python3 >= 3.11 with venv; hosts: a running libvirt daemon
                (a node that fails it is reported and left untouched)
      wheels    the wheelhouse's wheels, uploaded when missing or different
      venv      PREFIX/venvs/VERSION-HASH-ROLE, complete before it is used;
                PREFIX/venv points at it; older ones pruned (one kept)
      secret    hosts: /etc/accelmig/host.secret made once (0600), then kept
      config    host.toml / pool.toml, hosts.toml, tokens.toml, TLS files,
                checked by accelmig's own loaders before they are sent
      hook      hosts: 'accelmig install --systemd' (hook, unit, libvirt
                reloaded); removed again if it fails where it was not before
      unit      pool: 'accelmig-pool install --systemd' (unit and its user)
      service   systemctl enable; restart when what it reads changed, reload
                when only tenants or hosts did (where systemd is PID 1)
      verify    hosts: 'accelmig doctor'

    A second run with nothing changed changes nothing and says so.  Tenant
    tokens are made on the pool at the first deploy and kept there; they
    are never printed.  Exits 1 when a node failed.
    """
    from accelmig.fleet.deploy import FAILED, UNCHANGED, Deployer
    inventory = _load(inventory_path)
    lock = threading.Lock()

    def progress(node, step):
        if as_json or step.action == UNCHANGED:
            return
        with lock:
            click.echo(f"{node}: {step.name}: {step.action}" + (f" ({step.detail})" if step.detail else ""),
                       err=step.action == FAILED)

    try:
        deployer = Deployer(inventory, dry_run=dry_run, progress=progress, only=tuple(only))
    except AccelmigError as exc:
        _fail(exc.message, 2)
    reports = deployer.run()
    failed = [r for r in reports if r.failed]
    if as_json:
        click.echo(json.dumps({"dry_run": dry_run, "version": deployer.wheelhouse.version,
                               "nodes": [r.to_dict() for r in reports]}, indent=2))
    else:
        rows = [["NODE", "ROLE", "RESULT"]]
        for report in reports:
            if report.failed:
                result = f"FAILED: {report.error}"
            elif report.changed:
                verb = "would change" if dry_run else "changed"
                result = f"{verb}: " + ", ".join(s.name for s in report.steps if s.action not in (UNCHANGED, "ok", "skipped"))
            else:
                result = "unchanged"
            rows.append([report.node, report.role, result])
        for line in _table(rows):
            click.echo(line)
        changed = sum(r.changed for r in reports if not r.failed)
        click.echo(f"accelmig {deployer.wheelhouse.version}: {len(reports)} node(s), {changed} "
                   f"{'would change' if dry_run else 'changed'}, {len(failed)} failed"
                   + (" (dry run: nothing was changed)" if dry_run else "")
                   + ("; nothing to do" if not changed and not failed and not dry_run else ""))
    if failed:
        sys.exit(1)


@fleet.command()
@inventory_option
@json_option
def doctor(inventory_path, as_json):
    """Run 'accelmig doctor' on every host (and check the pool answers):
    one table.

    \b
    Columns are doctor's checks (ok / warn / FAIL / skip); a node that
    cannot be reached or has no accelmig installed says why.  The fleet
    also checks that every node runs the same version.  Exits 1 when a
    check FAILed, a node was unreachable, or versions differ.
    """
    from accelmig.fleet import checks
    inventory = _load(inventory_path)
    results, findings = checks.doctor(inventory)
    bad = [r for r in results if r.failed]
    if as_json:
        click.echo(json.dumps({"ok": not bad and not findings, "findings": findings,
                               "nodes": [r.to_dict() for r in results]}, indent=2))
    else:
        rows = [["NODE", "ROLE", "VERSION", *(c.upper() for c in checks.COLUMNS)]]
        for r in results:
            if r.error:
                rows.append([r.node, r.role, r.version or "-", f"UNREACHABLE/ERROR: {r.error}"]
                            + [""] * (len(checks.COLUMNS) - 1))
                continue
            rows.append([r.node, r.role, r.version or "-",
                         *((r.checks.get(c) or {}).get("status", "-") for c in checks.COLUMNS)])
        for line in _table(rows):
            click.echo(line)
        for r in results:
            for name, check in r.checks.items():
                if check["status"] in ("FAIL", "warn"):
                    click.echo(f"{r.node}: {name}: {check['status']}: {check['reason']}"
                               + (f" (hint: {check['hint']})" if check.get("hint") else ""))
        for finding in findings:
            click.echo(f"fleet: {finding}")
        click.echo(f"{len(results)} node(s), {len(bad)} with a failure"
                   + (f", {len(findings)} fleet finding(s)" if findings else ""))
    if bad or findings:
        sys.exit(1)


@fleet.command()
@inventory_option
@json_option
def status(inventory_path, as_json):
    """Every host's hostd and the pool's migrations, gathered.

    Each migration record once, with the nodes that report it (the pool,
    its source and destination hosts).  Exits 1 when a node could not
    answer.
    """
    from accelmig.fleet import checks
    inventory = _load(inventory_path)
    results, migrations = checks.status(inventory)
    bad = [r for r in results if r.error]
    if as_json:
        click.echo(json.dumps({"nodes": [r.to_dict() for r in results], "migrations": migrations}, indent=2))
    else:
        rows = [["NODE", "ROLE", "VERSION", "STATE"]]
        for r in results:
            if r.error:
                state = f"ERROR: {r.error}"
            elif r.role == "pool":
                state = f"{len((r.data or {}).get('records') or [])} migration record(s)"
            else:
                hostd = ((r.data or {}).get("hostd") or {}).get("status") or {}
                pool = "pool reachable" if (hostd.get("pool") or {}).get("reachable") else "pool NOT reachable"
                domains = [d for d in hostd.get("domains") or [] if d.get("phase") != "gone"]
                state = f"hostd pid {hostd.get('pid')}, {pool}, {len(domains)} accelmig domain(s)"
            rows.append([r.node, r.role, r.version or "-", state])
        for line in _table(rows):
            click.echo(line)
        if migrations:
            click.echo("")
            mrows = [["MIGRATION", "DOMAIN", "FROM", "TO", "STATE", "SEEN BY"]]
            for m in migrations:
                mrows.append([str(m.get("migration_id")), str(m.get("domain_name") or m.get("domain_uuid")),
                              str(m.get("source_host")), str(m.get("dest_host")), str(m.get("state")),
                              ", ".join(m["seen_by"])])
            for line in _table(mrows):
                click.echo(line)
        else:
            click.echo("no migration records")
    if bad:
        sys.exit(1)
