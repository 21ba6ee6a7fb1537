"""``accelmig migrate``: live migration with the operator's intent and a summary.

Plain ``virsh migrate --live`` works just as well (the hook and hostd do the
work); this command adds a pause policy, a progress bar, waits until every
session is rebound at the destination, and reports what it cost.  It talks
to libvirt (to migrate) and to this host's hostd (the intent, the wait, the
counters): never to the pool or the destination directly.
"""

from __future__ import annotations

import json
import sys
import textwrap
import threading
import time
import uuid as uuid_module

import click

from accelmig.runtime.cli import exit_codes_epilog
from accelmig.wire.errors import AccelmigError

#: s to wait, once every session resumed, for the destination's steps of the timeline
TIMELINE_WAIT = 10.0

EXIT_CODES = {0: "migrated, and every session resumed at the destination",
              1: "the migration failed (the VM goes on at the source), or not every session resumed",
              2: "usage, a host config that does not load, no such domain, or libvirt unreachable"}


def _fail(message: str, code: int = 1, as_json: bool = False):
    """One line on stderr; with --json one JSON object on stdout as well."""
    click.echo(f"accelmig migrate: {message}", err=True)
    if as_json:
        click.echo(json.dumps({"ok": False, "error": message}, indent=2))
    sys.exit(code)


def _lookup(libvirt, conn, domain: str):
    """DOMAIN by name, or by UUID where it is one; None when there is none."""
    try:
        return conn.lookupByName(domain)
    except libvirt.libvirtError as exc:
        if exc.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:
            raise
    try:
        uuid_module.UUID(domain)
    except ValueError:
        return None                          # not a UUID either: asking would say "Invalid UUID"
    try:
        return conn.lookupByUUIDString(domain)
    except libvirt.libvirtError as exc:
        if exc.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:
            raise
    return None


def _pool_sessions(hostd, domain_uuid: str) -> dict:
    """The domain's sessions as the pool sees them (through hostd: the one
    holder of this host's pool connection and secret)."""
    try:
        return {s["sid"]: s for s in hostd.sessions(domain_uuid)}
    except AccelmigError:
        return {}


def _timeline(record: dict):
    """The record's timeline, or None where it has none (or a pool that
    says garbage: the summary goes on without it)."""
    from accelmig.wire.records import Timeline
    try:
        timeline = Timeline.from_wire(record.get("timeline") or {})
    except AccelmigError:
        return None
    return timeline if timeline.steps else None


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@click.command(epilog=exit_codes_epilog(EXIT_CODES, click=True))
@click.argument("domain")
@click.argument("dest_uri")
@click.option("--pause-policy", type=click.Choice(["none", "switchover", "start"]), default="none",
              show_default=True, help="When the pool stops executing the domain's commands: never (the "
              "reply log keeps it exact), at switchover, or as soon as the migration starts.")
@click.option("--postcopy", is_flag=True, help="Switch to post-copy after the first pass (the guest runs "
              "on the destination while pages arrive; no way back to the source).")
@click.option("--migrate-uri", metavar="URI", help="Where QEMU sends the memory (e.g. tcp://10.88.3.2), "
              "when the destination's hostname is not the address to use.")
@click.option("--dest-host", metavar="NAME", help="The destination's host id at the pool: no other "
              "host may then open the migration's record.")
@click.option("--timeout", type=float, default=300.0, show_default=True, metavar="SECONDS",
              help="For the migration and the rehome together.")
