"""hostd's systemd unit (``accelmig install --systemd``).

hostd runs as root with a single capability, CAP_DAC_OVERRIDE: the guests'
channel sockets belong to QEMU's user (libvirt-qemu, in per-domain
directories only that user may search), libvirt's read-write socket to root,
and a dedicated user in the ``libvirt`` group would still be locked out of
the channels.  Every other privilege is dropped (docs/systemd.md).
"""

from __future__ import annotations

import os

from accelmig.plugin.config import HostdConfig
from accelmig.runtime import units

UNIT_NAME = "accelmig-hostd.service"


def render(config_path: str | None, hostd: HostdConfig) -> str:
    """The unit running ``accelmig hostd`` (with ``--config config_path``
    when given); ``hostd``'s state directory and socket's directory are the
    unit's writable paths."""
    argv = [*units.entry_point("accelmig", "accelmig.plugin.cli"), "hostd"]
    if config_path:
        argv += ["--config", config_path]
    writable = []
    for path in (hostd.state_dir, os.path.dirname(hostd.socket)):
        path = os.path.abspath(path)
        if path not in writable:
            writable.append(path)
    # "-": a path that does not exist is no reason not to start (hostd says what it misses).
    return units.render(units.template("accelmig.plugin", "accelmig-hostd.service.in"), {
        "EXEC_START": units.command_line(argv),
        "READ_WRITE_PATHS": " ".join(units.quote_arg("-" + p, command=False) for p in writable)})
