"""Floods before the handshake, and connections gone quiet after it
(issue 28, item 7), against a real pool process serving TLS with a
throwaway CA, under a descriptor limit of 300.

Before: the pool counted a connection only once its TLS handshake was done
(asyncio ran it first), so 320 silent TCP connections took every
descriptor and a real driver's handshake never finished; each cost
asyncio's 256 KiB TLS read buffer.  Now every connection is counted from
accept, per address and in total (``pool.admission``): one address gets
32 strangers, all of them together half of what the descriptor limit
leaves, and a newcomer evicts the oldest stranger of the most crowded
address — so a tenant's driver gets in during the flood.  An attached
connection that sends nothing for ``idle_timeout`` is cut; the driver's
keepalive keeps a healthy idle one.
"""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
import time

import numpy as np
import pytest

from accelmig.agent.driver import connect
from accelmig.pool.admission import ConnectionLimits
from accelmig.pool.config import PoolConfig
from accelmig.wire.errors import ConfigInvalid
from tests.support.raw_peers import PoolWatch, RawPeer, rss
from tests.support.wait import wait_for

TOKEN = "alice-token-00001"
TENANTS = f'[tenants.alice]\ntoken = "{TOKEN}"\nquota = "64MiB"\n'
DESCRIPTORS = 300
#: what the flood may add to the pool's resident memory: generous (~2 MiB
#: measured now: a silent connection costs no TLS state, a half handshake
#: one TLS record's buffer), far below what it cost main (86 MiB measured)
FLOOD_RSS_BOUND = 24 << 20


def client_hello_half() -> bytes:
    """The first half of a real TLS ClientHello: a handshake that never ends."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    hello = outgoing.read()
    return hello[:len(hello) // 2]


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="SKIPPED LOUDLY: util-linux's prlimit is not installed")
def test_a_driver_computes_through_a_flood_of_silent_connections_and_half_handshakes(tls_pool_process, lab_pki):
    pool = tls_pool_process(TENANTS, config="handshake_timeout = 20.0\n",
                            wrapper=("prlimit", f"--nofile={DESCRIPTORS}:{DESCRIPTORS}", "--"))
    told = pool.wait_log(lambda e: e["msg"].startswith("connections: "))
    assert f"{DESCRIPTORS} descriptors" in told["msg"], told["msg"]
    watch = PoolWatch(pool.tokens.parent / "pool.sock")
    with connect(pool.endpoint, TOKEN, cafile=str(lab_pki.ca), agent=False) as warm:
        warm.read(warm.upload(b"warm"))             # the pool's first session, before the flood
    before = rss(pool.pid)
    flood = []
    try:
        for n in range(10):                          # 10 addresses x 32: 320 silent TCP connections
            flood += [RawPeer(pool.endpoint, source=f"127.0.0.{2 + n}", handshake=False) for _ in range(32)]
        half = client_hello_half()
        for _ in range(20):                          # and 20 handshakes that stop half-way
            peer = RawPeer(pool.endpoint, source="127.0.0.20", handshake=False)
            peer.sock.sendall(half)
            flood.append(peer)
        started = time.monotonic()
        with connect(pool.endpoint, TOKEN, cafile=str(lab_pki.ca), agent=False, connect_timeout=10) as dev:
            data = np.arange(1 << 16, dtype=np.uint32)
            assert np.array_equal(np.frombuffer(dev.read(dev.upload(data)), np.uint32), data)
        took = time.monotonic() - started
        grown = rss(pool.pid) - before
        assert grown < FLOOD_RSS_BOUND, f"the flood cost the pool {grown >> 20} MiB"
        assert took < 10, f"the driver needed {took:.1f} s to get in"
        # the pool still holds a bounded number of strangers, evicted the rest
        metrics = watch.call("metrics")["text"]
        strangers = _metric(metrics, 'accelmig_connections{state="unauthenticated"}')
        assert 0 < strangers <= (DESCRIPTORS - max(64, DESCRIPTORS // 4)) // 2
        assert _metric(metrics, "accelmig_evicted_connections_total") >= len(flood) - strangers
    finally:
        for peer in flood:
            peer.close()


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} in the pool's metrics")


def test_a_connection_quiet_after_authenticating_is_cut_and_a_healthy_idle_driver_is_not(tls_pool_process,
                                                                                      lab_pki):
    idle_timeout = 1.5
    pool = tls_pool_process(TENANTS, config=f"idle_timeout = {idle_timeout}\n")
    watch = PoolWatch(pool.tokens.parent / "pool.sock")
    with connect(pool.endpoint, TOKEN, cafile=str(lab_pki.ca), agent=False) as dev:
        buf = dev.upload(b"kept")
        # the driver goes quiet now; a peer authenticates after it and goes quiet too
        quiet = RawPeer(pool.endpoint, lab_pki.ca)
        try:
            sid = quiet.open(TOKEN)["sid"]
            opened = time.monotonic()
            frames = quiet.frames_until_closed()
            cut_after = time.monotonic() - opened
        finally:
            quiet.close()
        assert frames[-1]["op"] == "error" and frames[-1]["error"]["code"] == "TIMEOUT", frames
        assert "idle_timeout" in frames[-1]["error"]["message"]
        assert idle_timeout - 0.2 <= cut_after < 3 * idle_timeout, cut_after
        assert watch.sessions()[sid] == "detached"        # its grace runs, as for any lost connection
        # the driver, quiet for longer than that, was kept by its keepalives
        assert watch.sessions()[dev.sid] == "attached"
        assert dev.read(buf) == b"kept" and dev.stats["resumes"] == 0


def test_the_connection_bounds_follow_the_descriptor_limit():
    limits = ConnectionLimits(PoolConfig(), descriptors=300)
    assert (limits.max_connections, limits.max_unauthenticated, limits.per_peer) == (225, 112, 32)
    assert "at most 225 connections (300 descriptors, 75 kept" in limits.describe()
    big = ConnectionLimits(PoolConfig(max_connections=10000), descriptors=65536)
    assert (big.max_connections, big.max_unauthenticated) == (10000, 512)
    with pytest.raises(ConfigInvalid, match="1000 connections cannot fit under the descriptor limit of 300"):
        ConnectionLimits(PoolConfig(max_connections=1000), descriptors=300)
    with pytest.raises(ConfigInvalid, match="descriptor limit of 70 leaves room for 6 connections"):
        ConnectionLimits(PoolConfig(), descriptors=70)


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="SKIPPED LOUDLY: util-linux's prlimit is not installed")
def test_a_pool_whose_descriptor_limit_cannot_hold_its_connections_does_not_start(tmp_path):
    (tmp_path / "pool.toml").write_text("[pool]\nmax_connections = 1000\n")
    (tmp_path / "tokens.toml").write_text(TENANTS)
    exe = os.path.join(os.path.dirname(sys.executable), "accelmig-pool")
    done = subprocess.run(["prlimit", "--nofile=300:300", "--", exe, "serve", "--config", tmp_path / "pool.toml",
                           "--tokens", tmp_path / "tokens.toml", "--insecure", "--listen", "127.0.0.1:0",
                           "--control-listen", "", "--admin-socket", "", "--log-format", "text"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert "1000 connections cannot fit under the descriptor limit of 300" in done.stderr, done.stderr
