"""What a tenant makes the pool hold stays within its quota and documented
bounds (issue 28, item 8), against a real pool process serving TLS with a
throwaway CA, real PoCL device processes, and peers driven frame by frame
that never acknowledge, or acknowledge what they never read.

- Each buffer and program costs host memory beside its device bytes (a
  1-byte buffer ~1.3 KiB, measured): it is charged to the quota with it
  (``BUFFER_CHARGE``), so 1-byte buffers end at the quota too.
- Replies are counted from the moment their command goes to the device (a
  read by its size), so a burst of reads waits for acknowledgements at
  ``max_reply_bytes`` instead of all running (main held 64 MiB of replies
  against an 8 MiB bound, and 798 MiB for 400 unacknowledged 1 MiB reads
  against 256 MiB); a single read larger than that is refused.
- A peer that acknowledges replies without reading them stops being read
  when the pool's output to it is full: its acknowledgements cannot empty
  the reply log into an unbounded socket buffer.
"""

from __future__ import annotations

import socket
import ssl

import pytest

from accelmig.pool.session import BUFFER_CHARGE, Tenant
from accelmig.wire.errors import LimitExceeded
from tests.support.raw_peers import PoolWatch, RawPeer, rss
from tests.support.wait import wait_for

TOKEN = "alice-token-00001"
MiB = 1 << 20


def tenants(quota: str) -> str:
    return f'[tenants.alice]\ntoken = "{TOKEN}"\nquota = "{quota}"\n'


def session_of(watch: PoolWatch, sid: str) -> dict:
    return next(s for s in watch.call("list_sessions")["sessions"] if s["sid"] == sid)


def test_one_byte_buffers_are_charged_their_bookkeeping_and_end_at_the_quota(tls_pool_process, lab_pki):
    quota = MiB
    pool = tls_pool_process(tenants("1MiB"))
    watch = PoolWatch(pool.tokens.parent / "pool.sock")
    peer = RawPeer(pool.endpoint, lab_pki.ca)
    try:
        peer.open(TOKEN)
        count = 1000                          # main took all of them: 1000 bytes of a 1 MiB quota
        for seq in range(1, count + 1):
            peer.send({"op": "alloc", "seq": seq, "epoch": 1, "buf": seq, "size": 1})
        replies = [h for h in peer.replies_through(count) if h["op"] in ("reply", "done")]
        refused = [h for h in replies if h["op"] == "reply" and not h["ok"]]
        made = count - len(refused)
        assert made == quota // (1 + BUFFER_CHARGE), made
        assert refused[0]["seq"] == made + 1 and refused[0]["error"]["code"] == "QUOTA_EXCEEDED"
        assert "host memory that the pool keeps for the tenant's buffers" in refused[0]["error"]["message"]
        # freeing one gives its charge back: one more fits again
        peer.send({"op": "free", "seq": count + 1, "epoch": 1, "buf": 1})
        peer.send({"op": "alloc", "seq": count + 2, "epoch": 1, "buf": count + 2, "size": 1})
        last = peer.replies_through(count + 2)[-1]
        assert last["op"] == "done" or last["ok"], last
        peer.send({"op": "release", "seq": count + 3, "epoch": 1})
        peer.replies_through(count + 3)
    finally:
        peer.close()
    wait_for(lambda: watch.bytes_in_use() == 0 and not watch.sessions(), 20, "the session to end")


def test_unacknowledged_reads_wait_at_max_reply_bytes_and_a_larger_one_is_refused(tls_pool_process, lab_pki):
    bound = 8 * MiB
    pool = tls_pool_process(tenants("64MiB"), "--grace", 60, config=f"max_reply_bytes = {bound}\n")
    watch = PoolWatch(pool.tokens.parent / "pool.sock")
    peer = RawPeer(pool.endpoint, lab_pki.ca)
    try:
        sid = peer.open(TOKEN)["sid"]
        peer.send({"op": "alloc", "seq": 1, "epoch": 1, "buf": 1, "size": MiB})
        peer.send({"op": "alloc", "seq": 2, "epoch": 1, "buf": 2, "size": 9 * MiB})
        peer.send({"op": "finish", "seq": 3, "epoch": 1})
        peer.replies_through(3)
        # one read larger than the bound: refused, no payload made for it
        peer.send({"op": "read", "seq": 4, "epoch": 1, "buf": 2, "offset": 0, "size": 9 * MiB, "ack": 3})
        header, payload = peer.next_frame()
        assert header["seq"] == 4 and not header["ok"] and payload == b""
        assert header["error"]["code"] == "QUOTA_EXCEEDED" and "max_reply_bytes" in header["error"]["message"]
        peer.send({"op": "ack", "ack": 4})
        before = rss(pool.pid)
        # 64 reads of 1 MiB that this peer neither reads nor acknowledges
        reads = range(5, 5 + 64)
        for seq in reads:
            peer.send({"op": "read", "seq": seq, "epoch": 1, "buf": 1, "offset": 0, "size": MiB})
        state = wait_for(lambda: (lambda s: s["held"] > 0 and s["in_flight"] == 0 and s)(session_of(watch, sid)),
                         20, "the reads within the bound to run, the others to be held")
        ran = state["sequence"]["highest_reply"] - 4
        assert 1 <= ran <= bound // MiB, state                  # main ran all 64
        assert state["sequence"]["reply_bytes"] <= bound
        assert state["held"] == len(reads) - ran
        grown = rss(pool.pid) - before
        assert grown < 40 * MiB, f"{grown >> 20} MiB for {ran} replies of 1 MiB kept"
        # read and acknowledged, the rest runs: held back, never dropped
        replies = []
        while len(replies) < len(reads):
            header, payload = peer.next_frame()
            assert header["op"] == "reply" and header["ok"] and len(payload) == MiB, header
            replies.append(header["seq"])
            peer.send({"op": "ack", "ack": header["seq"]})
        assert replies == list(reads)
    finally:
        peer.close()


