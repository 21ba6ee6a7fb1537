"""hostd's phase table and its typed libvirt events, as data: every trigger
in every phase has one defined outcome, and libvirt's own constants map to
the events docs/lab-notes.md names."""

from __future__ import annotations

import asyncio

import libvirt
import pytest

from accelmig.plugin.hostd.events import DomainEvent, EventKind
from accelmig.plugin.hostd.watch import TRIGGERS, DomainWatch, Phase, Step, Trigger, WatchPhase, WatchTable

IDLE, RUNNING, OUTGOING, INCOMING = Phase.IDLE, Phase.RUNNING, Phase.OUTGOING, Phase.INCOMING
REHOMING, SAVED, GONE = Phase.REHOMING, Phase.SAVED, Phase.GONE
STAYS = None        # the phase after: unchanged, and no line in the history

#: Every (trigger, phase) cell, written out by hand from what hostd does
#: (independent of watch.py's table: change a row there and a cell here
#: fails): the phase after and the step hostd takes; None for a trigger
#: that does not apply in that phase (nothing changes, no step).
EXPECTED = {
    Trigger.BOOTED: {
        IDLE: (RUNNING, Step.ATTEST), RUNNING: (RUNNING, Step.ATTEST), OUTGOING: (RUNNING, Step.ATTEST),
        INCOMING: (RUNNING, Step.ATTEST), REHOMING: (RUNNING, Step.ATTEST), SAVED: (RUNNING, Step.ATTEST),
        GONE: (RUNNING, Step.ATTEST)},
    Trigger.ARRIVING: {
        IDLE: (INCOMING, Step.PRECONNECT), RUNNING: (INCOMING, Step.PRECONNECT),
        OUTGOING: (INCOMING, Step.PRECONNECT), INCOMING: (INCOMING, Step.PRECONNECT),
        REHOMING: (INCOMING, Step.PRECONNECT), SAVED: (INCOMING, Step.PRECONNECT),
        GONE: (INCOMING, Step.PRECONNECT)},
    Trigger.HOOK_INCOMING: {
        IDLE: (INCOMING, Step.NOTHING), RUNNING: (INCOMING, Step.NOTHING), OUTGOING: (INCOMING, Step.NOTHING),
        INCOMING: (INCOMING, Step.NOTHING), REHOMING: (INCOMING, Step.NOTHING), SAVED: (INCOMING, Step.NOTHING),
        GONE: (INCOMING, Step.NOTHING)},
    # the source resumes its guest after switchover: the migration failed
    Trigger.RESUMED_HERE: {
        IDLE: (REHOMING, Step.REHOME), RUNNING: (REHOMING, Step.REHOME), OUTGOING: (RUNNING, Step.ABORT_STAYED),
        INCOMING: (REHOMING, Step.REHOME), REHOMING: (REHOMING, Step.REHOME), SAVED: (REHOMING, Step.REHOME),
        GONE: (REHOMING, Step.REHOME)},
    Trigger.RESUMED_POSTCOPY: {
        IDLE: (REHOMING, Step.REHOME_POSTCOPY), RUNNING: (REHOMING, Step.REHOME_POSTCOPY),
        OUTGOING: (REHOMING, Step.REHOME_POSTCOPY), INCOMING: (REHOMING, Step.REHOME_POSTCOPY),
        REHOMING: (REHOMING, Step.REHOME_POSTCOPY), SAVED: (REHOMING, Step.REHOME_POSTCOPY),
        GONE: (REHOMING, Step.REHOME_POSTCOPY)},
    # a pause decides nothing by itself: hostd asks libvirt whether it is an outgoing migration
    Trigger.PAUSED_FOR_MIGRATION: {
        IDLE: (STAYS, Step.CHECK_OUTGOING), RUNNING: (STAYS, Step.CHECK_OUTGOING), OUTGOING: None,
        INCOMING: None, REHOMING: None, SAVED: None, GONE: None},
    Trigger.PAUSED_FOR_POSTCOPY: {
        IDLE: (STAYS, Step.CHECK_OUTGOING_POSTCOPY), RUNNING: (STAYS, Step.CHECK_OUTGOING_POSTCOPY),
        OUTGOING: (STAYS, Step.CHECK_OUTGOING_POSTCOPY), INCOMING: None, REHOMING: None, SAVED: None,
        GONE: None},
    Trigger.SWITCHED_OVER: {
        IDLE: (OUTGOING, Step.SWITCH_OVER), RUNNING: (OUTGOING, Step.SWITCH_OVER), OUTGOING: None,
        INCOMING: None, REHOMING: None, SAVED: None, GONE: None},
    Trigger.SWITCHED_OVER_POSTCOPY: {
        IDLE: (OUTGOING, Step.SWITCH_OVER_POSTCOPY), RUNNING: (OUTGOING, Step.SWITCH_OVER_POSTCOPY),
        OUTGOING: (OUTGOING, Step.SWITCH_OVER_POSTCOPY), INCOMING: None, REHOMING: None, SAVED: None,
        GONE: None},
    Trigger.MIGRATED_AWAY: {
        IDLE: (GONE, Step.CLOSE), RUNNING: (GONE, Step.CLOSE), OUTGOING: (GONE, Step.CLOSE),
        INCOMING: (GONE, Step.CLOSE), REHOMING: (GONE, Step.CLOSE), SAVED: (GONE, Step.CLOSE),
        GONE: (GONE, Step.CLOSE)},
    # a domain that stops while it arrives is a failed migration, whatever libvirt's reason
    Trigger.STOPPED: {
        IDLE: (GONE, Step.FORGET), RUNNING: (GONE, Step.FORGET), OUTGOING: (GONE, Step.FORGET),
        INCOMING: (GONE, Step.ABORT_ARRIVAL), REHOMING: (GONE, Step.ABORT_ARRIVAL), SAVED: (GONE, Step.FORGET),
        GONE: (GONE, Step.FORGET)},
    Trigger.SAVED: {
        IDLE: (SAVED, Step.PARK), RUNNING: (SAVED, Step.PARK), OUTGOING: (SAVED, Step.PARK),
        INCOMING: (SAVED, Step.PARK), REHOMING: (SAVED, Step.PARK), SAVED: (SAVED, Step.PARK),
        GONE: (SAVED, Step.PARK)},
    Trigger.RESTORED: {
        IDLE: (RUNNING, Step.UNPARK), RUNNING: (RUNNING, Step.UNPARK), OUTGOING: (RUNNING, Step.UNPARK),
        INCOMING: (RUNNING, Step.UNPARK), REHOMING: (RUNNING, Step.UNPARK), SAVED: (RUNNING, Step.UNPARK),
        GONE: (RUNNING, Step.UNPARK)},
    Trigger.UNDEFINED: {
        IDLE: (GONE, Step.FORGET), RUNNING: (GONE, Step.FORGET), OUTGOING: (GONE, Step.FORGET),
        INCOMING: (GONE, Step.FORGET), REHOMING: (GONE, Step.FORGET), SAVED: (GONE, Step.FORGET),
        GONE: (GONE, Step.FORGET)},
    Trigger.REHOMED: {
        IDLE: None, RUNNING: None, OUTGOING: None, INCOMING: None, REHOMING: (RUNNING, Step.NOTHING),
        SAVED: None, GONE: None},
    Trigger.REHOME_ENDED: {
        IDLE: None, RUNNING: None, OUTGOING: None, INCOMING: None, REHOMING: (RUNNING, Step.NOTHING),
        SAVED: None, GONE: None},
    # reconciliation never starts a second rehome
    Trigger.FOUND_ARRIVED: {
        IDLE: (REHOMING, Step.REHOME), RUNNING: (REHOMING, Step.REHOME), OUTGOING: (REHOMING, Step.REHOME),
        INCOMING: (REHOMING, Step.REHOME), REHOMING: None, SAVED: (REHOMING, Step.REHOME),
        GONE: (REHOMING, Step.REHOME)},
    Trigger.FOUND_ARRIVING: {
        IDLE: (INCOMING, Step.NOTHING), RUNNING: (INCOMING, Step.NOTHING), OUTGOING: (INCOMING, Step.NOTHING),
        INCOMING: (INCOMING, Step.NOTHING), REHOMING: (INCOMING, Step.NOTHING), SAVED: (INCOMING, Step.NOTHING),
        GONE: (INCOMING, Step.NOTHING)},
    Trigger.FOUND_RUNNING: {
        IDLE: (RUNNING, Step.ATTEST), RUNNING: (RUNNING, Step.ATTEST), OUTGOING: None, INCOMING: None,
        REHOMING: None, SAVED: None, GONE: None},
}

