"""Property test of the sequence logic against a model.

Hypothesis drives the pool's ``SequenceLog`` and the driver's
``CommandWindow`` (the real classes) through any interleaving of sends,
deliveries, executions, acknowledgements, connection cuts, resumes, and
snapshots of the driver that later try to resume (stale copies).  The glue
between them does what pool/server.py and agent/driver/session.py do at a resume.

Invariants: no command executes twice; whatever executed is what the live
driver lineage issued under that number; no reply reaches the application
twice; a refused copy changes nothing at the pool; and once the link is
quiet, every command issued executed exactly once and its reply arrived.
"""

from __future__ import annotations

import collections
import copy

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from accelmig.agent.driver.window import CommandWindow
from accelmig.pool.sequencing import SequenceLog, StoredReply, Verdict
from accelmig.wire.dataplane import command_digest
from accelmig.wire.errors import SessionDiverged


class Driver:
    def __init__(self):
        self.window = CommandWindow(max_commands=6, max_bytes=1 << 20)
        self.epoch = 1
        self.connected = True
        self.history: dict[int, int] = {}
        self.delivered: list[int] = []
        self.acked_sent = 0


class Pool:
    def __init__(self):
        self.log = SequenceLog("s-model")
        self.epoch = 1
        self.executed: dict[int, list[int]] = collections.defaultdict(list)
        self.queue: collections.deque = collections.deque()
        self.attached = True

    def state(self):
        return (self.epoch, self.log.next_seq, self.log.acked, self.log.highest_reply,
                dict(self.log.digests), tuple(self.log.replies), tuple(self.queue))


class SequenceModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.driver = Driver()
        self.pool = Pool()
        self.to_pool: collections.deque = collections.deque()
        self.to_driver: collections.deque = collections.deque()
        self.copies: list[Driver] = []
        self.refusals = 0

    # -- the application ---------------------------------------------------------
    @precondition(lambda self: self.driver.connected)
    @rule(value=st.integers(0, 1000))
    def send(self, value):
        d = self.driver
        if not d.window.has_room(0):
            return
        header = {"op": "launch", "epoch": d.epoch, "ack": d.window.last_seen, "v": value}
        cmd = d.window.add(header)
        d.history[cmd.seq] = value
        self.to_pool.append(("cmd", dict(header)))

    @precondition(lambda self: self.driver.connected)
    @rule()
    def send_ack(self):
        self.to_pool.append(("ack", self.driver.window.last_seen))

    # -- the link and the pool -------------------------------------------------------
    @precondition(lambda self: self.to_pool)
    @rule()
    def pool_receives(self):
        kind, item = self.to_pool.popleft()
        pool = self.pool
        if kind == "ack":
            pool.log.acknowledge(item)
            return
        if item["epoch"] != pool.epoch:          # fenced: STALE_EPOCH, frame refused
            self.refusals += 1
            return
        pool.log.acknowledge(item["ack"])
        digest = command_digest(item)
        verdict = pool.log.classify(item["seq"], digest)
        if verdict is Verdict.NEW:
            pool.log.accept(item["seq"], digest)
            pool.queue.append(item)
        elif verdict is Verdict.DUPLICATE:
            stored = pool.log.stored_reply(item["seq"])
            if stored is not None and pool.attached:
                self.to_driver.append(stored)
        else:
            raise AssertionError(f"the live driver was refused: {verdict} for {item}")

    @precondition(lambda self: self.pool.queue)
    @rule()
    def pool_executes(self):
        item = self.pool.queue.popleft()
        self.pool.executed[item["seq"]].append(item["v"])
        reply = StoredReply(item["seq"], {"op": "reply", "seq": item["seq"], "ok": True})
        self.pool.log.record_reply(reply)
        if self.pool.attached:
            self.to_driver.append(reply)

    @precondition(lambda self: self.to_driver)
    @rule()
    def driver_receives(self):
        reply = self.to_driver.popleft()
        cmd = self.driver.window.complete(reply.seq, reply.header)
        if cmd is not None:
            self.driver.delivered.append(reply.seq)

    @rule()
    def cut(self):
        self.to_pool.clear()
        self.to_driver.clear()
        self.driver.connected = False
        self.pool.attached = False

    # -- resumes ---------------------------------------------------------------------
    def _try_resume(self, driver: Driver) -> bool:
        """What pool/server.py does; True when the resume was accepted."""
        pool = self.pool
        before = pool.state()
        try:
            if driver.epoch != pool.epoch:
                raise SessionDiverged(sid="s", reason="older epoch")
            replay = pool.log.check_resume(driver.window.last_seen, driver.window.next_seq)
        except SessionDiverged:
            assert pool.state() == before, "a refused resume changed the pool"
            self.refusals += 1
            return False
        # accepted: the old connection is fenced, in-flight frames of it are gone
        self.to_pool.clear()
        self.to_driver.clear()
        pool.epoch += 1
        pool.log.acknowledge(driver.window.last_seen)
        pool.attached = True
        driver.epoch = pool.epoch
        driver.connected = True
        self.to_driver.extend(replay)
        for cmd in driver.window.resend_from(pool.log.next_seq):
            cmd.header["epoch"] = driver.epoch
            cmd.header["ack"] = driver.window.last_seen
            self.to_pool.append(("cmd", dict(cmd.header)))
        return True

    @precondition(lambda self: not self.driver.connected)
    @rule()
    def resume(self):
        assert self._try_resume(self.driver), "the live driver's resume was refused"

    @precondition(lambda self: len(self.copies) < 3)
    @rule()
    def snapshot(self):
        self.copies.append(copy.deepcopy(self.driver))

    @precondition(lambda self: self.copies)
    @rule(data=st.data())
    def stale_copy_resumes(self, data):
        index = data.draw(st.integers(0, len(self.copies) - 1))
        stale = self.copies.pop(index)
        stale.connected = False
        if self._try_resume(stale):
            # Accepted only when indistinguishable from the live driver at this
            # point: the copy now is the driver, the old one is fenced.
            self.driver = stale

    # -- invariants --------------------------------------------------------------------
    @invariant()
    def executed_at_most_once_and_as_issued(self):
        for seq, values in self.pool.executed.items():
            assert len(values) == 1, f"seq {seq} executed {len(values)} times"
            assert self.driver.history.get(seq) == values[0], f"seq {seq} is not what was issued"

    @invariant()
    def replies_reach_the_application_once(self):
        delivered = self.driver.delivered
        assert len(delivered) == len(set(delivered))
        assert delivered == sorted(delivered)

    def teardown(self):
        # Quiesce: reconnect if needed, then run everything to completion.
        if not self.driver.connected:
            self.resume()
        for _ in range(10000):
            if self.to_pool:
                self.pool_receives()
            elif self.pool.queue:
                self.pool_executes()
            elif self.to_driver:
                self.driver_receives()
            else:
                break
        issued = set(self.driver.history)
        assert set(self.pool.executed) == issued
        assert all(len(v) == 1 for v in self.pool.executed.values())
        assert set(self.driver.delivered) == issued


TestSequenceModel = SequenceModel.TestCase
TestSequenceModel.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
