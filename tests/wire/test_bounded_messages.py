"""What keeps every message bounded whatever the number of sessions (issue
11): a rehome's tickets in pieces, an agent's answer listing what fits,
pages merged by the control plane's clients."""

from __future__ import annotations

import json

import pytest

from accelmig.wire import channel as ch
from accelmig.wire import control as wc
from accelmig.wire.errors import BadRequest, ProtocolError
from accelmig.wire.records import RECORD_INLINE_SESSIONS, RecordView


def _document(n: int) -> dict:
    return {"migration_id": "m-1", "identity": {"host_id": "hostB", "pool_endpoint": "10.0.0.1:7070"},
            "tickets": {f"s-abcdef01-{i}-{i:06x}": "v1." + "t" * 320 + f".{i:064x}" for i in range(n)}}


def test_a_small_rehome_goes_whole():
    pieces, rehome = ch.rehome_pieces(_document(10))
    assert pieces == [] and rehome == _document(10) and "ticket_count" not in rehome


def test_a_big_rehome_goes_in_pieces_that_add_up_each_within_its_budget():
    document = _document(1000)
    assert len(ch.encode({"type": "rehome", "id": 1, **document})) > ch.MAX_LINE     # one line could not
    pieces, rehome = ch.rehome_pieces(document)
    lines = [ch.encode({"type": "tickets", "id": 1, **p}) for p in pieces] + \
        [ch.encode({"type": "rehome", "id": 2, **rehome})]
    assert len(pieces) >= 6 and max(map(len, lines)) <= ch.REHOME_LINE_BUDGET
    merged = {}
    for piece in pieces:
        assert ch.parse_tickets(piece) == ("m-1", piece["tickets"])
        merged.update(piece["tickets"])
    merged.update(rehome["tickets"])
    assert merged == document["tickets"] and rehome["ticket_count"] == 1000
    assert ch.parse_rehome_count(rehome) == 1000 and rehome["identity"] == document["identity"]


@pytest.mark.parametrize("message", [
    {"migration_id": "m", "tickets": {"s": "t" * (ch.MAX_TICKET + 1)}},
    {"migration_id": "m", "tickets": {"s" * 257: "t"}},
    {"migration_id": "m", "tickets": ["s", "t"]},
    {"migration_id": "m" * 257, "tickets": {}},
    {"migration_id": 7, "tickets": {}},
])
def test_a_tickets_piece_out_of_bounds_is_refused(message):
    with pytest.raises(BadRequest):
        ch.parse_tickets(message)


@pytest.mark.parametrize("count", [-1, True, "3", 1.5, ch.MAX_REHOME_TICKETS + 1])
def test_a_ticket_count_out_of_bounds_is_refused(count):
    with pytest.raises(BadRequest, match="ticket_count"):
        ch.parse_rehome_count({"ticket_count": count})


def test_an_outcome_lists_the_failures_first_within_its_budget_and_counts_all():
    sessions = {f"s-{i}": {"ok": True, "seconds": 0.01, "epoch": 2, "endpoint": "[::1]:7070"} for i in range(3000)}
    sessions.update({f"f-{i}": {"ok": False, "error": {"code": "TIMEOUT", "message": "late"}} for i in range(5)})
    outcome = ch.bounded_outcome({"migration_id": "m", "ok": False, "sessions": sessions})
    listed = outcome["sessions"]
    assert len(json.dumps(listed, separators=(",", ":"))) <= ch.ANSWER_BUDGET
    assert all(f"f-{i}" in listed for i in range(5))
    assert outcome["sessions_omitted"] == len(sessions) - len(listed) > 0
    assert outcome["session_count"] == 3005 and outcome["resumed_count"] == 3000 and outcome["ok"] is False
    assert len(ch.encode(ch.result(1, result=outcome))) < ch.MAX_LINE
    small = ch.bounded_outcome({"ok": True, "sessions": {"s-1": {"ok": True}}})
    assert small["sessions"] == {"s-1": {"ok": True}} and "sessions_omitted" not in small


