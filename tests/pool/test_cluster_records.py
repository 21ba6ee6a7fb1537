"""Migration records across pool nodes in a real etcd (``pool.cluster.records``):
one record with a part per node, each step ONE transaction that moves all of
them or none, an abort that releases every part, a node's part that goes
with its lease, and an etcd restart that loses nothing.  Nodes here are
real registrations (``NodeRegistration``: a key under a live lease), the
store a real etcd; the two-node migration through pools and hostd is in
``tests/continuity/test_cluster_migration.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("etcd3gw", reason="the cluster extra (pip install 'accelmig[cluster]')")

from accelmig.pool.cluster.records import (RECORDS, EtcdRecords, StoredRecord, part_key,  # noqa: E402
                                           record_key)
from accelmig.pool.cluster.registry import NodeRegistration, NodeView  # noqa: E402
from accelmig.pool.cluster.store import ClusterStore  # noqa: E402
from accelmig.pool.ledger import LedgerRecord  # noqa: E402
from accelmig.wire.errors import RecordState  # noqa: E402
from accelmig.wire.records import PausePolicy, RecordStateName as S  # noqa: E402
from tests.support.etcd import etcd_server  # noqa: E402,F401  (the fixture)

DOMAIN = "6f1c1f8e-7d1e-4a53-9c55-0d6a3c6f2b11"


@pytest.fixture
def cluster(etcd_server):
    """Two registered nodes, n1 and n2 (each its own lease), and the store."""
    store = ClusterStore([("127.0.0.1", etcd_server.client_port)])
    registrations = {}
    for index, name in enumerate(("n1", "n2")):
        view = NodeView(name=name, instance=f"aaaa000{index}", data=f"127.0.0.1:{7100 + index}",
                        control=f"127.0.0.1:{7200 + index}", devices=(), sessions=0)
        registrations[name] = NodeRegistration(store, view, ttl=30).start()
    yield store, registrations
    for registration in registrations.values():
        registration.stop()


def opened(ledger: EtcdRecords, mid: str = "m1") -> StoredRecord:
    local = LedgerRecord(DOMAIN, mid, "hostA", "hostB", PausePolicy.NONE, 30.0, 0.0)
    return ledger.open(local)


def states(store, mid: str = "m1") -> dict:
    """Every key of the record as etcd holds it: key -> state."""
    kvs, _ = store.range(record_key(DOMAIN, mid))
    return {key.rsplit("/", 1)[1] if key != record_key(DOMAIN, mid) else "record": value["state"]
            for key, value, _ in kvs}


def test_a_record_opens_with_a_part_per_live_node_each_under_that_nodes_lease(cluster):
    store, registrations = cluster
    stored = opened(EtcdRecords(store, "n1"))
    assert stored == EtcdRecords(store, "n1").read(DOMAIN, "m1")        # what it says is what etcd holds
    assert stored.state is S.OPEN and stored.nodes == {"n1": "aaaa0000", "n2": "aaaa0001"}
    assert set(stored.parts) == {"n1", "n2"}
    for name, part in stored.parts.items():
        assert part.lease == registrations[name].lease != 0
    assert stored.lease not in (0, registrations["n1"].lease, registrations["n2"].lease)
    # the other node opening the same migration finds it: one record, not two
    again = opened(EtcdRecords(store, "n2"))
    assert again.mod_revision == stored.mod_revision and again.nodes == stored.nodes
    # what etcd holds: states, names, parties; no ticket, token or secret
    kvs, _ = store.range(RECORDS)
    assert len(kvs) == 3
    text = repr(kvs).lower()
    assert "ticket" not in text and "token" not in text and "secret" not in text


def test_every_step_moves_the_record_and_every_part_together(cluster):
    store, _ = cluster
    n1, n2 = EtcdRecords(store, "n1"), EtcdRecords(store, "n2")
    opened(n1)
    assert n1.advance(DOMAIN, "m1", "switchover").state is S.SWITCHED_OVER
    assert states(store) == {"record": "switched_over", "n1": "switched_over", "n2": "switched_over"}
    # the other node taking the same step is a repeat: nothing written
    revision = store.get(record_key(DOMAIN, "m1"))[1]["mod_revision"]
    assert n2.advance(DOMAIN, "m1", "switchover").mod_revision == revision
    # the source stops before the destination completes: noted; completing closes
    assert n1.advance(DOMAIN, "m1", "close").source_stopped
    assert n2.advance(DOMAIN, "m1", "complete").state is S.CLOSED
    assert states(store) == {"record": "closed", "n1": "closed", "n2": "closed"}
    # a closed record cannot be aborted: etcd says so, whichever node asks
    with pytest.raises(RecordState, match="closed"):
        n1.advance(DOMAIN, "m1", "abort", abort_reason="too late")


def test_a_step_whose_guard_fails_on_one_part_moves_nothing(cluster):
    store, _ = cluster
    ledger = EtcdRecords(store, "n1")
    stored = opened(ledger)
    # n2's part changes after the read (as a concurrent step would change it)
    key = part_key(DOMAIN, "m1", "n2")
    value, meta = store.get(key)
    store.put(key, value, meta["lease"])
    assert ledger.step(stored, "switchover") is None
    assert states(store) == {"record": "open", "n1": "open", "n2": "open"}       # not one moved
    # read again, the same step commits, all together; what it says is what etcd holds
    after = ledger.step(ledger.read(DOMAIN, "m1"), "switchover")
    assert states(store) == {"record": "switched_over", "n1": "switched_over", "n2": "switched_over"}
    assert after == ledger.read(DOMAIN, "m1")


def test_an_abort_releases_every_nodes_part_in_one_transaction(cluster):
    store, _ = cluster
    ledger = EtcdRecords(store, "n2")
    opened(ledger)
    ledger.advance(DOMAIN, "m1", "switchover")
    before = store.get(record_key(DOMAIN, "m1"))[1]["mod_revision"]
    aborted = ledger.advance(DOMAIN, "m1", "abort", abort_reason="the migration failed (by hostA)")
    assert aborted == ledger.read(DOMAIN, "m1")
    assert aborted.state is S.ABORTED and aborted.abort_reason == "the migration failed (by hostA)"
    assert states(store) == {"record": "aborted", "n1": "aborted", "n2": "aborted"}
    # one transaction: every key of the record carries the same revision, a later one
    # (other writes, a node's load, may come between: only the sameness is the proof)
    revisions = {meta["mod_revision"] for _, _, meta in store.range(record_key(DOMAIN, "m1"))[0]}
    assert len(revisions) == 1 and revisions.pop() > before
    # no node may complete it now
    with pytest.raises(RecordState, match="aborted"):
        EtcdRecords(store, "n1").advance(DOMAIN, "m1", "complete")


def test_a_node_that_dies_loses_its_part_with_its_lease_and_the_record_names_it_lost(cluster):
    store, registrations = cluster
    ledger = EtcdRecords(store, "n1")
    opened(ledger)
    ledger.advance(DOMAIN, "m1", "switchover")
    store.revoke(registrations["n2"].lease)          # what etcd does when n2's TTL runs out
    stored = ledger.read(DOMAIN, "m1")
    assert set(stored.parts) == {"n1"} and "n2" not in stored.lost   # not written yet
    completed = ledger.advance(DOMAIN, "m1", "complete")
    assert completed == ledger.read(DOMAIN, "m1")
    assert completed.state is S.COMPLETED and completed.lost == ("n2",)
    assert completed.nodes["n2"] == "aaaa0001" and completed.lost == ("n2",)
    assert states(store) == {"record": "completed", "n1": "completed"}


def test_an_etcd_restart_mid_migration_loses_nothing(cluster, etcd_server):
    store, _ = cluster
    ledger = EtcdRecords(store, "n1")
    opened(ledger)
    ledger.advance(DOMAIN, "m1", "switchover")
    etcd_server.restart()
    assert states(store) == {"record": "switched_over", "n1": "switched_over", "n2": "switched_over"}
    assert ledger.advance(DOMAIN, "m1", "complete").state is S.COMPLETED
    assert states(store) == {"record": "completed", "n1": "completed", "n2": "completed"}


def test_a_record_that_does_not_check_is_a_clear_error_and_odd_ids_get_keys_of_their_own(cluster):
    store, _ = cluster
    ledger = EtcdRecords(store, "n1")
    store.put(record_key(DOMAIN, "bad"), {"domain_uuid": DOMAIN, "migration_id": "bad", "state": "open",
                                          "nodes": {"n1": "not-hex"}, "dest_host": "hostB", "policy": "none"})
    with pytest.raises(Exception, match="does not check"):
        ledger.read(DOMAIN, "bad")
    odd = "../../nodes/n1"
    assert record_key(DOMAIN, odd).startswith(RECORDS + DOMAIN + "/~")
    stored = opened(ledger, odd)
    assert stored.migration_id == odd and stored.key == record_key(DOMAIN, odd)
