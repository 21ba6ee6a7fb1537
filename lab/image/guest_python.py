"""The guest's Python: the host's own interpreter, the part of its stdlib a
headless guest imports, the shared libraries ``ldd`` names, and accelmig's
guest side (``accelmig.agent``, ``accelmig.wire``, ``accelmig.runtime``:
standard library only), so the image builds in seconds from files already
on disk.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from .errors import ImageError, run

#: Where the guest's Python finds accelmig (Debian's python3.11 has it on
#: ``sys.path`` through site.py: no PYTHONPATH needed).
GUEST_SITE = "/usr/lib/python3/dist-packages"

#: stdlib parts a headless guest never imports (saves ~35 MB of initramfs).
STDLIB_EXCLUDE_DIRS = frozenset({
    "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3",
    "pydoc_data", "distutils", "site-packages", "dist-packages", "venv",
    "sqlite3", "curses", "dbm", "__phello__",
})
# sitecustomize.py: Debian's apport hook, a link out of the stdlib.
STDLIB_EXCLUDE_FILES = frozenset({"turtle.py", "antigravity.py", "this.py", "sitecustomize.py"})
#: Extension modules left out (tests, terminals, databases, audio), and so
#: the libraries only they need.
DYNLOAD_EXCLUDE = re.compile(
    r"^(_test|_xx|xxlimited|_ctypes_test|_curses|_dbm|_gdbm|nis|_sqlite3|readline|"
    r"ossaudiodev|audioop|_tkinter)")


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImageError(f"cannot find the {name} package to copy into the image")
    return Path(list(spec.submodule_search_locations)[0])


def source_files(root: Path):
    """Files of a source package, without bytecode caches."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
        for name in sorted(filenames):
            if not name.endswith((".pyc", ".pyo")):
                yield Path(dirpath) / name


def stdlib_dir(python: str) -> Path:
    out = run([python, "-S", "-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"]).stdout
    return Path(out.strip())


def stdlib_files(stdlib: Path):
    """(path, is_pyc) of the stdlib files the guest gets."""
    for dirpath, dirnames, filenames in os.walk(stdlib):
        rel = Path(dirpath).relative_to(stdlib)
        if rel == Path("."):
            dirnames[:] = [d for d in dirnames
                           if d not in STDLIB_EXCLUDE_DIRS and not d.startswith("config-")]
        else:
            dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDE_DIRS]
        dirnames.sort()
        in_cache = rel.name == "__pycache__"
        for name in sorted(filenames):
            if rel == Path(".") and name in STDLIB_EXCLUDE_FILES:
                continue
            if rel.name == "lib-dynload" and DYNLOAD_EXCLUDE.match(name):
                continue
            if in_cache:
                # only the plain (non-optimised) bytecode of this interpreter
                if ".opt-" in name or not name.endswith(".pyc"):
                    continue
                yield Path(dirpath) / name
            elif name.endswith((".py", ".so")) or rel.name == "lib-dynload":
                yield Path(dirpath) / name


def ldd(paths, required=()) -> list[str]:
    """The shared libraries (as ldd names them, loader included) of ``paths``.
    A library of one of the ``required`` binaries that this host lacks is an
    error (the guest would fail to start it)."""
    libs: set[str] = set()
    paths = [str(p) for p in paths]
    required = {str(p) for p in required}
    out = run(["ldd", *paths]).stdout
    current = paths[0] if len(paths) == 1 else None
    for line in out.splitlines():
        if not line.startswith(("\t", " ")) and line.endswith(":"):
            current = line[:-1]        # ldd of several files: "path:" heads each one's list
            continue
        line = line.strip()
        if line.endswith("=> not found") and current in required:
            raise ImageError(f"{current} needs {line.split()[0]}, which is not installed on this host")
        match = re.match(r"\S+ => (/\S+) \(0x", line) or re.match(r"(/\S+) \(0x", line)
        if match:
            libs.add(match.group(1))
    # glibc dlopen()s libgcc_s when a thread exits (pthread_exit unwinds);
    # ldd cannot see that, and without it every Python thread's exit aborts.
    for lib in libs.copy():
        if os.path.basename(lib).startswith("libc.so"):
            gcc_s = os.path.join(os.path.dirname(lib), "libgcc_s.so.1")
            if os.path.exists(gcc_s):
                libs.add(gcc_s)
    return sorted(libs)
