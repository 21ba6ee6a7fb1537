"""The pool's systemd unit and its user (``accelmig-pool install --systemd``).

The pool needs no root: it serves TCP ports above 1024 and a unix socket,
and reaches its accelerators through device nodes that udev gives to the
groups ``render`` and ``video``.  So it runs as the system user
``accelmig-pool`` (declared in a sysusers.d file, made by systemd-sysusers),
with no capabilities at all.
"""

from __future__ import annotations

from accelmig.runtime import units

UNIT_NAME = "accelmig-pool.service"
SYSUSERS_NAME = "accelmig-pool.conf"
USER = "accelmig-pool"
DEFAULT_CONFIG = "/etc/accelmig/pool.toml"


def render(config: str = DEFAULT_CONFIG) -> dict[str, str]:
    """``{"unit": text, "sysusers": text}``; ``config`` is baked into ExecStart."""
    argv = [*units.entry_point("accelmig-pool", "accelmig.pool.cli"), "serve", "--config", config]
    unit = units.render(units.template("accelmig.pool", "accelmig-pool.service.in"),
                        {"EXEC_START": units.command_line(argv), "USER": USER})
    return {"unit": unit, "sysusers": units.template("accelmig.pool", "accelmig-pool.sysusers")}
