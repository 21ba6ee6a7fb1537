"""The pool's nodes as hostd reaches them.

hostd is configured with one control endpoint (``[pool] control``): its
**coordinator**.  A node alone answers ``list_nodes`` with ``cluster``
false and nothing changes: every call goes to it, as ever.  A node of a
pool of several nodes (etcd) lists the live nodes; hostd then keeps a
control client per node (the same host secret and TLS settings: every node
of a pool is given the same hosts file) and routes:

- a session's own calls (``unbind_session``; the binding proofs of
  ``plugin.hostd.attestation``, which asks each node for its own challenge
  and binds each session at its node: ``every``, ``node_for_sid``) to the
  node whose instance made the session (its id says which: ``s-<instance>-...``);
- a migration's steps (open, switchover, commit, close, abort) to the
  coordinator first — its answer names the migration — then to every other
  node, which follows the record etcd holds (``pool.cluster.records``);
- ``complete`` to every node: each mints the tickets of its own sessions,
  and the rehome delivers their union, each ticket for its own node;
- an intent to the coordinator first, then to every node with its migration
  id (each node checks who may open);
- ``renew`` (each node keeps its own record's lease), ``register_host``
  (each node attributes guests' connections to hosts), ``park`` and
  ``unpark`` (each node parks its own sessions) to every node, and a
  domain's ``list_sessions`` is every node's, one after the other;
  ``wait_record`` to every node at once (each knows whether its own
  sessions resumed); reading and the timeline to the coordinator.

A node that does not answer a step is left to catch up from etcd at its
next call; for ``complete`` it is asked again (the rehome retries) unless
it left the pool (no longer live: its sessions are lost with it).
What the coordinator lists is input (it relays etcd): bounded, every field
checked.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time

from accelmig.wire.dataplane import parse_endpoint
from accelmig.wire.errors import AccelmigError, ProtocolError, Unavailable, UnknownOp
from accelmig.wire.values import is_int

LOG = logging.getLogger("accelmig.hostd")

#: the most nodes hostd keeps a client for
MAX_NODES = 128
#: s between listings that a session id of an unknown instance makes hostd ask for
RELIST_INTERVAL = 1.0
#: steps every node takes, the coordinator first
STEPS = frozenset({"register_intent", "open_migration", "switchover", "commit", "close", "abort"})
#: calls every node answers for itself; hostd keeps the coordinator's answer
EVERY_NODE = frozenset({"renew", "register_host", "park", "unpark"})
#: listings of a domain's sessions: every node's, one after the other
UNION = {"list_sessions": "sessions"}
#: calls of one session, to the node that made it
PER_SESSION = frozenset({"unbind_session"})
_SID = re.compile(r"^s-([0-9a-f]{4,32})-")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}$")
_INSTANCE = re.compile(r"^[0-9a-f]{4,32}$")


class PoolNodes:
    def __init__(self, coordinator, make_client, clock=time.monotonic):
        """``coordinator``: the control client of ``[pool] control``;
        ``make_client(endpoint)``: a client of another node (same host,
        secret and TLS)."""
        self.coordinator = coordinator
        self.make_client = make_client
        self.clock = clock
        self._listed_at = float("-inf")        # when an unknown instance last made hostd list again
        # node -> (the version it last gave, its domains): accel_domains asks each with its own
        self._accel: dict[str, tuple[object, dict]] = {}
        self.clustered = False
        self.name: str | None = None            # the coordinator's node name
        self.instance: str | None = None        # and its instance
        self.nodes: dict[str, tuple[str, str]] = {}   # other node -> (instance, control endpoint)
        self._clients: dict[str, object] = {}   # control endpoint -> client

    # -- who is there ---------------------------------------------------------------------
    async def refresh(self) -> bool:
        """Ask the coordinator which nodes are live; True when in a cluster."""
        try:
            answer = await self.coordinator.call("list_nodes")
        except UnknownOp:
            answer = {"cluster": False}          # a pool from before clusters: one node
        if not isinstance(answer, dict) or not answer.get("cluster"):
            if self.clustered:
                LOG.warning("the pool at %s is no longer a cluster: one node from now on",
                            self.coordinator.endpoint)
            self.clustered, self.nodes = False, {}
            return False
        nodes = answer.get("nodes")
        if not isinstance(nodes, list) or len(nodes) > MAX_NODES:
            raise ProtocolError(reason=f"list_nodes: nodes is not a list of at most {MAX_NODES}")
        fresh = {}
        for item in nodes:
            try:
                name, instance, control = _node(item)
            except (ValueError, AccelmigError) as exc:
                LOG.warning("list_nodes: skipping a node: %s", str(exc)[:200])
                continue
            if name == answer.get("node"):
                self.instance = instance
            elif control is not None:
                fresh[name] = (instance, control)
        if fresh != self.nodes or not self.clustered:
            LOG.info("pool of several nodes: coordinator %s at %s, others: %s", answer.get("node"),
                     self.coordinator.endpoint, ", ".join(f"{n} at {c}" for n, (_, c) in sorted(fresh.items()))
                     or "none")
        self.clustered, self.name, self.nodes = True, str(answer.get("node")), fresh
        for endpoint in set(self._clients) - {c for _, c in fresh.values()}:
            client = self._clients.pop(endpoint)
            await client.close()
        return True

    def client_of(self, name: str):
        _, control = self.nodes[name]
        client = self._clients.get(control)
        if client is None:
            client = self._clients[control] = self.make_client(control)
        return client

    def for_sid(self, sid):
        """The client of the node whose instance made ``sid``: the
        coordinator's for its own sessions and for what names no instance;
        None for an instance not listed (yet: a node that just came back)."""
        match = _SID.match(sid) if isinstance(sid, str) else None
        if match is None or match.group(1) == self.instance:
            return self.coordinator
        for name, (instance, _) in self.nodes.items():
            if instance == match.group(1):
                return self.client_of(name)
        return None

    def every(self) -> list:
        """Every node's client, the coordinator's first."""
        return [self.coordinator] + [self.client_of(name) for name in sorted(self.nodes)] if self.clustered \
            else [self.coordinator]

    async def node_for_sid(self, sid):
        """``for_sid``, listing the nodes again (at most every RELIST_INTERVAL:
        a guest's made-up session ids cost no listing each) when ``sid``
        names an instance not listed yet (a node that came back); the
        coordinator for what names no node."""
        client = self.for_sid(sid)
        if client is None and self.clustered and self.clock() - self._listed_at >= RELIST_INTERVAL:
            self._listed_at = self.clock()
            await self.refresh()
            client = self.for_sid(sid)
        return client or self.coordinator

    def instances(self) -> tuple:
        """The other nodes' instances (a new one: hostd registers there too)."""
        return tuple(sorted(instance for instance, _ in self.nodes.values()))

    def clients(self) -> list:
        """The other nodes' clients (a reload gives them its new secret and TLS files)."""
        return list(self._clients.values())

    async def close(self) -> None:
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.close()

    # -- calls ----------------------------------------------------------------------------
    async def call(self, method: str, **args):
        if not self.clustered:
            return await self.coordinator.call(method, **args)
        if method in PER_SESSION:
            # a node restarted since the last listing: listed again, once
            return await (await self.node_for_sid(args.get("sid"))).call(method, **args)
        if method in STEPS or method in EVERY_NODE:
            answer = await self.coordinator.call(method, **args)
            if method in STEPS and isinstance(answer, dict) and answer.get("migration_id"):
                args = dict(args, migration_id=answer["migration_id"])
            await self._others(method, args, required=False)
            return answer
        return await self.coordinator.call(method, **args)

    async def call_all(self, method: str, **args):
        if self.clustered and method == "accel_domains":
            return await self._accel_domains(args.get("since"))
        if self.clustered and method in UNION and args.get("domain_uuid") is not None:
            answer = await self.coordinator.call_all(method, **args)
            items = list(answer.get(UNION[method]) or [])
            elsewhere = answer.get("elsewhere") if is_int(answer.get("elsewhere")) else 0
            for _name, other in await self._others(method, args, required=True, all_pages=True):
                items.extend((other or {}).get(UNION[method]) or [])
                theirs = (other or {}).get("elsewhere")
                elsewhere += theirs if is_int(theirs) else 0
            return dict(answer, **{UNION[method]: items, "elsewhere": elsewhere})
        if not self.clustered or method != "complete":
            return await self.coordinator.call_all(method, **args)
        # every node mints the tickets of its own sessions: the union, each for its node
        answer = await self.coordinator.call_all(method, **args)
        tickets = dict(answer.get("tickets") or {})
        for _name, other in await self._others(method, args, required=True, all_pages=True):
            extra = other.get("tickets") if isinstance(other, dict) else None
            if isinstance(extra, dict):
                tickets.update(extra)
        return dict(answer, tickets=tickets)

    async def call_within(self, timeout: float, method: str, /, **args):
        """A long wait (``wait_record``): in a cluster, on every node at once
        (each says whether its own sessions resumed); the coordinator's
        record with every node's counts, reached once every node's is."""
        if not self.clustered or method != "wait_record":
            return await self.coordinator.call_within(timeout, method, **args)
        names = sorted(self.nodes)
        others = dict(args, until="rehomed")       # the timeline is the coordinator's alone
        answers = await asyncio.gather(self.coordinator.call_within(timeout, method, **args),
                                       *(self.client_of(n).call_within(timeout, method, **others) for n in names),
                                       return_exceptions=True)
        first = answers[0]
        if isinstance(first, BaseException):
            raise first
        record = first.get("record")
        reached = bool(first.get("reached"))
        if not isinstance(record, dict):
            return first
        record = dict(record)
        for name, answer in zip(names, answers[1:]):
            if isinstance(answer, BaseException):
                LOG.warning("wait_record at node %s: %s", name, answer)
                reached = False
                continue
            theirs = answer.get("record") if isinstance(answer, dict) else None
            if not isinstance(theirs, dict):
                continue                     # no record there: none of its sessions migrates
            for count in ("session_count", "resumed_count"):
                if isinstance(theirs.get(count), int) and isinstance(record.get(count), int):
                    record[count] += theirs[count]
            record.pop("sessions", None)     # (per node; ``record_sessions`` pages each)
            record.pop("resumed", None)
            reached = reached and bool(answer.get("reached"))
        return dict(first, record=record, reached=reached)

    async def _accel_domains(self, since) -> dict:
        """Which domains hold sessions on any node (a Nova VM's sessions may
        all live on a node other than the coordinator): every node asked with
        the version it last gave, the answers united under one version of
        the nodes' versions.  A node that does not answer this round keeps
        its last picture (the hook stays strict for its domains)."""
        targets = [(self.name or "", self.coordinator)] + [(n, self.client_of(n)) for n in sorted(self.nodes)]
        views: dict[str, tuple[object, dict]] = {}
        for name, client in targets:
            held = self._accel.get(name)
            try:
                answer = await client.call_all("accel_domains", since=held[0] if held else None)
            except AccelmigError as exc:
                if client is self.coordinator:
                    raise
                LOG.warning("accel_domains at node %s: %s (its last picture kept)", name, exc)
                if held is not None:
                    views[name] = held
                continue
            if not isinstance(answer, dict):
                continue
            if answer.get("unchanged") and held is not None:
                views[name] = held
            else:
                domains = answer.get("domains")
                views[name] = (answer.get("version"), domains if isinstance(domains, dict) else {})
        self._accel = views                  # a node no longer listed: gone with its sessions
        version = hashlib.sha256(repr(sorted((n, str(v)) for n, (v, _) in views.items())).encode()).hexdigest()[:32]
        if since == version:
            return {"version": version, "unchanged": True}
        union: dict[str, int] = {}
        for _, domains in views.values():
            for uuid, unattested in domains.items():
                if isinstance(uuid, str) and is_int(unattested):
                    union[uuid] = union.get(uuid, 0) + max(0, unattested)
        return {"version": version, "domains": union}

    async def _others(self, method: str, args: dict, *, required: bool, all_pages: bool = False) -> list:
        """``method`` at every node but the coordinator: [(name, answer)].
        ``required``: a live node that fails it fails the call (a node no
        longer live is skipped: it left the pool with its sessions)."""
        out = []
        for name in sorted(self.nodes):
            client = self.client_of(name)
            try:
                answer = await (client.call_all if all_pages else client.call)(method, **args)
            except AccelmigError as exc:
                if isinstance(exc, Unavailable):
                    try:
                        await self.refresh()
                    except AccelmigError as listing:       # the coordinator answered the call itself
                        LOG.warning("%s: the pool's nodes could not be listed again: %s", method, listing)
                    if name not in self.nodes:
                        LOG.warning("%s: node %s left the pool: its sessions are lost with it", method, name)
                        continue
                if required:
                    raise
                LOG.warning("%s at node %s: %s (it follows etcd at its next call)", method, name, exc)
                continue
            out.append((name, answer))
        return out


def _node(item) -> tuple[str, str, str | None]:
    if not isinstance(item, dict):
        raise ValueError("a node is not an object")
    name, instance, control = item.get("name"), item.get("instance"), item.get("control")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"node name {name!r:.80}")
    if not isinstance(instance, str) or not _INSTANCE.match(instance):
        raise ValueError(f"node {name}: instance {instance!r:.40}")
    if control is not None:
        if not isinstance(control, str):
            raise ValueError(f"node {name}: control endpoint")
        parse_endpoint(control)
    return name, instance, control
