"""Pages of the control plane (issue 11): what grows with the number of
sessions comes a page at a time, behind cursors bound to their listing and
their caller; a record view stays bounded; hostile page requests are
refused before anything is read.  A real pool; sessions opened by hand
(``Raw``) so that a hundred of them cost no driver threads."""

from __future__ import annotations

import os
import types
import uuid

import pytest

from accelmig.wire import control as wc
from accelmig.wire.errors import BadRequest
from accelmig.wire.frames import encode_frame
from accelmig.wire.records import RECORD_INLINE_SESSIONS, RecordView
from tests.support.attest import bind
from tests.support.twohosts import Raw, TwoHosts, make_pool

MANY = RECORD_INLINE_SESSIONS + 6        # past what a record lists inline


@pytest.fixture
def many():
    """A pool with MANY sessions of one domain on hostA (their connections
    closed: kept detached), a second domain with two, and the two hosts."""
    with make_pool(max_sessions_per_tenant=MANY + 20, grace=600.0) as pool:
        hosts = TwoHosts(pool)
        domain, other = str(uuid.uuid4()), str(uuid.uuid4())
        sids = {domain: [], other: []}
        for dom, count in ((domain, MANY), (other, 2)):
            for _ in range(count):
                raw = Raw(hosts.a.endpoint)
                secret = os.urandom(32)
                sid = raw.open(secret)["sid"]
                raw.close()
                bind(hosts.a, {sid: secret}, dom)
                sids[dom].append(sid)
        yield types.SimpleNamespace(pool=pool, hosts=hosts, domain=domain, other=other, sids=sids)
        hosts.close()


def _opened_and_switched(many, domain):
    record = many.hosts.b.call("open_migration", domain_uuid=domain)
    many.hosts.a.call("switchover", domain_uuid=domain)
    return record["migration_id"]