#: how a new watch (IDLE) gets to each phase, as hostd's events take it there
REACH = {IDLE: (), RUNNING: (Trigger.BOOTED,), OUTGOING: (Trigger.SWITCHED_OVER,), INCOMING: (Trigger.ARRIVING,),
         REHOMING: (Trigger.FOUND_ARRIVED,), SAVED: (Trigger.SAVED,), GONE: (Trigger.UNDEFINED,)}


def fire(watch: DomainWatch, *triggers: Trigger) -> list:
    """Fire ``triggers`` under the watch's lock, as hostd does: the steps."""
    async def locked():
        async with watch.lock:
            return [watch.fire(trigger) for trigger in triggers]
    return asyncio.run(locked())


def watch_in(phase: Phase) -> DomainWatch:
    watch = DomainWatch("11111111-2222-4333-8444-555555555555", "vm1")
    fire(watch, *REACH[phase])
    assert watch.phase is phase, f"{REACH[phase]} from idle lead to {watch.phase}, not {phase}"
    watch.history.clear()
    return watch


def test_the_expected_table_has_every_cell_and_the_machine_its_enums():
    assert set(EXPECTED) == set(Trigger) and all(set(row) == set(Phase) for row in EXPECTED.values())
    assert len(Trigger) * len(Phase) == sum(len(row) for row in EXPECTED.values())
    assert WatchPhase.STATES is Phase and WatchPhase.EVENTS is Trigger and WatchPhase.INITIAL is IDLE


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("trigger", list(Trigger))
def test_every_trigger_in_every_phase_does_what_the_hand_written_table_says(phase, trigger):
    watch = watch_in(phase)
    [step] = fire(watch, trigger)
    expected = EXPECTED[trigger][phase]
    if expected is None:
        assert (step, watch.phase, list(watch.history)) == (None, phase, [])
        return
    after, want = expected
    assert step is want
    if after is STAYS:
        assert watch.phase is phase and not watch.history
    else:
        assert watch.phase is after
        assert [(t, a, b) for _at, t, a, b in watch.history] == [(trigger.value, phase.value, after.value)]


