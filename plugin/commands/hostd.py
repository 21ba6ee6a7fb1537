"""``accelmig hostd``: run the host daemon."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import click

from accelmig.runtime import logs
from accelmig.runtime.cli import exit_codes_epilog
from accelmig.wire.errors import AccelmigError, AlreadyRunning


@click.command(epilog=exit_codes_epilog({0: "stopped by SIGTERM or SIGINT",
                                         2: "usage, or a host config that does not load",
                                         3: "another hostd already serves [hostd] socket"}, click=True))
@click.option("--config", "config_path", metavar="FILE", envvar="ACCELMIG_CONFIG",
              help="Host config (TOML) [default /etc/accelmig/host.toml; $ACCELMIG_CONFIG].")
@click.option("--rehome-timeout", type=float, default=30.0, show_default=True, metavar="SECONDS",
              help="How long a rehome may take (the guest agent waits for every driver).")
@click.option("--log-format", type=click.Choice(["json", "text"]), default="json", show_default=True)
@click.option("--log-level", type=click.Choice(logs.LEVELS, case_sensitive=False), default="INFO",
              show_default=True)
def hostd(config_path, rehome_timeout, log_format, log_level):
    """Follow libvirt and rehome migrated guests' accelerator sessions.

    One per hypervisor host.  It follows libvirt's domain events, talks to
    the pool's control plane (HMAC with this host's secret), opens the
    guests' agent channels (nobody else may: a QEMU chardev serves one
    client), renews the leases of its migration records, and reconciles
    whatever it missed whenever it (or libvirt) restarts.  The hook and the
    CLI reach it on [hostd] socket.

    SIGHUP reads the config and the secret file again: a new secret
    (rotated with the pool's hosts file) and [hostd] strict take effect at
    once, renewed TLS files ([pool] ca_file, cert_file, key_file, also at
    the same paths) from the next connection to the pool; the log names
    any other changed key, which needs a restart.  A
    config that does not load changes nothing (the log says why).

    The host config, e.g. /etc/accelmig/host.toml:

    \b
      [host]
      id = "hostA"
      [pool]
      endpoint = "10.88.0.1:7070"      # data plane, as guests here reach it
      control = "10.88.0.1:7071"
      secret_file = "/etc/accelmig/host.secret"
      [fabric]
      mode = "bridge"                  # bridge | direct | none
      bridge = "fab0"
      guest_subnet = "10.89.1.0/24"    # a host-bound fabric: guests re-addressed here
      [hostd]
      socket = "/run/accelmig/hostd.sock"
      strict = true
      libvirt_uri = "qemu:///system"
    """
    from accelmig.plugin.config import HostConfig
    from accelmig.plugin.hostd.daemon import HostDaemon
    logs.setup("accelmig-hostd", log_format, log_level)
    logging.getLogger("pyroute2").setLevel(logging.WARNING)   # its debug output is per message
    try:
        config = HostConfig.load(config_path)
        daemon = HostDaemon(config, rehome_timeout=rehome_timeout)
    except AccelmigError as exc:
        click.echo(f"accelmig hostd: {exc}", err=True)
        sys.exit(2)

    async def main():
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, daemon.stop)
        loop.add_signal_handler(signal.SIGHUP, daemon.reload)     # never the default: it kills
        await daemon.run()

    try:
        asyncio.run(main())
    except AlreadyRunning as exc:
        click.echo(f"accelmig hostd: {exc.message}", err=True)
        sys.exit(3)
    except AccelmigError as exc:
        click.echo(f"accelmig hostd: {exc}", err=True)
        sys.exit(2)
