"""A session on the pool: its state machine, its worker, its objects.

State machine (``Session.TABLE``)::

                open/resume            connection lost
    (new) ---> ATTACHED  <---------->  DETACHED --(grace over)--> RELEASED
                 |  ^ park/unpark         | ^ park/unpark             ^
                 v  |     conn. lost      v |                         |
             ATTACHED_SAVED ----------> PARKED --(retention over)-----+
                        <--- resume ---
                  (and from every live state: release by the driver)

``PARKED`` is ``DETACHED`` with the longer retention the host asked for when
the session's domain was saved; a session parked while its connection is
still open is ``ATTACHED_SAVED`` (on the wire: ``attached``, ``parked``) and
parks when that connection goes.

Commands run on the session's own worker thread, one at a time, in sequence
order (one in-order queue per session).  The event loop holds commands back
while the session is paused by a migration record, or while its reply log
or its queue is over their bounds; work already handed to the worker always
runs to completion.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import queue
import threading
import time
from typing import Callable

from accelmig.pool import clcommands
from accelmig.pool.devices import DeviceContext, buildpolicy
from accelmig.pool.sequencing import REPLY_BYTES, RUN_REPLY_BYTES, SequenceLog, StoredReply, ok_reply
from accelmig.runtime.statemachine import StateMachine
from accelmig.wire.dataplane import OPENCL_OPS, Op
from accelmig.wire.errors import (AccelmigError, BadRequest, InternalError, LimitExceeded, OutOfRange,
                                  QuotaExceeded)

LOG = logging.getLogger(__name__)

#: Host memory the pool and the tenant's device process keep for each
#: object beside its device bytes, charged to the tenant's quota with it
#: (measured, docs/DESIGN.md "What a tenant costs the pool": a buffer ~1.3
#: KiB, a one-line program ~550 KiB in the device process).
BUFFER_CHARGE = 2048
PROGRAM_CHARGE = 1 << 20           # and the program's source or binary, byte for byte
#: A session's accepted, unacknowledged commands' identities
#: (``SequenceLog.command_bytes``) past which its connection stops being
#: read until acknowledgements come: far above a driver's window (4096
#: commands of a few KiB counted each), far below what a peer that never
#: acknowledges could otherwise make the pool hold.
MAX_COMMAND_BYTES = 64 << 20


def _packed_size(header: dict) -> int:
    """A ``read_rect``'s reply bytes: its region, packed (validated at accept)."""
    width, height, depth = header["region"]
    return width * height * depth


def refuse_oversized_read(session: "Session", size: int) -> None:
    """A read whose reply alone would be more than the session may keep
    unacknowledged (drivers read in chunks of the welcome's
    ``max_payload``, which is at most that) is refused before its reply
    buffer is made."""
    if size > session.max_reply_bytes:
        raise LimitExceeded(tenant=session.tenant.name, reason=(
            f"a read of {size} bytes is more than a session's replies may hold until "
            f"acknowledged (max_reply_bytes = {session.max_reply_bytes}): read it in chunks"))


class SessionState(enum.Enum):
    ATTACHED = "attached"
    ATTACHED_SAVED = "attached_saved"     # its domain was saved while its connection is open
    DETACHED = "detached"
    PARKED = "parked"
    RELEASED = "released"

    @property
    def wire(self) -> str:
        """As ``list_sessions`` and the metrics say it (``wire.records.SessionView``):
        a session attached while its domain is saved is ``attached`` (and ``parked``)."""
        return "attached" if self is SessionState.ATTACHED_SAVED else self.value


class SessionEvent(enum.Enum):
    ATTACH = "attach"          # opened, or resumed on a new connection
    DETACH = "detach"          # its connection was lost
    PARK = "park"              # its domain was saved (its host's park)
    UNPARK = "unpark"          # its domain was restored
    RELEASE = "release"        # released by its driver, expired, or killed


