"""``accelmig hook``: the libvirt qemu hook, by hand (libvirt runs the
script ``accelmig install`` writes; it calls the same code)."""

from __future__ import annotations

import sys

import click


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def hook(args):
    """Run as libvirt runs it: DOMAIN OPERATION SUB-OPERATION EXTRA, the
    domain XML on stdin.

    Acts only on accelmig domains; only 'migrate begin' and 'restore begin'
    can fail (strict mode, when hostd or the pool cannot be reached); at
    those it prints the domain XML rewritten for this host where a
    host-bound part differs.
    """
    from accelmig.plugin.hook import main
    sys.exit(main(list(args)))
