"""Fuzzing the guest agent (issue 14, "Done when"): the line parser alone
(``wire.channel.LineParser``), and a real ``accelmig-agent run`` process
through both of its doors — the host channel (what hostd writes: the
virtio-serial port, here its unix-socket stand-in) and the local socket
(what any process in the guest may write).  Fixed seed, bounded examples
(tests/fuzz/strategies.py).

What must hold whatever arrives:

- the parser returns message objects with a string ``type``, or drops the
  line with its reason; its buffer never holds more than one line's limit;
- everything the agent writes back is a well-formed line: a ``result``
  (``ok``, and an error with a code that is not ``INTERNAL``), a ``sync``
  answer, or one of its own events;
- after any of it the agent answers: a ping on a freshly synchronised host
  channel, a ``where`` on the same local connection and on a new one;
- no traceback and no error in the agent's log, nothing else on its
  stderr (a thread that died prints there: ``peers.AgentProcess.raw``);
- a line over the limit is dropped without the agent's memory growing by
  it (``VmRSS`` before and after, printed).

No fuzzed message ever carries a guest NIC configuration the agent would
apply (``safe``): the agent may run as root here, and would re-address
this machine's interfaces.

The bugs this test found are fixed; each is reproduced exactly by a
regression test at the end (and the fuzzer sends such inputs too).
"""

from __future__ import annotations

import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accelmig.wire import channel as ch
from accelmig.wire.identity import GuestNic
from tests.fuzz.peers import problems, proc_status, start_agent
from tests.fuzz.strategies import fuzz_settings, integers, json_values, text
from tests.support.wait import wait_for

# -- never a NIC configuration that would be applied ------------------------------------------


def _applicable_nic(value) -> bool:
    try:
        GuestNic.from_wire(value)
        return True
    except Exception:          # refused (or failing) here: refused (or failing) in the agent too
        return False


def safe(value):
    """``value`` with every ``guest_nic`` the agent would accept (and apply)
    replaced by None, at any depth."""
    if isinstance(value, list):
        return [safe(v) for v in value]
    if isinstance(value, dict):
        return {k: (None if k == "guest_nic" and _applicable_nic(v) else safe(v)) for k, v in value.items()}
    return value


# -- the parser alone ---------------------------------------------------------------------------

MAX = 64
line_bytes = st.one_of(
    st.binary(max_size=80), st.sampled_from([b"\n", b"\xff", b"{}", b'{"type":1}', b"[1]", b"\xff\n",
                                             b'{"type":"ping","id":1}\n', b"[" * 3000, b"x" * 200]),
    json_values.map(lambda v: ch.encode({"type": "x", "v": v}) if v is not None else b"null\n"))


@fuzz_settings(400)
@given(st.lists(line_bytes, max_size=10).map(b"".join), st.lists(st.integers(0, 2000), max_size=8))
def test_the_parser_gives_messages_or_drops_and_its_buffer_stays_bounded(data, cuts):
    parser = ch.LineParser(max_line=MAX, name="fuzz")
    bounds = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    for start, end in zip(bounds, bounds[1:]):
        for message in parser.feed(data[start:end]):
            assert isinstance(message, dict) and isinstance(message["type"], str), message
        assert len(parser._buf) <= MAX, len(parser._buf)
    assert len(parser.dropped) <= 100


# -- the agent ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    proc = start_agent(tmp_path_factory.mktemp("fuzz-agent"), "--rehome-timeout", "1")
    yield proc
    assert proc.stop() == 0
    assert problems(proc) == []


def _connect(path, timeout: float = 15) -> socket.socket:
    return ch.connect_unix(str(path), timeout)