def test_a_phase_changes_only_under_the_watchs_lock():
    """The hook's note, an event, reconciliation and a retry each change a
    phase under the lock; one fired beside them is a bug, and says so."""
    watch = DomainWatch("11111111-2222-4333-8444-555555555555", "vm1")
    with pytest.raises(RuntimeError, match="vm1: BOOTED fired outside its watch's lock"):
        watch.fire(Trigger.BOOTED)
    assert watch.phase is IDLE and not watch.history
    assert fire(watch, Trigger.BOOTED) == [Step.ATTEST] and watch.phase is RUNNING


@pytest.mark.parametrize("path, phases, steps", [
    # the destination of a pre-copy migration
    ([Trigger.HOOK_INCOMING, Trigger.ARRIVING, Trigger.RESUMED_HERE, Trigger.REHOMED],
     [Phase.INCOMING, Phase.INCOMING, Phase.REHOMING, Phase.RUNNING],
     [Step.NOTHING, Step.PRECONNECT, Step.REHOME, Step.NOTHING]),
    # the source of it
    ([Trigger.BOOTED, Trigger.PAUSED_FOR_MIGRATION, Trigger.SWITCHED_OVER, Trigger.MIGRATED_AWAY],
     [Phase.RUNNING, Phase.RUNNING, Phase.OUTGOING, Phase.GONE],
     [Step.ATTEST, Step.CHECK_OUTGOING, Step.SWITCH_OVER, Step.CLOSE]),
    # a migration that failed after switchover: the source resumes its guest
    ([Trigger.BOOTED, Trigger.SWITCHED_OVER, Trigger.RESUMED_HERE],
     [Phase.RUNNING, Phase.OUTGOING, Phase.RUNNING], [Step.ATTEST, Step.SWITCH_OVER, Step.ABORT_STAYED]),
    # an arrival that fails: the incoming domain stops
    ([Trigger.HOOK_INCOMING, Trigger.ARRIVING, Trigger.STOPPED],
     [Phase.INCOMING, Phase.INCOMING, Phase.GONE], [Step.NOTHING, Step.PRECONNECT, Step.ABORT_ARRIVAL]),
    # post-copy on the source: SUSPENDED_MIGRATED first, then SUSPENDED_POSTCOPY
    ([Trigger.BOOTED, Trigger.SWITCHED_OVER, Trigger.PAUSED_FOR_POSTCOPY, Trigger.SWITCHED_OVER_POSTCOPY],
     [Phase.RUNNING, Phase.OUTGOING, Phase.OUTGOING, Phase.OUTGOING],
     [Step.ATTEST, Step.SWITCH_OVER, Step.CHECK_OUTGOING_POSTCOPY, Step.SWITCH_OVER_POSTCOPY]),
    # save and restore
    ([Trigger.BOOTED, Trigger.SAVED, Trigger.RESTORED],
     [Phase.RUNNING, Phase.SAVED, Phase.RUNNING], [Step.ATTEST, Step.PARK, Step.UNPARK]),
    # a rehome that the record outlived is not retried for ever
    ([Trigger.FOUND_ARRIVED, Trigger.REHOME_ENDED], [Phase.REHOMING, Phase.RUNNING],
     [Step.REHOME, Step.NOTHING]),
])
def test_the_ways_a_domain_goes(path, phases, steps):
    watch = watch_in(Phase.IDLE)
    seen_phases, seen_steps = [], []
    for trigger in path:
        seen_steps += fire(watch, trigger)
        seen_phases.append(watch.phase)
    assert (seen_phases, seen_steps) == (phases, steps)


