"""2,000 dependent launches through 50 randomly timed connection cuts and 10
moves between two hosts (two of them back to back before the first ticket
was used): bit-identical to an uncut run, zero rebuilds, zero re-uploads."""

from __future__ import annotations

import random
import threading
import time

from accelmig.agent.driver import connect
from accelmig.pool.harness import CutProxy
from accelmig.wire.errors import AccelmigError
from tests.conftest import ALICE
from tests.continuity.conftest import TwoHosts, make_pool
from tests.continuity.workload import PROGRAMS, WEIGHT_BYTES, Workload

LAUNCHES = 2000
CUTS = 50
MOVES = 10


def reference_digest(endpoint: str) -> str:
    with connect(endpoint, ALICE, agent=False) as dev:
        return Workload(dev).run(LAUNCHES)


class Mover:
    """Plays the host side: migration records through the control plane, and
    the guest agent's part: tell the driver its new endpoint and ticket."""

    def __init__(self, hosts: TwoHosts, proxies: dict, dev, domain: str):
        self.hosts, self.proxies, self.dev, self.domain = hosts, proxies, dev, domain
        self.at = hosts.a
        self.moves = 0
        self.double_moves = 0
        self.errors: list = []
        self._lock = threading.Lock()    # a domain migrates once at a time

    def move(self, back_to_back: bool = False) -> None:
        with self._lock:
            self._move(back_to_back)

    def _move(self, back_to_back: bool) -> None:
        try:
            dst = self.hosts.other(self.at)
            ticket = self.hosts.migrate(self.domain, self.at, dst)["tickets"][self.dev.sid]
            self.moves += 1
            if back_to_back:       # move on again before the first ticket was used
                self.at, dst = dst, self.hosts.other(dst)
                ticket = self.hosts.migrate(self.domain, self.at, dst)["tickets"][self.dev.sid]
                self.moves += 1
                self.double_moves += 1
            for attempt in range(50):
                try:
                    self.dev.resume(self.proxies[dst.name].endpoint, ticket)
                    break
                except AccelmigError as exc:   # a cut landed on the resume itself
                    if not exc.retriable and exc.code.value not in ("UNAVAILABLE",):
                        raise
                    if self.dev.state.value == "connected" and self.dev.bound_host == dst.name:
                        break      # the background retry made it first
                    time.sleep(0.02)
            self.at = dst
        except Exception as exc:  # reported by the test
            self.errors.append(exc)


def test_long_dependent_workload_survives_cuts_and_moves():
    domain = "dom-long-workload"
    with make_pool(grace=30) as pool:
        hosts = TwoHosts(pool)
        reference = reference_digest(hosts.a.endpoint)
        proxies = {"hostA": CutProxy(hosts.a.endpoint), "hostB": CutProxy(hosts.b.endpoint)}
        rng = random.Random(4242)
        cut_steps = set(rng.sample(range(20, LAUNCHES - 20), CUTS))
        move_steps = sorted(rng.sample(range(100, LAUNCHES - 100, 50), MOVES - 2))
        double_at = set(move_steps[2:4])    # two of the moves are back-to-back pairs
        move_steps = set(move_steps)
        cuts_done = []
        threads = []
        try:
            dev = connect(proxies["hostA"].endpoint, ALICE, agent=False, timeout=60)
            hosts.a.call("bind_session", sid=dev.sid, domain_uuid=domain)
            mover = Mover(hosts, proxies, dev, domain)

            def on_step(step):
                if step in cut_steps:
                    def cut():
                        time.sleep(rng.random() * 0.004)     # land anywhere in the pipeline
                        cuts_done.append(proxies["hostA"].cut() + proxies["hostB"].cut())
                    threads.append(threading.Thread(target=cut))
                    threads[-1].start()
                if step in move_steps:
                    threads.append(threading.Thread(target=mover.move, args=(step in double_at,)))
                    threads[-1].start()

            workload = Workload(dev)
            digest = workload.run(LAUNCHES, on_step=on_step)
            for thread in threads:
                thread.join(60)
            assert not mover.errors, mover.errors
            session = pool.session(dev.sid)
            dev.close()
        finally:
            for proxy in proxies.values():
                proxy.close()
            hosts.close()
    assert len(cuts_done) == CUTS
    assert mover.moves == MOVES and mover.double_moves == 2
    assert digest == reference, "results differ from the uncut run"
    counters = session["counters"]
    assert counters["builds"] == len(PROGRAMS), "a program was rebuilt"
    assert counters["bytes_uploaded"] == WEIGHT_BYTES, "weights or state were re-uploaded"
    assert counters["duplicates"] == 0, "the pool received commands it already had"
    assert counters["launches"] == LAUNCHES + LAUNCHES // 50
    assert session["epoch"] >= 1 + MOVES - 2      # every move resumed (pairs resume once)
