"""A migration's timeline through the real parts, without a VM: the real
pool, a real guest agent on its channel socket, real drivers (each a
session at the pool, registered with the agent), hostd's own delivery
(``ChannelDelivery``), its control client, and its timeline code
(``MigrationSteps``' notes, ``rehome_timeline``).  Every step is there,
once, on the pool's clock, in causal order — and a host cannot write
outside its part of it."""

from __future__ import annotations

import asyncio
import time
import types
import uuid

import pytest

from accelmig.plugin.hostd.delivery import ChannelDelivery
from accelmig.plugin.hostd.migration import MigrationSteps, rehome_timeline
from accelmig.wire.control import AsyncControlClient
from accelmig.wire.errors import BadRequest
from accelmig.wire.records import STEP_NAMES, RecordView, Side, Stamp, Timeline
from tests.support.twohosts import SECRETS, TwoHosts, drivers_bound_at_host_a, make_pool
from tests.support.wait import wait_for


def test_every_step_of_a_rehome_is_on_the_pools_clock_in_order(tmp_path, agent):
    domain = str(uuid.uuid4())
    with drivers_bound_at_host_a(agent, domain) as (pool, hosts, devs, bufs):

        async def migrate():
            src = AsyncControlClient(pool.control_endpoint, "hostA", SECRETS["hostA"].encode())
            dst = AsyncControlClient(pool.control_endpoint, "hostB", SECRETS["hostB"].encode())
            watch = types.SimpleNamespace(name="timeline", uuid=domain,
                                          channel_path=str(tmp_path / "channel.sock"))
            source = MigrationSteps(types.SimpleNamespace(pool_call=src.call), retry_first=1, retry_max=1)
            dest = MigrationSteps(types.SimpleNamespace(pool_call=dst.call), retry_first=1, retry_max=1)
            delivery = ChannelDelivery(inspect=_nothing, on_event=lambda w, m: None, timeout=15)
            try:
                # in hostd's order: the hook opens; the source sees the
                # pause and switches over; the destination sees the guest
                # run, completes, takes its identity and delivers
                record = await dst.call("open_migration", domain_uuid=domain)
                mid = record["migration_id"]
                suspended = time.time()
                await src.call("switchover", domain_uuid=domain, migration_id=mid)
                await source._note_source_timeline(watch, mid, suspended)
                resumed = time.time()
                clock = {"asked": time.time()}
                done = await dst.call_all("complete", domain_uuid=domain, migration_id=mid)
                clock.update(answered=time.time(), pool_now=done["now"])
                identity = {"host_id": "hostB", "pool_endpoint": hosts.b.endpoint}
                clock["identity"] = clock["delivering"] = time.time()
                outcome = await delivery.rehome(None, watch, {"migration_id": mid, "identity": identity,
                                                              "tickets": done["tickets"]})
                clock.update(answer=time.time(), sent=delivery.rehome_sent)
                await dest._note_dest_timeline(watch, mid, resumed, clock, outcome)
                waited = await dst.call("wait_record", domain_uuid=domain, migration_id=mid,
                                        until="timeline", timeout=30)
                # a host writes its own part only, and only known steps
                foreign = {"switchover": Stamp(time.time(), 0.0, Side.DEST).to_wire(),
                           "suspended_seen": Stamp(time.time(), 0.0, Side.SOURCE).to_wire()}
                taken = await dst.call("note_timeline", domain_uuid=domain, migration_id=mid, steps=foreign)
                with pytest.raises(BadRequest, match="unknown step"):
                    await dst.call("note_timeline", domain_uuid=domain, migration_id=mid,
                                   steps={"coffee": {"t": time.time()}})
                return mid, outcome, waited, taken
            finally:
                await delivery.close(watch)
                await src.close()
                await dst.close()

        mid, outcome, waited, taken = asyncio.run(migrate())
        assert outcome["ok"] and waited["reached"] and taken == {"taken": []}
        # the application goes on: its first commands after the resume
        for dev, buf, i in zip(devs, bufs, range(2)):
            assert dev.read(buf) == b"state-%d" % i
        record = wait_for(lambda: _record_with(hosts, domain, mid, "first_command"),
                          what="the first command after the resume in the timeline")
        timeline = record.timeline
        missing = set(STEP_NAMES) - set(timeline.steps)
        assert missing == {"nic_readdressed"}          # this guest has no fabric NIC to re-address
        assert timeline.out_of_order() == []
        sides = {step: stamp.side for step, stamp in timeline.steps.items()}
        assert sides["agent_received"] is sides["driver_connected"] is Side.GUEST
        assert sides["resumed_seen"] is Side.DEST and sides["suspended_seen"] is Side.SOURCE
        assert sides["first_command"] is Side.POOL
        # one clock: every stamp within this test's run, each within a small uncertainty
        assert all(abs(s.t - record.times["opened"]) < 60 and s.err < 1.0 for s in timeline.steps.values())
        # and it reads as a table, and travels in every view of the record
        assert all(step in timeline.table() for step in timeline.steps)
        assert Timeline.from_wire(record.to_wire()["timeline"]) == timeline


def _record_with(hosts, domain, mid, step) -> RecordView | None:
    records = [RecordView.from_wire(r) for r in hosts.a.call("list_records", domain_uuid=domain)["records"]]
    record = next(r for r in records if r.migration_id == mid)
    return record if step in record.timeline else None


def test_a_host_that_takes_no_part_cannot_write_a_records_timeline():
    domain = str(uuid.uuid4())
    with make_pool() as pool:
        hosts = TwoHosts(pool)
        try:
            record = hosts.b.call("open_migration", domain_uuid=domain, domain_name="d")
            # hostA holds none of the domain's sessions: it is not this record's source
            from accelmig.wire.errors import Forbidden
            with pytest.raises(Forbidden):
                hosts.a.call("note_timeline", domain_uuid=domain, migration_id=record["migration_id"],
                             steps={"suspended_seen": Stamp(time.time(), 0.0, Side.SOURCE).to_wire()})
            with pytest.raises(BadRequest):
                hosts.b.call("note_timeline", domain_uuid=domain, migration_id=record["migration_id"],
                             steps=[1, 2])
            with pytest.raises(BadRequest, match="not a finite number"):
                hosts.b.call("note_timeline", domain_uuid=domain, migration_id=record["migration_id"],
                             steps={"identity": {"t": "now", "side": "dest"}})
        finally:
            hosts.close()


async def _nothing(dom, watch):
    return None