def test_a_peer_that_acknowledges_what_it_never_reads_stops_being_read(tls_pool_process, lab_pki):
    pool = tls_pool_process(tenants("64MiB"), "--grace", 60)
    watch = PoolWatch(pool.tokens.parent / "pool.sock")
    peer = RawPeer(pool.endpoint, lab_pki.ca, timeout=10)
    try:
        sid = peer.open(TOKEN)["sid"]
        peer.send({"op": "alloc", "seq": 1, "epoch": 1, "buf": 1, "size": MiB})
        peer.send({"op": "finish", "seq": 2, "epoch": 1})
        peer.replies_through(2)
        before = rss(pool.pid)
        peer.sock.settimeout(2.0)
        sent = 0
        for seq in range(3, 3 + 200):           # main took all 200: 200 MiB in its output
            try:
                peer.send({"op": "read", "seq": seq, "epoch": 1, "buf": 1, "offset": 0, "size": MiB})
                # acknowledged as soon as the pool has it, never read
                wait_for(lambda: session_of(watch, sid)["sequence"]["highest_reply"] >= seq, 5,
                         f"reply {seq}")
                peer.send({"op": "ack", "ack": seq})
            except (socket.timeout, ssl.SSLError, AssertionError):
                break                              # the pool stopped reading this peer
            sent += 1
        assert sent < 100, f"the pool read {sent} reads from a peer that reads nothing"
        grown = rss(pool.pid) - before
        assert grown < 40 * MiB, f"the pool's output to a peer that never reads grew by {grown >> 20} MiB"
    finally:
        peer.close()
    wait_for(lambda: session_of(watch, sid)["state"] == "detached", 10, "the session to detach")


def test_headers_kept_for_unacknowledged_commands_are_bounded(tls_pool_process, lab_pki):
    """Every accepted command's header is kept until acknowledged (to tell a
    re-sent command from a diverged one).  A 60 KiB header of empty objects
    is ~1.3 MiB once parsed: a peer that never acknowledges stops being
    read at MAX_COMMAND_BYTES of them (counted at the worst case), where
    main read on to 65,536 commands."""
    pool = tls_pool_process(tenants("64MiB"), "--grace", 60)
    peer = RawPeer(pool.endpoint, lab_pki.ca)
    try:
        peer.open(TOKEN)
        junk = [{}] * 20000                           # 60 KB on the wire
        before = rss(pool.pid)
        peer.sock.settimeout(3.0)
        sent = 0
        for seq in range(1, 1 + 400):                 # main took all 400 (154 MiB for 200, measured)
            try:
                peer.send({"op": "info", "seq": seq, "epoch": 1, "junk": junk})
            except (socket.timeout, ssl.SSLError):
                break                                 # the pool stopped reading this peer
            sent += 1
        assert sent < 200, f"the pool read {sent} commands of 60 KB headers, never acknowledged"
        grown = rss(pool.pid) - before
        assert grown < 120 * MiB, f"{grown >> 20} MiB held for {sent} unacknowledged headers"
    finally:
        peer.close()


def test_a_tenants_quota_counts_its_objects_bookkeeping_beside_device_bytes():
    tenant = Tenant("t", "token-xxxxxxxx", 10_000, quota_by_type={"cpu": 9_000})
    tenant.reserve(4_000, "cpu", overhead=2_048)
    with pytest.raises(LimitExceeded, match="would use 8000 bytes of device memory and 4096 bytes of host memory"):
        tenant.reserve(4_000, "cpu", overhead=2_048)
    assert (tenant.used, tenant.overhead, tenant.used_by_type) == (4_000, 2_048, {"cpu": 4_000})
    tenant.reserve(3_000, "cpu", overhead=512)       # device bytes alone: the type's limit still holds
    tenant.give_back(4_000, "cpu", overhead=2_048)
    assert (tenant.used, tenant.overhead) == (3_000, 512)
