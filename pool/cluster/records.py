"""Migration records across the nodes of a pool, kept in etcd.

One VM's sessions may live on several nodes; its migration is one record
with one part per node, and every step moves them together:

- ``records/<domain>/<migration>``: the record (state, parties, policy, the
  nodes that take part, the nodes lost since), under a lease of its own
  (``RECORD_TTL``: a bound on what an abandoned record holds in etcd, far
  longer than any migration);
- ``records/<domain>/<migration>/<node>``: that node's part (its name,
  instance and the state it follows), under *that node's* lease: a node that
  dies loses its part when its lease runs out, and the record's readers see
  its sessions lost (never re-created elsewhere).

Each step is ONE transaction guarded by the record's and every part's
``mod_revision`` as read: a record or a part that changed (another node's
step, a part whose node died) fails it whole, nothing moves, and the step
reads again.  The state machine is the one of a node's own records
(``pool.ledger.LedgerRecord.TABLE``): etcd takes a step first, each node's
ledger follows it (``pool.ledger.cluster.EtcdFollower``), so no node is ever
ahead of etcd.  etcd never holds tickets, tokens, secrets or device data: tickets are
minted by each node for its own sessions and travel only to the host.

Every value read is input: bounded, every field checked (``StoredRecord.parse``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import time

from accelmig.pool.cluster.keys import PREFIX, check_name
from accelmig.pool.cluster.registry import live_nodes
from accelmig.pool.cluster.store import ClusterStore
from accelmig.pool.ledger.record import LedgerRecord, RecordEvent
from accelmig.wire.errors import NoSuchRecord, RecordState, Unavailable
from accelmig.wire.records import FINAL, PausePolicy, RecordStateName

LOG = logging.getLogger("accelmig.pool.cluster")

RECORDS = PREFIX + "records/"
#: s an abandoned record stays in etcd (its parts go with their nodes' leases earlier)
RECORD_TTL = 24 * 3600
#: nodes one record names: a value stays well within the store's MAX_VALUE_BYTES
MAX_NODES = 128
#: steps lost in a row to other nodes' before giving up (they made progress)
MAX_ROUNDS = 16
#: a host name or reason as the control plane bounds them
MAX_TEXT = 256
_INSTANCE = re.compile(r"^[0-9a-f]{4,32}$")


def _part(text: str) -> str:
    """A domain uuid or migration id as one key part: itself when it is a
    plain name, else its digest marked '~' (which no plain name has)."""
    try:
        return check_name(text, "key part")
    except ValueError:
        return "~" + hashlib.sha256(str(text).encode()).hexdigest()[:32]


def record_key(domain_uuid: str, migration_id: str) -> str:
    return RECORDS + _part(domain_uuid) + "/" + _part(migration_id)


def part_key(domain_uuid: str, migration_id: str, node: str) -> str:
    return record_key(domain_uuid, migration_id) + "/" + check_name(node, "node name")


def _text(value, what: str, optional: bool = False):
    if value is None and optional:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TEXT:
        raise ValueError(f"{what} is not a string of 1 to {MAX_TEXT} characters")
    return value


@dataclasses.dataclass(frozen=True)
class StoredPart:
    node: str
    instance: str
    state: RecordStateName
    mod_revision: int
    lease: int

    @classmethod
    def parse(cls, key: str, value: dict, meta: dict, record: str) -> "StoredPart":
        node = check_name(value.get("node"), "node")
        if key != record + "/" + node:
            raise ValueError(f"part {key!r:.120} does not name node {node}")
        instance = value.get("instance")
        if not isinstance(instance, str) or not _INSTANCE.match(instance):
            raise ValueError("instance is not 4-32 hex digits")
        return cls(node, instance, RecordStateName(value.get("state")), meta["mod_revision"], meta["lease"])

    def to_value(self, state: RecordStateName) -> dict:
        return {"node": self.node, "instance": self.instance, "state": state.value}


@dataclasses.dataclass(frozen=True)
class StoredRecord:
    """A record as read from etcd with its parts, every field checked."""

    domain_uuid: str
    migration_id: str
    state: RecordStateName
    source_host: str | None
    dest_host: str
    policy: PausePolicy
    postcopy: bool
    source_stopped: bool
    vouched: bool          # the domain's host vouched for the destination (at the node that took it)
    nodes: dict            # name -> instance: every node that took part when it opened
    lost: tuple            # names of those whose part is gone (their node died): their sessions are lost
    abort_reason: str | None
    mod_revision: int
    lease: int
    parts: dict            # name -> StoredPart, the parts still there

    @classmethod
    def parse(cls, key: str, value: dict, meta: dict, parts: list) -> "StoredRecord":
        domain = _text(value.get("domain_uuid"), "domain_uuid")
        mid = _text(value.get("migration_id"), "migration_id")
        if key != record_key(domain, mid):
            raise ValueError(f"record {key!r:.120} does not name {domain}/{mid}")
        nodes = value.get("nodes")
        if not isinstance(nodes, dict) or not 0 < len(nodes) <= MAX_NODES:
            raise ValueError(f"nodes is not an object of 1 to {MAX_NODES} nodes")
        for name, instance in nodes.items():
            check_name(name, "node")
            if not isinstance(instance, str) or not _INSTANCE.match(instance):
                raise ValueError("a node's instance is not 4-32 hex digits")
        lost = value.get("lost", [])
        if not isinstance(lost, list) or not all(isinstance(n, str) and n in nodes for n in lost):
            raise ValueError("lost is not a list of the record's nodes")
        flags = {name: value.get(name, False) for name in ("postcopy", "source_stopped", "vouched")}
        if not all(isinstance(flag, bool) for flag in flags.values()):
            raise ValueError("postcopy, source_stopped and vouched are booleans")
        kept = {}
        for part_key_, part_value, part_meta in parts:
            try:
                part = StoredPart.parse(part_key_, part_value, part_meta, key)
            except (ValueError, KeyError) as exc:
                LOG.warning("etcd: skipping record part %s: %s", part_key_[:160], exc)
                continue
            if nodes.get(part.node) == part.instance:
                kept[part.node] = part
        return cls(domain, mid, RecordStateName(value.get("state")), _text(value.get("source_host"),
                   "source_host", optional=True), _text(value.get("dest_host"), "dest_host"),
                   PausePolicy.parse(value.get("policy")), flags["postcopy"], flags["source_stopped"],
                   flags["vouched"], dict(nodes), tuple(lost),
                   _text(value.get("abort_reason"), "abort_reason", optional=True),
                   meta["mod_revision"], meta["lease"], kept)

    @property
    def key(self) -> str:
        return record_key(self.domain_uuid, self.migration_id)

    def to_value(self, **changes) -> dict:
        out = {"domain_uuid": self.domain_uuid, "migration_id": self.migration_id, "state": self.state.value,
               "source_host": self.source_host, "dest_host": self.dest_host, "policy": self.policy.value,
               "postcopy": self.postcopy, "source_stopped": self.source_stopped, "vouched": self.vouched,
               "nodes": dict(self.nodes),
               "lost": list(self.lost), "abort_reason": self.abort_reason}
        out.update(changes)
        return out


def _target(event, state: RecordStateName) -> RecordStateName | None:
    """Where ``event`` (a step's name) takes a record in ``state``, by the
    ledger's own table; None where it has no row there."""
    return LedgerRecord.TABLE[RecordEvent(event)].get(state)


class EtcdRecords:
    """This node's door to the pool-wide migration records in etcd (the
    ledger that follows them: ``pool.ledger.cluster.EtcdFollower``)."""

    def __init__(self, store: ClusterStore, node: str):
        self.store = store
        self.node = check_name(node, "node name")

    def read(self, domain_uuid: str, migration_id: str) -> StoredRecord | None:
        """The record and its parts in one range (one revision): None when absent."""
        key = record_key(domain_uuid, migration_id)
        (record, parts), _ = self.store.read_together([(key, False), (key + "/", True)], limit=MAX_NODES)
        if not record:
            return None
        try:
            return StoredRecord.parse(key, record[0][1], record[0][2], parts)
        except (ValueError, KeyError) as exc:
            raise Unavailable(what="etcd", reason=f"record {key[:160]} does not check: {exc}"[:400]) from None

    def latest_open(self, domain_uuid: str) -> StoredRecord | None:
        """The domain's newest record not final yet, in etcd's own order
        (its create revision, not a time a value claims); None: none."""
        prefix = RECORDS + _part(domain_uuid) + "/"
        kvs, _ = self.store.range(prefix)
        finals = {state.value for state in FINAL}
        candidates = [(meta["create_revision"], value.get("migration_id")) for key, value, meta in kvs
                      if "/" not in key[len(prefix):] and value.get("state") not in finals]
        if not candidates:
            return None
        _, mid = max(candidates, key=lambda item: item[0])
        return self.read(domain_uuid, mid) if isinstance(mid, str) and mid else None

    def open(self, record: LedgerRecord) -> StoredRecord:
        """Put ``record`` (just opened on this node) with a part for every
        live node, in one transaction, unless it is there already (another
        node opened it first: then that one, as etcd has it)."""
        key = record_key(record.domain_uuid, record.migration_id)
        existing = self.read(record.domain_uuid, record.migration_id)
        if existing is not None:          # (the usual case for every node but the first: one read)
            return existing
        nodes = live_nodes(self.store)
        if self.node not in nodes:
            raise Unavailable(what="etcd", reason=f"node {self.node} is not live in etcd (its lease ran "
                                                  f"out): it cannot open a record there")
        taking = dict(sorted(nodes.items())[:MAX_NODES])
        lease = self.store.grant(RECORD_TTL)
        value = {"domain_uuid": record.domain_uuid, "migration_id": record.migration_id,
                 "state": RecordStateName.OPEN.value, "source_host": record.source_host,
                 "dest_host": record.dest_host, "policy": record.policy.value, "postcopy": record.postcopy,
                 "source_stopped": False, "vouched": record.vouched,
                 "nodes": {n: v.instance for n, v in taking.items()}, "lost": [],
                 "abort_reason": None, "opened": round(time.time(), 3), "opened_by": self.node}
        parts = {name: {"node": name, "instance": view.instance, "state": "open"} for name, view in taking.items()}
        puts = [self.store.op_put(key, value, lease)]
        puts += [self.store.op_put(part_key(record.domain_uuid, record.migration_id, name), parts[name], view.lease)
                 for name, view in taking.items()]
        # opened once (another node may have first: then that one); every part under its
        # node's lease, each node still the one read
        guards = [self.store.absent(key)] + [
            {"key": _b64(f"{PREFIX}nodes/{name}"), "target": "LEASE", "result": "EQUAL", "lease": str(view.lease)}
            for name, view in taking.items()]
        ok, answer = self.store.txn(guards, puts)
        if not ok:
            self.store.revoke(lease)
            stored = self.read(record.domain_uuid, record.migration_id)
            if stored is None:
                raise Unavailable(what="etcd", reason=f"record {key[:160]}: a node left while it opened "
                                                      f"(open it again)")
            return stored
        revision = _answer_revision(answer)
        LOG.info("record %s/%s opened in etcd with parts on %s", record.domain_uuid, record.migration_id,
                 ", ".join(sorted(taking)), extra={"domain": record.domain_uuid, "migration": record.migration_id})
        meta = {"mod_revision": revision, "lease": lease}
        return StoredRecord.parse(key, value, meta, [
            (part_key(record.domain_uuid, record.migration_id, name), parts[name],
             {"mod_revision": revision, "lease": view.lease}) for name, view in taking.items()])

    def step(self, stored: StoredRecord, event: str, **changes) -> StoredRecord | None:
        """ONE transaction: the record and every part still there move to
        the state ``event`` leads to from ``stored.state``, guarded by the
        mod_revision of each as read; the record as it is after (no read
        more: the transaction's revision is each key's).  None: something
        changed since ``stored`` was read (nothing moved)."""
        target = _target(event, stored.state) or stored.state
        lost = sorted(set(stored.lost) | (set(stored.nodes) - set(stored.parts)))
        guards = [_same(stored.key, stored.mod_revision)]
        puts = [self.store.op_put(stored.key, stored.to_value(state=target.value, lost=lost, **changes),
                                  stored.lease or None)]
        for name, part in sorted(stored.parts.items()):
            key = part_key(stored.domain_uuid, stored.migration_id, name)
            guards.append(_same(key, part.mod_revision))
            puts.append(self.store.op_put(key, part.to_value(target), part.lease or None))
        ok, answer = self.store.txn(guards, puts)
        if not ok:
            return None
        revision = _answer_revision(answer)
        fields = {name: value for name, value in changes.items() if name in _FIELDS}
        return dataclasses.replace(
            stored, state=target, lost=tuple(lost), mod_revision=revision, **fields,
            parts={n: dataclasses.replace(p, state=target, mod_revision=revision) for n, p in stored.parts.items()})

    def advance(self, domain_uuid: str, migration_id: str, event: str, **changes) -> StoredRecord:
        """Take ``event`` on the etcd record (a harmless repeat writes
        nothing); the record as etcd has it after.  ``RecordState`` when
        etcd's record is in a state the event cannot leave (e.g. aborted by
        another node): the caller's node then follows etcd."""
        for _ in range(MAX_ROUNDS):
            stored = self.read(domain_uuid, migration_id)
            if stored is None:
                raise NoSuchRecord(record=f"{domain_uuid}/{migration_id} (not in etcd)")
            allowed = _target(event, stored.state)
            wanted = {k: v for k, v in changes.items() if stored.to_value().get(k) != v}
            if allowed is None and event == "close" and stored.state not in FINAL:
                # the source stopped before the destination completed: noted, completing closes
                if stored.source_stopped:
                    return stored
                after = self.step(stored, "close", source_stopped=True)
                if after is not None:
                    return after
                continue
            if allowed is None:
                if stored.state in LedgerRecord.REPEATS[RecordEvent(event)]:
                    return stored         # a host's retry, or another node took it first: as it was
                raise RecordState(record=f"{domain_uuid}/{migration_id}", state=stored.state.value,
                                  action=f"{event} (as etcd has it)")
            if event == "complete" and stored.source_stopped:
                allowed = RecordStateName.CLOSED
            after = self._step_to(stored, allowed, event, **wanted)
            if after is not None:
                LOG.info("record %s/%s: %s in etcd (%s -> %s), parts on %s", domain_uuid, migration_id,
                         event, stored.state.value, allowed.value, ", ".join(sorted(stored.parts)) or "no node",
                         extra={"domain": domain_uuid, "migration": migration_id})
                return after
        raise Unavailable(what="etcd", reason=f"record {domain_uuid}/{migration_id}: {MAX_ROUNDS} "
                                              f"steps in a row lost to other nodes' (try again)")

    def _step_to(self, stored: StoredRecord, target: RecordStateName, event: str, **changes):
        if target is _target(event, stored.state):
            return self.step(stored, event, **changes)
        # complete with the source already stopped: completed and closed in one step
        return self.step(dataclasses.replace(stored, state=RecordStateName.COMPLETED), "close", **changes) \
            if target is RecordStateName.CLOSED else None


#: the record's fields a step may change (``advance``'s ``changes``)
_FIELDS = {"source_host", "postcopy", "source_stopped", "abort_reason", "vouched"}


def _answer_revision(answer: dict) -> int:
    header = answer.get("header") if isinstance(answer, dict) else None
    try:
        return int(header["revision"])
    except (TypeError, KeyError, ValueError):
        raise Unavailable(what="etcd", reason="a transaction's answer without its revision") from None


def _same(key: str, revision: int) -> dict:
    """The key's mod_revision is still ``revision`` (0: the key is absent)."""
    return {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(revision)}


def _b64(text: str) -> str:
    import base64
    return base64.b64encode(text.encode()).decode()