class Tenant:
    """A tenant's token and device-memory quota, shared by its sessions:
    ``quota`` across every device of the pool, ``quota_by_type`` (optional)
    on the devices of one type."""

    def __init__(self, name: str, token: str, quota: int, max_sessions: int | None = None,
                 quota_by_type: dict[str, int] | None = None):
        self.name = name
        self.token = token
        self.quota = quota
        self.max_sessions = max_sessions     # None: the pool's max_sessions_per_tenant
        self.quota_by_type = dict(quota_by_type or {})
        self.used = 0                  # device bytes
        self.used_by_type: dict[str, int] = {}
        # host memory of its objects' bookkeeping (BUFFER_CHARGE, PROGRAM_CHARGE):
        # counted against ``quota`` with ``used``, on this node
        self.overhead = 0
        # live sessions (attached, detached or parked), counted as they are
        # made and released: an open checks its limit without a scan of
        # every session of the pool
        self.live_sessions = 0
        self._lock = threading.Lock()
        self.ledger = None      # pool.cluster.quotas.QuotaLedger: in a cluster the quota holds pool-wide
        # the replies its sessions on this node keep unacknowledged or have
        # under way (``Session.reply_bytes_held``), and the sessions holding
        # commands back until that falls: the event loop's alone
        self.replies = 0
        self.waiting_for_replies: set = set()

    @property
    def reply_budget(self) -> int:
        """What its sessions on this node may keep of unacknowledged replies
        together: as much as its quota (replies are the pool's memory, as
        its buffers are the device's), past it one command at a time.  Each
        session is bounded by ``max_reply_bytes`` too."""
        return self.quota

    def replies_changed(self, delta: int) -> None:
        """On the loop: its sessions' kept replies grew or fell by ``delta``;
        a fall lets the sessions that wait for it go on."""
        self.replies += delta
        if delta < 0 and self.waiting_for_replies:
            for session in list(self.waiting_for_replies):
                session.pump()

    def session_made(self) -> None:
        with self._lock:
            self.live_sessions += 1

    def session_released(self) -> None:
        with self._lock:
            self.live_sessions = max(0, self.live_sessions - 1)

    def reserve(self, nbytes: int, device_type: str | None = None, overhead: int = 0) -> None:
        """``nbytes`` of device memory and ``overhead`` bytes of the pool's
        host memory for the object that holds them, within the quota."""
        with self._lock:
            if self.used + nbytes > self.quota:
                raise QuotaExceeded(tenant=self.name, size=nbytes, used=self.used, quota=self.quota)
            if self.used + self.overhead + nbytes + overhead > self.quota:
                raise LimitExceeded(tenant=self.name, reason=(
                    f"allocating {nbytes} bytes would use {self.used + nbytes} bytes of device memory "
                    f"and {self.overhead + overhead} bytes of host memory that the pool keeps for the "
                    f"tenant's buffers and programs, over its {self.quota}-byte quota (which counts both)"))
            limit = self.quota_by_type.get(device_type) if device_type else None
            held = self.used_by_type.get(device_type, 0) if device_type else 0
            if limit is not None and held + nbytes > limit:
                raise LimitExceeded(tenant=self.name, reason=(
                    f"allocating {nbytes} bytes would use {held + nbytes} bytes on {device_type} "
                    f"devices, over its quota_by_type.{device_type} of {limit} bytes"))
            self.used += nbytes
            self.overhead += overhead
            if device_type:
                self.used_by_type[device_type] = held + nbytes
        if self.ledger is not None and nbytes:
            try:
                self.ledger.take(self.name, nbytes, self.quota)
            except BaseException:
                with self._lock:
                    self.used = max(0, self.used - nbytes)
                    self.overhead = max(0, self.overhead - overhead)
                    if device_type:
                        self.used_by_type[device_type] = max(0, self.used_by_type.get(device_type, 0) - nbytes)
                raise

    def give_back(self, nbytes: int, device_type: str | None = None, overhead: int = 0) -> None:
        with self._lock:
            self.used = max(0, self.used - nbytes)
            self.overhead = max(0, self.overhead - overhead)
            if device_type and device_type in self.used_by_type:
                self.used_by_type[device_type] = max(0, self.used_by_type[device_type] - nbytes)
        if self.ledger is not None and nbytes:
            self.ledger.give(self.name, nbytes)


@dataclasses.dataclass
class SessionCounters:
    """What this session cost the pool: the proof that a hot move re-sends nothing."""

    commands: int = 0
    builds: int = 0
    bytes_uploaded: int = 0        # write payloads
    bytes_downloaded: int = 0      # read replies
    source_bytes: int = 0          # program sources and binaries received
    launches: int = 0
    batched_launches: int = 0      # launches that came in batch frames (protocol 2)
    duplicates: int = 0            # re-sent commands answered from the log
    streamed_bytes: int = 0        # write bytes copied to the device while the rest arrived
    resumes: int = 0
    replayed: int = 0              # replies sent again on a resume

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Command:
    seq: int
    op: Op
    header: dict
    payload: bytes | bytearray | memoryview
    identity: object = None      # its CommandIdentity, settled before it runs
    # A write's payload received into the tenant's upload arena (an
    # ArenaLease; ``payload`` is its view): given back once the write ran,
    # or whenever the command is dropped, never to the pool's buffers.
    lease: object = None
    # A write whose pieces the worker copied while it arrived
    # (``pool.streaming.UploadStream``): it writes only the rest.
    stream: object = None
    # reply bytes counted for it from its hand-off to the worker to its reply
    reserved: int = 0

    def drop_payload(self, buffers) -> None:
        """The payload's memory may be reused: back to the arena or to ``buffers``."""
        if self.lease is not None:
            # (``execute`` took the identity's digest before the write ended;
            # a command that never ran belongs to a released session, whose
            # identities nothing compares again)
            self.lease.release()
        elif buffers is not None and self.payload:
            buffers.put(self.payload)


class LaunchRun:
    """New launches ``first``, ``first + 1``, ... of one batch frame
    (``wire.batch.decode_run``: each its header without seq, epoch and
    ack, shared between repeats), taken by the session's worker as one
    unit: one call into the device context, one outcome, their plain
    successes recorded and answered as one range.  The same commands as
    the launches one by one, with fewer Python steps per launch (a
    launch's own bookkeeping was most of the pool's time in a launch loop:
    docs/DESIGN.md)."""

    __slots__ = ("first", "launches", "reserved")

    def __init__(self, first: int, launches: list[dict]):
        self.first, self.launches = first, launches
        self.reserved = 0

    @property
    def last(self) -> int:
        return self.first + len(self.launches) - 1

    def commands(self) -> list[Command]:
        """Each launch as the command it would have been alone."""
        return [Command(seq, Op.LAUNCH, launch, b"") for seq, launch in enumerate(self.launches, self.first)]