def test_complete_hands_its_tickets_in_pages_the_same_live_ones_at_every_call(many):
    mid = _opened_and_switched(many, many.domain)
    b = many.hosts.b
    pages, cursor = [], None
    while True:
        page = b.call("complete", domain_uuid=many.domain, migration_id=mid, cursor=cursor, limit=16)
        assert len(page["tickets"]) <= 16
        assert len(encode_frame({"op": "result", "result": page})) <= wc.PAGED_ANSWER_MAX
        pages.append(page)
        cursor = page["next"]
        if cursor is None:
            break
    tickets = {sid: t for page in pages for sid, t in page["tickets"].items()}
    assert len(pages) == -(-MANY // 16) and set(tickets) == set(many.sids[many.domain])
    # a second hostd completing again gets the very same tickets, all of them
    again = b.client.call_all("complete", domain_uuid=many.domain, migration_id=mid)
    assert again["tickets"] == tickets and again["next"] is None
    # past RECORD_INLINE_SESSIONS a record view carries counts, not lists
    record = RecordView.from_wire(again["record"])
    assert not record.inline and "sessions" not in again["record"] and "resumed" not in again["record"]
    assert record.session_count == MANY and record.unresumed_count == MANY and not record.rehomed
    # its per-session detail is paged too
    detail = many.hosts.a.client.call_all("record_sessions", domain_uuid=many.domain, migration_id=mid)
    assert [s["sid"] for s in detail["sessions"]] == sorted(many.sids[many.domain])
    assert {s["blackout"] for s in detail["sessions"]} == {None} and detail["session_count"] == MANY


def test_a_cursor_is_refused_for_another_listing_another_host_or_when_forged(many):
    mid = _opened_and_switched(many, many.other)
    b, a = many.hosts.b, many.hosts.a
    cursor = b.call("complete", domain_uuid=many.other, migration_id=mid, limit=1)["next"]
    assert cursor
    # another host presenting it
    with pytest.raises(BadRequest, match="not for this listing"):
        a.call("complete", domain_uuid=many.other, migration_id=mid, cursor=cursor)
    # another record (another domain's migration) with it
    _opened_and_switched(many, many.domain)
    with pytest.raises(BadRequest, match="not for this listing"):
        b.call("complete", domain_uuid=many.domain, cursor=cursor)
    # another method with it
    with pytest.raises(BadRequest, match="not for this listing"):
        b.call("record_sessions", domain_uuid=many.other, migration_id=mid, cursor=cursor)
    # a list_sessions cursor of one domain is no cursor of another's listing
    listed = a.call("list_sessions", domain_uuid=many.domain, limit=2)
    with pytest.raises(BadRequest, match="not for this listing"):
        a.call("list_sessions", domain_uuid=many.other, cursor=listed["next"])
    with pytest.raises(BadRequest, match="not for this listing"):
        a.call("list_sessions", cursor=listed["next"])
    # forged: another position under the same MAC, or no cursor at all
    position, mac = cursor.split(".")
    for forged in (f"{int(position) + 1}.{mac}", "0." + "0" * 32, "garbage", "-1." + mac, "1e3." + mac):
        with pytest.raises(BadRequest):
            b.call("complete", domain_uuid=many.other, migration_id=mid, cursor=forged)
    # the genuine one still works, for its own host
    assert b.call("complete", domain_uuid=many.other, migration_id=mid, cursor=cursor)["next"] is None


@pytest.mark.parametrize("args, message", [
    ({"cursor": "7." + "a" * 300}, "cursor must be a string of 1 to 256"),
    ({"cursor": 12}, "cursor must be a string"),
    ({"cursor": ["1"]}, "cursor must be a string"),
    ({"limit": 0}, "limit must be an integer from 1 to 1000"),
    ({"limit": wc.MAX_PAGE_ITEMS + 1}, "limit must be an integer from 1 to 1000"),
    ({"limit": True}, "limit must be an integer"),
    ({"limit": "5"}, "limit must be an integer"),
    ({"limit": 2.5}, "limit must be an integer"),
])
def test_a_hostile_page_request_is_refused(many, args, message):
    for method, extra in (("list_sessions", {}), ("list_records", {}), ("accel_domains", {})):
        with pytest.raises(BadRequest, match=message):
            many.hosts.a.call(method, **extra, **args)


def test_every_listing_pages_to_the_whole_of_it(many):
    a = many.hosts.a
    whole = a.client.call_all("list_sessions", domain_uuid=many.domain)
    by_one = []
    cursor = None
    while True:
        page = a.call("list_sessions", domain_uuid=many.domain, cursor=cursor, limit=7)
        by_one += page["sessions"]
        cursor = page["next"]
        if not cursor:
            break
    assert [s["sid"] for s in by_one] == [s["sid"] for s in whole["sessions"]]
    assert {s["sid"] for s in whole["sessions"]} == set(many.sids[many.domain])
    # (paged by domain: what each holds waiting to be attested, never the sessions' ids)
    assert a.call("accel_domains", limit=1)["next"]
    domains = a.client.call_all("accel_domains", limit=1)
    assert domains["domains"] == {many.domain: 0, many.other: 0}
    # an unchanged picture still answers in a few bytes, whatever the pages
    assert a.call("accel_domains", since=domains["version"]) == {"version": domains["version"], "unchanged": True}
    mids = {_opened_and_switched(many, many.domain), _opened_and_switched(many, many.other)}
    first = a.call("list_records", limit=1)
    assert len(first["records"]) == 1 and first["next"]
    records = a.client.call_all("list_records", limit=1)["records"]
    assert {r["migration_id"] for r in records} == mids and len(records) == 2


def test_park_and_unpark_answers_list_a_bounded_number_of_sessions(many):
    parked = many.hosts.a.call("park", domain_uuid=many.domain, retention=600)
    assert len(parked["parked"]) == RECORD_INLINE_SESSIONS and parked["more"] == MANY - RECORD_INLINE_SESSIONS
    unparked = many.hosts.a.call("unpark", domain_uuid=many.domain)
    assert len(unparked["unparked"]) == RECORD_INLINE_SESSIONS and unparked["more"] == MANY - RECORD_INLINE_SESSIONS
