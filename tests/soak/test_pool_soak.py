"""A soak of one ``accelmig-pool serve`` process (issue 14, "Done when"):
several tenants' real drivers computing (tests/support/workload.py: builds,
uploads, dependent launches, reads), their connections cut under them
(``CutProxy``), their sessions migrated between two hosts through the
control plane (tests/support/twohosts.py's steps: open, switchover,
complete, close, resume with the ticket), while hostile clients work
beside them: garbage frames on both planes, slowloris half-frames, idle
connections that never authenticate, an authenticated control connection
and an opened session that both stay silent.

It runs ``ACCELMIG_SOAK_SECONDS`` (default 60) in two phases: a warm-up
(a quarter of it, 15 s at least) and the rest.  After each phase every
client stops and the pool's figures are read from ``/proc/PID/status`` at
rest.  What must hold:

- every round of every driver ends bit-identical to an uncut reference run;
- after the second phase, the pool's resident memory (VmRSS) is at most
  ``RSS_GROWTH`` above what it was after the warm-up, and its threads and
  open descriptors are back to what they were (``THREADS_SLACK``,
  ``FDS_SLACK``): nothing a client did is still held;
- no traceback and no error in the pool's log.

The figures are printed (``pytest -s`` shows them), the pool's device
processes' too (where the pool runs its tenants' device work in processes
of their own): those are printed, not bound — each build leaks about 1 MiB
there (pyopencl's ``Program.all_kernels()`` on PoCL 3.1, called by
``OpenCLContext._finish_build``); bind them as well once that is fixed.
(Where the device work runs in the pool's own process, that leak is the
pool's: about 4 MiB a round, past ``RSS_GROWTH`` within the default run.)

Nothing is timed besides the phases' lengths: the clients pace themselves
on events (the drivers' progress, the pool closing a connection)."""

from __future__ import annotations

import os
import random
import socket
import threading
import time

import pytest

from accelmig.agent.driver import connect
from accelmig.lab.cutproxy import CutProxy
from accelmig.wire.control import ControlClient, ControlSession
from accelmig.wire.errors import AccelmigError
from accelmig.wire.frames import MAGIC, PREFIX, encode_frame
from tests.fuzz.peers import HOST_SECRETS, FrameConn, descendants, dial, problems, proc_status, start_pool
from tests.support.attest import bind
from tests.support.tenants import ALICE, BOB
from tests.support.wait import wait_for
from tests.support.workload import Workload

pytestmark = pytest.mark.slow

SECONDS = float(os.environ.get("ACCELMIG_SOAK_SECONDS") or 60)
WARMUP = max(15.0, SECONDS / 4)
#: what the pool may grow by between the two rests (a leak of what the
#: second phase did — sessions, rounds, connections — would pass it)
RSS_GROWTH = 64 << 20
#: threads and descriptors at rest, after the second phase, beside those after the warm-up
THREADS_SLACK = 2
FDS_SLACK = 4
LAUNCHES = 600              # per round; each round a new session
CUT_EVERY = 70              # steps between cuts of a driver's connection
MOVE_AT = (150, 420)        # the steps of a round at which its session migrates
HANDSHAKE_TIMEOUT = 2.0     # how long the pool gives a connection to authenticate (slowloris churn)
TENANTS = [("alice-1", ALICE), ("alice-2", ALICE), ("bob-1", BOB)]


class Hosts:
    """hostA and hostB's control clients, and where their guests connect."""

    def __init__(self, pool):
        self.clients = {h: ControlClient(pool.control_endpoint, h, HOST_SECRETS[h].encode(), timeout=30)
                        for h in ("hostA", "hostB")}
        self.data = {h: next(e for e in pool.ready["data_all"] if e.startswith("[") == (h == "hostB"))
                     for h in ("hostA", "hostB")}

    def call(self, host, method, **args):
        return self.clients[host].call(method, **args)

    def bind(self, host, dev, domain):
        """What hostd does with the proof of a session its guest reports."""
        return bind(self.clients[host], dev, domain)

    def close(self):
        for client in self.clients.values():
            client.close()


def other(host: str) -> str:
    return "hostB" if host == "hostA" else "hostA"


