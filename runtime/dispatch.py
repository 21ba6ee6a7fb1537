"""The one way to route a message to its handler by its kind.

A class declares one table per protocol it answers, and marks each
handler with the kind (or kinds) it answers::

    class HostChannel:
        on_host = Dispatch("a host message", ch.HOST_TYPES)

        @on_host("ping")
        def _ping(self, message): ...

        def handle(self, message):
            return self.on_host.call(self, message.get("type"), message)

The table is checked when the class is created, against the contract's
list of kinds (``wire.channel.HOST_TYPES``, ``DRIVER_TYPES``,
``wire.localapi.REQUESTS``, ``wire.control.METHODS``): a kind of the
contract nobody answers, a handler for a kind the contract does not have,
or a kind answered twice fails at import, not when a peer first sends it.
A kind outside the table (a peer's garbage, a newer peer) is ``UnknownOp``.

Handlers are the functions of the class that declares the table (a
subclass that overrides one by name does not change the table).  Not for
the data plane's per-command dispatch (``execute``/``_handle``): that is the
hot path, where one more call per command shows.

Standard library only, Python 3.9: the guest agent uses it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Optional

from accelmig.wire.errors import UnknownOp


class Dispatch:
    """``kind -> handler`` for one protocol of one class."""

    def __init__(self, what: str, kinds: Iterable[str]):
        self.what = what
        self.kinds = frozenset(kinds)
        self.handlers: Dict[str, Callable] = {}
        self.owner: Optional[type] = None

    def __call__(self, *kinds: str) -> Callable[[Callable], Callable]:
        """Decorator: the function answers ``kinds``."""
        if not kinds:
            raise TypeError(f"{self.what}: a handler answers at least one kind")

        def register(function: Callable) -> Callable:
            for kind in kinds:
                if kind not in self.kinds:
                    raise TypeError(f"{self.what}: {function.__name__} answers {kind!r}, "
                                    f"which is not one of {sorted(self.kinds)}")
                if kind in self.handlers:
                    raise TypeError(f"{self.what}: {kind!r} is answered twice "
                                    f"({self.handlers[kind].__name__} and {function.__name__})")
                self.handlers[kind] = function
            return function
        return register

    def __set_name__(self, owner: type, name: str) -> None:
        # The class body has run: every handler is registered by now.
        missing = self.kinds - self.handlers.keys()
        if missing:
            raise TypeError(f"{owner.__name__}.{name} ({self.what}): no handler for {sorted(missing)}")
        self.owner = owner

    def lookup(self, kind: Any) -> Callable:
        """The handler of ``kind``; ``UnknownOp`` for anything else (any
        type: the kind comes from a peer)."""
        try:
            return self.handlers[kind]
        except (KeyError, TypeError):     # TypeError: an unhashable kind (a list, a dict)
            raise UnknownOp(op=kind) from None

    def call(self, instance: Any, kind: Any, *args, **kwargs) -> Any:
        """Run ``kind``'s handler on ``instance``."""
        return self.lookup(kind)(instance, *args, **kwargs)

    def __repr__(self) -> str:
        owner = self.owner.__name__ if self.owner else "?"
        return f"<Dispatch {self.what} of {owner}: {len(self.handlers)} kinds>"
