"""What the three command lines share: the version, the exit codes, and
the console-script entry points of ``accelmig`` and ``accelmig-pool``.

Those two need an extra's libraries (click, jinja2, numpy, ...), which a
base install or the other side's install lacks.  Their entry points are
here, standard library only, so that a missing one is a line that says what
to install instead of a traceback; the real command lines are imported
inside.  ``accelmig-agent`` needs nothing outside the standard library.
"""

from __future__ import annotations

import importlib
import sys

DISTRIBUTION = "accelmig"

#: the import names of each extra's libraries (setup.cfg's extras_require)
EXTRAS = {
    "host": frozenset({"click", "jinja2", "libvirt", "libvirtmod", "pyroute2", "prometheus_client"}),
    "pool": frozenset({"click", "numpy", "pyopencl", "prometheus_client", "xxhash"}),
    # 'accelmig fleet', on an operator's machine
    "fleet": frozenset({"click", "paramiko", "tomli_w"}),
}

#: what every command's exit status means; commands add their own
EXIT_CODES = {0: "success", 1: "failure (the message on stderr says why)",
              2: "usage: a bad option, argument or configuration"}


def version() -> str:
    """The installed distribution's version (importlib.metadata)."""
    from importlib import metadata
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:     # run from a copy, not an install
        return "unknown (not installed)"


def exit_codes_epilog(extra: dict | None = None, *, click: bool = False) -> str:
    """The ``Exit status`` paragraph of a ``--help``; ``click=True`` keeps
    click from re-wrapping its lines (its ``\\b`` marker)."""
    codes = {**EXIT_CODES, **(extra or {})}
    lines = ["Exit status:"] + [f"  {code}  {meaning}" for code, meaning in sorted(codes.items())]
    return ("\b\n" if click else "") + "\n".join(lines)


def missing_extra(exc: ModuleNotFoundError, extra: str) -> tuple[str, str] | None:
    """(module, extra): the top-level module that ``exc`` failed to import and
    the extra that has it (``extra`` first: a command of another extra, such
    as 'accelmig fleet', names its own), or None (a module that is no
    optional dependency: a real bug, not a missing extra)."""
    name = (exc.name or "").partition(".")[0]
    for candidate in (extra, *EXTRAS):
        if name in EXTRAS[candidate]:
            return name, candidate
    return None


def run(prog: str, target: str, extra: str, argv=None):
    """Import and call ``module:function``; a missing library of ``extra``,
    at import or in a command that imports it later, exits 1 with what to install."""
    module, _, attr = target.partition(":")
    try:
        main = getattr(importlib.import_module(module), attr)
        return main(argv) if argv is not None else main()
    except ModuleNotFoundError as exc:
        missing = missing_extra(exc, extra)
        if missing is None:
            raise
        module, needed = missing
        print(f"{prog}: this command needs the '{needed}' extra: pip install '{DISTRIBUTION}[{needed}]' "
              f"(missing module: {module})", file=sys.stderr)
        return 1


def accelmig(argv=None):
    """The ``accelmig`` console script (a hypervisor host: the 'host' extra)."""
    return run("accelmig", "accelmig.plugin.cli:main", "host", argv)


def accelmig_pool(argv=None):
    """The ``accelmig-pool`` console script (a pool node: the 'pool' extra)."""
    return run("accelmig-pool", "accelmig.pool.cli:main", "pool", argv)
