"""Where a new session goes: the live node that fits, least loaded.

A driver may open at any node; the node it reached asks etcd which nodes
are live now (their keys are under live leases) and either opens the
session itself or answers ``redirect`` with the chosen node's endpoint and
instance.  The driver follows once, with ``placed`` naming that node and
instance; the chosen node opens it only if that is itself, the same
instance (never one that restarted since), and never redirects it again.
A node only ever redirects to a node it just read live in etcd.  A driver
that could not open at the node it was sent to (killed less than a lease's
TTL ago: etcd still lists it) asks the node that placed it once more,
naming that node ``unreachable``; it is left out of that one decision.
"""

from __future__ import annotations

import dataclasses
import logging
import re

from accelmig.pool.cluster.registry import NodeView, live_nodes
from accelmig.pool.cluster.store import ClusterStore
from accelmig.wire import dataplane as dp
from accelmig.pool.devices.inventory import describe_briefly
from accelmig.wire.devices import DeviceSelector, parse_selector
from accelmig.wire.errors import NoSuchDevice, SessionLost, Unavailable

LOG = logging.getLogger("accelmig.pool.cluster")

#: a session id names the instance that made it (``Pool._new_sid``)
_SID = re.compile(r"s-([0-9a-f]{4,32})-[0-9]{1,19}-[0-9a-f]{1,16}")


def node_fits(node: NodeView, selector: DeviceSelector | None) -> bool:
    """Does one of ``node``'s devices fit the session's ``selector`` (the
    same test a node's own ``Placer`` makes when the session lands)?"""
    return selector is None or any(selector.matches(device) for device in node.devices)


class Placement:
    def __init__(self, store: ClusterStore, me: NodeView):
        self.store = store
        self.me = me

    def decide(self, header: dict, local_sessions: int) -> NodeView | None:
        """Blocking (run off the pool's loop): None to open here, or the node
        to redirect to.  etcd unreachable: here (this node is live; a
        session is better placed badly than refused)."""
        placed = header.get("placed")
        if placed is not None:
            node, instance = dp.placement_claim(placed)
            if (node, instance) != (self.me.name, self.me.instance):
                raise Unavailable(what=f"node {node} instance {instance}", reason=(
                    f"this is node {self.me.name} instance {self.me.instance}: the node the session was "
                    f"placed on {'restarted' if node == self.me.name else 'is not here'}; open again"))
            return None
        selector = parse_selector(header.get("device"))     # a malformed one: refused before etcd
        unreachable = header.get("unreachable")
        if unreachable is not None:                          # the driver could not open there
            unreachable = dp.placement_claim(unreachable, "unreachable")
        try:
            nodes = live_nodes(self.store)
        except Unavailable as exc:
            LOG.warning("placement: etcd unavailable, opening here: %s", exc)
            return None
        if unreachable is not None and unreachable[0] != self.me.name:
            gone = nodes.get(unreachable[0])
            if gone is not None and gone.instance == unreachable[1]:
                LOG.info("placement: the driver could not open at node %s (instance %s): placed again "
                         "without it", gone.name, gone.instance, extra={"node": gone.name})
                del nodes[gone.name]
        # this node by its own count, live whatever etcd's copy says
        nodes[self.me.name] = dataclasses.replace(self.me, sessions=local_sessions)
        fitting = [node for node in nodes.values() if node_fits(node, selector)]
        if not fitting:
            raise NoSuchDevice(selector=str(selector), available="; ".join(
                f"node {n.name}: {describe_briefly(list(n.devices))}" for _, n in sorted(nodes.items()))[:2000])
        best = min(fitting, key=lambda n: (n.sessions, n.name != self.me.name, n.name))
        return None if best.name == self.me.name else best

    def locate(self, sid) -> None:
        """Blocking: a resume at this node of a session another instance
        made.  Its node is live (same instance): ``Unavailable`` naming it
        (the driver retries there); no live node is that instance (it died,
        its lease ran out, or it restarted): ``SESSION_LOST``, never a new
        session elsewhere — the device memory is gone with the node."""
        match = _SID.fullmatch(sid) if isinstance(sid, str) else None
        if match is None:
            raise SessionLost(sid=str(sid)[:80], instance=self.me.instance)
        instance = match.group(1)
        for node in live_nodes(self.store).values():      # etcd unavailable: Unavailable, retried
            if node.instance == instance:
                raise Unavailable(what=f"session {sid}", reason=(
                    f"it lives on node {node.name} at {node.data}, not on node {self.me.name}: "
                    f"resume there"), details={"lives_at": node.data, "node": node.name})
        LOG.info("resume of %s refused: no live node is instance %s", sid, instance)
        raise SessionLost(f"session {sid} is lost: no live node of the pool is instance {instance}, "
                          f"which held it (that node died or restarted): its device state is gone",
                          sid=sid, instance=instance)
