"""``accelmig guest-bundle``: the guest side as one file to copy into a VM."""

from __future__ import annotations

import os
import shlex
import textwrap

import click

from accelmig.plugin import bundle
from accelmig.plugin.commands.install import cli_errors, json_option, print_json
from accelmig.runtime.cli import exit_codes_epilog

EPILOG = exit_codes_epilog(click=True)


def _kib(size: int) -> str:
    return f"{size / 1024:.1f} KiB"


@click.command("guest-bundle", epilog=EPILOG)
@click.option("-o", "--output", default="accelmig-agent.pyz", show_default=True,
              type=click.Path(dir_okay=False, writable=True),
              help="the zipapp to write (replaced atomically)")
@json_option
@cli_errors
def guest_bundle(output, as_json):
    """Write the guest side (accelmig.agent and accelmig.wire, standard
    library only) as one zipapp for Python 3.9 or later.

    \b
    In the guest:
      python3 accelmig-agent.pyz run ...          the agent ('accelmig-agent run ...')
      PYTHONPATH=/opt/accelmig/accelmig-agent.pyz python3 app.py
                                                   applications import accelmig.agent.driver

    The same sources give the same bytes (fixed timestamps and order): the
    printed sha256 identifies a bundle.
    """
    made = bundle.build(output)
    if as_json:
        print_json(made.to_json())
        return
    shown = shlex.quote(os.path.relpath(made.path) if not os.path.isabs(output) else made.path)
    click.echo(f"wrote {shown}: {made.size} bytes ({_kib(made.size)}), accelmig {made.version}, "
               f"Python {'.'.join(map(str, bundle.MIN_PYTHON))}+")
    click.echo(f"  sha256   {made.sha256}")
    click.echo(textwrap.fill(f"  modules  {len(made.modules)}: {', '.join(made.modules)}", width=100,
                             subsequent_indent=" " * 11, break_on_hyphens=False))
    if made.data:
        click.echo(f"  data     {', '.join(made.data)}")
    if made.optional:
        click.echo(f"  used when present, not bundled: {', '.join(made.optional)}")
    click.echo(f"run:     python3 {shown} run --help")
    click.echo(f"import:  PYTHONPATH={shown} python3 -c 'import accelmig.agent.driver'")
