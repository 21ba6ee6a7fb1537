"""The guest bundle: ``accelmig.agent``, ``accelmig.wire`` and
``accelmig.runtime`` as one standard-library-only zipapp, for guest images
whose Python (3.9 or later) cannot ``pip install accelmig`` (the
distribution needs 3.11: its pool and host sides read TOML with
``tomllib``) or that should not carry pip at all.

One file does both guest jobs:

* ``python3 accelmig-agent.pyz run ...`` is ``accelmig-agent run ...``;
* ``PYTHONPATH=accelmig-agent.pyz python3 app.py`` lets ``app.py`` import
  ``accelmig.agent.driver`` (zipimport).

The archive is built with ``zipfile`` and finished with ``zipapp`` (its
shebang), with fixed timestamps, modes and order, so that the same sources
give the same bytes: a bundle can be checked by its hash.  It holds nothing
but the three guest packages, their declared package data, a ``__main__`` and
a ``.dist-info`` naming the version (``importlib.metadata`` finds it in a
zip, so ``accelmig-agent --version`` answers inside a guest too).  Before
writing, every ``import`` of every module is checked: the standard library,
the three guest packages, or an optional library the code looks for first;
anything else refuses the bundle.
"""

from __future__ import annotations

import ast
import dataclasses
import errno
import hashlib
import importlib.resources
import io
import os
import pathlib
import sys
import zipapp
import zipfile
from importlib import metadata
from importlib.resources.abc import Traversable
from typing import Iterator, Mapping, Union

from accelmig.runtime.files import atomic_write
from accelmig.wire.errors import BadRequest

#: the packages a guest needs, nothing else
PACKAGES = ("accelmig.agent", "accelmig.wire", "accelmig.runtime")

#: package data shipped beside the code (setup.cfg's [options.package_data];
#: the systemd unit and init script the agent installs)
PACKAGE_DATA = {"accelmig.agent": ("data",)}

#: libraries the guest code uses only when the guest has them (looked up
#: with importlib.util.find_spec before the import); never bundled
OPTIONAL = frozenset({"pyroute2", "numpy"})

#: the oldest Python a guest may run it on (tests prove it on a real 3.9)
MIN_PYTHON = (3, 9)

INTERPRETER = "/usr/bin/env python3"

#: zip's epoch; any fixed time makes the archive reproducible
FIXED_TIME = (1980, 1, 1, 0, 0, 0)
FILE_MODE = 0o100644
DIR_MODE = 0o040755

# Kept to the oldest syntax a guest may have, so that a too-old Python gets
# this sentence instead of a SyntaxError from some module of the bundle.
MAIN = '''\
"""accelmig-agent, bundled: 'python3 accelmig-agent.pyz run ...'."""
import sys
if sys.version_info < {min_python!r}:
    sys.exit("accelmig-agent needs Python {min_text} or later; this is %d.%d" % sys.version_info[:2])
from accelmig.agent.cli import main
sys.exit(main())
'''

Source = Union[str, os.PathLike, Traversable]


@dataclasses.dataclass(frozen=True)
class Bundle:
    """What was written."""
    path: str
    size: int
    sha256: str
    version: str
    modules: tuple[str, ...]
    data: tuple[str, ...]
    optional: tuple[str, ...]

    def to_json(self) -> dict:
        return {"path": self.path, "size": self.size, "sha256": self.sha256, "version": self.version,
                "python": ".".join(map(str, MIN_PYTHON)) + "+", "modules": list(self.modules),
                "data": list(self.data), "optional_imports": list(self.optional)}


def distribution_version() -> str:
    try:
        return metadata.version("accelmig")
    except metadata.PackageNotFoundError:      # run from a copy, not an install
        return "0+unknown"


def _walk(root: Traversable, prefix: str) -> Iterator[tuple[str, Traversable]]:
    for child in root.iterdir():
        name = f"{prefix}/{child.name}"
        if child.is_dir():
            yield from _walk(child, name)
        else:
            yield name, child


def _package_files(package: str, root: Traversable) -> dict[str, bytes]:
    """``arcname -> bytes`` of one package: the ``.py`` files of it and of its
    subpackages (directories with an ``__init__.py``), and its declared data."""
    base = package.replace(".", "/")
    if not root.joinpath("__init__.py").is_file():
        raise BadRequest(reason=f"{root}: no {package} package there")
    files: dict[str, bytes] = {}
    stack = [(root, base)]
    while stack:
        folder, arc = stack.pop()
        for child in folder.iterdir():
            name = f"{arc}/{child.name}"
            if child.is_dir():
                if child.joinpath("__init__.py").is_file():
                    stack.append((child, name))
            elif child.name.endswith(".py"):
                files[name] = child.read_bytes()
            elif child.name.endswith((".so", ".pyd")):
                # compiled code is neither portable between guests nor standard library
                raise BadRequest(reason=f"{name}: an extension module cannot go into the guest bundle")
    for data in PACKAGE_DATA.get(package, ()):
        folder = root.joinpath(data)
        if folder.is_dir():
            files.update((name, item.read_bytes()) for name, item in _walk(folder, f"{base}/{data}")
                         if "__pycache__" not in name)
    return files


