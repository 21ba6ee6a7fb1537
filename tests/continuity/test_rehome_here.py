"""hostd's ``rehome_here`` through the real parts, without a VM: the real
pool, a real guest agent on its channel socket, real drivers registered
with it, hostd's own delivery (``ChannelDelivery``) and its
``MigrationSteps``.  The guest stays where it is and its drivers resume
over new connections, at a new epoch, without tickets, their state intact;
the steps come back on hostd's clock, in order.  It moves nothing: a host
the sessions are not bound to gets them refused, and a domain that is not
running here (a migration under way) is refused before anything is sent."""

from __future__ import annotations

import asyncio
import types
import uuid

import pytest

from accelmig.plugin.hostd.api import LocalApi
from accelmig.plugin.hostd.delivery import ChannelDelivery
from accelmig.plugin.hostd.migration import MigrationSteps
from accelmig.plugin.hostd.watch import Phase
from accelmig.wire.errors import BadRequest, Conflict
from accelmig.wire.identity import HostIdentity
from accelmig.wire.records import Timeline
from tests.support.twohosts import drivers_bound_at_host_a


async def _nothing(dom, watch):
    return None


def _here(tmp_path, domain: str, endpoint: str, host: str, phase: Phase = Phase.RUNNING):
    """hostd's parts for one domain: its watch (with the channel's delivery)
    and its steps, with this host's identity."""
    delivery = ChannelDelivery(inspect=_nothing, on_event=lambda w, m: None, timeout=15)
    watch = types.SimpleNamespace(name="here", uuid=domain, channel_path=str(tmp_path / "channel.sock"),
                                  phase=phase, delivery=delivery)
    identity = HostIdentity.from_wire({"host_id": host, "pool_endpoint": endpoint})
    asked = []

    async def identity_for(w, *, spare=False):
        asked.append(spare)
        return identity
    steps = MigrationSteps(types.SimpleNamespace(identity_for=identity_for), retry_first=1, retry_max=1)
    return watch, steps, asked


def test_a_guest_that_stays_resumes_its_drivers_at_a_new_epoch_without_tickets(tmp_path, agent):
    domain = str(uuid.uuid4())
    with drivers_bound_at_host_a(agent, domain) as (_pool, hosts, devs, bufs):
        epochs = [dev.epoch for dev in devs]
        watch, steps, asked = _here(tmp_path, domain, hosts.a.endpoint, "hostA")

        async def twice():
            try:
                first = await steps.rehome_here(None, watch, address="spare")
                second = await steps.rehome_here(None, watch)
                return first, second
            finally:
                await watch.delivery.close(watch)

        first, second = asyncio.run(twice())
        assert asked == [True, False]                # the spare address, then the lease
        for summary in (first, second):
            assert summary["ok"] and summary["why"] is None
            assert (summary["sessions"], summary["resumed"]) == (2, 2)
            assert summary["migration_id"].startswith("here-")
            timeline = Timeline.from_wire(summary["timeline"])
            # every step a warm guest takes, in causal order, on one clock
            assert [s for s in ("delivering", "agent_received", "driver_connected", "answered")
                    if s in timeline] == ["delivering", "agent_received", "driver_connected", "answered"]
            assert timeline.out_of_order() == []
            assert all(stamp.err < 1.0 for stamp in timeline.steps.values())
        assert first["migration_id"] != second["migration_id"]     # two rehomes, not one repeated
        # each rehome was a new connection per driver: two epochs more, the state intact
        assert [dev.epoch for dev in devs] == [e + 2 for e in epochs]
        for dev, buf, i in zip(devs, bufs, range(2)):
            assert dev.read(buf) == b"state-%d" % i
        # and no migration: the sessions are still hostA's, no record was opened
        listed = {s["sid"]: s for s in hosts.a.call("list_sessions", domain_uuid=domain)["sessions"]}
        assert {listed[dev.sid]["bound_host"] for dev in devs} == {"hostA"}
        assert hosts.a.call("list_records", domain_uuid=domain)["records"] == []


def test_it_moves_no_session_to_a_host_it_is_not_bound_to(tmp_path, agent):
    """Without a ticket the pool takes a resume only from the session's own
    host: a rehome here from another host is refused, session by session,
    and the sessions stay where they were."""
    domain = str(uuid.uuid4())
    with drivers_bound_at_host_a(agent, domain, count=1) as (_pool, hosts, _devs, _bufs):
        watch, steps, _asked = _here(tmp_path, domain, hosts.b.endpoint, "hostB")

        async def elsewhere():
            try:
                return await steps.rehome_here(None, watch)
            finally:
                await watch.delivery.close(watch)

        before = hosts.a.call("list_sessions", domain_uuid=domain)["sessions"]
        summary = asyncio.run(elsewhere())
        assert not summary["ok"] and "WRONG_HOST" in summary["why"]
        after = hosts.a.call("list_sessions", domain_uuid=domain)["sessions"]
        # still hostA's, at the same epoch: nothing was taken over
        assert [(s["bound_host"], s["epoch"]) for s in after] == \
            [("hostA", s["epoch"]) for s in before]


def test_a_domain_that_is_not_running_here_is_refused_before_anything_is_sent(tmp_path, agent):
    watch, steps, asked = _here(tmp_path, str(uuid.uuid4()), "127.0.0.1:1", "hostB", phase=Phase.INCOMING)
    with pytest.raises(Conflict, match="incoming here, not running"):
        asyncio.run(steps.rehome_here(None, watch))
    assert asked == [] and agent.stats["host_rehome"] == 0 and agent.rehomes == {}


def test_the_local_api_checks_its_request_first(tmp_path):
    watches = {}
    daemon = types.SimpleNamespace(config=types.SimpleNamespace(hostd=types.SimpleNamespace(
        socket=str(tmp_path / "hostd.sock"))), host="hostA", watches=types.SimpleNamespace(get=watches.get))
    api = LocalApi(daemon)
    with pytest.raises(BadRequest, match="address must be one of lease, spare"):
        asyncio.run(api.rehome_here({"uuid": str(uuid.uuid4()), "address": "10.0.0.9"}))
    with pytest.raises(BadRequest, match="uuid"):
        asyncio.run(api.rehome_here({"uuid": ["x"]}))
    with pytest.raises(Conflict, match="not an accelmig domain running on hostA"):
        asyncio.run(api.rehome_here({"uuid": str(uuid.uuid4())}))
