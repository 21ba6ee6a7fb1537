"""``accelmig status``: what hostd (and, without it, the pool) knows of this host."""

from __future__ import annotations

import click

from accelmig.plugin.commands.install import (cli_errors, config_option, fail, hostd_settings,
                                              json_option, load_config, print_json)
from accelmig.wire.localapi import LocalClient
from accelmig.wire.errors import AccelmigError, Timeout, Unavailable

HOSTD_TIMEOUT = 3.0
POOL_TIMEOUT = 5.0


def pool_ping(config) -> dict:
    """Ask the pool's control plane ``ping`` with this host's secret."""
    from accelmig.wire.control import ControlClient
    out = {"control": config.pool.control, "reachable": False, "instance": None}
    try:
        secret = config.read_secret()
    except AccelmigError as exc:
        out["error"] = f"no host secret: {exc.message}"
        return out
    try:
        context = config.control_tls()
    except AccelmigError as exc:
        out["error"] = exc.message
        return out
    out["tls"] = context is not None
    client = ControlClient(config.pool.control, config.host_id, secret, timeout=POOL_TIMEOUT, tls=context)
    try:
        answer = client.call("ping")
    except AccelmigError as exc:
        out["error"] = exc.message
        out["code"] = exc.code.value
        return out
    finally:
        client.close()
    out["reachable"] = True
    out["instance"] = (answer or {}).get("instance") or client.instance
    return out


# ---------------------------------------------------------------- formatting

def _get(data, *keys, default=None):
    for key in keys:
        if not isinstance(data, dict) or key not in data:
            return default
        data = data[key]
    return data


def _yes(value, yes: str, no: str, unknown: str = "unknown") -> str:
    return unknown if value is None else (yes if value else no)


def format_identity(identity) -> str:
    if not isinstance(identity, dict):
        return "not discovered yet"
    bits = []
    if identity.get("host_address"):
        via = f" on {identity['interface']}" if identity.get("interface") else ""
        bits.append(f"{identity['host_address']}{via}")
    extra = [f"{k} {identity[k]}" for k in ("mtu", "mac") if identity.get(k)]
    if extra:
        bits.append(f"({', '.join(extra)})")
    if identity.get("pool_endpoint"):
        bits.append(f"-> pool {identity['pool_endpoint']}")
    nic = identity.get("guest_nic")
    if isinstance(nic, dict) and nic.get("address"):
        text = f"{nic['address']}/{nic.get('prefixlen', '?')}"
        if nic.get("gateway"):
            text += f" via {nic['gateway']}"
        if nic.get("routes"):
            text += f" for {', '.join(map(str, nic['routes']))}"
        bits.append(f"; guest fabric {text}")
    return " ".join(bits) or "(empty)"


def format_domain(dom: dict) -> str:
    name = dom.get("name") or "?"
    uuid = dom.get("uuid") or "?"
    state = dom.get("phase") or dom.get("state") or "?"      # hostd says its watch's phase
    chan = dom.get("channel")
    if not isinstance(chan, dict):
        chan_text = "no agent channel"
    else:
        parts = [_yes(chan.get("connected"), "connected", "not connected", "state unknown")]
        if chan.get("synced") is not None:
            parts.append(_yes(chan.get("synced"), "synced", "not synced"))
        chan_text = "channel " + ", ".join(parts)
    sessions = dom.get("sessions") or []
    if not isinstance(sessions, list):
        sessions = [sessions]
    count = dom.get("session_count")
    count = count if isinstance(count, int) and count >= len(sessions) else len(sessions)
    sess_text = f"sessions {count}" + (f": {', '.join(map(str, sessions))}" if sessions else "") + \
        (", ..." if count > len(sessions) else "")
    return f"  {name}  {uuid}  {state}  {chan_text}  {sess_text}"


def format_record(rec: dict, names: dict) -> str:
    uuid = rec.get("domain_uuid") or "?"
    label = rec.get("domain_name") or names.get(uuid)
    head = f"  {label} ({uuid})" if label else f"  {uuid}"
    bits = [head]
    if rec.get("migration_id"):
        bits.append(f"migration {rec['migration_id']}")
    if rec.get("source_host") or rec.get("dest_host"):
        bits.append(f"{rec.get('source_host') or '?'} -> {rec.get('dest_host') or '?'}")
    if rec.get("state"):
        bits.append(str(rec["state"]))
    if rec.get("policy"):
        bits.append(f"pause policy {rec['policy']}")
    resumed = rec.get("resumed")
    if "resumed" not in rec and isinstance(rec.get("session_count"), int) and rec["session_count"]:
        bits.append(f"resumed {rec.get('resumed_count', '?')} of {rec['session_count']}")
    if isinstance(resumed, dict) and resumed:
        parts = []
        for sid, seconds in resumed.items():
            parts.append(f"{sid} {seconds:.3f} s" if isinstance(seconds, (int, float)) else f"{sid} {seconds}")
        bits.append("resumed " + ", ".join(parts))
    return "  ".join(bits)