class Stop:
    """The end of a phase, and the pace of the hostile clients: a tick each
    time a driver reaches a checkpoint."""

    def __init__(self):
        self.event = threading.Event()
        self.cond = threading.Condition()
        self.ticks = 0

    def tick(self):
        with self.cond:
            self.ticks += 1
            self.cond.notify_all()

    def next_tick(self, seen: int) -> int | None:
        """The tick after ``seen``; None once the phase is over."""
        with self.cond:
            self.cond.wait_for(lambda: self.ticks > seen or self.event.is_set(), timeout=30)
        return None if self.event.is_set() else self.ticks


class Tenant:
    """One application: round after round of the workload, each round a new
    session whose connection is cut every ``CUT_EVERY`` steps and which
    migrates at ``MOVE_AT``; the session's domain is the tenant's own VM."""

    def __init__(self, name, token, hosts: Hosts, reference: str, stop: Stop):
        self.name, self.token, self.hosts, self.reference, self.stop = name, token, hosts, reference, stop
        self.domain = f"soak-{name}"
        self.at = "hostA"
        self.proxies = {h: CutProxy(hosts.data[h]) for h in ("hostA", "hostB")}
        self.rounds = self.cuts = self.moves = 0
        self.errors: list = []
        self.thread = None
        self.move_lock = threading.Lock()    # a domain migrates once at a time

    def start(self):
        self.thread = threading.Thread(target=self._run, name=f"soak-{self.name}", daemon=True)
        self.thread.start()

    def _run(self):
        try:
            while not self.stop.event.is_set():
                self._round()
        except BaseException as exc:          # reported by the test
            self.errors.append(f"{self.name} round {self.rounds}: {type(exc).__name__}: {exc}")

    def _round(self):
        movers = []
        dev = connect(self.proxies[self.at].endpoint, self.token, agent=False, timeout=60, connect_timeout=30)
        try:
            self.hosts.bind(self.at, dev, self.domain)

            def on_step(step):
                if step % CUT_EVERY == 0:
                    self.cuts += self.proxies["hostA"].cut() + self.proxies["hostB"].cut()
                if step in MOVE_AT:
                    movers.append(threading.Thread(target=self._move, args=(dev,), daemon=True))
                    movers[-1].start()
                if step % 50 == 0:
                    self.stop.tick()

            digest = Workload(dev).run(LAUNCHES, on_step=on_step)
            for mover in movers:
                mover.join(120)
                assert not mover.is_alive(), "a migration did not end"
            assert digest == self.reference, f"{self.name}: round {self.rounds} differs from the uncut run"
            self.rounds += 1
        finally:
            dev.close()

    def _move(self, dev):
        """Migrate the tenant's VM to the other host: the records through the
        control plane, then the driver resumes there with its ticket (what
        the guest agent would tell it); a cut may land on the resume."""
        with self.move_lock:
            self._move_locked(dev)

    def _move_locked(self, dev):
        try:
            src, dst = self.at, other(self.at)
            record = self.hosts.call(dst, "open_migration", domain_uuid=self.domain)
            self.hosts.call(src, "switchover", domain_uuid=self.domain)
            done = self.hosts.call(dst, "complete", domain_uuid=self.domain, migration_id=record["migration_id"])
            self.hosts.call(src, "close", domain_uuid=self.domain, migration_id=record["migration_id"])
            ticket = done["tickets"][dev.sid]

            def resumed():
                try:
                    dev.resume(self.proxies[dst].endpoint, ticket)
                    return True
                except AccelmigError as exc:
                    if not exc.retriable and exc.code.value != "UNAVAILABLE":
                        raise
                    # the driver's own reconnect may have used the ticket first
                    return dev.state.value == "connected" and dev.bound_host == dst

            wait_for(resumed, 60, f"{self.name}'s resume at {dst}", interval=0.02)
            self.at = dst
            self.moves += 1
        except BaseException as exc:
            self.errors.append(f"{self.name} move: {type(exc).__name__}: {exc}")

    def join(self):
        self.thread.join(180)
        assert not self.thread.is_alive(), f"{self.name} did not end its round"

    def close(self):
        for proxy in self.proxies.values():
            proxy.close()


# -- hostile clients ------------------------------------------------------------------------------

def _drain(sock: socket.socket) -> None:
    """Read until the pool closes (the socket's timeout bounds it)."""
    try:
        while sock.recv(1 << 16):
            pass
    except OSError:
        pass
    finally:
        sock.close()


