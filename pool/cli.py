"""``accelmig-pool``: run the pooled accelerator and look inside it."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys

import click

from accelmig.wire import logs
from accelmig.wire.errors import AccelmigError, AlreadyRunning

LOG = logging.getLogger("accelmig.pool")


def _fail(exc: AccelmigError) -> None:
    click.echo(f"accelmig-pool: {exc}", err=True)
    sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """The accelmig accelerator pool.

    A pool node owns accelerators (OpenCL devices: PoCL on a CPU, GPUs,
    FPGAs) and serves sessions to user-space drivers inside virtual
    machines.  Device state (buffers, built programs, queues) stays here
    while the VMs live-migrate between hypervisor hosts.
    """


@main.command()
@click.option("--listen", metavar="HOST:PORT", help="Data-plane address for guest drivers "
              "[config: listen; default 127.0.0.1:7070].")
@click.option("--control-listen", metavar="HOST:PORT", help="Control-plane address for "
              "hypervisor hosts (HMAC-authenticated) [default 127.0.0.1:7071]; '' disables it.")
@click.option("--tokens", "tokens", metavar="FILE", help="Tenants file (TOML): [tenants.NAME] "
              "with token and quota (e.g. quota = \"2GiB\") [default /etc/accelmig/tokens.toml].")
@click.option("--hosts", "hosts", metavar="FILE", help="Hypervisor hosts file (TOML): "
              "[hosts.NAME] with secret (16+ characters) and optional addresses (CIDRs).")
@click.option("--config", "config_path", metavar="FILE", type=click.Path(dir_okay=False),
              help="Pool config (TOML, a [pool] table); flags override it.")
@click.option("--device", metavar="SPEC", help="auto (the first device) or opencl:N "
              "(see 'accelmig-pool devices') [default auto].")
@click.option("--admin-socket", metavar="PATH", help="Local admin socket for 'sessions' and "
              "'migrations' [default /run/accelmig/pool.sock]; '' disables it.")
@click.option("--metrics-listen", metavar="HOST:PORT", help="Serve Prometheus metrics over HTTP "
              "here (they are also on the control plane).")
@click.option("--grace", type=float, metavar="SECONDS", help="How long a session whose "
              "connection died keeps its device state [default 30].")
@click.option("--park-retention", type=float, metavar="SECONDS", help="How long sessions of a "
              "saved domain are kept [default 86400].")
@click.option("--lease-ttl", type=float, metavar="SECONDS", help="Lifetime of an unrenewed "
              "migration record [default 30].")
@click.option("--ticket-ttl", type=float, metavar="SECONDS", help="Lifetime of a resume "
              "ticket [default 300].")
@click.option("--log-format", type=click.Choice(["json", "text"]), help="Log lines on stderr "
              "[default json].")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"],
                                                case_sensitive=False))
def serve(config_path, **flags):
    """Serve accelerator sessions until SIGTERM or SIGINT.

    Example:

      accelmig-pool serve --listen 0.0.0.0:7070 --tokens tokens.toml --hosts hosts.toml
    """
    from accelmig.pool.config import PoolConfig, load_hosts, load_tenants
    from accelmig.pool.devices import open_backend
    from accelmig.pool.listeners import PoolServer
    from accelmig.pool.state import Pool
    try:
        config = PoolConfig.load(config_path, flags)
        logs.setup("accelmig-pool", config.log_format, config.log_level)
        tenants = load_tenants(config.tokens)
        hosts = load_hosts(config.hosts)
        backend = open_backend(config.device)
    except AccelmigError as exc:
        _fail(exc)
    server = PoolServer(Pool(config, backend, tenants, hosts))
    pool = server.pool

    async def run():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await server.start()
        except AlreadyRunning as exc:
            LOG.error("%s", exc.message)
            raise SystemExit(3)
        except (OSError, AccelmigError) as exc:
            LOG.error("cannot listen: %s", exc)
            raise SystemExit(2)
        # A line a supervisor (or a test) can wait for.
        print(json.dumps({"ready": True, "instance": pool.instance, **server.endpoints}), flush=True)
        await stop.wait()
        LOG.info("signal received: stopping")
        await server.stop()

    asyncio.run(run())


def _admin_call(socket_path: str, method: str, **args):
    from accelmig.wire.control import ControlClient
    try:
        with ControlClient("unix:" + socket_path, "admin", None) as client:
            return client.call(method, **args)
    except AccelmigError as exc:
        _fail(exc)


_admin_option = click.option("--admin-socket", default="/run/accelmig/pool.sock", show_default=True,
                             metavar="PATH", help="The pool's admin socket.")


@main.command()
@_admin_option
@click.option("--domain", metavar="UUID", help="Only the sessions of this domain.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def sessions(admin_socket, domain, as_json):
    """List the pool's sessions: state, epoch, host, domain, counters."""
    result = _admin_call(admin_socket, "list_sessions", domain_uuid=domain)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    rows = result["sessions"]
    click.echo(f"pool instance {result['instance']}: {len(rows)} session(s)")
    click.echo(f"{'SESSION':34} {'TENANT':10} {'STATE':9} {'EPOCH':>5} {'HOST':10} {'CMDS':>8} "
               f"{'BUILDS':>6} {'UPLOADED':>10}  DOMAIN")
    for s in rows:
        c = s["counters"]
        click.echo(f"{s['sid']:34} {s['tenant']:10} {s['state']:9} {s['epoch']:>5} "
                   f"{str(s['bound_host']):10} {c['commands']:>8} {c['builds']:>6} "
                   f"{c['bytes_uploaded']:>10}  {s['domain_uuid'] or '-'}")


@main.command()
@_admin_option
@click.option("--open", "open_only", is_flag=True, help="Only records still in progress.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def migrations(admin_socket, open_only, as_json):
    """List migration records: domain, hosts, policy, state, blackout per session."""
    result = _admin_call(admin_socket, "list_records", open_only=open_only)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    rows = result["records"]
    click.echo(f"{len(rows)} record(s)")
    click.echo(f"{'DOMAIN/MIGRATION':52} {'FROM':8} {'TO':8} {'POLICY':10} {'STATE':13} RESUMED")
    for r in rows:
        resumed = ", ".join(f"{sid[-6:]}:{t * 1000:.0f}ms" for sid, t in r["resumed"].items()) or "-"
        click.echo(f"{r['domain_uuid'] + '/' + r['migration_id']:52} {str(r['source_host']):8} "
                   f"{r['dest_host']:8} {r['policy']:10} {r['state']:13} {resumed}")


@main.command()
def devices():
    """List the accelerators this node could serve (their --device SPEC)."""
    from accelmig.pool.devices import list_devices
    found = list_devices()
    if not found:
        click.echo("no OpenCL device found (install pocl-opencl-icd or a vendor ICD)", err=True)
        sys.exit(1)
    for dev in found:
        click.echo(f"{dev['spec']:10} {dev['name']} ({dev['platform']}, "
                   f"{dev['global_mem_size'] >> 20} MiB)")


if __name__ == "__main__":  # pragma: no cover
    main()
