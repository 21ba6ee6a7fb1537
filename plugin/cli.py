"""``accelmig``: the hypervisor host's operator CLI.

Each command lives in its own module under accelmig.plugin.commands and is
imported only when used (``accelmig --help`` and the libvirt hook stay fast).
Other installed distributions add commands through entry points of the group
``accelmig.commands`` (``accelmig lab`` comes from accelmig-lab, a test rig
that production hosts do not install); a built-in name always wins.
"""

from __future__ import annotations

import importlib
import importlib.metadata

import click

from accelmig.runtime.cli import exit_codes_epilog

COMMANDS_GROUP = "accelmig.commands"

COMMANDS = {
    "hook": ("accelmig.plugin.commands.hook", "hook", "The libvirt qemu hook (libvirt calls it)."),
    "hostd": ("accelmig.plugin.commands.hostd", "hostd", "Run the host daemon."),
    "migrate": ("accelmig.plugin.commands.migrate", "migrate", "Live-migrate a domain with its sessions."),
    "status": ("accelmig.plugin.commands.status", "status", "What hostd and the pool know of this host."),
    "install": ("accelmig.plugin.commands.install", "install", "Install the hook where libvirt runs it."),
    "uninstall": ("accelmig.plugin.commands.install", "uninstall", "Remove the hook."),
    "domain": ("accelmig.plugin.commands.domain", "domain", "Render accelerator-ready domain XML."),
    "doctor": ("accelmig.plugin.commands.doctor", "doctor", "Check hook, hostd, pool and channels."),
    "guest-bundle": ("accelmig.plugin.commands.guest_bundle", "guest_bundle",
                     "Write the guest side as one zipapp (Python 3.9+)."),
    # run on an operator's machine, not a host: its own extra ('fleet')
    "fleet": ("accelmig.fleet.cli", "fleet", "Deploy and check every node over SSH (inventory)."),
}


class LazyGroup(click.Group):
    """The built-in ``COMMANDS`` plus those of the installed ``accelmig.commands``
    entry points (``entry_points``: the ones to use instead, for tests)."""

    def __init__(self, *args, entry_points=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.entry_points = entry_points

    def added_commands(self) -> dict[str, importlib.metadata.EntryPoint]:
        found = self.entry_points
        if found is None:
            found = importlib.metadata.entry_points(group=COMMANDS_GROUP)
        return {ep.name: ep for ep in found if ep.name not in COMMANDS}

    def list_commands(self, ctx):
        return [*COMMANDS, *sorted(self.added_commands())]

    def get_command(self, ctx, name):
        entry = COMMANDS.get(name)
        if entry is not None:       # the hook's path: no entry-point scan
            module, attr, _ = entry
            return getattr(importlib.import_module(module), attr)
        added = self.added_commands().get(name)
        return added.load() if added is not None else None

    def format_commands(self, ctx, formatter):
        # Short help without importing every built-in command module; an
        # added command is loaded for its own.
        added = sorted(self.added_commands().items())
        limit = formatter.width - 6 - max(len(name) for name in [*COMMANDS, *dict(added)])
        rows = [(name, help_text) for name, (_, _, help_text) in COMMANDS.items()]
        rows += [(name, ep.load().get_short_help_str(limit)) for name, ep in added]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog=exit_codes_epilog({3: "hostd: another hostd already serves its socket"}, click=True))
@click.version_option(package_name="accelmig", prog_name="accelmig", message="%(prog)s %(version)s")
def main():
    """accelmig on a hypervisor host.

    VMs whose applications compute on a pooled accelerator live-migrate
    with their accelerator sessions intact: a libvirt hook and the host
    daemon (hostd) follow each migration, tell the guest agent where the
    pool is from the new host, and the pool resumes every session there.
    Plain 'virsh migrate --live' works: no accelmig command is needed.

    Configuration: /etc/accelmig/host.toml (see 'accelmig hostd --help').
    """


if __name__ == "__main__":  # pragma: no cover
    main()