def garbage(pool, stop: Stop, counts: dict) -> None:
    """At every tick: a connection to either plane that says something no
    peer should — random bytes, a frame announcing 1 GiB, a header that is
    no JSON, a hello and then nonsense — then reads until the pool closes."""
    rng = random.Random(14)
    seen = 0
    while (seen := stop.next_tick(seen)) is not None:
        endpoint = rng.choice([pool.endpoint, pool.control_endpoint])
        data = rng.choice([
            lambda: rng.randbytes(rng.randrange(1, 200)),
            lambda: PREFIX.pack(MAGIC, 1, 0, 40, 1 << 30),
            lambda: PREFIX.pack(MAGIC, 1, 0, 9, 0) + b"not json!",
            lambda: encode_frame({"op": "hello", "versions": [1], "host": "hostA"}) + rng.randbytes(64),
            lambda: encode_frame({"op": "hello", "versions": [1]}) + encode_frame({"op": "open", "token": "nope",
                                                                                   "secret": "00" * 32}),
        ])()
        try:
            sock = dial(endpoint, 30)
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            continue
        _drain(sock)
        counts["garbage"] += 1


def slowloris(pool, stop: Stop, counts: dict, endpoint: str, nothing: bool) -> None:
    """A connection that sends half a frame (or ``nothing``) and waits: the
    pool closes it after its handshake timeout; then the next one."""
    half = encode_frame({"op": "hello", "versions": [1], "host": "hostA"})[:11]
    while not stop.event.is_set():
        try:
            sock = dial(endpoint, 30)
            if not nothing:
                sock.sendall(half)
        except OSError:
            continue
        _drain(sock)
        counts["idle" if nothing else "slowloris"] += 1


class SilentPeers:
    """Peers that authenticated and then say nothing: a hostA control
    connection after its welcome, a session opened by bob."""

    def __init__(self, pool):
        self.control = FrameConn(pool.control_endpoint, 30)
        session = ControlSession("hostA", HOST_SECRETS["hostA"].encode())
        self.control.sendraw(session.hello())
        session.welcome(self.control.next())
        self.data = FrameConn(pool.endpoint, 30)
        self.data.send({"op": "hello", "versions": [1]})
        assert self.data.next()["op"] == "welcome"
        self.data.send({"op": "open", "token": BOB, "secret": "cd" * 32})
        opened = self.data.next()
        assert opened["op"] == "opened", opened
        self.sid = opened["sid"]

    def close(self):
        self.control.close()
        self.data.close()


# -- the soak -------------------------------------------------------------------------------------

def children_figures(pool) -> tuple[str, dict]:
    """The pool's child processes (its tenants' device processes): a line for
    the record, and each one's VmRSS by pid.  They come and go with their
    tenants' sessions: only those alive at both rests are held to a bound."""
    kids = {}
    for pid in descendants(pool.pid):
        try:
            kids[pid] = proc_status(pid)
        except FileNotFoundError:
            pass
    if not kids:
        return "no child processes", {}
    line = (f"{len(kids)} child process(es): VmRSS {sum(k['rss'] for k in kids.values()) / (1 << 20):.1f} MiB, "
            f"{sum(k['threads'] for k in kids.values())} threads, {sum(k['fds'] for k in kids.values())} fds")
    return line, {pid: k["rss"] for pid, k in kids.items()}


def at_rest(pool, hosts: Hosts, baseline_threads: int | None) -> dict:
    """The pool's figures once every client has gone: no session is live
    (each round released its own; the silent one expired after its grace),
    threads back at ``baseline_threads`` (when given)."""
    def settled():
        sessions = hosts.call("hostA", "list_sessions")["sessions"]
        live = [s for s in sessions if s["state"] in ("attached", "detached", "parked")]
        if live:
            return False
        status = proc_status(pool.pid)
        return status if baseline_threads is None or status["threads"] <= baseline_threads + THREADS_SLACK \
            else False
    return wait_for(settled, 60, "the pool at rest (no live session, threads back)", interval=0.1)


