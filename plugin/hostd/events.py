"""libvirt's domain lifecycle events as typed values, made once at the edge.

libvirt reports a lifecycle event as two integers (``event``, ``detail``)
whose meaning depends on each other.  ``DomainEvent.from_libvirt`` turns them
into one member — ``DomainEvent.RESUMED_MIGRATED`` — with the names docs/lab-notes.md
and libvirt's documentation use; the table behind it is built once, at
import, from the constants this libvirt-python has (an older binding simply
lacks the newer details).  Everything past ``LibvirtSession`` sees only these
members, the way nova's ``host.py`` turns libvirt callbacks into its own
``LifecycleEvent``s.
"""

from __future__ import annotations

import enum

import libvirt


class EventKind(enum.Enum):
    DEFINED = "DEFINED"
    UNDEFINED = "UNDEFINED"
    STARTED = "STARTED"
    SUSPENDED = "SUSPENDED"
    RESUMED = "RESUMED"
    STOPPED = "STOPPED"
    SHUTDOWN = "SHUTDOWN"
    PMSUSPENDED = "PMSUSPENDED"
    CRASHED = "CRASHED"
    OTHER = "OTHER"


class DomainEvent(enum.Enum):
    """One lifecycle event; the value is its name (``"RESUMED_MIGRATED"``)."""

    DEFINED_ADDED = "DEFINED_ADDED"
    DEFINED_UPDATED = "DEFINED_UPDATED"
    DEFINED_RENAMED = "DEFINED_RENAMED"
    DEFINED_FROM_SNAPSHOT = "DEFINED_FROM_SNAPSHOT"
    UNDEFINED_REMOVED = "UNDEFINED_REMOVED"
    UNDEFINED_RENAMED = "UNDEFINED_RENAMED"
    STARTED_BOOTED = "STARTED_BOOTED"
    STARTED_MIGRATED = "STARTED_MIGRATED"
    STARTED_RESTORED = "STARTED_RESTORED"
    STARTED_FROM_SNAPSHOT = "STARTED_FROM_SNAPSHOT"
    STARTED_WAKEUP = "STARTED_WAKEUP"
    STARTED_RECREATED = "STARTED_RECREATED"
    SUSPENDED_PAUSED = "SUSPENDED_PAUSED"
    SUSPENDED_MIGRATED = "SUSPENDED_MIGRATED"
    SUSPENDED_IOERROR = "SUSPENDED_IOERROR"
    SUSPENDED_WATCHDOG = "SUSPENDED_WATCHDOG"
    SUSPENDED_RESTORED = "SUSPENDED_RESTORED"
    SUSPENDED_FROM_SNAPSHOT = "SUSPENDED_FROM_SNAPSHOT"
    SUSPENDED_API_ERROR = "SUSPENDED_API_ERROR"
    SUSPENDED_POSTCOPY = "SUSPENDED_POSTCOPY"
    SUSPENDED_POSTCOPY_FAILED = "SUSPENDED_POSTCOPY_FAILED"
    RESUMED_UNPAUSED = "RESUMED_UNPAUSED"
    RESUMED_MIGRATED = "RESUMED_MIGRATED"
    RESUMED_FROM_SNAPSHOT = "RESUMED_FROM_SNAPSHOT"
    RESUMED_POSTCOPY = "RESUMED_POSTCOPY"
    RESUMED_POSTCOPY_FAILED = "RESUMED_POSTCOPY_FAILED"
    STOPPED_SHUTDOWN = "STOPPED_SHUTDOWN"
    STOPPED_DESTROYED = "STOPPED_DESTROYED"
    STOPPED_CRASHED = "STOPPED_CRASHED"
    STOPPED_MIGRATED = "STOPPED_MIGRATED"
    STOPPED_SAVED = "STOPPED_SAVED"
    STOPPED_FAILED = "STOPPED_FAILED"
    STOPPED_FROM_SNAPSHOT = "STOPPED_FROM_SNAPSHOT"
    STOPPED_RECREATED = "STOPPED_RECREATED"
    SHUTDOWN_FINISHED = "SHUTDOWN_FINISHED"
    SHUTDOWN_GUEST = "SHUTDOWN_GUEST"
    SHUTDOWN_HOST = "SHUTDOWN_HOST"
    PMSUSPENDED_MEMORY = "PMSUSPENDED_MEMORY"
    PMSUSPENDED_DISK = "PMSUSPENDED_DISK"
    CRASHED_PANICKED = "CRASHED_PANICKED"
    CRASHED_CRASHLOADED = "CRASHED_CRASHLOADED"
    OTHER = "OTHER"

    @property
    def kind(self) -> EventKind:
        for kind in EventKind:
            if self.value.startswith(kind.value + "_"):
                return kind
        return EventKind.OTHER

    @classmethod
    def from_libvirt(cls, event: int, detail: int) -> "DomainEvent":
        return _BY_CODE.get((event, detail), cls.OTHER)


def _codes() -> dict[tuple[int, int], DomainEvent]:
    """(event, detail) -> member, from the constants this binding has."""
    table = {}
    for member in DomainEvent:
        kind = member.kind
        event = getattr(libvirt, f"VIR_DOMAIN_EVENT_{kind.value}", None)
        code = getattr(libvirt, f"VIR_DOMAIN_EVENT_{member.value}", None)
        if event is not None and code is not None:
            table[(event, code)] = member
    return table


_BY_CODE = _codes()
