"""``PoolNodes`` alone (hostd's routing to a pool's nodes): what the
coordinator lists is input, checked and bounded; a session's calls go to
the node whose instance made it.  The coordinator and the nodes here are
recording stand-ins of the control client (a unit test of one class);
the real routing against two real pool nodes on etcd is
``tests/continuity/test_cluster_migration.py``."""

from __future__ import annotations

import asyncio

import pytest

from accelmig.plugin.hostd.nodes import MAX_NODES, PoolNodes
from accelmig.wire.errors import ProtocolError, UnknownOp


class Client:
    """Answers ``list_nodes`` with ``listing``; records every other call."""

    def __init__(self, endpoint: str, listing=None):
        self.endpoint, self.listing, self.calls, self.closed = endpoint, listing, [], False

    async def call(self, method, **args):
        if method == "list_nodes":
            if isinstance(self.listing, Exception):
                raise self.listing
            return self.listing
        self.calls.append((method, args))
        return {"migration_id": "m-1"} if method == "open_migration" else {"ok": self.endpoint}

    async def call_all(self, method, **args):
        if isinstance(self.pictures, Exception):
            raise self.pictures
        version, domains = self.pictures
        self.calls.append((method, args))
        return {"version": version, "unchanged": True} if args.get("since") == version else \
            {"version": version, "domains": domains}

    pictures = ("v0", {})

    async def close(self):
        self.closed = True


def routing(listing, clock=None):
    made = {}

    def make(endpoint):
        made[endpoint] = Client(endpoint)
        return made[endpoint]
    return PoolNodes(Client("10.0.0.1:7071", listing), make, **({"clock": clock} if clock else {})), made


def node(name, instance, control):
    return {"name": name, "instance": instance, "control": control}


def test_a_pool_from_before_clusters_or_a_single_node_is_one_node():
    for listing in (UnknownOp(op="list_nodes"), {"cluster": False, "nodes": []}, "garbage"):
        nodes, made = routing(listing)
        assert asyncio.run(nodes.refresh()) is False and not nodes.clustered
        asyncio.run(nodes.call("unbind_session", sid="s-abcd1234-1-000000", domain_uuid="d"))
        assert nodes.coordinator.calls == [("unbind_session", {"sid": "s-abcd1234-1-000000", "domain_uuid": "d"})]
        assert made == {}


def test_what_the_coordinator_lists_is_checked_and_bounded():
    nodes, made = routing({"cluster": True, "node": "n1", "nodes": [
        node("n1", "aaaa0001", "10.0.0.1:7071"),          # the coordinator itself: not twice
        node("n2", "bbbb0002", "10.0.0.2:7071"),
        node("../etc", "cccc0003", "10.0.0.3:7071"),      # not a name
        node("n4", "NOT-HEX", "10.0.0.4:7071"),
        node("n5", "dddd0005", "no port here"),
        node("n6", "eeee0006", None),                     # no control plane: nothing to call
        "not an object"]})
    assert asyncio.run(nodes.refresh()) is True
    assert nodes.nodes == {"n2": ("bbbb0002", "10.0.0.2:7071")}
    too_many = [node(f"n{i}", f"{i:08x}", f"10.0.1.{i % 250}:7071") for i in range(MAX_NODES + 1)]
    nodes, _ = routing({"cluster": True, "node": "n1", "nodes": too_many})
    with pytest.raises(ProtocolError, match="at most"):
        asyncio.run(nodes.refresh())


