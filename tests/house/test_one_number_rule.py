"""What counts as an integer or a number is decided in one place,
``accelmig.wire.values``: no shipped module writes "an int but not a bool"
by hand (``isinstance(v, int) and not isinstance(v, bool)`` and its
variants), which was written some 35 ways, a few of them wrong.  A plain
"must be a bool" check (``isinstance(v, bool)`` alone) is not one.

PENDING: one entry a line, a blank line between; the agent's split (issue
29, C) empties it."""

from __future__ import annotations

import ast

from tests.house.shipped import pending, rel, shipped_files, tree

THE_RULE = "wire/values.py"

PENDING = """
agent/daemon/agent.py isinstance    (C: the agent's split reads its drivers' values with wire.values)
"""


def _types_asked(node) -> set[str]:
    """The type names of ``isinstance(x, T)`` (T a name or a tuple of them);
    empty for any other node."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
            and len(node.args) == 2):
        return set()
    kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
    return {k.id for k in kinds if isinstance(k, ast.Name)}


def hand_written_checks() -> list[tuple[str, int]]:
    """(file, line) of every boolean expression that asks "is it a bool"
    beside "is it an int (or a float)": the two halves of the rule."""
    found = []
    for path in shipped_files():
        for node in ast.walk(tree(path)):
            if not isinstance(node, ast.BoolOp):
                continue
            asked = [_types_asked(n) for n in ast.walk(node)]
            if {"bool"} in asked and any(kinds & {"int", "float"} and "bool" not in kinds for kinds in asked):
                found.append((rel(path), node.lineno))
    return sorted(set(found))


def test_no_integer_check_is_written_by_hand():
    allowed = {path for path, _what in pending(PENDING)}
    by_hand = [f"{path}:{line}" for path, line in hand_written_checks() if path != THE_RULE and path not in allowed]
    assert by_hand == [], ("an int-but-not-a-bool check written by hand: use accelmig.wire.values "
                           "(is_int, is_number, is_a, field)\n  " + "\n  ".join(by_hand))


def test_every_pending_entry_still_has_an_offender():
    assert sorted({path for path, _ in pending(PENDING)} - {path for path, _ in hand_written_checks()}) == []


def test_the_scan_finds_the_rule_itself():
    """It sees such a check where there is one: in wire/values.py."""
    assert THE_RULE in {path for path, _ in hand_written_checks()}
