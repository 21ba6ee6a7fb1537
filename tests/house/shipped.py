"""The shipped packages' sources, parsed once for the house tests."""

from __future__ import annotations

import ast
import configparser
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the folders of the shipped distribution's packages (setup.cfg's package_dir)
SHIPPED = ("agent", "pool", "plugin", "wire", "runtime", "fleet")


def package_dirs() -> dict[str, Path]:
    """Every package of the accelmig distribution (setup.cfg) and of the
    lab's (lab/pyproject.toml) -> its folder."""
    import tomllib

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    roots = dict(line.split("=") for line in cfg["options"]["package_dir"].strip().splitlines())
    roots = {name.strip(): folder.strip() for name, folder in roots.items()}
    packages = cfg["options"]["packages"].split()
    lab = tomllib.loads((ROOT / "lab" / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots.update({name: "lab" if folder == "." else f"lab/{folder}" for name, folder in lab["package-dir"].items()})
    packages += lab["packages"]
    out = {}
    for package in packages:
        base = max((name for name in roots if package == name or package.startswith(name + ".")), key=len)
        rest = package[len(base):].lstrip(".").replace(".", "/")
        out[package] = ROOT / roots[base] / rest if rest else ROOT / roots[base]
    return out


def modules(folder: Path) -> set[str]:
    """A package's own modules (not ``__init__``/``__main__``) and its
    subpackages (as ``name/``)."""
    names = {p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")}
    names |= {f"{p.name}/" for p in folder.iterdir() if (p / "__init__.py").is_file()}
    return names


def shipped_files() -> list[Path]:
    return sorted(p for side in SHIPPED for p in (ROOT / side).rglob("*.py") if "__pycache__" not in p.parts)


@functools.lru_cache(maxsize=None)
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def pending(text: str) -> set[tuple[str, str]]:
    """A pending list: one entry a line, ``path what`` and any comment after."""
    return {tuple(line.split()[:2]) for line in text.splitlines() if line.strip()}