class Reader:
    """Every line the agent writes on one connection, all kept (ungated:
    each is checked), with a gated ``LineSession`` beside to find answers."""

    def __init__(self, sock: socket.socket, session: ch.LineSession):
        self.sock, self.session = sock, session
        self.parser = ch.LineParser(max_line=1 << 24, name="fuzz-reader")
        self.lines: list[dict] = []
        self.answers: dict = {}        # (``_answer_or_problem``) answers by id

    def until(self, want) -> dict:
        """The answer (or sync answer) with id ``want`` (the socket's timeout
        bounds an agent that never sends it: the test then fails)."""
        while True:
            data = self.sock.recv(1 << 16)
            assert data, f"the agent closed before answering {want}; it wrote {self.lines[-5:]}"
            self.lines += self.parser.feed(data)
            for kind, msg_id, message in self.session.feed(data):
                if kind in ("answer", "synced") and msg_id == want:
                    return message


def check_lines(lines: list[dict], kinds: set) -> None:
    for line in lines:
        assert line.get("type") in kinds, line
        if line["type"] == "result":
            assert isinstance(line.get("ok"), bool), line
            if not line["ok"]:
                error = line.get("error")
                assert isinstance(error, dict) and isinstance(error.get("code"), str), line
                assert error["code"] != "INTERNAL", line


def host_sync(agent) -> tuple[socket.socket, Reader]:
    sock = _connect(agent.channel)
    session = ch.LineSession("fuzz-host")
    sync_id, data = session.sync()
    sock.sendall(data)
    reader = Reader(sock, session)
    assert reader.until(sync_id)["nonce"] == session.wanted_nonce
    return sock, reader


def answers_a_ping(agent) -> None:
    sock, reader = host_sync(agent)
    try:
        sock.sendall(ch.encode({"type": "ping", "id": 424242}))
        assert reader.until(424242)["result"]["pong"] is True
    finally:
        sock.close()


def answers_where(path) -> None:
    with _connect(path) as sock:
        sock.sendall(ch.encode({"type": "where", "id": 31337}))
        assert Reader(sock, ch.LineSession("fuzz-driver")).until(31337)["ok"] is True


ids = st.one_of(st.integers(0, 10**6), st.integers(0, 10**6), integers, json_values)
BAD_NICS = [5, "x", [], {}, {"address": "10.0.0.1"}, {"address": "nope", "prefixlen": 24},
            {"address": "10.0.0.1", "prefixlen": 99}, {"address": "10.0.0.1", "prefixlen": True},
            {"address": "10.0.0.1", "prefixlen": 24, "mtu": 1},
            {"address": "10.0.0.1", "prefixlen": 24, "routes": ["nope"]},
            {"address": "10.0.0.1", "prefixlen": 24, "routes": 5},
            {"address": "10.0.0.1", "prefixlen": 24, "gateway": "x"}]


def likely(values):
    """Mostly one of ``values``' strategy, sometimes anything at all."""
    return st.one_of(values, values, values, json_values)


identities = st.one_of(
    st.fixed_dictionaries(
        {"host_id": likely(st.sampled_from(["hostB", "hostA", "h" * 300])),
         "pool_endpoint": likely(st.sampled_from(["127.0.0.1:7070", "[::1]:7070", "pool:1", "x", "", "[::1", "a:0",
                                                  "a:65536", "-a:1"]))},
        optional={"host_address": likely(st.sampled_from(["10.0.0.2", "::1", None, "x"])),
                  "interface": likely(st.sampled_from(["eth0", None])),
                  "mtu": likely(st.sampled_from([1500, 9000, None, 67, 2**31, True])),
                  "mac": likely(st.sampled_from(["52:54:00:00:00:01", None, "x"])),
                  "version": likely(st.sampled_from([1, 2, 1, 0, -1, 1.5])),
                  "guest_nic": st.sampled_from([None, None, *BAD_NICS])}),
    json_values)
SIDS = ["s-1", "s-2", "", "s" * 1000]
tickets = st.one_of(st.dictionaries(st.sampled_from(SIDS), text, max_size=2), json_values)
mids = likely(st.sampled_from(["m1", "m2", "", "m" * 300]))