_S, _E = SessionState, SessionEvent
_LIVE = (_S.ATTACHED, _S.ATTACHED_SAVED, _S.DETACHED, _S.PARKED)


class Session(StateMachine):
    """Everything the pool keeps for one driver session."""

    INITIAL = _S.ATTACHED
    FINAL = frozenset({_S.RELEASED})
    TABLE = {
        _E.ATTACH: {_S.ATTACHED: _S.ATTACHED, _S.DETACHED: _S.ATTACHED,
                    _S.ATTACHED_SAVED: _S.ATTACHED_SAVED, _S.PARKED: _S.ATTACHED_SAVED},
        _E.DETACH: {_S.ATTACHED: _S.DETACHED, _S.ATTACHED_SAVED: _S.PARKED},
        # (parked again: a new retention, and for a parked one a new deadline)
        _E.PARK: {_S.ATTACHED: _S.ATTACHED_SAVED, _S.DETACHED: _S.PARKED, _S.PARKED: _S.PARKED},
        _E.UNPARK: {_S.ATTACHED_SAVED: _S.ATTACHED, _S.PARKED: _S.DETACHED},
        _E.RELEASE: {state: _S.RELEASED for state in _LIVE},
    }
    REPEATS = {
        _E.DETACH: frozenset({_S.DETACHED, _S.PARKED, _S.RELEASED}),    # (a connection lost twice)
        _E.PARK: frozenset({_S.ATTACHED_SAVED}),                         # (only its retention changes)
        _E.UNPARK: frozenset({_S.ATTACHED, _S.DETACHED, _S.RELEASED}),
        _E.RELEASE: frozenset({_S.RELEASED}),
    }

    def __init__(self, sid: str, tenant: Tenant, secret: bytes, context: DeviceContext,
                 post: Callable[[Callable], None], *, serial: int = 0, metrics=None, buffers=None,
                 max_reply_bytes: int = 256 << 20, max_queued_bytes: int = 256 << 20,
                 max_unacked: int = 65536, max_objects: int = 8192,
                 max_source_bytes: int = 1 << 20, device=None):
        self.sid = sid
        # The one device this session lives on (a PoolDevice), for its whole
        # life: its context, programs and buffers are there, so a resume or
        # a migration never changes it.
        self.device = device
        self.serial = serial            # the pool's order of sessions (pages of list_sessions)
        self.tenant = tenant
        self.secret = secret
        self.context = context
        StateMachine.__init__(self)      # ATTACHED
        self.epoch = 1
        self.created = time.time()
        self.log = SequenceLog(sid)
        self.counters = SessionCounters()
        self.metrics = metrics
        self.buffers = buffers          # PayloadBuffers: recycled bulk host memory
        self.connection = None          # the attached DataConnection, if any
        self.deadline: float | None = None
        # the retention its host asked for when its domain was saved (None: not saved)
        self.park_retention: float | None = None
        self.released_reason: str | None = None
        # where it is bound: written by the migration ledger alone (pool.ledger.parties)
        self.bound_host: str | None = None
        self.domain_uuid: str | None = None
        # The domain the guest says it is (its SMBIOS system UUID, told at
        # open): only a hint for hosts to find the sessions of domains that
        # nobody marked (Nova's); bindings come from hosts' attestation alone.
        self.claimed_domain: str | None = None
        # The driver opened from an address of a host's network (a host-bound
        # fabric): its host is checked by address at every resume.  False on
        # a Neutron tenant network, where an address is the same on every
        # host: the binding is what hosts attest, and tickets what moves it.
        self.by_address = True
        self.pending_move: tuple[str, str] | None = None   # (domain, migration id) awaiting a ticket
        self.paused_by: set[str] = set()                    # record keys pausing this session
        # a write cut half-way after some of it reached the device
        # (``pool.streaming.TornWrite``): only it may come at its seq
        self.torn = None
        self.detached_at: float | None = None
        self.pause_started: float | None = None
        self.last_resume: dict = {}
        # execution
        self.max_reply_bytes = max_reply_bytes
        self.max_queued_bytes = max_queued_bytes
        self.max_unacked = max_unacked
        # Buffers and programs held, counted on the worker thread (the only
        # one that creates or frees them): an empty buffer costs no quota
        # but still host memory, so their number is bounded too.
        self.max_objects = max_objects
        self.objects = 0
        self.max_source_bytes = max_source_bytes
        self.held: collections.deque[Command] = collections.deque()
        self.held_bytes = 0
        self.queued_bytes = 0            # payload bytes handed to the worker, not yet done
        self.in_worker = 0               # commands handed to the worker, not yet completed
        # the replies of commands handed to the worker, counted from the
        # hand-off (a read's by its size): with the log's, at most max_reply_bytes
        self.replies_reserved = 0
        self._replies_counted = 0         # what of them the tenant's ``replies`` holds
        # the host memory charged to the tenant for this session's objects
        # (BUFFER_CHARGE, PROGRAM_CHARGE and the program's bytes): given back
        # whole at release, whatever still runs; a lock, as the worker frees
        # objects while the loop releases
        self.overhead = 0
        self._overhead_lock = threading.Lock()
        self._overhead_open = True                      # (until the release gives it all back)
        self.program_charges: dict[int, int] = {}      # program handle -> its charge (worker thread)
        self.on_reply: Callable[["Session", StoredReply], None] | None = None
        # plain successes first..last, in order (a launch run's): answered as one range
        self.on_ok_run: Callable[["Session", int, int], None] | None = None
        self.on_flow: Callable[["Session"], None] | None = None
        self._worker = SessionWorker(self, post)
        self._worker.start()
        tenant.session_made()
        if device is not None:
            device.session_opened()

    # -- device memory: the tenant's quota and the device's accounting -----------
    @property
    def device_type(self) -> str | None:
        return self.device.type if self.device is not None else None

    def charge(self, nbytes: int, overhead: int = 0) -> None:
        """Count an allocation of ``nbytes`` of device memory and the
        ``overhead`` bytes of host memory its object holds
        (QUOTA_EXCEEDED when the tenant may not)."""
        self.tenant.reserve(nbytes, self.device_type, overhead)     # (in a cluster: etcd, no lock held)
        if overhead:
            with self._overhead_lock:
                kept = self._overhead_open
                if kept:
                    self.overhead += overhead
            if not kept:                         # released meanwhile: it gave back all it had
                self.tenant.give_back(0, None, overhead)
        if self.device is not None:
            self.device.charge(nbytes)

    def refund(self, nbytes: int, overhead: int = 0) -> None:
        with self._overhead_lock:
            overhead = min(overhead, self.overhead)      # (a release may have given it back already)
            self.overhead -= overhead
        self.tenant.give_back(nbytes, self.device_type, overhead)
        if self.device is not None:
            self.device.refund(nbytes)

    # -- state machine -----------------------------------------------------------
    def refuse(self, event: SessionEvent) -> None:
        raise InternalError(reason=f"session {self.sid} is {self.state.value}: it cannot {event.value}"
                                   + (f" ({self.released_reason})" if self.released_reason else ""))

    def attach(self, connection) -> None:
        self.fire(SessionEvent.ATTACH)
        self.connection = connection
        self.deadline = None
        self.detached_at = None

    def detach(self, now: float, grace: float) -> None:
        if self.fire(SessionEvent.DETACH) is None:
            return          # not attached
        self.connection = None
        self.detached_at = now
        self.deadline = now + (self.park_retention if self.state is SessionState.PARKED else grace)

    def park(self, now: float, retention: float) -> None:
        self.fire(SessionEvent.PARK)
        self.park_retention = retention
        if self.state is SessionState.PARKED:
            self.deadline = now + retention

    def unpark(self, now: float, grace: float) -> None:
        self.park_retention = None
        if self.fire(SessionEvent.UNPARK) is not None and self.state is SessionState.DETACHED:
            self.deadline = now + grace

    def note_resume(self, from_epoch: int, last_seen: int) -> None:
        """After an accepted resume (``self.epoch`` already the new epoch);
        the ticket it used, if any, is the ledger's (``TicketBook.last_used``)."""
        self.last_resume = {"from_epoch": from_epoch, "to_epoch": self.epoch, "last_seen": last_seen,
                            "next_seq": self.log.next_seq, "acked": self.log.acked}

    def is_resume_retry(self, epoch: int, last_seen: int) -> bool:
        """The driver whose last resume was accepted but whose answer was lost
        (the connection died right after) tries again: it presents the epoch
        that resume came from and the same progress, and nothing has happened
        on the epoch that resume made.  The retry's answer may be lost too, so
        a retry of a retry is one as well: it still comes from the same epoch.
        Any other older epoch is a copy."""
        last = self.last_resume
        return bool(last) and epoch < self.epoch and last["from_epoch"] == epoch \
            and last["to_epoch"] == self.epoch \
            and last["last_seen"] == last_seen and last["next_seq"] == self.log.next_seq \
            and last["acked"] == self.log.acked

    def release(self, reason: str) -> None:
        """Free everything (idempotent).  Queued commands are skipped."""
        if self.fire(SessionEvent.RELEASE) is None:
            return
        self.tenant.session_released()
        if self.device is not None:
            self.device.session_released()
        self.released_reason = reason
        self.connection = None
        for command in self.held:
            command.drop_payload(None)       # (an arena lease must go back; a buffer may go to GC)
        self.held.clear()
        self.held_bytes = 0
        self.tenant.waiting_for_replies.discard(self)
        counted, self._replies_counted = self._replies_counted, 0
        self.tenant.replies_changed(-counted)        # its replies go with it
        # quota back now where the backend can (a kernel may still be running),
        # and all of the objects' host memory charge
        with self._overhead_lock:
            overhead, self.overhead, self._overhead_open = self.overhead, 0, False
        self.tenant.give_back(0, None, overhead)
        self.refund(self.context.abandon())
        self._worker.stop()

    def wait_released(self, timeout: float | None = None) -> None:
        """After ``release``: wait until the worker has given the device objects back."""
        self._worker.join(timeout)

    @property
    def live(self) -> bool:
        return self.state is not SessionState.RELEASED

    # -- commands ----------------------------------------------------------------
    @property
    def paused(self) -> bool:
        return bool(self.paused_by)

    @property
    def reply_bytes_held(self) -> int:
        """Its replies kept unacknowledged and counted for commands under way."""
        return self.log.reply_bytes + self.replies_reserved

    def _count_replies(self) -> None:
        """Tell the tenant how its replies held changed (after each change)."""
        if self.state is SessionState.RELEASED:
            return
        held = self.reply_bytes_held
        delta, self._replies_counted = held - self._replies_counted, held
        if delta:
            self.tenant.replies_changed(delta)

    def _may_run(self, replies: int) -> bool:
        """Whether commands whose replies are counted ``replies`` bytes may
        go to the worker now: the replies kept or to come stay within
        ``max_reply_bytes`` for the session and within the tenant's
        ``reply_budget`` for all its sessions together (one command may
        always run alone, in the session and in the tenant: a read of at
        most ``max_reply_bytes``, see ``reply_estimate``), payloads queued
        and commands unacknowledged within theirs.  A session held back by
        the tenant's budget waits on the tenant: another session's
        acknowledgement lets it go on."""
        kept, tenant = self.reply_bytes_held, self.tenant
        if tenant.replies and tenant.replies + replies > tenant.reply_budget:
            tenant.waiting_for_replies.add(self)
            return False
        tenant.waiting_for_replies.discard(self)
        return ((not kept or kept + replies <= self.max_reply_bytes)
                and self.queued_bytes <= self.max_queued_bytes
                and self.log.unacked_commands <= self.max_unacked)

    def reply_estimate(self, command: Command) -> int:
        """What ``command``'s reply will be counted for (``StoredReply.nbytes``):
        a read's size; a read larger than ``max_reply_bytes`` is refused
        without its payload (``execute``).  A program's binary is counted
        once it is back (the bound is passed by at most that one binary)."""
        op = command.op
        if op is Op.READ or op is Op.READ_RECT:
            size = command.header["size"] if op is Op.READ else _packed_size(command.header)
            if size <= self.max_reply_bytes:
                return REPLY_BYTES + size
        return REPLY_BYTES

    def submit(self, command: Command) -> None:
        """Hand an accepted command to the worker, or hold it back."""
        if self.held or self.paused or not self._may_run(self.reply_estimate(command)):
            self.held.append(command)
            self.held_bytes += len(command.payload)
        elif command.op is Op.FINISH and not self.in_worker and self.context.finish_is_noop():
            self._finish_inline(command)
        else:
            self._dispatch(command)

    def submit_run(self, commands: list[Command]) -> None:
        """Commands accepted together (a launch batch's, none with a
        payload): one hand-off to the worker when nothing holds them back,
        else each as ``submit`` would."""
        if self.held or self.paused or not self._may_run(REPLY_BYTES * len(commands)):
            for command in commands:
                self.submit(command)
            return
        for command in commands:
            command.reserved = REPLY_BYTES
        self.replies_reserved += REPLY_BYTES * len(commands)
        self._count_replies()
        self.in_worker += len(commands)
        self._worker.put_run(commands)

    def submit_launches(self, run: LaunchRun) -> None:
        """A run of new launches: one unit for the worker when nothing
        holds them back, else each as ``submit`` would."""
        reserved = RUN_REPLY_BYTES * len(run.launches)
        if self.held or self.paused or not self._may_run(reserved):
            for command in run.commands():
                self.submit(command)
            return
        run.reserved = reserved
        self.replies_reserved += reserved
        self._count_replies()
        self.in_worker += len(run.launches)
        self._worker.put_run(run)

    def run_on_worker(self, task: Callable[[], None]) -> None:
        """``task`` on the session's worker, in order with its commands (a
        piece of a write on its way: ``pool.streaming``)."""
        self._worker.put_task(task)

    def _dispatch(self, command: Command) -> None:
        command.reserved = self.reply_estimate(command)
        self.replies_reserved += command.reserved
        self._count_replies()
        self.queued_bytes += len(command.payload)
        self.in_worker += 1
        self._worker.put(command)

    def _finish_inline(self, command: Command) -> None:
        """A finish on a session with nothing in flight and a quiet device,
        answered on the loop: every earlier reply is recorded already (so
        the order holds), and it would wait for nothing.  The worker's
        thread and the device process's round trip were most of an idle
        round trip's time (docs/DESIGN.md, benchmarks)."""
        self.counters.commands += 1
        if self.metrics is not None:
            self.metrics.count_command(self, command, 0)
        self.in_worker += 1           # (completed counts it out again)
        self.completed([(command, StoredReply(command.seq, {"op": "reply", "seq": command.seq,
                                                            "ok": True}))])

    def pump(self) -> None:
        """Release held commands as far as pause and bounds allow."""
        while self.held and not self.paused and self._may_run(self.reply_estimate(self.held[0])):
            command = self.held.popleft()
            self.held_bytes -= len(command.payload)
            self._dispatch(command)

    @property
    def backlogged(self) -> bool:
        """True when the connection should stop reading from the driver."""
        return (len(self.held) > 4096 or self.held_bytes > self.max_queued_bytes
                or self.queued_bytes > self.max_queued_bytes
                or self.log.command_bytes > MAX_COMMAND_BYTES)

    def pause(self, key: str, now: float) -> None:
        if not self.paused_by:
            self.pause_started = now
        self.paused_by.add(key)

    def unpause(self, key: str) -> None:
        self.paused_by.discard(key)
        if not self.paused_by:
            self.pause_started = None
            self.pump()

    # -- called on the event loop by the worker ----------------------------------
    def completed(self, results: list[tuple[Command, StoredReply] | tuple[LaunchRun, dict]]) -> None:
        """Replies the worker executed, handed back in order on the loop (a
        launch run's as its failures by index)."""
        for command, reply in results:
            if type(command) is LaunchRun:
                self._run_completed(command, reply)
                continue
            self.queued_bytes -= len(command.payload)
            self.replies_reserved -= command.reserved
            self.in_worker -= 1
            command.drop_payload(self.buffers)        # ran on the device: reusable
            if self.state is SessionState.RELEASED:
                continue
            self.log.record_reply(reply)
            if self.on_reply is not None:
                self.on_reply(self, reply)
        self._count_replies()
        self.pump()
        if self.on_flow is not None:
            self.on_flow(self)

    def _run_completed(self, run: LaunchRun, failures: dict) -> None:
        self.in_worker -= len(run.launches)
        self.replies_reserved -= run.reserved
        if self.state is SessionState.RELEASED:
            return
        if not failures and self.on_ok_run is not None:
            self.log.record_ok_run(run.first, run.last)
            self.on_ok_run(self, run.first, run.last)
            return
        for index in range(len(run.launches)):
            seq = run.first + index
            error = failures.get(index)
            reply = ok_reply(seq) if error is None else _error_reply(self, seq, Op.LAUNCH, error)
            self.log.record_reply(reply)
            if self.on_reply is not None:
                self.on_reply(self, reply)

    def acknowledge(self, upto: int) -> None:
        if upto > self.log.acked:
            for reply in self.log.acknowledge(upto):
                if self.buffers is not None and reply.payload:
                    self.buffers.put(reply.payload)  # the driver has it: reusable
            self._count_replies()
            self.pump()

    def describe(self) -> dict:
        return {
            "sid": self.sid, "tenant": self.tenant.name, "state": self.state.wire,
            "epoch": self.epoch, "bound_host": self.bound_host, "domain_uuid": self.domain_uuid,
            "claimed_domain": self.claimed_domain,
            "device": self.device.id if self.device is not None else None,
            "paused": sorted(self.paused_by), "pending_move": list(self.pending_move or ()),
            "parked": self.park_retention is not None,
            "deadline_in": None if self.deadline is None else round(self.deadline - time.time(), 3),
            "counters": self.counters.to_dict(), "sequence": self.log.snapshot(),
            "torn": self.torn.describe() if self.torn is not None else None,
            "held": len(self.held), "in_flight": self.in_worker, "created": self.created,
        }