def module_name(arcname: str) -> str:
    name = arcname[:-len(".py")].replace("/", ".")
    return name[:-len(".__init__")] if name.endswith(".__init__") else name


def check_imports(files: Mapping[str, bytes]) -> list[str]:
    """Parse every module as Python 3.9 and refuse an import that the guest
    may not have; return the optional libraries the code looks for."""
    stdlib = sys.stdlib_module_names
    optional, problems = set(), []
    for arcname, source in sorted(files.items()):
        if not arcname.endswith(".py"):
            continue
        try:
            tree = ast.parse(source, filename=arcname, feature_version=MIN_PYTHON)
        except SyntaxError as exc:
            problems.append(f"{arcname}:{exc.lineno}: not Python {MIN_PYTHON[0]}.{MIN_PYTHON[1]} "
                            f"syntax: {exc.msg}")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue        # a relative import stays inside its package
            for name in names:
                top = name.partition(".")[0]
                if top in stdlib or top == "__future__":
                    continue
                if any(name == p or name.startswith(p + ".") for p in PACKAGES):
                    continue
                if top in OPTIONAL:
                    optional.add(top)
                    continue
                problems.append(f"{arcname}:{node.lineno}: imports {name}, which is neither the "
                                f"standard library nor {' nor '.join(PACKAGES)}")
    if problems:
        raise BadRequest(reason="the guest bundle would not be standard-library-only Python 3.9:\n  "
                         + "\n  ".join(problems))
    return sorted(optional)


def _metadata(version: str) -> bytes:
    return (f"Metadata-Version: 2.1\nName: accelmig\nVersion: {version}\n"
            f"Summary: the guest side of accelmig (accelmig.agent, accelmig.wire, accelmig.runtime), "
            f"bundled by 'accelmig guest-bundle'\n"
            f"Requires-Python: >={MIN_PYTHON[0]}.{MIN_PYTHON[1]}\n").encode()


def _entries(files: Mapping[str, bytes]) -> Iterator[tuple[zipfile.ZipInfo, bytes]]:
    """Every file, and every folder (zipimport finds the namespace package
    ``accelmig`` only by its folder entry), in one fixed order."""
    folders = {name.rsplit("/", i)[0] + "/" for name in files for i in range(1, name.count("/") + 1)}
    for name in sorted(folders | set(files)):
        info = zipfile.ZipInfo(name, date_time=FIXED_TIME)
        info.create_system = 3          # unix, so that the modes below are read
        if name.endswith("/"):
            info.external_attr = (DIR_MODE << 16) | 0x10      # MS-DOS directory bit
            yield info, b""
        else:
            info.external_attr = FILE_MODE << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            yield info, files[name]


def collect(sources: Mapping[str, Source] | None = None, version: str | None = None) -> dict[str, bytes]:
    """``arcname -> bytes`` of the whole bundle; ``sources`` maps a package to
    its folder (the installed packages by default)."""
    files: dict[str, bytes] = {}
    for package in PACKAGES:
        root = (sources or {}).get(package)
        if root is None:
            root = importlib.resources.files(package)
        elif not isinstance(root, Traversable):
            root = pathlib.Path(root)
        files.update(_package_files(package, root))
    version = version or distribution_version()
    files["__main__.py"] = MAIN.format(min_python=MIN_PYTHON,
                                       min_text=".".join(map(str, MIN_PYTHON))).encode()
    files[f"accelmig-{version}.dist-info/METADATA"] = _metadata(version)
    return files


def build(output: str, sources: Mapping[str, Source] | None = None, version: str | None = None) -> Bundle:
    """Write the bundle to ``output`` (atomically) and say what is in it."""
    version = version or distribution_version()
    files = collect(sources, version)
    optional = check_imports(files)
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w", compresslevel=9) as zf:
        for info, data in _entries(files):
            zf.writestr(info, data)
    archive.seek(0)
    output = os.path.abspath(output)
    if not os.path.isdir(os.path.dirname(output)):
        raise FileNotFoundError(errno.ENOENT, "no such directory", os.path.dirname(output))
    pyz = io.BytesIO()
    zipapp.create_archive(archive, pyz, interpreter=INTERPRETER)       # the shebang
    atomic_write(output, pyz.getvalue(), 0o755)
    digest = hashlib.sha256(pyz.getvalue()).hexdigest()
    modules = tuple(sorted(module_name(n) for n in files if n.endswith(".py") and n != "__main__.py"))
    data = tuple(sorted(n for n in files if not n.endswith(".py") and ".dist-info/" not in n))
    return Bundle(path=output, size=os.path.getsize(output), sha256=digest, version=version,
                  modules=modules, data=data, optional=tuple(optional))
