"""hostd's phase table and its typed libvirt events, as data: every trigger
in every phase has one defined outcome, and libvirt's own constants map to
the events docs/lab-notes.md names."""

from __future__ import annotations

import libvirt
import pytest

from accelmig.plugin.hostd.events import DomainEvent, EventKind
from accelmig.plugin.hostd.watch import (ANY, TRANSITIONS, TRIGGERS, DomainWatch, Phase, Step, Trigger,
                                         WatchTable)


def watch_in(phase: Phase) -> DomainWatch:
    watch = DomainWatch("11111111-2222-4333-8444-555555555555", "vm1")
    watch.phase = phase
    return watch


def test_every_trigger_has_rows_and_every_row_names_real_phases_and_steps():
    assert set(TRANSITIONS) == set(Trigger)
    for trigger, rows in TRANSITIONS.items():
        assert rows, trigger
        for phases, target, step in rows:
            assert phases <= ANY and (target is None or target in Phase) and step in Step


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("trigger", list(Trigger))
def test_a_trigger_applies_per_the_first_matching_row_or_changes_nothing(phase, trigger):
    watch = watch_in(phase)
    expected = next(((target, step) for phases, target, step in TRANSITIONS[trigger] if phase in phases), None)
    step = watch.fire(trigger)
    if expected is None:
        assert step is None and watch.phase is phase and not watch.history
    else:
        target, want = expected
        assert step is want
        assert watch.phase is (target if target is not None else phase)


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
        seen_steps.append(watch.fire(trigger))
        seen_phases.append(watch.phase)
    assert (seen_phases, seen_steps) == (phases, steps)


def test_the_history_records_each_phase_change_and_its_trigger():
    watch = watch_in(Phase.IDLE)
    watch.fire(Trigger.BOOTED)
    watch.fire(Trigger.PAUSED_FOR_MIGRATION)       # decides nothing by itself: no change recorded
    watch.fire(Trigger.SWITCHED_OVER)
    assert [(t, a, b) for _at, t, a, b in watch.history] == [
        ("booted", "idle", "running"), ("switched_over", "running", "outgoing")]


def test_a_stopped_domain_that_was_running_is_only_forgotten():
    assert watch_in(Phase.RUNNING).fire(Trigger.STOPPED) is Step.FORGET


def test_reconciliation_does_not_start_a_second_rehome():
    assert watch_in(Phase.REHOMING).fire(Trigger.FOUND_ARRIVED) is None


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
    watch.phase = Phase.RUNNING
    table.evict(watch)
    assert table.get("uuid-4") is watch               # not gone: kept
    watch.phase = Phase.GONE
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