class SessionWorker:
    """The session's in-order queue: one thread executing its commands."""

    def __init__(self, session: Session, post: Callable[[Callable], None]):
        self.session = session
        self.post = post
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"session-{session.sid}", daemon=True)

    def start(self) -> None:
        """The thread starts with the session's first command (or its
        release, which gives its device objects back on it): an open costs
        the pool's loop no thread start, and a session that never computes
        no thread."""
        self._started = False
        self._start_lock = threading.Lock()

    def _ensure_started(self) -> None:
        if not self._started:
            with self._start_lock:
                if not self._started:
                    self._thread.start()
                    self._started = True

    def put(self, command: Command) -> None:
        self._ensure_started()
        self._queue.put(command)

    def put_run(self, commands: list[Command]) -> None:
        """Commands in order, one hand-off (one wake-up) for all."""
        self._ensure_started()
        self._queue.put(commands)

    def put_task(self, task: Callable[[], None]) -> None:
        """A callable run in order with the commands (no reply)."""
        self._ensure_started()
        self._queue.put(task)

    def stop(self) -> None:
        self._stopping = True
        self._queue.put(None)
        self._ensure_started()

    def join(self, timeout: float | None = None) -> None:
        if self._started:
            self._thread.join(timeout)

    def _run(self) -> None:
        session = self.session
        batch: list[tuple[Command, StoredReply]] = []
        while True:
            item = self._queue.get()
            if item is None:
                if self._queue.empty():
                    break
                continue        # (what came after the stop: tasks run, commands are dropped)
            if callable(item):
                _run_task(session, item)
            elif type(item) is LaunchRun:
                if not self._stopping:
                    batch.append((item, _begin_run(session, item)))
            else:
                for command in item if type(item) is list else (item,):
                    if self._stopping:
                        command.drop_payload(None)     # never runs: its arena lease goes back
                        continue
                    batch.append((command, execute(session, command)))
            # Hand replies back in batches: one loop wake-up per burst (a
            # task's turn included: replies before it must not wait on it).
            if batch and (self._queue.empty() or len(batch) >= 256):
                done, batch = _settled(batch), []
                self.post(lambda done=done: session.completed(done))
        if batch:
            done = _settled(batch)
            self.post(lambda: session.completed(done))
        try:
            released = session.context.release()
            session.refund(released)
            if session.metrics is not None:
                session.metrics.device_bytes.labels(session.tenant.name).set(session.tenant.used)
        except Exception:  # pragma: no cover - a runtime failing at release
            LOG.exception("session %s: releasing device objects failed", session.sid)


