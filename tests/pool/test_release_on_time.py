"""Quota and sessions come back on time after the pool ends a connection
or a tenant's device process (issue 28, item 9), against a real pool
process serving TLS with a throwaway CA, real PoCL device processes, and
peers driven frame by frame.  Every wait is on the pool's own state (its
admin socket) with a deadline of the grace plus one janitor period.

- A bad request: the pool answers with an error and closes.  Under TLS
  asyncio then waited up to 30 s for the peer's close_notify before it told
  the pool the connection was gone, and the session stayed attached (and
  its memory charged) all that while.  A peer that never reads held it on
  plain TCP too.
- A killed device process: the tenant's other sessions, idle, never heard
  of it (only a call in flight failed with KILLED): their quota stayed
  charged, for device memory that no longer existed, until their drivers
  did something.
"""

from __future__ import annotations

import time

from accelmig.pool.config import PoolConfig
from accelmig.pool.listeners import janitor_period
from tests.support.raw_peers import PoolWatch, RawPeer
from tests.support.wait import wait_for

TOKEN = "alice-token-00001"
TENANTS = f'[tenants.alice]\ntoken = "{TOKEN}"\nquota = "64MiB"\n'
SPIN = "__kernel void spin(__global volatile uint *a) { while (a[0] == 0) { } }"


def released_within(watch: PoolWatch, sid: str, seconds: float, since: float) -> float:
    """Wait until ``sid`` is gone and no device memory is counted; the
    seconds it took from ``since`` (AssertionError past ``seconds``)."""
    wait_for(lambda: sid not in watch.sessions() and watch.bytes_in_use() == 0,
             seconds - (time.monotonic() - since), f"session {sid} and its memory to be released",
             explain=lambda: f"sessions {watch.sessions()}, {watch.bytes_in_use()} bytes in use")
    return time.monotonic() - since


def test_a_session_whose_connection_the_pool_closed_is_released_after_its_grace(tls_pool_process, lab_pki):
    grace = 2.0
    pool = tls_pool_process(TENANTS, "--grace", grace)
    watch = PoolWatch(pool.tokens.parent / "pool.sock")
    peer = RawPeer(pool.endpoint, lab_pki.ca)
    try:
        sid = peer.open(TOKEN)["sid"]
        peer.send({"op": "alloc", "seq": 1, "epoch": 1, "buf": 1, "size": 8 << 20})
        peer.send({"op": "finish", "seq": 2, "epoch": 1})
        peer.replies_through(2)
        assert watch.bytes_in_use() == 8 << 20
        # a frame the pool refuses: it answers with an error and closes; this
        # peer reads nothing more and keeps its end open
        peer.send({"op": "teleport", "seq": 3, "epoch": 1})
        sent = time.monotonic()
        period = janitor_period(PoolConfig(grace=grace))
        took = released_within(watch, sid, grace + period + 1.0, sent)
        assert took >= grace - 0.5, f"released after {took:.2f} s, before its grace of {grace} s"
    finally:
        peer.close()


def test_a_killed_device_process_ends_every_session_in_it_at_once(tls_pool_process, lab_pki):
    """The tenant's second session computes nothing while the first one's
    kernel is killed: it ends too (its device state is gone), and its
    quota comes back without waiting for its driver."""
    # the limit is every device call's, the first alloc's (its process's
    # start) and the build's too: room for those on a loaded machine
    limit, grace = 4.0, 30.0
    pool = tls_pool_process(TENANTS, "--device-time-limit", limit, "--grace", grace)
    watch = PoolWatch(pool.tokens.parent / "pool.sock")
    idle, spinner = RawPeer(pool.endpoint, lab_pki.ca), RawPeer(pool.endpoint, lab_pki.ca)
    try:
        idle_sid = idle.open(TOKEN)["sid"]
        idle.send({"op": "alloc", "seq": 1, "epoch": 1, "buf": 1, "size": 1 << 20})
        idle.send({"op": "finish", "seq": 2, "epoch": 1})
        idle.replies_through(2)
        spinner_sid = spinner.open(TOKEN)["sid"]
        spinner.send({"op": "alloc", "seq": 1, "epoch": 1, "buf": 1, "size": 16})
        spinner.send({"op": "build", "seq": 2, "epoch": 1, "prog": 1, "options": ""}, SPIN.encode())
        spinner.send({"op": "launch", "seq": 3, "epoch": 1, "prog": 1, "kernel": "spin", "gsize": [64],
                      "lsize": [1], "args": [{"buf": 1}]})
        spinner.send({"op": "finish", "seq": 4, "epoch": 1})
        started = time.monotonic()
        frames = spinner.frames_until_closed()
        assert frames[-1]["op"] == "error" and frames[-1]["error"]["code"] == "KILLED", frames[-1]
        assert spinner_sid not in watch.sessions()
        took = released_within(watch, idle_sid, limit + janitor_period(PoolConfig(grace=grace)) + 3.0, started)
        # and the idle session's driver is told why, on its own connection
        told = idle.frames_until_closed()
        assert told and told[-1]["op"] == "error" and told[-1]["error"]["code"] == "KILLED", told
        assert took < grace
    finally:
        idle.close()
        spinner.close()