def test_pages_merge_lists_and_objects_and_a_domain_spanning_two_pages():
    first = {"version": "v", "domains": {"d1": ["a"], "d2": ["b"]}, "next": "1.x"}
    second = {"version": "v2", "domains": {"d2": ["c"], "d3": ["d"]}, "next": None}
    merged = wc.merge_page("accel_domains", first, second)
    assert merged == {"version": "v", "domains": {"d1": ["a"], "d2": ["b", "c"], "d3": ["d"]}, "next": None}
    assert wc.merge_page("list_sessions", {"sessions": [1], "next": "c"}, {"sessions": [2], "next": None}) == \
        {"sessions": [1, 2], "next": None}
    with pytest.raises(ProtocolError):
        wc.merge_page("list_sessions", {"sessions": [1], "next": "c"}, {"sessions": {"x": 1}})
    with pytest.raises(ProtocolError):
        wc.merge_page("ping", {}, {})


def test_a_record_view_lists_inline_while_short_and_counts_always():
    base = {"domain_uuid": "d", "migration_id": "m", "state": "completed", "dest_host": "hostB"}
    short = RecordView.from_wire(dict(base, sessions=["s1", "s2"], resumed={"s1": 0.1}, session_count=2,
                                      resumed_count=1, rehomed=False))
    assert short.inline and short.unresumed_count == 1 and not short.rehomed
    assert short.to_wire()["sessions"] == ["s1", "s2"] and "sessions" not in short.to_wire(inline=False)
    many = RecordView.from_wire(dict(base, session_count=RECORD_INLINE_SESSIONS + 1,
                                     resumed_count=RECORD_INLINE_SESSIONS + 1, blackout_max=0.2, rehomed=True))
    assert not many.inline and many.rehomed and many.unresumed_count == 0 and many.blackout_max == 0.2
    assert "sessions" not in many.to_wire() and many.to_wire()["session_count"] == RECORD_INLINE_SESSIONS + 1
    # an older pool (no counts): the lists are the counts
    old = RecordView.from_wire(dict(base, sessions=["s1"], resumed={"s1": 0.1}))
    assert old.session_count == old.resumed_count == 1
    # the verdict is the pool's, read off the wire, never recomputed from the counts
    assert not old.rehomed and many.to_wire()["rehomed"] is True
    with pytest.raises(ProtocolError, match="rehomed"):
        RecordView.from_wire(dict(base, rehomed="yes"))
    with pytest.raises(ProtocolError, match="all of them or none"):
        RecordView.from_wire(dict(base, sessions=["s1"], session_count=5))


def test_a_pools_announced_payload_limit_is_bounded_below():
    """A driver chunks transfers to the pool's limit: a pool announcing a
    few bytes must not turn one upload into millions of commands."""
    from accelmig.wire import dataplane as dp
    own = 1 << 30
    assert dp.announced_payload_limit({}, own) == own
    assert dp.announced_payload_limit({"max_payload": 256 << 10}, own) == 256 << 10
    assert dp.announced_payload_limit({"max_payload": 1 << 40}, own) == own       # never above ours
    assert dp.announced_payload_limit({"max_payload": dp.MIN_PAYLOAD_LIMIT}, own) == dp.MIN_PAYLOAD_LIMIT
    for hostile in (1, 0, -5, dp.MIN_PAYLOAD_LIMIT - 1, "1GiB", 1.5e9, True, [1]):
        with pytest.raises(BadRequest, match="the pool announced max_payload"):
            dp.announced_payload_limit({"max_payload": hostile}, own)


def test_a_pool_configured_below_the_floor_is_refused():
    from accelmig.pool.config import PoolConfig
    from accelmig.wire.errors import ConfigInvalid
    with pytest.raises(ConfigInvalid, match="max_payload must be at least 4096"):
        PoolConfig.load(None, {"max_payload": "1KiB"})