def messages(kinds: dict):
    """A message of one of ``kinds`` (type -> its fields' strategies, all
    given, each likely right), an id, and now and then more keys."""
    def build(kind):
        fields = st.fixed_dictionaries(kinds[kind])
        extra = st.one_of(st.just({}), st.just({}), st.dictionaries(text, json_values, max_size=2))
        return st.builds(lambda f, e, i: {**e, **f, "type": kind, "id": i}, fields, extra, ids)
    # the types the peer may send, three times as often as the others
    weighted = [k for k in sorted(kinds) for _ in range(3 if kinds[k] or k in ("ping", "status", "where") else 1)]
    return st.sampled_from(weighted).flatmap(build)


HOST_MESSAGES = messages({
    "sync": {"nonce": likely(text)}, "ping": {}, "status": {}, "identity": {"identity": identities},
    "rehome": {"migration_id": mids, "identity": identities, "tickets": tickets},
    "hello": {}, "result": {"ok": st.booleans()}, "nope": {}, "": {}, "PING": {}})


def chunks(message_strategy):
    """What a peer writes: messages, messages cut before their newline, bytes
    that are no message, sentinels, a line past the limit, a line nested too
    deeply."""
    return st.lists(st.one_of(
        message_strategy.map(lambda m: ("line", m)), message_strategy.map(lambda m: ("line", m)),
        message_strategy.map(lambda m: ("cut", m)),
        st.binary(max_size=60), st.sampled_from([ch.SENTINEL, b"\n", b"\r\n", b"\x00", b"{" * 20 + b"\n"]),
        st.sampled_from(sorted(BIG)),
    ), min_size=1, max_size=10)


#: big lines, named (so that hypothesis does not print them): past the limit, nested too deeply
BIG = {"<past the limit>": b"x" * (ch.MAX_LINE + 10),
       "<nested too deeply>": b'{"type":"ping","id":1,"x":' + b"[" * 100000 + b"]" * 100000 + b"}\n"}


def send_all(sock: socket.socket, data: list) -> None:
    """Write ``data``: a message is made safe first."""
    for chunk in data:
        if isinstance(chunk, tuple):
            kind, message = chunk
            line = ch.encode(safe(message))
            sock.sendall(line if kind == "line" else line[:-1])
        else:
            sock.sendall(BIG.get(chunk, chunk) if isinstance(chunk, str) else chunk)


HOST_KINDS = {"result", "sync", "hello", "session_opened", "session_closed"}


@fuzz_settings(250)
@given(chunks(HOST_MESSAGES), st.booleans())
def test_anything_on_the_host_channel_leaves_an_agent_that_answers(agent, data, sync_first):
    if sync_first:
        sock, reader = host_sync(agent)
    else:
        sock = _connect(agent.channel)
        reader = Reader(sock, ch.LineSession("fuzz-host"))
    try:
        send_all(sock, data)
        # a new handshake on the same connection ends whatever was half sent
        sync_id, sync = reader.session.sync()
        sock.sendall(sync)
        reader.until(sync_id)
        sock.sendall(ch.encode({"type": "ping", "id": "ping-after-the-fuzz"}))
        assert reader.until("ping-after-the-fuzz")["result"]["pong"] is True
    finally:
        sock.close()
    check_lines(reader.lines, HOST_KINDS)
    assert problems(agent) == []


sids = likely(st.sampled_from(SIDS))
documents = likely(st.fixed_dictionaries({"migration_id": mids, "identity": identities, "tickets": tickets}))
LOCAL_MESSAGES = messages({
    "register": {"sid": sids, "endpoint": likely(st.sampled_from(["127.0.0.1:7070", "x"])), "name": likely(text),
                 "epoch": likely(integers)},
    "unregister": {"sid": sids}, "where": {}, "status": {},
    "result": {"ok": st.booleans(), "result": json_values, "error": json_values},
    "rehome_local": {"document": documents}, "resume": {}, "ping": {}, "sync": {}, "": {}})