def phase(pool, hosts: Hosts, reference: str, seconds: float, counts: dict) -> list[Tenant]:
    stop = Stop()
    tenants = [Tenant(name, token, hosts, reference, stop) for name, token in TENANTS]
    silent = SilentPeers(pool)
    hostile = [threading.Thread(target=garbage, args=(pool, stop, counts), daemon=True)]
    for endpoint in (pool.endpoint, pool.control_endpoint):
        for nothing in (False, True):
            hostile.append(threading.Thread(target=slowloris, args=(pool, stop, counts, endpoint, nothing),
                                            daemon=True))
    for thread in hostile:
        thread.start()
    for tenant in tenants:
        tenant.start()
    try:
        stop.event.wait(seconds)           # the phase's length: the one timed thing
    finally:
        stop.event.set()
        with stop.cond:
            stop.cond.notify_all()
        for tenant in tenants:
            tenant.join()
        for thread in hostile:
            thread.join(HANDSHAKE_TIMEOUT + 60)
        silent.close()
        for tenant in tenants:
            tenant.close()
    assert not [t.name for t in hostile if t.is_alive()], "a hostile client did not end"
    errors = [e for tenant in tenants for e in tenant.errors]
    assert not errors, errors
    return tenants


def test_a_pool_under_tenants_cuts_migrations_and_hostile_clients_stays_flat(tmp_path):
    pool = start_pool(tmp_path, "--grace", "3", "--listen", "127.0.0.1:0,[::1]:0",
                      config=f"handshake_timeout = {HANDSHAKE_TIMEOUT}\n")
    hosts = Hosts(pool)
    counts = {"garbage": 0, "slowloris": 0, "idle": 0}
    try:
        for host in ("hostA", "hostB"):
            hosts.call(host, "register_host", addresses=[], identity={"hostname": host})
        start = proc_status(pool.pid)
        with connect(hosts.data["hostA"], ALICE, agent=False, timeout=60) as dev:
            reference = Workload(dev).run(LAUNCHES)          # uncut, unmoved
        began = time.monotonic()
        warm = phase(pool, hosts, reference, WARMUP, counts)
        rest1 = at_rest(pool, hosts, None)
        rest1_at, (kids1, kid_rss1) = time.monotonic() - began, children_figures(pool)
        second = phase(pool, hosts, reference, max(1.0, SECONDS - WARMUP), counts)
        rest2 = at_rest(pool, hosts, rest1["threads"])
        rest2_at, (kids2, kid_rss2) = time.monotonic() - began, children_figures(pool)
        records = len(hosts.call("hostA", "list_records")["records"])
    finally:
        hosts.close()
        code = pool.stop()
    mib = 1 << 20
    rounds = sum(t.rounds for t in warm + second)
    print(f"\nsoak: {SECONDS:.0f} s (warm-up {WARMUP:.0f} s), {len(TENANTS)} tenants' drivers, "
          f"{rounds} rounds of {LAUNCHES} launches, {sum(t.cuts for t in warm + second)} connections cut, "
          f"{sum(t.moves for t in warm + second)} migrations; hostile: {counts['garbage']} garbage, "
          f"{counts['slowloris']} slowloris, {counts['idle']} idle connections; {records} records kept")
    print(f"soak: pool at start      VmRSS {start['rss'] / mib:7.1f} MiB, {start['threads']} threads, "
          f"{start['fds']} fds")
    print(f"soak: at rest at {rest1_at:5.1f} s VmRSS {rest1['rss'] / mib:7.1f} MiB, {rest1['threads']} threads, "
          f"{rest1['fds']} fds (after the warm-up); {kids1}")
    print(f"soak: at rest at {rest2_at:5.1f} s VmRSS {rest2['rss'] / mib:7.1f} MiB, {rest2['threads']} threads, "
          f"{rest2['fds']} fds (at the end): growth {(rest2['rss'] - rest1['rss']) / mib:+.1f} MiB "
          f"(bound {RSS_GROWTH / mib:.0f} MiB); {kids2}")
    assert code == 0
    assert problems(pool) == []
    assert all(t.rounds >= 1 for t in second), [(t.name, t.rounds) for t in second]
    assert sum(t.moves for t in warm + second) >= len(TENANTS) and sum(t.cuts for t in warm + second) > 0
    assert min(counts.values()) > 0, counts
    assert rest2["rss"] - rest1["rss"] < RSS_GROWTH, (rest1, rest2)
    assert rest2["threads"] <= rest1["threads"] + THREADS_SLACK, (rest1, rest2)
    assert rest2["fds"] <= rest1["fds"] + FDS_SLACK, (rest1, rest2)
    # a device process that lived through both phases (each build leaked
    # 1 MiB there before KERNEL_NAMES): flat too
    for pid in kid_rss1.keys() & kid_rss2.keys():
        assert kid_rss2[pid] - kid_rss1[pid] < RSS_GROWTH, (pid, kid_rss1[pid], kid_rss2[pid])