def _stream_settle(identity, stream, start: int) -> Callable[[], None]:
    """A streamed write's digest, once: its pieces' then the rest's."""
    done = False

    def settle() -> None:
        nonlocal done
        if not done:
            done = True
            identity.set_digest(stream.digest(start))
    return settle


def _run_task(session: Session, task: Callable[[], None]) -> None:
    try:
        task()
    except Exception:  # a task must not end the worker
        LOG.exception("session %s: a worker task failed", session.sid)


class PendingReply:
    """A launch the backend took without answering yet (``launch_begin``)."""

    def __init__(self, session: Session, command: Command, outcome: Callable[[], object]):
        self.session, self.command, self.outcome = session, command, outcome

    def settle(self) -> StoredReply:
        try:
            self.outcome()
        except Exception as exc:      # as in execute: report, keep serving
            return _error_reply(self.session, self.command.seq, Op.LAUNCH, exc)
        return ok_reply(self.command.seq)


class PendingRun:
    """A launch run the backend took (``launch_run_begin``): its failures,
    ``{index in the run: exception}``, once settled."""

    __slots__ = ("session", "run", "outcome")

    def __init__(self, session: Session, run: LaunchRun, outcome: Callable[[], dict]):
        self.session, self.run, self.outcome = session, run, outcome

    def settle(self) -> dict:
        try:
            return self.outcome()
        except Exception as exc:      # the whole run failed: each launch of it says so
            return dict.fromkeys(range(len(self.run.launches)), exc)


