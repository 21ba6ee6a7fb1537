"""Every way a session's resume can fail without its driver's own answer
is a ``wire.errors`` error, in that class's words: a driver that answers
garbage, one that goes away, one that cannot be reached, one that does not
answer in time, one never asked before the rehome's time ran out, and a
ticket for a session no driver holds.  A real agent; its drivers are hand
driven on its local socket, each by a script."""

from __future__ import annotations

import contextlib
import socket
import threading

from accelmig.plugin.channel import GuestChannel
from accelmig.wire import channel as ch
from accelmig.wire.errors import ProtocolError, SessionNotHere, Timeout, Unavailable, from_wire
from tests.agent.test_big_rehomes import IDENTITY, _register

REHOME_TIMEOUT = 1.0


class ScriptedDriver:
    """A driver on the agent's local socket that registers ``sid`` and
    answers each ``resume`` with ``script(sock, message)``."""

    def __init__(self, path: str, sid: str, script):
        self.sid, self.script = sid, script
        self.sock = ch.connect_unix(path, 10)
        _register(self.sock, [sid])
        self.resumes = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        parser = ch.LineParser()
        for data in iter(self._read, b""):
            for message in parser.feed(data):
                if message.get("type") == "resume":
                    self.resumes += 1
                    self.script(self.sock, message)

    def _read(self) -> bytes:
        try:
            return self.sock.recv(1 << 16)
        except OSError:         # closed by its script
            return b""


def answer_garbage(sock, message):
    sock.sendall(ch.encode({"type": "result", "id": message["id"], "ok": "yes"}))


def go_away(sock, message):
    sock.close()


def never_answer(sock, message):
    pass


def test_every_failed_resume_is_a_wire_error_in_its_class_words(agent_on_thread):
    agent = agent_on_thread(rehome_timeout=REHOME_TIMEOUT, resume_window=1)
    with contextlib.ExitStack() as stack:
        # One at a time (a window of one), in the order they registered: the
        # silent one holds the window until the rehome's time runs out.
        drivers = {}
        for sid, script in (("garbage", answer_garbage), ("gone", go_away), ("unreachable", never_answer),
                            ("silent", never_answer), ("unasked", never_answer)):
            drivers[sid] = ScriptedDriver(agent.socket_path, sid, script)
            stack.callback(drivers[sid].sock.close)
        # the agent's sends to this one fail at once (EPIPE), its link stays
        drivers["unreachable"].sock.shutdown(socket.SHUT_RD)
        host = stack.enter_context(GuestChannel(agent.port_path))
        host.connect()
        outcome = host.request("rehome", timeout=30, migration_id="m-fail", identity=IDENTITY,
                               tickets={sid: f"t-{sid}" for sid in (*drivers, "ghost")})
    sessions = outcome["sessions"]
    assert not outcome["ok"] and set(sessions) == {*drivers, "ghost"}
    assert not any(s["ok"] for s in sessions.values())
    expected = {
        "garbage": ProtocolError(reason="the driver answered garbage: its ok is a string of 3 characters, "
                                        "not a boolean"),
        "gone": Unavailable(what="the driver", reason="it went away"),
        "silent": Timeout(what="the driver's resume", timeout=REHOME_TIMEOUT),
        "unasked": Timeout(what="asking every driver to resume", timeout=REHOME_TIMEOUT),
        "ghost": SessionNotHere(sid="ghost"),
    }
    wrong = {sid: sessions[sid]["error"] for sid, error in expected.items()
             if sessions[sid]["error"] != error.to_wire()}
    unreachable = sessions["unreachable"]["error"]
    prefix = Unavailable(what="the driver", reason="it cannot be reached: ").message
    if unreachable["code"] != "UNAVAILABLE" or not unreachable["message"].startswith(prefix):
        wrong["unreachable"] = unreachable
    assert wrong == {}, "not in their classes' words"
    for sid, session in sessions.items():             # each one comes back as its class from the wire
        error = session["error"]
        assert from_wire(error).to_wire() == error and type(from_wire(error)).code.value == error["code"], sid
    assert drivers["unasked"].resumes == 0 and drivers["silent"].resumes == 1
