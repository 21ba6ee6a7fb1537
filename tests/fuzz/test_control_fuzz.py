"""Fuzzing the control plane (issue 14, "Done when") of a real
``accelmig-pool serve`` process: strangers sending anything before they
authenticate, and an authenticated host (hostA, with its real secret and
the real client's framing and HMAC, ``wire.control.ControlSession``) — and
the admin socket — calling every method, and some that do not exist, with
hostile arguments: wrong types, huge and negative numbers, nested JSON,
other hosts' names, other hosts' sessions and domains.  Fixed seed, bounded
examples (tests/fuzz/strategies.py).

What must hold whatever arrives:

- strangers get a ``welcome`` or an ``error`` frame, then a close: a
  complete first frame is always answered, never met with a silent close;
- every call of an authenticated host gets its answer, by id, signed with
  the host's secret (the client verifies it): a result, or a clear error —
  never ``INTERNAL``; only a frame the pool cannot decode (a lone
  surrogate) closes the connection, with ``BAD_FRAME``;
- nothing hostA calls changes what hostB holds: hostB's session stays bound
  to hostB, in hostB's domain, unparked;
- no traceback and no error in the pool's log (``peers.problems``), and,
  after all of it, the pool still serves a real driver and real hosts
  moving it from hostA to hostB (tests/support/twohosts.py's steps).

Bugs it found (a hello whose versions are not a list of integers, a method
that is a list) are fixed; each has its exact reproduction at the end.
"""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from accelmig.agent.driver import connect
from accelmig.pool.control import ControlServer
from accelmig.wire import control as wc
from accelmig.wire.control import ControlClient, ControlSession
from accelmig.wire.errors import AccelmigError, FrameError
from accelmig.wire.frames import PREFIX_SIZE, decode_header, encode_frame, parse_prefix
from tests.fuzz.peers import HOST_SECRETS, FrameConn, problems, start_pool
from tests.fuzz.strategies import (frame_prefixes, fuzz_settings, integers, json_values, objects,
                                   odd_header_bytes, raw_header_frame, text)
from tests.support.attest import bind
from tests.support.tenants import ALICE, BOB

SECRET_A = HOST_SECRETS["hostA"].encode()

# -- the pool -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    proc = start_pool(tmp_path_factory.mktemp("fuzz-control-pool"), "--grace", "2",
                      "--listen", "127.0.0.1:0,[::1]:0")
    yield proc
    assert proc.stop() == 0
    # after the stop: asyncio reports a task that died of an exception only
    # when the task is collected
    assert problems(proc) == []


def endpoint_of(pool, host: str) -> str:
    """The data-plane endpoint that host's guests use (A: IPv4, B: IPv6 loopback)."""
    return next(e for e in pool.ready["data_all"] if e.startswith("[") == (host == "hostB"))


class Targets:
    """What the fuzzed calls aim at: a live session of each host, bound to
    a domain of each (``dom-a`` by hostA, ``dom-b`` by hostB)."""

    def __init__(self, pool):
        self.devs = {h: connect(endpoint_of(pool, h), ALICE, agent=False, timeout=30) for h in ("hostA", "hostB")}
        self.clients = {h: ControlClient(pool.control_endpoint, h, HOST_SECRETS[h].encode())
                        for h in ("hostA", "hostB")}
        for host, dev in self.devs.items():
            domain = "dom-a" if host == "hostA" else "dom-b"
            assert bind(self.clients[host], dev, domain)["bound"] == [dev.sid]
        self.sids = {"@sid-a": self.devs["hostA"].sid, "@sid-b": self.devs["hostB"].sid}

    def resolve(self, value):
        """``value`` with the placeholders of the live sessions' ids filled in."""
        if isinstance(value, str):
            return self.sids.get(value, value)
        if isinstance(value, list):
            return [self.resolve(v) for v in value]
        if isinstance(value, dict):
            return {self.resolve(k): self.resolve(v) for k, v in value.items()}
        return value

    def check_b_untouched(self):
        """hostA's calls never change what hostB holds."""
        sessions = {s["sid"]: s for s in self.clients["hostB"].call("list_sessions")["sessions"]}
        mine = sessions[self.sids["@sid-b"]]
        assert (mine["bound_host"], mine["domain_uuid"], mine["parked"]) == ("hostB", "dom-b", False), mine

    def close(self):
        for dev in self.devs.values():
            dev.close()
        for client in self.clients.values():
            client.close()