@fuzz_settings(250)
@given(chunks(LOCAL_MESSAGES))
def test_anything_on_the_local_socket_leaves_an_agent_that_answers(agent, data):
    sock = _connect(agent.socket)
    reader = Reader(sock, ch.LineSession("fuzz-driver"))
    try:
        send_all(sock, data)
        # a newline ends whatever line was half sent; then the same connection still works
        sock.sendall(b"\n" + ch.encode({"type": "where", "id": "where-after-the-fuzz"}))
        assert reader.until("where-after-the-fuzz")["ok"] is True
    finally:
        sock.close()
    check_lines(reader.lines, {"result", "resume"})
    answers_where(agent.socket)
    answers_a_ping(agent)
    assert problems(agent) == []


def test_a_line_over_the_limit_is_dropped_and_costs_the_agent_no_memory(agent):
    """64 MiB without a newline, on each door: dropped once it passes the
    limit (256 KiB), the agent's resident memory grows by far less than
    what was sent, and the next line on the same connection is answered."""
    before = proc_status(agent.pid)["rss"]
    flood = b"x" * (1 << 20)
    with _connect(agent.socket, 60) as sock:
        for _ in range(64):
            sock.sendall(flood)
        sock.sendall(b"\n" + ch.encode({"type": "where", "id": 5}))
        assert Reader(sock, ch.LineSession("fuzz-driver")).until(5)["ok"] is True
    entry = agent.wait_log(lambda e: "dropped input" in e["msg"] and "longer than" in e["msg"])
    assert entry["logger"].startswith("accelmig") and entry["level"] == "warning"
    sock, reader = host_sync(agent)
    try:
        for _ in range(64):
            sock.sendall(flood)
        sock.sendall(b"\n" + ch.encode({"type": "ping", "id": 6}))
        assert reader.until(6)["result"]["pong"] is True
    finally:
        sock.close()
    after = proc_status(agent.pid)["rss"]
    print(f"agent VmRSS before {before / 2**20:.1f} MiB, after 2 x 64 MiB of one line {after / 2**20:.1f} MiB")
    assert after - before < 16 << 20, (before, after)
    assert problems(agent) == []


# -- the bugs this test found, exactly (fixed: regression tests now) ---------------------------

ROUTES_IDENTITY = {"host_id": "hostB", "pool_endpoint": "127.0.0.1:7070",
                   "guest_nic": {"address": "10.0.0.1", "prefixlen": 24, "routes": 5}}


@pytest.fixture
def fresh_agent(tmp_path):
    proc = start_agent(tmp_path, "--rehome-timeout", "1")
    yield proc
    proc.stop()


def test_an_identity_whose_routes_are_a_number_is_refused_clearly(fresh_agent):
    """wire/identity.py ``GuestNic.from_wire`` raised TypeError (``tuple(5)``):
    an ``identity`` went unanswered with a traceback in the log, a ``rehome``
    was answered ``INTERNAL``."""
    sock, reader = host_sync(fresh_agent)
    try:
        sock.sendall(ch.encode({"type": "rehome", "id": 10, "migration_id": "m1", "identity": ROUTES_IDENTITY}))
        rehome = reader.until(10)
        # one write: the ping after the identity comes in the same read, and is answered too
        sock.sendall(ch.encode({"type": "identity", "id": 9, "identity": ROUTES_IDENTITY}) +
                     ch.encode({"type": "ping", "id": 11}))
        identity = _answer_or_problem(fresh_agent, sock, reader, 9)
        pong = _answer_or_problem(fresh_agent, sock, reader, 11)
    finally:
        sock.close()
    assert rehome["error"]["code"] == "BAD_REQUEST" and "routes" in rehome["error"]["message"], rehome
    assert identity is not None and identity["error"]["code"] == "BAD_REQUEST", (identity, problems(fresh_agent))
    assert "routes must be a list" in identity["error"]["message"], identity
    assert pong is not None and pong["result"]["pong"] is True, (pong, problems(fresh_agent))
    assert problems(fresh_agent) == []


