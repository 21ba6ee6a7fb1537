"""``accelmig-pool``: run the pooled accelerator and look inside it."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys

import click

from accelmig.runtime import logs
from accelmig.runtime.cli import exit_codes_epilog
from accelmig.wire.dataplane import parse_endpoint, parse_listen_list
from accelmig.wire.errors import AccelmigError, AlreadyRunning, BadRequest

LOG = logging.getLogger("accelmig.pool")


class ListenAddress(click.ParamType):
    """HOST:PORT to listen on (port 0: any free one; ``[v6]:PORT``), checked by
    wire's one endpoint parser; ``several``: a comma-separated list;
    ``optional``: '' turns the listener off.  The value stays the text given."""

    name = "HOST:PORT"

    def __init__(self, *, several: bool = False, optional: bool = False):
        self.several, self.optional = several, optional

    def convert(self, value, param, ctx):
        if self.optional and value == "":
            return value
        try:
            if self.several:
                parse_listen_list(value)
            else:
                parse_endpoint(value, listen=True)
        except BadRequest as exc:
            self.fail(exc.kwargs.get("reason", exc.message), param, ctx)
        return value


def _fail(exc: AccelmigError) -> None:
    click.echo(f"accelmig-pool: {exc}", err=True)
    sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]},
             epilog=exit_codes_epilog({2: "usage; a config, tenants or hosts file that does not load; "
                                          "cannot listen; no pool at the admin socket",
                                       3: "serve: another pool already owns the admin socket"}, click=True))
@click.version_option(package_name="accelmig", prog_name="accelmig-pool", message="%(prog)s %(version)s")
def main():
    """The accelmig accelerator pool.

    A pool node owns accelerators (OpenCL devices: PoCL on a CPU, GPUs,
    FPGAs) and serves sessions to user-space drivers inside virtual
    machines.  Device state (buffers, built programs, queues) stays here
    while the VMs live-migrate between hypervisor hosts.
    """


@main.command()
@click.option("--listen", type=ListenAddress(several=True), help="Data-plane address for guest drivers "
              "[config: listen; default 127.0.0.1:7070].")
@click.option("--control-listen", type=ListenAddress(optional=True), help="Control-plane address for "
              "hypervisor hosts (HMAC-authenticated) [default 127.0.0.1:7071]; '' disables it.")
@click.option("--tls-cert", metavar="FILE", help="The pool's certificate (PEM) for TLS on both planes; "
              "an IP endpoint needs an IP subjectAltName [config: tls_cert].")
@click.option("--tls-key", metavar="FILE", help="Its private key (PEM) [config: tls_key; default: in "
              "--tls-cert].")
@click.option("--tls-client-ca", metavar="FILE", help="CA (PEM) that signs hosts' certificates: the "
              "control plane then requires one (mutual TLS) [config: tls_client_ca].")
@click.option("--insecure", is_flag=True, default=None, help="Plain TCP on both planes instead of TLS "
              "(anyone on the path reads tokens and data); drivers and hosts must say insecure too.")
@click.option("--tokens", "tokens", metavar="FILE", help="Tenants file (TOML): [tenants.NAME] "
              "with token and quota (e.g. quota = \"2GiB\") [default /etc/accelmig/tokens.toml].")
@click.option("--hosts", "hosts", metavar="FILE", help="Hypervisor hosts file (TOML): "
              "[hosts.NAME] with secret (16+ characters) and optional addresses (CIDRs).")
@click.option("--config", "config_path", metavar="FILE", type=click.Path(dir_okay=False),
              help="Pool config (TOML, a [pool] table); flags override it.")
@click.option("--devices", metavar="LIST", help="The devices to serve: all, or device ids / opencl:N, "
              "comma-separated (see 'accelmig-pool devices') [config: devices; default all]. Each has "
              "its own queues and memory accounting; a session is placed on one (connect(device=...), "
              "else the least loaded) and stays there.")
@click.option("--device", metavar="SPEC", help="Serve one device only (the older form): auto (the "
              "first), opencl:N or a device id; not with --devices.")
@click.option("--device-isolation", type=click.Choice(["process", "none"]), help="process: each tenant's "
              "device work in a process of its own, killed when a call overruns --device-time-limit; "
              "none: all in the pool's process (one trusted tenant only) [default process].")
@click.option("--allow-unconfined-builds", is_flag=True, default=None, help="Serve program builds that "
              "nothing confines (with --device-isolation none, or where device processes cannot be "
              "confined): they can read every file the pool can. One trusted tenant only "
              "[config: allow_unconfined_builds; default: refused].")
@click.option("--device-time-limit", type=float, metavar="SECONDS", help="Longest one device call of a "
              "tenant (a finish, a read, a build) may take before its device process is killed "
              "[default 60].")
@click.option("--upload-arena", metavar="SIZE", help="Shared memory per tenant and device that write "
              "payloads are received into straight from the network, so they reach the tenant's device "
              "process without a copy through its socket; at most the tenant's quota; 0: off "
              "[config: upload_arena; default 256MiB].")
@click.option("--admin-socket", metavar="PATH", help="Local admin socket for 'sessions' and "
              "'migrations' [default /run/accelmig/pool.sock]; '' disables it.")
@click.option("--metrics-listen", type=ListenAddress(optional=True), help="Serve Prometheus metrics over HTTP "
              "here (they are also on the control plane).")
@click.option("--grace", type=float, metavar="SECONDS", help="How long a session whose "
              "connection died keeps its device state [default 30].")
@click.option("--park-retention", type=float, metavar="SECONDS", help="How long sessions of a "
              "saved domain are kept [default 86400].")
@click.option("--lease-ttl", type=float, metavar="SECONDS", help="Lifetime of an unrenewed "
              "migration record [default 30].")
@click.option("--ticket-ttl", type=float, metavar="SECONDS", help="Lifetime of a resume "
              "ticket [default 300].")
@click.option("--cluster", metavar="etcds://HOST:PORT[,...]", help="Join the pool's other nodes: "
              "register this node in etcd under a lease [config: cluster; default: a single node, no etcd]. "
              "etcds:// is TLS with this node's client certificate (--cluster-tls-ca and --cluster-tls-cert "
              "required); etcd:// is plain HTTP, unauthenticated (test rigs), and takes no --cluster-tls-* "
              "file; http(s):// is refused. Checked before serving: a missing file, a key other users may "
              "read, or an etcd that refuses this node stops the pool with exit status 2.")
@click.option("--cluster-tls-ca", metavar="FILE", help="etcds://: CA (PEM) etcd's certificate must verify "
              "against (it must name each endpoint's host) [config: cluster_tls_ca].")
@click.option("--cluster-tls-cert", metavar="FILE", help="etcds://: this node's client certificate (PEM) "
              "for etcd --client-cert-auth [config: cluster_tls_cert].")
@click.option("--cluster-tls-key", metavar="FILE", help="Its private key (PEM), mode 0600 or 0640 "
              "[config: cluster_tls_key; default: in --cluster-tls-cert].")
@click.option("--cluster-user", metavar="USER", help="etcds://: this node's etcd user, when etcd's access "
              "control is on (its role: readwrite on /accelmig/v1/); --cluster-tls-cert must then carry no "
              "CommonName [config: cluster_user; default: none].")
@click.option("--cluster-password-file", metavar="FILE", help="With --cluster-user: the file whose first line "
              "is its password, mode 0600 or 0640 [config: cluster_password_file].")
@click.option("--node-name", metavar="NAME", help="This node's name in the cluster [default: the short "
              "host name].")
@click.option("--cluster-advertise", metavar="HOST:PORT", help="The data endpoint other nodes redirect "
              "drivers to [default: the first --listen address].")
@click.option("--cluster-ttl", type=float, metavar="SECONDS", help="The node's etcd lease: a node that "
              "dies leaves the pool this long after its last renewal [default 10].")
@click.option("--log-format", type=click.Choice(["json", "text"]), help="Log lines on stderr "
              "[default json].")
@click.option("--log-level", type=click.Choice(logs.LEVELS, case_sensitive=False),
              help="[config: log_level; default INFO]")
def serve(config_path, **flags):
    """Serve accelerator sessions until SIGTERM or SIGINT.

    SIGHUP reloads the tenants and hosts files (other settings need a
    restart).  Sessions are untouched; a file that does not load keeps the
    running tenants and hosts, and the log says why.  A removed tenant opens
    no new session, but its sessions keep running until they end; a removed
    host's control-plane calls are refused.

    Example:

      accelmig-pool serve --listen 0.0.0.0:7070 --tokens tokens.toml --hosts hosts.toml \\
          --tls-cert pool.crt --tls-key pool.key --tls-client-ca hosts-ca.crt
    """
    from accelmig.pool.config import PoolConfig, load_hosts, load_tenants
    from accelmig.pool.devices import devices_for
    from accelmig.pool.listeners import PoolServer
    from accelmig.pool.state import Pool
    try:
        config = PoolConfig.load(config_path, flags)
        logs.setup("accelmig-pool", config.log_format, config.log_level)
        tenants = load_tenants(config.tokens)
        hosts = load_hosts(config.hosts)
        config.check_tls(config_path or "flags")
        config.check_cluster_tls_files(config_path or "flags")
        devices = devices_for(config)
    except AccelmigError as exc:
        _fail(exc)
    server = PoolServer(Pool(config, devices, tenants, hosts))
    pool = server.pool

    async def run():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, server.reload)    # never the default: it kills
        store = None
        if config.cluster:
            # before listening: a node etcd refuses (TLS, certificate) never serves a session
            from accelmig.pool.cluster.store import ClusterStore
            try:
                store = ClusterStore.from_config(config)
                await loop.run_in_executor(None, store.probe)
            except AccelmigError as exc:
                LOG.error("cannot join the cluster at %s: %s", config.cluster, exc)
                raise SystemExit(2)
        try:
            await server.start()
        except AlreadyRunning as exc:
            LOG.error("%s", exc.message)
            raise SystemExit(3)
        except (OSError, AccelmigError) as exc:
            LOG.error("cannot listen: %s", exc)
            raise SystemExit(2)
        cluster = None
        if config.cluster:
            from accelmig.pool.cluster.node import ClusterNode
            try:
                cluster = await loop.run_in_executor(None, ClusterNode.join, config, server, store)
            except AccelmigError as exc:
                LOG.error("cannot join the cluster at %s: %s", config.cluster, exc)
                await server.stop()
                raise SystemExit(2)
        # A line a supervisor (or a test) can wait for.
        print(json.dumps({"ready": True, "instance": pool.instance, **server.endpoints,
                          "security": server.security(), **({"node": cluster.name} if cluster else {})}),
              flush=True)
        await stop.wait()
        LOG.info("signal received: stopping")
        if cluster is not None:          # first: no placement sends a session here any more
            await loop.run_in_executor(None, cluster.leave)
        await server.stop()

    try:
        asyncio.run(run())
    finally:
        devices.close()          # the tenants' device processes, their cache directories


def _admin_call(socket_path: str, method: str, **args):
    from accelmig.wire.control import ControlClient
    try:
        with ControlClient("unix:" + socket_path, "admin", None) as client:
            return client.call_all(method, **args)      # every page of a paged listing
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
@click.option("--timeline", "show_timeline", is_flag=True, help="Each record's steps on the pool's "
              "clock, counted from the switchover, with their uncertainty (a guest's are its claims).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (each record's "
              "\"timeline\" included).")
def migrations(admin_socket, open_only, show_timeline, as_json):
    """List migration records: domain, hosts, policy, state, blackout per session."""
    from accelmig.wire.records import Timeline
    result = _admin_call(admin_socket, "list_records", open_only=open_only)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    rows = result["records"]
    click.echo(f"{len(rows)} record(s)")
    click.echo(f"{'DOMAIN/MIGRATION':52} {'FROM':8} {'TO':8} {'POLICY':10} {'STATE':13} RESUMED")
    for r in rows:
        if "resumed" in r:
            resumed = ", ".join(f"{sid[-6:]}:{t * 1000:.0f}ms" for sid, t in r["resumed"].items()) or "-"
        else:           # too many sessions to list inline: the counts and the longest blackout
            resumed = (f"{r['resumed_count']}/{r['session_count']}, longest "
                       f"{(r.get('blackout_max') or 0) * 1000:.0f}ms")
        click.echo(f"{r['domain_uuid'] + '/' + r['migration_id']:52} {str(r['source_host']):8} "
                   f"{r['dest_host']:8} {r['policy']:10} {r['state']:13} {resumed}")
        if show_timeline and r.get("timeline"):
            click.echo("\n".join("    " + line for line in Timeline.from_wire(r["timeline"]).table().splitlines()))


@main.command()
@click.option("--admin-socket", default="/run/accelmig/pool.sock", show_default=True, metavar="PATH",
              help="A running pool's admin socket: its devices with what is in use on them. "
                   "Where no pool answers there, the devices this node has (nothing in use).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def devices(admin_socket, as_json):
    """List the accelerators of this node: SPEC (opencl:N, this enumeration's
    order), stable ID (what --devices and connect(device=ID) take), TYPE
    (gpu, accelerator, cpu, custom), memory, and what is in use.

    The ID is TYPE-HASH-K: HASH from the platform, vendor and name, K the
    rank among identical devices; it stays the same across restarts."""
    import os

    from accelmig.wire.control import ControlClient
    served = None
    if admin_socket and os.path.exists(admin_socket):
        try:
            with ControlClient("unix:" + admin_socket, "admin", None) as client:
                served = client.call("list_devices")
        except AccelmigError as exc:      # a stale socket, a pool of an older version: say so, list ours
            click.echo(f"accelmig-pool: no pool answered at {admin_socket} ({exc}); listing this "
                       f"node's devices", err=True)
    if served is not None:
        found, source = served["devices"], f"pool instance {served['instance']}"
    else:
        from accelmig.pool.devices import list_devices
        found = [dict(d, bytes_in_use=None, sessions=None) for d in list_devices()]
        for dev in found:
            dev.pop("index", None)
        source = "this node (no pool running: nothing in use)"
    if as_json:
        click.echo(json.dumps({"source": source, "devices": found}, indent=2))
    else:
        for dev in found:
            used = "-" if dev.get("sessions") is None else \
                f"{dev['sessions']} sessions, {dev['bytes_in_use'] >> 20} MiB in use"
            click.echo(f"{dev['spec']:10} {dev['id']:22} {dev['type']:11} {dev['name']} "
                       f"({dev['vendor']}, {dev['global_mem_size'] >> 20} MiB): {used}")
    if not found:
        click.echo("no OpenCL device found (install pocl-opencl-icd or a vendor ICD)", err=True)
        sys.exit(1)


@main.command()
@click.option("--systemd", is_flag=True, help="Install the systemd unit accelmig-pool.service and "
              "its user (the only thing there is to install today; the flag keeps the command line "
              "the same as 'accelmig install --systemd' and 'accelmig-agent install --systemd').")
@click.option("--config", "config_path", default="/etc/accelmig/pool.toml", show_default=True,
              metavar="FILE", help="The pool config the unit runs with (baked into ExecStart).")
@click.option("--root", metavar="DIR", type=click.Path(file_okay=False),
              help="Install under this alternate file system root (an image, a test).")
@click.option("--unit-dir", default="/etc/systemd/system", show_default=True, metavar="DIR",
              help="Where the unit goes (under --root).")
@click.option("--print", "print_only", is_flag=True, help="Print the unit and install nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def install(systemd, config_path, root, unit_dir, print_only, as_json):
    """Install the pool as a systemd service.

    Writes accelmig-pool.service (ExecStart: this installation's
    accelmig-pool, User=accelmig-pool, hardened: docs/systemd.md) into
    UNIT_DIR and /etc/sysusers.d/accelmig-pool.conf, creates the user with
    systemd-sysusers, and runs 'systemctl daemon-reload' when systemd is
    PID 1 and the unit went where it reads.  A rerun that would write the
    same files leaves them and says "unchanged".  Then:
    systemctl enable --now accelmig-pool.
    """
    import os

    from accelmig.pool import unit
    from accelmig.runtime import units
    if not systemd:
        raise click.UsageError("nothing to install: pass --systemd")
    config_path = os.path.abspath(config_path)
    rendered = unit.render(config_path)
    if print_only:
        click.echo(rendered["unit"], nl=False)
        return
    try:
        result = units.install_units({unit.UNIT_NAME: rendered["unit"]}, root=root, unit_dir=unit_dir,
                                     sysusers={unit.SYSUSERS_NAME: rendered["sysusers"]})
    except OSError as exc:
        click.echo(f"accelmig-pool: {exc.filename or ''}: {exc.strerror or exc}", err=True)
        sys.exit(1)
    warnings = []
    if not os.path.exists(units.under_root(root, config_path)):
        warnings.append(f"{config_path} does not exist yet: the service will not start without it")
    result["warnings"] = warnings
    for message in warnings:
        click.echo(f"accelmig-pool: warning: {message}", err=True)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        for line in units.summary(result):
            click.echo(line)
    failed = [step for step in (result["users"], result["reload"]) if step["action"] == "failed"]
    if failed:
        click.echo(f"accelmig-pool: {failed[0]['reason']}", err=True)
        sys.exit(1)


if __name__ == "__main__":  # pragma: no cover
    main()