def test_the_history_records_each_phase_change_and_its_trigger():
    watch = watch_in(Phase.IDLE)
    fire(watch, Trigger.BOOTED, Trigger.PAUSED_FOR_MIGRATION,     # (a pause decides nothing by itself)
         Trigger.SWITCHED_OVER)
    assert [(t, a, b) for _at, t, a, b in watch.history] == [
        ("booted", "idle", "running"), ("switched_over", "running", "outgoing")]


def test_a_stopped_domain_that_was_running_is_only_forgotten():
    assert fire(watch_in(Phase.RUNNING), Trigger.STOPPED) == [Step.FORGET]


def test_reconciliation_does_not_start_a_second_rehome():
    assert fire(watch_in(Phase.REHOMING), Trigger.FOUND_ARRIVED) == [None]


def test_libvirt_constants_become_typed_events():
    assert DomainEvent.from_libvirt(libvirt.VIR_DOMAIN_EVENT_RESUMED,
                                    libvirt.VIR_DOMAIN_EVENT_RESUMED_MIGRATED) is DomainEvent.RESUMED_MIGRATED
    assert DomainEvent.from_libvirt(libvirt.VIR_DOMAIN_EVENT_STOPPED,
                                    libvirt.VIR_DOMAIN_EVENT_STOPPED_MIGRATED) is DomainEvent.STOPPED_MIGRATED
    assert DomainEvent.from_libvirt(libvirt.VIR_DOMAIN_EVENT_SUSPENDED,
                                    libvirt.VIR_DOMAIN_EVENT_SUSPENDED_POSTCOPY) is DomainEvent.SUSPENDED_POSTCOPY
    assert DomainEvent.from_libvirt(999, 0) is DomainEvent.OTHER
    assert DomainEvent.UNDEFINED_REMOVED.kind is EventKind.UNDEFINED
    assert DomainEvent.DEFINED_ADDED.kind is EventKind.DEFINED
    assert DomainEvent.PMSUSPENDED_DISK.kind is EventKind.PMSUSPENDED


