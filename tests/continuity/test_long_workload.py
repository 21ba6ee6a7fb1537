"""2,000 dependent launches through 50 randomly timed connection cuts and 10
moves between two hosts (two of them back to back before the first ticket
was used): bit-identical to an uncut run, zero rebuilds, zero re-uploads.

The schedule (which steps cut, which move) and each cut's timing come from
one base seed, printed and named in every assertion message; rerun a
failure with ``ACCELMIG_TEST_SEED=<seed>``.  Every cut thread has its own
``random.Random`` (derived from the base seed and its step), so no two
threads share a generator."""

from __future__ import annotations

import os
import random
import threading
import time

from accelmig.agent.driver import connect
from accelmig.lab.cutproxy import CutProxy
from accelmig.wire.errors import AccelmigError
from tests.conftest import ALICE
from tests.support.attest import bind
from tests.support.twohosts import TwoHosts, make_pool
from tests.support.wait import wait_for
from tests.support.workload import PROGRAMS, WEIGHT_BYTES, Workload

LAUNCHES = 2000
CUTS = 50
MOVES = 10


def base_seed() -> int:
    """``ACCELMIG_TEST_SEED`` if set, else a fresh one (printed by the test)."""
    return int(os.environ.get("ACCELMIG_TEST_SEED") or random.SystemRandom().randrange(1 << 32))


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
        seed = base_seed()
        print(f"test_long_workload: base seed {seed} (rerun with ACCELMIG_TEST_SEED={seed})")
        why = f"[base seed {seed}: rerun with ACCELMIG_TEST_SEED={seed}]"
        rng = random.Random(seed)                 # the schedule: this thread only
        cut_steps = set(rng.sample(range(20, LAUNCHES - 20), CUTS))
        move_steps = sorted(rng.sample(range(100, LAUNCHES - 100, 50), MOVES - 2))
        double_at = set(move_steps[2:4])    # two of the moves are back-to-back pairs
        move_steps = set(move_steps)
        cuts_made = []                            # (step, connections cut), one per cut that cut
        cut_errors = []
        threads = []
        try:
            dev = connect(proxies["hostA"].endpoint, ALICE, agent=False, timeout=60)
            bind(hosts.a, dev, domain)
            mover = Mover(hosts, proxies, dev, domain)

            def on_step(step):
                if step in cut_steps:
                    def cut(step=step, own=random.Random(seed * 100_003 + step)):
                        try:
                            time.sleep(own.random() * 0.004)     # land anywhere in the pipeline
                            # cut() says how many connections it cut: none while the driver
                            # is between connections (a move, the previous cut): try again
                            cut_now = wait_for(lambda: proxies["hostA"].cut() + proxies["hostB"].cut(), 20,
                                               f"a connection to cut at step {step} {why}", interval=0.005)
                            cuts_made.append((step, cut_now))
                        except BaseException as exc:   # reported by the test
                            cut_errors.append((step, exc))
                    threads.append(threading.Thread(target=cut, name=f"cut-{step}"))
                    threads[-1].start()
                if step in move_steps:
                    threads.append(threading.Thread(target=mover.move, args=(step in double_at,)))
                    threads[-1].start()

            workload = Workload(dev)
            digest = workload.run(LAUNCHES, on_step=on_step)
            for thread in threads:
                thread.join(60)
            assert not [t.name for t in threads if t.is_alive()], f"threads still running {why}"
            assert not cut_errors, f"{cut_errors} {why}"
            assert not mover.errors, f"{mover.errors} {why}"
            session = pool.session(dev.sid)
            dev.close()
        finally:
            for proxy in proxies.values():
                proxy.close()
            hosts.close()
    assert len(cuts_made) == CUTS and all(n >= 1 for _, n in cuts_made), \
        f"cuts made (step, connections): {sorted(cuts_made)} {why}"
    assert mover.moves == MOVES and mover.double_moves == 2, f"{mover.moves} moves {why}"
    assert digest == reference, f"results differ from the uncut run {why}"
    counters = session["counters"]
    assert counters["builds"] == len(PROGRAMS), f"a program was rebuilt {why}"
    assert counters["bytes_uploaded"] == WEIGHT_BYTES, f"weights or state were re-uploaded {why}"
    assert counters["duplicates"] == 0, f"the pool received commands it already had {why}"
    assert counters["launches"] == LAUNCHES + LAUNCHES // 50, why
    # every move resumed (pairs resume once)
    assert session["epoch"] >= 1 + MOVES - 2, f"epoch {session['epoch']} {why}"