def _begin_run(session: Session, run: LaunchRun) -> PendingRun:
    """Hand a run to the device context; never raises."""
    session.counters.commands += len(run.launches)
    try:
        outcome = session.context.launch_run_begin(run.launches)
    except Exception as exc:
        failures = dict.fromkeys(range(len(run.launches)), exc)
        outcome = lambda: failures   # noqa: E731
    return PendingRun(session, run, outcome)


def _error_reply(session: Session, seq: int, op: Op, exc: Exception) -> StoredReply:
    """A command's failure as its reply: an AccelmigError as it is, anything
    else (a bug, an unexpected runtime failure) logged and reported."""
    if not isinstance(exc, AccelmigError):
        LOG.error("session %s: seq %d (%s) failed", session.sid, seq, op.value, exc_info=exc)
        exc = InternalError(reason=f"{type(exc).__name__}: {exc}")
    error = exc.to_wire()
    return StoredReply(seq, {"op": "reply", "seq": seq, "ok": False, "error": error}, b"", len(str(error)))


def _settled(batch: list) -> list[tuple[Command, StoredReply]]:
    """Every reply of a batch final, in order (pending launches waited for);
    the launches that ran are counted once for the batch."""
    out, ran, session = [], 0, None
    for command, reply in batch:
        if type(command) is LaunchRun:
            session = reply.session
            reply = reply.settle()
            ran += len(command.launches) - len(reply)
        elif isinstance(reply, PendingReply):
            session = reply.session
            reply = reply.settle()
            ran += reply.header["ok"]
        out.append((command, reply))
    if ran:
        session.counters.launches += ran
        if session.metrics is not None:
            session.metrics.count_launches(ran)
    return out