@pytest.fixture(scope="module")
def targets(pool):
    t = Targets(pool)
    yield t
    t.close()


def still_serving(pool) -> None:
    """A real driver computes on hostA, the real hosts move it to hostB
    (open, switchover, complete, close) and it goes on there with its
    ticket: its buffer holds what it wrote; the log shows no bug."""
    domain = "dom-after-the-fuzz"
    a, b = (ControlClient(pool.control_endpoint, h, HOST_SECRETS[h].encode()) for h in ("hostA", "hostB"))
    try:
        for host in (a, b):
            assert host.call("ping")["caller"] == host.host
            host.call("register_host", addresses=[], identity={"hostname": host.host})
        with connect(endpoint_of(pool, "hostA"), BOB, agent=False, timeout=30) as dev:
            data = np.arange(1024, dtype=np.uint32)
            buf = dev.upload(data)
            assert bind(a, dev, domain)["bound"] == [dev.sid]
            record = b.call("open_migration", domain_uuid=domain)
            a.call("switchover", domain_uuid=domain)
            done = b.call("complete", domain_uuid=domain, migration_id=record["migration_id"])
            a.call("close", domain_uuid=domain, migration_id=record["migration_id"])
            assert dev.resume(endpoint_of(pool, "hostB"), done["tickets"][dev.sid])["ticket"]
            assert bytes(dev.read(buf)) == data.tobytes()
            listed = {s["sid"]: s for s in b.call("list_sessions", domain_uuid=domain)["sessions"]}
            assert listed[dev.sid]["bound_host"] == "hostB"
    finally:
        a.close()
        b.close()
    assert problems(pool) == []


@pytest.fixture(scope="module")
def probe_done(pool, targets):
    yield
    still_serving(pool)


# -- strangers ---------------------------------------------------------------------------------

HOST_NAMES = ["hostA", "hostB", "admin", "nope", "", "hostA "]
hello_headers = st.tuples(
    st.sampled_from(["hello"] * 6 + ["call", "welcome", "result", "", "HELLO"]),
    objects({"versions": st.one_of(st.just([1]), st.sampled_from([[1, 2], [2], [], [2**64], "1", {}, None])),
             "host": st.sampled_from(HOST_NAMES)})).map(lambda pair: {**pair[1], "op": pair[0]})
#: what a stranger follows a hello with: calls it cannot sign, anything else
stranger_calls = st.builds(
    lambda method, args, call_id, mac: {"op": "call", "method": method, "args": args, "id": call_id, "mac": mac},
    st.one_of(st.sampled_from(sorted(wc.METHODS)), json_values), json_values, integers,
    st.one_of(st.binary(min_size=32, max_size=32).map(bytes.hex), text))
stranger_frames = st.one_of(
    hello_headers.map(encode_frame), stranger_calls.map(encode_frame),
    frame_prefixes(), st.binary(max_size=64), odd_header_bytes.map(raw_header_frame),
    st.builds(lambda h, p: encode_frame(h, p), hello_headers, st.binary(min_size=1, max_size=32)))


def expects_an_answer(data: bytes) -> bool:
    """Whether the pool must answer ``data`` (all a stranger sent, then a
    half-close) before it closes: when it is exactly one frame, or exactly
    one prefix it refuses.  (Bytes after the frame that ends the connection
    are never read: the close is then a reset, which may take the answer
    with it.)"""
    if len(data) < PREFIX_SIZE:
        return False
    try:
        _flags, hlen, _plen = parse_prefix(data[:PREFIX_SIZE], wc.HELLO_LIMITS)
    except FrameError:
        return len(data) == PREFIX_SIZE
    return len(data) == PREFIX_SIZE + hlen


def check_stranger_answers(frames: list[dict]) -> None:
    assert len(frames) <= 2, frames
    for i, frame in enumerate(frames):
        assert frame.get("op") in ({"welcome", "error"} if i == 0 else {"error"}), frames
        if frame["op"] == "welcome":
            assert isinstance(frame.get("challenge"), str) and len(frame["challenge"]) == 32, frame
        else:
            code = frame.get("error", {}).get("code")
            assert code in ("AUTH_FAILED", "PROTOCOL_ERROR", "VERSION_UNSUPPORTED", "BAD_REQUEST", "BAD_FRAME",
                            "FRAME_TOO_LARGE"), frame


