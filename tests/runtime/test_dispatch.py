"""accelmig.runtime.dispatch: one table per protocol, checked against the
contract's kinds when the class is made; a peer's unknown kind is UnknownOp."""

from __future__ import annotations

import pytest

from accelmig.runtime.dispatch import Dispatch
from accelmig.wire import channel as ch
from accelmig.wire.errors import UnknownOp

KINDS = frozenset({"ping", "status", "sync"})


class Answering:
    on = Dispatch("a test message", KINDS)

    def __init__(self):
        self.calls = []

    @on("ping")
    def _ping(self, message):
        self.calls.append(("ping", message))
        return "pong"

    @on("status", "sync")
    def _rest(self, message, *, extra=None):
        self.calls.append((message["type"], extra))
        return message["type"]

    def handle(self, message, **kwargs):
        return self.on.call(self, message.get("type"), message, **kwargs)


def test_each_kind_reaches_its_handler_on_the_instance():
    a, b = Answering(), Answering()
    assert a.handle({"type": "ping"}) == "pong"
    assert a.handle({"type": "sync"}, extra=1) == "sync" and a.handle({"type": "status"}) == "status"
    assert a.calls == [("ping", {"type": "ping"}), ("sync", 1), ("status", None)] and b.calls == []
    assert Answering.on.owner is Answering and "3 kinds" in repr(Answering.on)


@pytest.mark.parametrize("kind", ["nope", None, 7, ["ping"], {"a": 1}, ""])
def test_a_peers_unknown_kind_is_unknown_op(kind):
    a = Answering()
    with pytest.raises(UnknownOp) as raised:
        a.handle({"type": kind})
    assert raised.value.kwargs["op"] == kind and a.calls == []


def _made(handlers: dict) -> type:
    """A class whose table has a handler named ``name`` for each
    ``name: kinds`` of ``handlers``, made as a class statement makes it."""
    on = Dispatch("a test message", KINDS)
    namespace = {"on": on}
    for name, kinds in handlers.items():
        def handler(self, message):
            return None
        handler.__name__ = name
        namespace[name] = on(*kinds)(handler)
    return type("Made", (), namespace)


def test_a_kind_of_the_contract_without_a_handler_fails_when_the_class_is_made():
    with pytest.raises(Exception) as raised:
        _made({"_handle": ("ping", "status")})
    # Python < 3.12 wraps what __set_name__ raises in a RuntimeError
    error = raised.value if isinstance(raised.value, TypeError) else raised.value.__cause__
    assert isinstance(error, TypeError)
    assert str(error) == "Made.on (a test message): no handler for ['sync']"


@pytest.mark.parametrize("handlers,reason", [
    ({"_all": tuple(KINDS), "_extra": ("rehome",)}, r"_extra answers 'rehome', which is not one of \['ping', "),
    ({"_one": ("ping", "sync", "status"), "_two": ("ping",)}, r"'ping' is answered twice \(_one and _two\)"),
], ids=["a-kind-the-contract-lacks", "a-kind-twice"])
def test_a_wrong_handler_fails_as_it_is_declared(handlers, reason):
    with pytest.raises(TypeError, match=reason):
        _made(handlers)


def test_a_handler_answers_at_least_one_kind():
    with pytest.raises(TypeError, match="at least one kind"):
        Dispatch("a test message", KINDS)()


def test_a_contracts_list_is_checked_whole():
    """Against a real contract: the host's message kinds of the guest channel."""
    handlers = {kind: (lambda self, message, kind=kind: kind) for kind in ch.HOST_TYPES}
    on = Dispatch("a host message", ch.HOST_TYPES)
    for kind, function in handlers.items():
        on(kind)(function)
    Channel = type("Channel", (), {"on": on})
    assert {kind: Channel.on.call(Channel(), kind, {}) for kind in ch.HOST_TYPES} == {k: k for k in ch.HOST_TYPES}
    short = Dispatch("a host message", ch.HOST_TYPES)
    for kind in sorted(ch.HOST_TYPES)[1:]:
        short(kind)(handlers[kind])
    with pytest.raises(Exception, match="Short"):
        type("Short", (), {"on": short})
