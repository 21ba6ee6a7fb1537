"""In a pool of several nodes each node's ledger answers for its own
sessions: hostd's ``PoolNodes.call_within("wait_record")`` must AND the
nodes' ``rehomed`` verdicts as it ANDs ``reached``, or the coordinator's
"rehomed" would win while another node's sessions have not resumed.

A unit test of that one method, its nodes scripted (the whole path with
real nodes and etcd: ``tests/continuity/test_cluster_migration.py``)."""

from __future__ import annotations

import asyncio

import pytest

from accelmig.plugin.hostd.nodes import PoolNodes


class ScriptedNode:
    """A node's control client that answers ``wait_record`` as told."""

    def __init__(self, answer):
        self.answer = answer

    async def call_within(self, within, method, /, **args):
        assert method == "wait_record"
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def waited(rehomed: bool, resumed: int, count: int = 2) -> dict:
    return {"reached": rehomed, "record": {"state": "completed", "session_count": count,
                                           "resumed_count": resumed, "rehomed": rehomed}}


def nodes_answering(coordinator, other) -> PoolNodes:
    nodes = PoolNodes(ScriptedNode(coordinator), lambda endpoint: ScriptedNode(other))
    nodes.clustered, nodes.nodes = True, {"n2": ("abcd", "tcp://n2")}
    return nodes


@pytest.mark.parametrize("other,rehomed", [
    (waited(True, 2), True),
    (waited(False, 1), False),                     # n2's sessions have not all resumed
    (ConnectionError("n2 unreachable"), False),    # n2 says nothing: not known to be rehomed
])
def test_rehomed_only_when_every_node_says_so(other, rehomed):
    nodes = nodes_answering(waited(True, 2), other)
    answer = asyncio.run(nodes.call_within(5, "wait_record", domain_uuid="d", migration_id="m",
                                           until="rehomed", timeout=1))
    assert answer["record"]["rehomed"] is rehomed and answer["reached"] is rehomed
