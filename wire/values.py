"""What counts as an integer, a number or a field of the right type in
anything a peer sends: one rule for every wire and every file.

JSON has no integer type of its own, and Python's ``bool`` is an ``int``
(``isinstance(True, int)``), so "an integer" written by hand as
``isinstance(v, int)`` takes ``true`` for 1.  Here an integer is an
``int`` that is not a ``bool``, a number is such an integer or a finite
``float`` (never ``NaN`` or an infinity, which ``json`` parses), and a
field's type never lets a ``bool`` pass for an ``int`` or a ``float``
unless ``bool`` itself is asked for.  ``describe`` names a wrong value in an
error without echoing what a peer wrote.

Standard library only, Python 3.9: the guest side uses it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Tuple, Type, Union

from accelmig.wire.errors import AccelmigError, BadRequest

#: ``field``'s default for "required"
REQUIRED = object()

_JSON_NAMES = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
               tuple: "a list", dict: "an object", type(None): "null"}
_WANTED_NAMES = {str: "a string", int: "an integer", float: "a number", list: "a list", tuple: "a list",
                 dict: "an object", bool: "a boolean", type(None): "null"}
#: how much of a wrong value an error repeats
SHOWN = 40


def is_int(value: Any, low: Optional[int] = None, high: Optional[int] = None) -> bool:
    """An ``int`` that is not a ``bool``, within ``[low, high]`` where given."""
    if not isinstance(value, int) or isinstance(value, bool):
        return False
    return (low is None or value >= low) and (high is None or value <= high)


def is_number(value: Any, low: Optional[float] = None, high: Optional[float] = None) -> bool:
    """An integer (``is_int``) or a finite ``float``, within ``[low, high]``
    where given."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return (low is None or value >= low) and (high is None or value <= high)


def describe(value: Any) -> str:
    """How a wrong value is named in an error: its JSON type; a number's or a
    boolean's value when it is short; a string's length, never its text (a
    peer's string may be anything, and errors are logged); never a
    container's repr (it may be nested deeply)."""
    kind = _JSON_NAMES.get(type(value), type(value).__name__)
    if isinstance(value, (bool, int, float)):
        text = repr(value)
        return f"{kind} ({text})" if len(text) <= SHOWN else kind
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    return kind


def shown(value: Any) -> str:
    """``repr(value)``, cut to ``SHOWN`` characters: a value an error must
    name (a cursor, a challenge) without repeating all of it."""
    text = repr(value)
    return text if len(text) <= SHOWN else text[:SHOWN - 3] + "..."


def wanted(types: Tuple[type, ...]) -> str:
    """``(str, type(None))`` -> "a string or null"."""
    return " or ".join(dict.fromkeys(_WANTED_NAMES.get(t, t.__name__) for t in types))


def is_a(value: Any, types: Union[type, Tuple[type, ...]]) -> bool:
    """``isinstance(value, types)``, except that a ``bool`` is no ``int`` or
    ``float`` unless ``bool`` is one of ``types``, and a float is finite."""
    # Ordered for the data plane, which checks every command's fields with
    # it: an exact int or str costs one isinstance.
    cls = type(value)
    if cls is bool:
        return bool in types if isinstance(types, tuple) else types is bool
    if not isinstance(value, types):
        return False
    return cls is int or cls is str or not isinstance(value, float) or math.isfinite(value)


def field(data: Mapping, key: str, types: Union[type, Tuple[type, ...]], what: str,
          default: Any = REQUIRED, *, error: Type[AccelmigError] = BadRequest) -> Any:
    """``data[key]`` when it is one of ``types`` (``is_a``); absent, the
    ``default``.  Absent and required, or of another type: ``error`` with a
    reason that names ``what`` and the key ("identity lacks 'host_id'",
    "identity: mtu must be an integer or null, not a string of 4 characters")."""
    if key not in data:
        if default is REQUIRED:
            raise error(reason=f"{what} lacks {key!r}")
        return default
    value = data[key]
    if not is_a(value, types):
        types = types if isinstance(types, tuple) else (types,)
        raise error(reason=f"{what}: {key} must be {wanted(types)}, not {describe(value)}")
    return value