def test_the_events_of_a_migration_exist_in_this_libvirt_and_map_back():
    needed = {DomainEvent.STARTED_MIGRATED, DomainEvent.RESUMED_MIGRATED, DomainEvent.RESUMED_POSTCOPY,
              DomainEvent.SUSPENDED_MIGRATED, DomainEvent.SUSPENDED_POSTCOPY, DomainEvent.STOPPED_MIGRATED,
              DomainEvent.STOPPED_FAILED, DomainEvent.STOPPED_SAVED, DomainEvent.STARTED_RESTORED}
    for event in TRIGGERS:
        detail = getattr(libvirt, f"VIR_DOMAIN_EVENT_{event.value}", None)
        if detail is None:
            assert event not in needed, f"this libvirt-python lacks {event.value}"
            continue                   # a newer libvirt's detail (e.g. STARTED_RECREATED, 9.x)
        kind = getattr(libvirt, f"VIR_DOMAIN_EVENT_{event.kind.value}")
        assert DomainEvent.from_libvirt(kind, detail) is event


def test_the_watch_table_forgets_foreign_and_gone_domains_within_bounds():
    table = WatchTable()
    table.FOREIGN_MEMORY = 3
    for n in range(5):
        table.mark_foreign(f"uuid-{n}")
    assert table.foreign_count == 3 and not table.is_foreign("uuid-0") and table.is_foreign("uuid-4")
    watch = table.add("uuid-4", "vm4")                # its XML changed: accelmig's now
    assert not table.is_foreign("uuid-4") and table.get("uuid-4") is watch
    fire(watch, Trigger.BOOTED)
    table.evict(watch)
    assert table.get("uuid-4") is watch               # not gone: kept
    fire(watch, Trigger.UNDEFINED)
    table.evict(watch)
    assert table.get("uuid-4") is None and len(table) == 0
    table.JOB_MEMORY = 2
    for n in range(3):
        table.note_job(f"job-{n}", {"downtime": n})
    assert table.job("job-0") is None and table.job("job-2") == {"downtime": 2}


def test_what_status_says_of_a_domain_stays_small_whatever_its_sessions():
    """hostd's local API answers in one line: a domain with a thousand
    sessions, a record past what lists inline and a last rehome of a
    thousand outcomes is said in a few KiB (issue 11)."""
    import json

    from accelmig.wire import channel as ch
    from accelmig.wire.records import RecordView
    watch = DomainWatch("uuid-1", "big")
    watch.sessions = {f"s-{i:04d}-{'x' * 20}" for i in range(1000)}
    watch.record = RecordView.from_wire({"domain_uuid": "uuid-1", "migration_id": "m", "state": "completed",
                                         "dest_host": "hostB", "session_count": 1000, "resumed_count": 1000})
    outcome = {sid: {"ok": True, "seconds": 0.01, "epoch": 2} for sid in watch.sessions}
    outcome["s-bad"] = {"ok": False, "error": {"code": "TIMEOUT", "message": "late"}}
    watch.last_rehome = {"migration_id": "m", "ok": False, "result": {"ok": False, "sessions": outcome}}
    said = watch.describe()
    assert len(json.dumps(said)) < 8192
    assert said["session_count"] == 1000 and len(said["sessions"]) == DomainWatch.STATUS_SESSIONS
    assert "sessions" not in said["record"] and said["record"]["session_count"] == 1000
    result = said["last_rehome"]["result"]
    assert result["session_count"] == 1001 and result["resumed_count"] == 1000
    assert "s-bad" in result["sessions"] and result["sessions_omitted"] > 900
    assert len(ch.encode(ch.result(1, result={"domains": [said] * 20}))) < ch.MAX_LINE