@click.option("--connect", "connect_uri", metavar="URI", help="Source libvirt URI [default: [hostd] libvirt_uri].")
@click.option("--config", "config_path", metavar="FILE", envvar="ACCELMIG_CONFIG")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def migrate(domain, dest_uri, pause_policy, postcopy, migrate_uri, dest_host, timeout, connect_uri,
            config_path, as_json):
    """Live-migrate DOMAIN to DEST_URI (peer to peer) with its accelerator sessions.

    Registers the intent at the pool (pause policy), runs libvirt's
    migrateToURI3 with a progress bar, waits until every session is
    rebound at the destination, then prints VM downtime (libvirt's job
    stats), accelerator blackout per session, sessions resumed and bytes
    sent to the pool meanwhile (0 for a hot move of a steady workload).

    Example: accelmig migrate vm1 qemu+tcp://hostB/system --migrate-uri tcp://10.88.3.2
    """
    import libvirt

    from accelmig.plugin.config import HostConfig
    # libvirt's default handler prints every error on stderr itself: each
    # one is reported here, once, with what it means for the migration
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
    from accelmig.wire.localapi import LocalClient
    try:
        config = HostConfig.load(config_path)
    except AccelmigError as exc:
        _fail(str(exc), 2, as_json)
    uri = connect_uri or config.hostd.libvirt_uri
    try:
        conn = libvirt.open(uri)
    except libvirt.libvirtError as exc:
        _fail(f"cannot connect to libvirt at {uri}: {exc.get_error_message()}", 2, as_json)
    try:
        dom = _lookup(libvirt, conn, domain)
    except libvirt.libvirtError as exc:
        _fail(f"{domain}: {exc.get_error_message()}", 2, as_json)
    if dom is None:
        _fail(f"no such domain: {domain} (on {uri})", 2, as_json)
    uuid = dom.UUIDString()
    hostd = LocalClient(config.hostd.socket, timeout=10)
    try:
        intent = hostd.call("intent", uuid=uuid, policy=pause_policy, dest_host=dest_host)
    except AccelmigError as exc:
        _fail(f"cannot register the migration at the pool through hostd: {exc}", 1, as_json)
    before = _pool_sessions(hostd, uuid)

    flags = libvirt.VIR_MIGRATE_LIVE | libvirt.VIR_MIGRATE_PEER2PEER
    if postcopy:
        flags |= libvirt.VIR_MIGRATE_POSTCOPY
    params = {}
    if migrate_uri:
        params[libvirt.VIR_MIGRATE_PARAM_URI] = migrate_uri
    outcome: dict = {}

    def run():
        try:
            dom.migrateToURI3(dest_uri, params, flags)
            outcome["ok"] = True
        except libvirt.libvirtError as exc:
            outcome["error"] = exc.get_error_message()

    # a progress bar only for a person watching: not into a log or a pipe
    progress = not as_json and click.get_text_stream("stderr").isatty()
    started = time.monotonic()
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    switched_postcopy = False
    shown = -1
    while worker.is_alive():
        worker.join(0.2)
        try:
            stats = dom.jobStats()
        except libvirt.libvirtError:
            continue
        total, done = stats.get("memory_total") or stats.get("data_total"), stats.get("memory_processed") \
            or stats.get("data_processed")
        if total and progress:
            percent = min(100, int(100 * (done or 0) / total))
            if percent != shown:
                shown = percent
                bar = "#" * (percent // 4)
                click.echo(f"\rmigrating {domain}: [{bar:<25}] {percent:3d}% "
                           f"({_fmt_bytes(done or 0)} of {_fmt_bytes(total)})", nl=False, err=True)
        if postcopy and not switched_postcopy and (stats.get("memory_iteration") or 0) >= 1:
            try:
                dom.migrateStartPostCopy(0)
                switched_postcopy = True
                if not as_json:
                    click.echo(f"\nswitched {domain} to post-copy", err=True)
            except libvirt.libvirtError:
                pass
        if time.monotonic() - started > timeout:
            try:
                dom.abortJob()
            except libvirt.libvirtError:
                pass
    if shown >= 0:
        click.echo("", err=True)             # end the progress bar's line
    migration_s = time.monotonic() - started
    if "error" in outcome:
        _fail(f"the migration of {domain} failed: {outcome['error']} (the VM goes on at the source)",
              1, as_json)
    try:
        wait = max(5.0, timeout - migration_s)
        rehomed = hostd.call("wait_rehomed", timeout=wait + 5, uuid=uuid,
                             migration_id=intent["migration_id"], wait=wait)
    except AccelmigError as exc:
        rehomed = {"error": str(exc), "record": None, "job": None}
    if rehomed.get("rehomed"):
        # the destination's hostd notes its steps once the agent answered:
        # a moment after the sessions resumed (a hostd that never does
        # leaves the timeline without them, not the migration failed)
        try:
            noted = hostd.call("wait_rehomed", timeout=TIMELINE_WAIT + 5, uuid=uuid,
                               migration_id=intent["migration_id"], wait=TIMELINE_WAIT, until="timeline")
            rehomed["record"] = noted.get("record") or rehomed["record"]
        except AccelmigError as exc:
            click.echo(f"accelmig migrate: the destination's steps are not in the timeline: {exc}", err=True)
    record = rehomed.get("record") or {}
    job = rehomed.get("job") or {}       # the source's completed job, downtime included
    after = _pool_sessions(hostd, uuid)
    resent = 0
    for sid, session in after.items():
        was = before.get(sid, {}).get("counters", {})
        now = session.get("counters", {})
        resent += (now.get("bytes_uploaded", 0) - was.get("bytes_uploaded", 0)) + \
                  (now.get("source_bytes", 0) - was.get("source_bytes", 0))
    summary = {
        "ok": bool(rehomed.get("rehomed")), "domain": domain, "uuid": uuid, "migration_id": intent["migration_id"], "policy": pause_policy,
        "postcopy": postcopy, "migration_s": round(migration_s, 3),
        "downtime_ms": job.get("downtime"), "rehomed": rehomed.get("rehomed", False),
        "sessions": record.get("session_count", len(record.get("sessions") or [])),
        "resumed": record.get("resumed_count", len(record.get("resumed") or {})),
        # per session while the record lists them inline (64 at most), the longest always
        "blackout_s": record.get("resumed") or {}, "blackout_max_s": record.get("blackout_max"),
        "bytes_sent_to_pool_meanwhile": resent,
        "record_state": record.get("state"), "error": rehomed.get("error"),
        # every step on the pool's clock (wire.records.TIMELINE_STEPS)
        "timeline": record.get("timeline") or {},
    }
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        click.echo(f"migrated {domain} in {migration_s:.2f} s (migration {intent['migration_id']}, "
                   f"policy {pause_policy}{', post-copy' if postcopy else ''})")
        click.echo(f"  VM downtime (libvirt):      {job.get('downtime', '?')} ms")
        for sid, blackout in (record.get("resumed") or {}).items():
            click.echo(f"  accelerator blackout {sid[-8:]}: {blackout * 1000:.0f} ms")
        if "resumed" not in record and record.get("blackout_max") is not None:
            click.echo(f"  longest accelerator blackout: {record['blackout_max'] * 1000:.0f} ms")
        click.echo(f"  sessions resumed:           {summary['resumed']} of {summary['sessions']}")
        click.echo(f"  bytes sent to the pool meanwhile (uploads + programs): {resent}")
        if rehomed.get("error"):
            click.echo(f"  NOT REHOMED: {rehomed['error']}")
        timeline = _timeline(record)
        if timeline is not None:
            click.echo("timeline (the pool's clock, from the switchover):")
            click.echo(textwrap.indent(timeline.table(), "  "))
    sys.exit(0 if summary["rehomed"] else 1)
