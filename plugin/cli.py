"""``accelmig``: the hypervisor host's operator CLI.

Each command lives in its own module under accelmig.plugin.commands and is
imported only when used (``accelmig --help`` and the libvirt hook stay fast).
"""

from __future__ import annotations

import importlib

import click

COMMANDS = {
    "hook": ("accelmig.plugin.commands.hook", "hook", "The libvirt qemu hook (libvirt calls it)."),
    "hostd": ("accelmig.plugin.commands.hostd", "hostd", "Run the host daemon."),
    "migrate": ("accelmig.plugin.commands.migrate", "migrate", "Live-migrate a domain with its sessions."),
    "status": ("accelmig.plugin.commands.status", "status", "What hostd and the pool know of this host."),
    "install": ("accelmig.plugin.commands.install", "install", "Install the hook where libvirt runs it."),
    "uninstall": ("accelmig.plugin.commands.install", "uninstall", "Remove the hook."),
    "domain": ("accelmig.plugin.commands.domain", "domain", "Render accelerator-ready domain XML."),
    "doctor": ("accelmig.plugin.commands.doctor", "doctor", "Check hook, hostd, pool and channels."),
    "lab": ("accelmig.plugin.commands.lab", "lab", "A local lab: two libvirt hosts, a pool, a VM."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        entry = COMMANDS.get(name)
        if entry is None:
            return None
        module, attr, _ = entry
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx, formatter):
        # Short help without importing every command module.
        rows = [(name, help_text) for name, (_, _, help_text) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
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