def test_a_sessions_calls_go_to_the_node_that_made_it_and_steps_to_every_node():
    nodes, made = routing({"cluster": True, "node": "n1", "nodes": [
        node("n1", "aaaa0001", "10.0.0.1:7071"), node("n2", "bbbb0002", "10.0.0.2:7071")]})

    async def scenario():
        await nodes.refresh()
        await nodes.call("unbind_session", sid="s-bbbb0002-7-abcdef", domain_uuid="d")
        await nodes.call("unbind_session", sid="s-aaaa0001-3-abcdef", domain_uuid="d")
        await nodes.call("unbind_session", sid="s-99999999-1-abcdef", domain_uuid="d")   # no such node: the coordinator
        await nodes.call("open_migration", domain_uuid="d")
        await nodes.call("note_timeline", domain_uuid="d", migration_id="m-1", steps={})
    asyncio.run(scenario())
    n2 = made["10.0.0.2:7071"]
    assert n2.calls == [("unbind_session", {"sid": "s-bbbb0002-7-abcdef", "domain_uuid": "d"}),
                        ("open_migration", {"domain_uuid": "d", "migration_id": "m-1"})]   # the coordinator's id
    assert [m for m, _ in nodes.coordinator.calls] == ["unbind_session", "unbind_session", "open_migration",
                                                       "note_timeline"]


def test_a_session_of_a_node_that_came_back_is_routed_there_after_one_listing_more():
    """A node restarted (a new instance) since hostd last listed: the first
    call for one of its sessions lists again, once, and goes there — not to
    the coordinator, which would refuse it (hostd attests nothing again)."""
    now = [100.0]
    nodes, made = routing({"cluster": True, "node": "n1", "nodes": [
        node("n1", "aaaa0001", "10.0.0.1:7071"), node("n2", "bbbb0002", "10.0.0.2:7071")]}, clock=lambda: now[0])
    listings = []
    listed = nodes.refresh

    async def counted():
        listings.append(now[0])
        return await listed()
    nodes.refresh = counted

    async def scenario():
        await nodes.refresh()
        nodes.coordinator.listing = {"cluster": True, "node": "n1", "nodes": [
            node("n1", "aaaa0001", "10.0.0.1:7071"), node("n2", "cccc0003", "10.0.0.2:7071")]}
        await nodes.call("unbind_session", sid="s-cccc0003-1-abcdef", domain_uuid="d")
        for n in range(50):                    # made-up instances: no listing each, the coordinator refuses
            await nodes.call("unbind_session", sid=f"s-{n:08x}-1-abcdef", domain_uuid="d")
        now[0] += 1.0
        await nodes.call("unbind_session", sid="s-dddd0004-1-abcdef", domain_uuid="d")
    asyncio.run(scenario())
    assert nodes.nodes == {"n2": ("cccc0003", "10.0.0.2:7071")}
    assert made["10.0.0.2:7071"].calls == [("unbind_session", {"sid": "s-cccc0003-1-abcdef", "domain_uuid": "d"})]
    assert listings == [100.0, 100.0, 101.0]       # the first listing, then one per RELIST_INTERVAL
    assert len(nodes.coordinator.calls) == 51


def test_a_node_that_does_not_answer_keeps_its_last_picture_of_the_domains_holding_sessions():
    from accelmig.wire.errors import Unavailable
    nodes, made = routing({"cluster": True, "node": "n1", "nodes": [
        node("n1", "aaaa0001", "10.0.0.1:7071"), node("n2", "bbbb0002", "10.0.0.2:7071")]})

    async def scenario():
        await nodes.refresh()
        nodes.coordinator.pictures = ("c1", {"dom-a": 1})
        nodes.client_of("n2").pictures = ("x1", {"dom-b": 0, "dom-a": 2, "dom-x": True, "dom-y": "3"})
        first = await nodes.call_all("accel_domains")
        nodes.client_of("n2").pictures = Unavailable(what="n2", reason="down")
        while_down = await nodes.call_all("accel_domains", since=first["version"])
        return first, while_down
    first, while_down = asyncio.run(scenario())
    # each domain's sessions waiting to be attested, on every node (what is no count is dropped)
    assert first["domains"] == {"dom-a": 3, "dom-b": 0}
    assert while_down == {"version": first["version"], "unchanged": True}    # n2's domains still counted
    n2 = made["10.0.0.2:7071"]
    assert n2.calls == [("accel_domains", {"since": None})]     # asked with the version it last gave
    assert nodes.coordinator.calls[-1] == ("accel_domains", {"since": "c1"})