def _unprofiled(command: Command) -> Command:
    """The same command without ``prof`` (what ``clcommands.profiled`` runs)."""
    return dataclasses.replace(command, header={k: v for k, v in command.header.items() if k != "prof"})


def _check_object_limit(session: Session, kind: str) -> None:
    """Before a buffer or program is made: the session's count limit."""
    if session.objects >= session.max_objects:
        raise LimitExceeded(tenant=session.tenant.name, reason=(
            f"session {session.sid} already holds {session.objects} buffers and programs, "
            f"the most a session may (max_objects_per_session = {session.max_objects}); "
            f"free one before making another {kind}"))


def execute(session: Session, command: Command) -> StoredReply | PendingReply:
    """Run one command on the session's device context; never raises.  A
    launch the backend pipelines comes back pending (``_settled`` ends it)."""
    if command.header.get("prof") is True:       # protocol 3: run alone, timed
        return clcommands.profiled(session, command, lambda cmd: execute(session, _unprofiled(cmd)))
    ctx = session.context
    h = command.header
    counters = session.counters
    counters.commands += 1
    fields: dict = {}
    payload: bytes | bytearray = b""
    try:
        op = command.op
        settle = command.identity.settle if command.identity is not None else None
        if settle is not None and command.lease is None:
            settle()                    # digest the payload here, off the event loop
        if op is Op.LAUNCH:
            outcome = ctx.launch_begin_wire(h["prog"], h["kernel"], h["gsize"], h.get("lsize"), h["args"],
                                            goffset=h.get("goffset") or None)
            if outcome is not None:
                return PendingReply(session, command, outcome)
            counters.launches += 1
        elif op is Op.WRITE:
            if command.lease is not None:
                # received into the upload arena: no copy on the way, and
                # the digest is taken while the device process writes; a
                # streamed write's pieces are on the device already
                start = 0
                stream = command.stream
                if stream is not None:
                    start = stream.rest()
                    if command.identity is not None:
                        settle = _stream_settle(command.identity, stream, start)
                try:
                    ctx.write_leased(h["buf"], h["offset"], command.lease, meanwhile=settle, start=start)
                finally:
                    if settle is not None:
                        settle()        # (a no-op unless the call failed first)
            else:
                ctx.write(h["buf"], h["offset"], command.payload)
            counters.bytes_uploaded += len(command.payload)
        elif op is Op.READ:
            size = h["size"]
            # The range first: a read past a 16-byte buffer must not cost a
            # reply buffer the size it claims.
            limit = ctx.buffer_size(h["buf"])
            if h["offset"] < 0 or size < 0 or h["offset"] + size > limit:
                raise OutOfRange(what=f"read of buffer {h['buf']}", offset=h["offset"], size=size,
                                 limit=limit)
            refuse_oversized_read(session, size)
            payload = session.buffers.get(size) if session.buffers is not None and size else bytearray(size)
            try:
                ctx.read_into(h["buf"], h["offset"], payload)
            except BaseException:
                if session.buffers is not None:
                    session.buffers.put(payload)
                raise
            counters.bytes_downloaded += len(payload)
        elif op is Op.ALLOC:
            _check_object_limit(session, "buffer")
            session.charge(h["size"], BUFFER_CHARGE)
            try:
                ctx.alloc(h["buf"], h["size"])
            except BaseException:
                session.refund(h["size"], BUFFER_CHARGE)
                raise
            session.objects += 1
        elif op is Op.FREE:
            session.refund(ctx.free(h["buf"]), BUFFER_CHARGE)
            session.objects -= 1
        elif op is Op.COPY:
            ctx.copy(h["src"], h["dst"], h["src_offset"], h["dst_offset"], h["size"])
        elif op is Op.FINISH:
            ctx.finish()
        elif op is Op.BUILD:
            counters.source_bytes += len(command.payload)
            try:
                source = bytes(command.payload).decode("utf-8")
            except UnicodeDecodeError:
                raise BadRequest(reason="program source is not UTF-8") from None
            buildpolicy.check_source(source, session.max_source_bytes)
            buildpolicy.check_options(h["options"])
            _check_object_limit(session, "program")
            result = _build(session, h["prog"], len(command.payload),
                            lambda: ctx.build_source(h["prog"], source, h["options"]))
            session.objects += 1
            counters.builds += 1
            fields = {"kernels": result.kernels, "log": result.log, "binary_size": result.binary_size}
        elif op is Op.BUILD_BINARY:
            counters.source_bytes += len(command.payload)
            buildpolicy.check_options(h["options"])
            _check_object_limit(session, "program")
            result = _build(session, h["prog"], len(command.payload),
                            lambda: ctx.build_binary(h["prog"], command.payload, h["options"]))
            session.objects += 1
            counters.builds += 1
            fields = {"kernels": result.kernels, "log": result.log, "binary_size": result.binary_size}
        elif op is Op.PROGRAM_BINARY:
            payload = ctx.program_binary(h["prog"])
        elif op is Op.FREE_PROGRAM:
            ctx.free_program(h["prog"])
            session.refund(0, session.program_charges.pop(h["prog"], 0))
            session.objects -= 1
        elif op is Op.INFO:
            fields = {"device": ctx.info()}
        elif op is Op.RELEASE:
            ctx.finish()
            fields = {"released": True}
        elif op in OPENCL_OPS:
            fields, payload = clcommands.execute(session, command)
        else:  # pragma: no cover - validate_command admits only the ops above
            raise InternalError(reason=f"no executor for {op.value}")
        if session.metrics is not None:
            session.metrics.count_command(session, command, len(payload))
        reply = {"op": "reply", "seq": command.seq, "ok": True}
        if fields:
            reply.update(fields)
            # (a build's log, a device's description: kept with the reply until acknowledged)
            return StoredReply(command.seq, reply, payload, len(str(fields)))
        return StoredReply(command.seq, reply, payload)
    except Exception as exc:  # an error reply (a bug or an unexpected failure: logged); keep serving
        return _error_reply(session, command.seq, command.op, exc)


def _build(session: Session, prog: int, nbytes: int, build):
    """A program built under its charge: ``PROGRAM_CHARGE`` and its source's
    or binary's ``nbytes`` (QUOTA_EXCEEDED first when they do not fit),
    given back when it fails or is freed."""
    charge = PROGRAM_CHARGE + nbytes
    session.charge(0, charge)
    try:
        result = build()
    except BaseException:
        session.refund(0, charge)
        raise
    session.program_charges[prog] = charge
    return result