def format_status(status: dict, socket_path: str) -> list[str]:
    lines = []
    host = status.get("host") or "?"
    pid = status.get("pid")
    uptime = status.get("uptime")
    up = f", up {uptime:.0f} s" if isinstance(uptime, (int, float)) else ""
    lines.append(f"hostd     running (pid {pid if pid is not None else '?'}, host {host}{up}, "
                 f"socket {socket_path})")
    libvirt = status.get("libvirt")
    if isinstance(libvirt, dict):
        lines.append(f"libvirt   {libvirt.get('uri') or '?'}: "
                     f"{_yes(libvirt.get('connected'), 'connected', 'NOT connected')}")
    pool = status.get("pool")
    if isinstance(pool, dict):
        text = _yes(pool.get("reachable"), "reachable", "NOT reachable")
        if pool.get("instance"):
            text += f", instance {pool['instance']}"
        lines.append(f"pool      {pool.get('control') or '?'}: {text}")
    if "identity" in status:
        lines.append(f"identity  {format_identity(status.get('identity'))}")
    domains = status.get("domains")
    names = {}
    if isinstance(domains, list):
        # hostd lists the domains it watches (accelmig's); the others it only
        # counts (``foreign_domains``): they are no accelmig domains
        ours = [d for d in domains if isinstance(d, dict) and d.get("phase") != "gone"]
        foreign = status.get("foreign_domains")
        others = f", {foreign} other domain(s) not accelmig's" if isinstance(foreign, int) and foreign else ""
        lines.append(f"domains   {len(ours)} accelmig domain(s){others}" if ours or others
                     else "domains   none")
        for dom in ours:
            names[dom.get("uuid")] = dom.get("name")
            lines.append(format_domain(dom))
    records = status.get("records")
    if isinstance(records, list):
        lines.append(f"records   {len(records)} migration record(s)" if records else "records   none")
        for rec in records:
            if isinstance(rec, dict):
                lines.append(format_record(rec, names))
    return lines


# ---------------------------------------------------------------- command

@click.command("status")
@config_option
@json_option
@cli_errors
def status(config_path, as_json):
    """Show what hostd knows of this host.

    Asks the host daemon (its local API socket, [hostd] socket in the
    config): its libvirt connection, the pool's reachability, this host's
    network identity, the accelmig domains it watches (their agent
    channels and accelerator sessions) and the migration records it
    follows.  When hostd does not answer, says so, still shows the
    configuration and whether the pool's control plane answers this host,
    and exits 1.
    """
    config, error, path = load_config(config_path)
    socket_path = hostd_settings(config).socket
    out = {"config": {"path": path, "ok": error is None, "host": config.host_id if config else None,
                      "error": error.message if error else None},
           "hostd": {"socket": socket_path, "running": False}}
    try:
        answer = LocalClient(socket_path, timeout=HOSTD_TIMEOUT).call("status")
    except AccelmigError as exc:
        out["hostd"]["error"] = exc.message
        # connecting failed or no answer came, or hostd answered with an error
        out["hostd"]["answered"] = not (isinstance(exc, (Unavailable, Timeout))
                                        and exc.message.startswith("hostd"))
        answer = None
    else:
        out["hostd"]["running"] = True
        out["hostd"]["status"] = answer if isinstance(answer, dict) else {"result": answer}
    if answer is None and config is not None:
        out["pool"] = pool_ping(config)

    if as_json:
        print_json(out)
    else:
        lines = []
        if error is not None:
            lines.append(f"config    {error.message}")
        elif answer is None:
            lines.append(f"config    {path} (host {config.host_id}, pool {config.pool.endpoint}, "
                         f"control {config.pool.control})")
        if answer is not None:
            lines += format_status(out["hostd"]["status"], socket_path)
        else:
            if out["hostd"]["answered"]:
                lines.append(f"hostd     answered with an error: {out['hostd']['error']}")
            else:
                lines.append(f"hostd     NOT RUNNING (or not answering): {out['hostd']['error']}")
                lines.append("          hint: start it with 'accelmig hostd"
                             + (f" --config {path}'" if config_path else "'"))
            pool = out.get("pool")
            if pool is not None:
                text = (f"reachable, instance {pool['instance']}" if pool["reachable"]
                        else f"NOT reachable: {pool.get('error')}")
                lines.append(f"pool      {pool['control']}: {text} (asked directly)")
        for line in lines:
            click.echo(line)
    if answer is None:
        fail(out["hostd"]["error"])
    if error is not None:
        fail(error.message)