def _first_header(data: bytes) -> dict | None:
    try:
        _flags, hlen, _plen = parse_prefix(data[:PREFIX_SIZE], wc.HELLO_LIMITS)
        return decode_header(data[PREFIX_SIZE:PREFIX_SIZE + hlen])
    except (FrameError, Exception):
        return None


@fuzz_settings(120)
@given(st.one_of(hello_headers.map(lambda h: [encode_frame(h)]), st.lists(stranger_frames, min_size=1, max_size=4)))
def test_strangers_get_a_welcome_or_an_error_and_a_clean_close(pool, frames):
    data = b"".join(frames)
    first = _first_header(data)
    conn = FrameConn(pool.control_endpoint)
    try:
        conn.sendraw(data)
        conn.done_sending()
        answers = conn.until_closed()
    finally:
        conn.close()
    check_stranger_answers(answers)
    if expects_an_answer(data):
        assert answers, f"the pool closed without a word after {data[:120]!r}"
        if first is not None and first.get("op") == "hello" and first.get("host") in ("hostA", "hostB") \
                and 1 in (first.get("versions") if isinstance(first.get("versions"), list) else []):
            assert answers[0]["op"] == "welcome", answers


# -- an authenticated host, and the admin socket -------------------------------------------------

DOMAINS = ["dom-a", "dom-b", "dom-x"]
domains = st.one_of(st.sampled_from(DOMAINS), st.sampled_from(DOMAINS), json_values)
hosts = st.one_of(st.sampled_from(HOST_NAMES), json_values)
mids = st.one_of(st.sampled_from(["m1", "m2", "", "m1/x"]), json_values)
sids = st.one_of(st.sampled_from(["@sid-a", "@sid-b", "@sid-b", "s-0-0", ""]), json_values)
ARG_FIELDS = {
    "sid": sids, "domain_uuid": domains, "domain_name": text, "migration_id": mids,
    "policy": st.sampled_from(["none", "switchover", "start", "START", "", "pause"]),
    "dest_host": hosts, "source_host": hosts, "postcopy": st.booleans(), "reason": text,
    "records": st.lists(st.tuples(domains, mids).map(list), max_size=3),
    "retention": st.one_of(st.sampled_from([0.5, 1, 60, 30 * 86400, 30 * 86400 + 1, -1, 1e300, 5e-324]),
                           integers),
    "addresses": st.lists(st.one_of(st.sampled_from(["10.1.0.0/16", "0.0.0.0/0", "::/0", "::1", "127.0.0.1/8",
                                                     "fe80::/10", "300.1.1.1", "", "10.0.0.1", "::1/128"]),
                                    text), max_size=3),
    "identity": st.one_of(st.dictionaries(text, json_values, max_size=3), st.sampled_from([[["k", "v"]], ["kv"]])),
    "open_only": st.booleans(), "until": st.sampled_from(["rehomed", "final", "x", ""]),
    # a binding's proofs (made up: hostA holds no session's secret), challenges, tokens
    "sessions": st.one_of(st.dictionaries(sids.filter(lambda v: isinstance(v, str)),
                                          st.one_of(st.none(), st.sampled_from(["ab" * 32, "00" * 8, ""]), text),
                                          max_size=3), json_values),
    "challenge": st.one_of(st.sampled_from(["ab" * 16, "", None]), json_values),
    "token": st.one_of(st.sampled_from(["cd" * 32, "xyz", None]), json_values),
    "digest": st.one_of(st.sampled_from(["ef" * 32, "ab", None]), json_values),
}
#: a wait_record must not wait: the timeout is one that is refused, or short
WAIT_TIMEOUTS = st.sampled_from([0, 0.02, -1, 601, 1e300, "0", None, True, [0]])
UNKNOWN_METHODS = ["nope", "do_ping", "__init__", "wait_nope", "_call", "", "Ping", "ping ", "close\x00"]
method_names = st.one_of(st.sampled_from(sorted(wc.METHODS)), st.sampled_from(sorted(wc.METHODS)),
                         st.sampled_from(sorted(wc.METHODS)), st.sampled_from(UNKNOWN_METHODS), json_values)


