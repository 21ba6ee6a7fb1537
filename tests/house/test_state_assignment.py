"""A machine's state is assigned in one place: ``StateMachine.fire``
(``accelmig.runtime.statemachine``).  Anywhere else in the shipped code,
``x.state = ...`` or ``x.phase = ...`` is state changed beside the machine's
table, where no table checks it.

PENDING names today's offenders, one a line, a blank line between (so that
removing one never conflicts with removing another): the work packages of
issue 29 convert them and delete their own lines; the list ends empty.  An
entry with no offender left fails too, so the list never outlives the code.
"""

from __future__ import annotations

import ast

from tests.house.shipped import pending, rel, shipped_files, tree

#: where the idiom itself assigns the state
THE_IDIOM = "runtime/statemachine.py"
NAMES = frozenset({"state", "phase", "_state", "_phase"})

PENDING = """
pool/admission.py self.phase        (D: the connection's admission, its own TRANSITIONS and _to)

pool/cluster/registry.py self.state (D: NodeRegistration)

pool/dataplane.py self.state        (D: DataConnection)

plugin/hostd/watch.py self.phase    (D: DomainWatch)

pool/migration.py self.state        (B: the ledger's record)

pool/session.py self.state          (B: the pool's Session)
"""


def assignments() -> set[tuple[str, str, int]]:
    """(file, target, line) of every assignment of a state-like attribute."""
    found = set()
    for path in shipped_files():
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.Assign):
                targets = [t for target in node.targets
                           for t in (target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target])]
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                  and node.args[1].value in NAMES):
                found.add((rel(path), f"setattr(..., {node.args[1].value!r})", node.lineno))
                continue
            else:
                continue
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in NAMES:
                    found.add((rel(path), ast.unparse(target), node.lineno))
    return found


def test_state_is_assigned_only_inside_the_idiom():
    allowed = pending(PENDING)
    outside = sorted(f"{path}:{line}: {target} = ..." for path, target, line in assignments()
                     if path != THE_IDIOM and (path, target) not in allowed)
    assert outside == [], ("state assigned outside StateMachine.fire (runtime/statemachine.py): "
                           "give the machine a table and fire its events\n  " + "\n  ".join(outside))


def test_every_pending_entry_still_has_an_offender():
    """A converted machine's entry goes with it (the list ends empty)."""
    offenders = {(path, target) for path, target, _line in assignments()}
    assert sorted(pending(PENDING) - offenders) == []


def test_the_idiom_is_where_the_scan_finds_its_own_assignments():
    """The scan sees an assignment where there is one (it is not blind)."""
    assert {(path, target) for path, target, _ in assignments() if path == THE_IDIOM} == {(THE_IDIOM, "self.state")}
