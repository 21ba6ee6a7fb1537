"""The guest side (agent/, wire/ and runtime/) keeps to Python 3.9, checked without
any old interpreter: every file parses as 3.9 syntax, and none uses the
3.10+ standard library that a parse cannot see (``zip(strict=)``,
``int.bit_count``, ``dataclass(slots=)``, ``tomllib``, ...).

A check by list cannot be complete; the proof is running the code on a real
3.9 (tests/agent/test_guest_python.py, tests/plugin/test_guest_bundle.py).
This one runs everywhere, so a 3.10+ habit is caught even on a machine
without 3.9."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUEST = sorted(p for side in ("agent", "wire", "runtime") for p in (ROOT / side).rglob("*.py")
               if "__pycache__" not in p.parts)

#: module -> names it gained after 3.9
NEWER_NAMES = {
    "typing": {"ParamSpec", "ParamSpecArgs", "ParamSpecKwargs", "TypeAlias", "TypeGuard", "Concatenate",
               "is_typeddict", "Self", "LiteralString", "Never", "assert_never", "assert_type",
               "reveal_type", "Required", "NotRequired", "Unpack", "TypeVarTuple", "dataclass_transform",
               "override", "get_overloads", "clear_overloads", "TypeIs", "ReadOnly"},
    "asyncio": {"TaskGroup", "timeout", "timeout_at", "Timeout", "Runner", "Barrier"},
    "itertools": {"pairwise", "batched"},
    "enum": {"StrEnum", "ReprEnum", "EnumCheck", "FlagBoundary", "verify", "member", "nonmember",
             "global_enum", "property"},
    "contextlib": {"chdir", "aclosing"},
    "datetime": {"UTC"},
    "hashlib": {"file_digest"},
    "operator": {"call"},
    "logging": {"getLevelNamesMapping", "getHandlerByName", "getHandlerNames"},
    "sys": {"stdlib_module_names", "orig_argv", "exception", "activate_stack_trampoline"},
    "os": {"EFD_CLOEXEC", "eventfd", "splice", "login_tty"},
    "socket": {"IP_RECVTOS", "SO_INCOMING_CPU"},
    "inspect": {"get_annotations"},
    "types": {"EllipsisType", "NoneType", "NotImplementedType", "UnionType"},
    "dataclasses": {"KW_ONLY"},
}
NEWER_MODULES = {"tomllib", "zoneinfo._common"}
#: file -> functions that only the host sides call, which may import a newer
#: module inside (the guest imports the file on 3.9, never calls them)
HOST_ONLY_FUNCTIONS = {"runtime/files.py": {"load_toml", "parse_toml"}}
NEWER_BUILTINS = {"aiter", "anext", "ExceptionGroup", "BaseExceptionGroup", "EncodingWarning"}
#: call -> keyword arguments it gained after 3.9
NEWER_KEYWORDS = {"zip": {"strict"}, "dataclass": {"slots", "kw_only", "match_args", "weakref_slot"},
                  "field": {"kw_only"}, "bisect": {"key"}, "bisect_left": {"key"}, "bisect_right": {"key"},
                  "insort": {"key"}, "insort_left": {"key"}, "insort_right": {"key"},
                  "glob": {"root_dir", "dir_fd", "include_hidden"}, "iglob": {"root_dir", "dir_fd"},
                  "basicConfig": {"encoding", "errors"}}
NEWER_METHODS = {"bit_count", "is_integer_ratio"}


def _name(func) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _bitor_in_runtime_types(node) -> bool:
    """``isinstance(x, A | B)``: a union evaluated at runtime (3.10)."""
    return (isinstance(node, ast.Call) and _name(node.func) in {"isinstance", "issubclass"}
            and len(node.args) == 2 and isinstance(node.args[1], ast.BinOp)
            and isinstance(node.args[1].op, ast.BitOr))


def _annotations(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if arg is not None and arg.annotation is not None:
                    yield arg.annotation
            if node.returns is not None:
                yield node.returns
        elif isinstance(node, ast.AnnAssign):
            yield node.annotation


def newer_than_39(path: Path, root: Path = ROOT) -> list[str]:
    """What in ``path`` a Python 3.9 lacks, as ``file:line: what`` lines."""
    source = path.read_text()
    rel = path.relative_to(root)
    try:
        tree = ast.parse(source, filename=str(rel), feature_version=(3, 9))
    except SyntaxError as exc:
        return [f"{rel}:{exc.lineno}: not 3.9 syntax: {exc.msg}"]
    found = []
    postponed = any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
                    and any(a.name == "annotations" for a in n.names) for n in tree.body)

    def say(node, what):
        found.append(f"{rel}:{getattr(node, 'lineno', '?')}: {what}")

    host_only = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                 and f.name in HOST_ONLY_FUNCTIONS.get(rel.as_posix(), ()) for n in f.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in NEWER_MODULES and id(node) not in host_only:
                    say(node, f"imports {alias.name} (3.11)")
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in NEWER_MODULES:
                say(node, f"imports {node.module}")
            for alias in node.names:
                if alias.name in NEWER_NAMES.get(node.module, ()):
                    say(node, f"from {node.module} import {alias.name} (3.10+)")
        elif isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.attr in NEWER_NAMES.get(node.value.id, ()):
                say(node, f"{node.value.id}.{node.attr} (3.10+)")
            elif node.attr in NEWER_METHODS:
                say(node, f".{node.attr}() (3.10+)")
        elif isinstance(node, ast.Name) and node.id in NEWER_BUILTINS:
            say(node, f"{node.id} (3.10+)")
        if isinstance(node, ast.Call):
            for keyword in node.keywords:
                if keyword.arg in NEWER_KEYWORDS.get(_name(node.func), ()):
                    say(node, f"{_name(node.func)}({keyword.arg}=...) (3.10+)")
            if isinstance(node.func, ast.Attribute) and node.func.attr == "joinpath" and len(node.args) > 1:
                # importlib.resources in a zip (the guest bundle) is zipfile.Path: one name on 3.9
                say(node, "joinpath() with more than one name (3.10+ in a zip)")
            if _bitor_in_runtime_types(node):
                say(node, "a union 'A | B' evaluated at runtime (3.10)")
    if not postponed:
        for annotation in _annotations(tree):
            if any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.BitOr) for n in ast.walk(annotation)):
                say(annotation, "an 'X | Y' annotation without 'from __future__ import annotations'")
    return found


def test_the_guest_side_is_there_to_check():
    names = {p.relative_to(ROOT).as_posix() for p in GUEST}
    assert {"agent/cli.py", "agent/driver/device.py", "agent/daemon/agent.py", "wire/frames.py"} <= names


@pytest.mark.parametrize("path", GUEST, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_guest_code_is_python_39(path):
    assert newer_than_39(path) == []


@pytest.mark.parametrize("snippet, words", [
    ("match x:\n    case 1:\n        pass\n", "not 3.9 syntax"),
    ("import tomllib\n", "imports tomllib"),
    ("for a, b in zip(x, y, strict=True):\n    pass\n", "zip(strict=...)"),
    ("from dataclasses import dataclass\n@dataclass(slots=True)\nclass A:\n    x: int\n", "dataclass(slots="),
    ("n = (5).bit_count()\n", ".bit_count()"),
    ("import asyncio\nasync def f():\n    async with asyncio.TaskGroup():\n        pass\n", "asyncio.TaskGroup"),
    ("from typing import Self\n", "from typing import Self"),
    ("ok = isinstance(x, int | None)\n", "evaluated at runtime"),
    ("def f(x: int | None):\n    pass\n", "without 'from __future__ import annotations'"),
    ("import importlib.resources as r\nt = r.files('p').joinpath('data', 'x').read_text()\n", "joinpath() with more"),
])
def test_the_check_sees_what_39_lacks(tmp_path, snippet, words):
    # the check itself, on code that 3.9 refuses (so an empty result above means something)
    path = tmp_path / "newer.py"
    path.write_text(snippet)
    found = newer_than_39(path, tmp_path)
    assert len(found) == 1 and words in found[0], found


def test_postponed_annotations_may_use_unions(tmp_path):
    path = tmp_path / "fine.py"
    path.write_text("from __future__ import annotations\ndef f(x: int | None) -> list[str]:\n"
                    "    return [str(x)]\n")
    assert newer_than_39(path, tmp_path) == []