def parameters(method) -> list[str]:
    """The arguments the pool's handler of ``method`` takes (read off its
    signature, so that new arguments are fuzzed too); every field for a
    method that has no handler."""
    handler = None
    if isinstance(method, str) and method in wc.METHODS:
        handler = getattr(ControlServer, f"do_{method}", None) or getattr(ControlServer, method, None)
    if handler is None:
        return sorted(ARG_FIELDS)
    return [name for name in inspect.signature(handler).parameters if name not in ("self", "caller")]


def _no_surrogates(value):
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, list):
        return [_no_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {_no_surrogates(k): _no_surrogates(v) for k, v in value.items()}
    return value


@st.composite
def host_calls(draw):
    """(method, args): mostly a method of the table with the arguments its
    handler takes, each a likely value or anything; sometimes more keys,
    sometimes a lone surrogate (the pool cannot decode: BAD_FRAME)."""
    method = draw(method_names)
    known = {name: ARG_FIELDS.get(name, json_values) for name in parameters(method)}
    args = draw(objects(known, extra=draw(st.integers(0, 5)) == 0))
    if method == "wait_record" or "timeout" in args:
        args["timeout"] = draw(WAIT_TIMEOUTS)
    if draw(st.integers(0, 9)):
        args = _no_surrogates(args)
    return method, args


#: a migration's calls, in order, each one's arguments mostly right: the
#: deeper states (switched over, completed, tickets, parked) get reached
flow_steps = ["register_intent", "open_migration", "bind_challenge", "bind_sessions", "register_token",
              "switchover", "commit", "complete", "renew", "park", "unpark", "close", "abort", "list_records",
              "wait_record"]


@st.composite
def flows(draw):
    domain = draw(st.sampled_from(DOMAINS))
    mid = draw(st.sampled_from(["m1", "m2", None]))
    calls = []
    for method in draw(st.lists(st.sampled_from(flow_steps), min_size=2, max_size=8)):
        args = {"domain_uuid": domain, **({"migration_id": mid} if mid else {})}
        if method == "bind_sessions":
            args["sessions"] = {draw(st.sampled_from(["@sid-a", "@sid-b"])): draw(st.sampled_from([None, "ab" * 32]))}
            args["challenge"] = draw(st.sampled_from([None, "ab" * 16]))
        if method == "register_token":
            args["digest"] = draw(st.sampled_from(["ef" * 32, "0" * 64]))
        if method == "renew":
            args = {"records": [[domain, mid or "m1"]]}
        if method == "wait_record":
            args["timeout"] = 0
        if method == "park":
            args["retention"] = draw(st.one_of(st.sampled_from([None, 1, 60, 30 * 86400]),
                                               ARG_FIELDS["retention"]))
        if method in ("register_intent", "open_migration"):
            args["policy"] = draw(ARG_FIELDS["policy"])
            args["dest_host"] = draw(st.sampled_from(["hostA", "hostB"]))
        if method == "open_migration":
            args.pop("dest_host")
            if draw(st.booleans()):
                args["token"] = "cd" * 32
        if method == "switchover":
            args["postcopy"] = draw(st.booleans())
        args = {k: v for k, v in args.items() if k in parameters(method)}
        mutated = draw(st.one_of(st.just(None), st.just(None), st.just(None), host_calls()))
        calls.append(mutated if mutated is not None else (method, args))
    return calls


def _decodable(header: dict) -> bool:
    """Whether the pool can decode a header as sent (a lone surrogate: not)."""
    try:
        decode_header(json.dumps(header).encode())
        return True
    except FrameError:
        return False


class HostConn:
    """A control connection of hostA (signing with its secret, by the real
    client's ``ControlSession``), or of the admin socket (no MAC)."""

    def __init__(self, endpoint: str, admin: bool):
        self.conn = FrameConn(endpoint)
        self.secret = None if admin else SECRET_A
        self.session = ControlSession(wc.ADMIN_HOST if admin else "hostA", self.secret)
        self.conn.sendraw(self.session.hello())
        self.session.welcome(self.conn.next())

    def frame(self, method, args) -> tuple[int, dict]:
        """A call as the real client makes it; a method that is no string is
        signed the way the pool checks it (over ``str(method)``), as a
        hostile host that read the pool's code would."""
        call_id, raw = self.session.call(method if isinstance(method, str) else str(method), args)
        header = {"op": "call", "id": call_id, "method": method, "args": args}
        if self.secret is not None:
            header["mac"] = wc.request_mac(self.secret, self.session.challenge, call_id, str(method), args)
        return call_id, header

    def call(self, method, args) -> tuple[str, object]:
        """('ok', result), ('error', code) or ('closed', the error frame)."""
        call_id, header = self.frame(method, args)
        self.conn.send(header)
        frame = self.conn.next()
        if frame is None or frame.get("op") == "error":
            return "closed", frame
        assert frame.get("op") == "result" and frame.get("id") == call_id, (method, args, frame)
        try:
            return "ok", self.session.answer(frame, call_id)      # the answer's MAC verified
        except AccelmigError as exc:
            return "error", exc.code.value

    def close(self):
        self.conn.close()


def _run_calls(endpoint: str, admin: bool, targets: Targets, calls) -> None:
    conn = HostConn(endpoint, admin)
    try:
        for method, args in calls:
            args = targets.resolve(args)
            decodable = _decodable({"op": "call", "method": method, "args": args})
            outcome, detail = conn.call(method, args)
            where = f"{method!r}({json.dumps(args)[:300]})"
            if not decodable:
                assert outcome == "closed" and detail and detail["error"]["code"] == "BAD_FRAME", \
                    f"{where}: {outcome} {detail}"
                return
            assert outcome != "closed", f"{where}: the pool closed the connection: {detail}"
            if outcome == "error":
                assert detail != "INTERNAL", where
    finally:
        conn.close()


@fuzz_settings(150)
@given(st.one_of(st.lists(host_calls(), min_size=1, max_size=6), flows()))
def test_an_authenticated_host_calling_anything_gets_a_signed_answer_and_harms_no_other_host(
        pool, targets, probe_done, calls):
    _run_calls(pool.control_endpoint, False, targets, calls)
    targets.check_b_untouched()
    assert problems(pool) == []


@fuzz_settings(40)
@given(st.one_of(st.lists(host_calls(), min_size=1, max_size=6), flows()))
def test_the_admin_socket_answers_anything_clearly(pool, targets, probe_done, calls):
    _run_calls(pool.ready["admin"], True, targets, calls)
    assert problems(pool) == []


# -- the bugs it found, exactly (fixed) -----------------------------------------------------------

def _fresh_pool(tmp_path):
    return start_pool(tmp_path)


@pytest.mark.parametrize("versions", [5, [[1]], True])
def test_a_hello_whose_versions_are_not_a_list_of_numbers_is_answered(tmp_path, versions):
    pool = _fresh_pool(tmp_path)
    try:
        conn = FrameConn(pool.control_endpoint)
        conn.send({"op": "hello", "versions": versions, "host": "hostA"})
        conn.done_sending()
        answers = conn.until_closed()
        conn.close()
    finally:
        pool.stop()
    assert [a["op"] for a in answers] == ["error"] and problems(pool) == [], (answers, problems(pool))


def test_a_method_that_is_a_list_is_answered_unknown(tmp_path):
    pool = _fresh_pool(tmp_path)
    try:
        conn = HostConn(pool.control_endpoint, admin=False)
        outcome = conn.call(["ping"], {})
        conn.close()
    finally:
        pool.stop()
    assert outcome == ("error", "UNKNOWN_OP") and problems(pool) == [], (outcome, problems(pool))


def test_register_host_with_an_identity_that_is_a_string_is_a_bad_request_and_changes_nothing(pool):
    """Found by the fuzzer: ``dict("ab")`` raised ValueError, answered
    ``INTERNAL`` with a traceback in the log, after the host's networks
    had been replaced."""
    with ControlClient(pool.control_endpoint, "hostA", SECRET_A) as client:
        with pytest.raises(AccelmigError) as caught:
            client.call("register_host", addresses=["10.9.0.0/16"], identity="ab")
        networks = {h["host"]: h for h in client.call("list_hosts")["hosts"]}["hostA"]["networks"]
    assert caught.value.code.value == "BAD_REQUEST", caught.value
    assert "10.9.0.0/16" not in networks, "a refused registration changed the host's networks"
    assert problems(pool) == []
