"""The bounds of a tenant's program build, checked before the compiler runs.

Not a defence of the node's files: a build runs in the tenant's device
process, which sees none of them (``accelmig.pool.devices.sandbox``), so
``#include "/etc/hostname"`` fails as a missing file does, whatever its
spelling.  The regular-expression deny-list that stood here could not be
complete (``/**/#include`` passed it) and is gone; so is the allow-list of
options: ``-I``, ``-include`` or ``@file`` name paths that are not there.
What stays bounds the pool's own work, whatever the source says: its size
and its options' length, and neither check looks at a path.
"""

from __future__ import annotations

from accelmig.wire.errors import BadRequest

#: longest build options (a command line's worth)
MAX_OPTIONS = 4096


def check_source(source: str, max_bytes: int) -> None:
    nbytes = len(source.encode("utf-8", "surrogatepass"))
    if nbytes > max_bytes:
        raise BadRequest(reason=f"program source of {nbytes} bytes is over the pool's limit of "
                                f"{max_bytes} (max_source_bytes)")


def check_options(options: str, what: str = "build") -> None:
    if len(options) > MAX_OPTIONS:
        raise BadRequest(reason=f"{what} options of {len(options)} characters ({MAX_OPTIONS} at most)")