def _answer_or_problem(agent, sock, reader, want) -> dict | None:
    """The answer with id ``want``, or None as soon as the agent's log or
    stderr shows a problem instead (whichever comes first)."""
    got = reader.answers           # every answer read, kept: one read may bring several

    def look():
        if want in got:
            return True
        sock.settimeout(0.05)
        try:
            data = sock.recv(1 << 16)
        except socket.timeout:
            data = b""
        reader.lines += reader.parser.feed(data)
        for kind, msg_id, message in reader.session.feed(data):
            if kind == "answer" and isinstance(msg_id, (int, str)):
                got[msg_id] = message
        return want in got or problems(agent)

    wait_for(look, 20, f"the answer to {want} or a problem in the agent's log")
    return got.get(want)


def _where_after(agent, sock, reader, message) -> dict | None:
    """Send ``message`` and a ``where`` in one write: the where's answer, or
    None if the agent's log shows a problem first."""
    sock.sendall(ch.encode(message) + ch.encode({"type": "where", "id": 5}))
    return _answer_or_problem(agent, sock, reader, 5)


def test_an_unregister_whose_sid_is_a_list_costs_only_itself(fresh_agent):
    """agent.py ``_on_driver_message``: ``link.sessions.pop([1])`` raised
    TypeError, the rest of the read was lost.  (``dict.pop`` hashes its key
    only when the dict is not empty: the connection must hold a session.)"""
    with _connect(fresh_agent.socket) as sock:
        reader = Reader(sock, ch.LineSession("fuzz-driver"))
        sock.sendall(ch.encode({"type": "register", "id": 1, "sid": "s-1", "endpoint": "127.0.0.1:7070"}))
        assert reader.until(1)["ok"] is True
        answer = _where_after(fresh_agent, sock, reader, {"type": "unregister", "id": 3, "sid": [1]})
    assert answer is not None and problems(fresh_agent) == [], (answer, problems(fresh_agent))


def test_a_result_whose_id_is_a_list_costs_only_itself(fresh_agent):
    """agent.py ``_on_driver_message``: ``link.pending.pop([1])`` raised
    TypeError.  (Only while a rehome waits for this driver's answer:
    ``pending`` is then not empty.)"""
    with _connect(fresh_agent.socket) as sock:
        reader = Reader(sock, ch.LineSession("fuzz-driver"))
        sock.sendall(ch.encode({"type": "register", "id": 1, "sid": "s-1", "endpoint": "127.0.0.1:7070"}))
        assert reader.until(1)["ok"] is True
        host, _ = host_sync(fresh_agent)
        try:
            host.sendall(ch.encode({"type": "rehome", "id": 2, "migration_id": "m1", "tickets": {"s-1": "t"},
                                    "identity": {"host_id": "hostB", "pool_endpoint": "127.0.0.1:7070"}}))
            while not any(m.get("type") == "resume" for m in reader.lines):
                reader.lines += reader.parser.feed(sock.recv(1 << 16))
            answer = _where_after(fresh_agent, sock, reader, {"type": "result", "id": [1], "ok": True})
        finally:
            host.close()
    assert answer is not None and problems(fresh_agent) == [], (answer, problems(fresh_agent))


def test_a_rehome_local_whose_document_is_a_list_is_answered(fresh_agent):
    """agent.py ``_local_rehome``: a document that is no object killed the
    rehome thread (a traceback on stderr) and nothing was answered."""
    import os
    if os.geteuid() != 0:
        pytest.skip("rehome_local is root's only: as another user it is refused before the document is read")
    with _connect(fresh_agent.socket) as sock:
        sock.sendall(ch.encode({"type": "rehome_local", "id": 8, "document": [1]}))
        answer = _answer_or_problem(fresh_agent, sock, Reader(sock, ch.LineSession("fuzz-driver")), 8)
    assert answer is not None and answer["error"]["code"] == "BAD_REQUEST" and problems(fresh_agent) == [], \
        (answer, problems(fresh_agent))
