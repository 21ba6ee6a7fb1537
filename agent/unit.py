"""The guest agent's systemd unit, in its two modes (standard library only).

- **channel** (``--port /dev/virtio-ports/...``, the default): the host
  talks to the agent over a virtio-serial port.  The unit is bound to the
  port's device unit (``BindsTo=``, ``WantedBy=``): it starts when the port
  appears, also hot-plugged, and stops with it; only that device is allowed.
- **none** (``--port none``): a VM that only has qemu-guest-agent (Nova);
  hosts rehome it through ``guest-exec`` of ``accelmig-agent rehome
  --stdin``.  Nothing to bind to: the unit is wanted by multi-user.target
  and sees no devices at all.
"""

from __future__ import annotations

import os
import sys
import zipimport

from accelmig.runtime import units
from accelmig.wire.errors import BadRequest

UNIT_NAME = "accelmig-agent.service"
TEMPLATE = "accelmig-agent.service.in"


def mode_of(port: str) -> str:
    if port == "none":
        return "none"
    if port.startswith("/dev/"):
        return "channel"
    raise BadRequest(f"--port {port!r}: a unit runs the agent on a virtio-serial device (/dev/...) "
                     f"or with --port none")


def agent_command() -> list[str]:
    """How this installation runs ``accelmig-agent``: the guest bundle
    (``python3 accelmig-agent.pyz``) when this code is imported from one,
    else the console script (``units.entry_point``)."""
    import accelmig.agent
    loader = getattr(accelmig.agent.__spec__, "loader", None)
    if isinstance(loader, zipimport.zipimporter):
        return [os.path.abspath(sys.executable), os.path.abspath(loader.archive)]
    return units.entry_point("accelmig-agent", "accelmig.agent.cli")


def render(port: str, endpoint: str | None = None) -> str:
    """The unit's text for ``port`` (a device path or ``none``)."""
    mode = mode_of(port)
    argv = [*agent_command(), "run", "--port", port]
    if endpoint:
        argv += ["--endpoint", endpoint]
    if mode == "channel":
        device = units.device_unit(port)
        dependencies = ("# Start once the host's channel exists (also hot-plugged); stop with it.\n"
                        f"BindsTo={device}\nAfter={device} network.target")
        devices = ("# Only the channel: virtio-serial ports are \"virtio-portsdev\" in /proc/devices.\n"
                   "DevicePolicy=closed\nDeviceAllow=char-virtio-portsdev rw")
        wanted_by = device
    else:
        dependencies = ("# No channel: hosts rehome this guest through qemu-guest-agent (guest-exec\n"
                        "# of 'accelmig-agent rehome --stdin'), so there is no device to bind to.\n"
                        "After=network.target")
        devices = "PrivateDevices=yes"
        wanted_by = "multi-user.target"
    return units.render(units.template("accelmig.agent", TEMPLATE), {
        "MODE": mode, "DEPENDENCIES": dependencies, "EXEC_START": units.command_line(argv),
        "DEVICES": devices, "WANTED_BY": wanted_by})
