"""accelmig.wire.values: one rule for "an integer", "a number" and "a field
of this type" in what a peer sends; and errors that name a wrong value
without repeating what the peer wrote."""

from __future__ import annotations

import json

import pytest

from accelmig.wire.errors import BadRequest, ProtocolError
from accelmig.wire.values import describe, field, is_a, is_int, is_number, shown, wanted


class Counted(int):
    """An int subclass (an IntEnum is one): an integer."""


@pytest.mark.parametrize("value,expected", [
    (0, True), (-5, True), (1 << 70, True), (Counted(3), True),
    (True, False), (False, False), (1.0, False), ("1", False), (None, False), ([1], False),
])
def test_an_integer_is_an_int_and_never_a_bool(value, expected):
    assert is_int(value) is expected


def test_an_integers_bounds_are_inclusive():
    assert is_int(1, 1, 3) and is_int(3, 1, 3) and not is_int(0, 1, 3) and not is_int(4, 1, 3)
    assert is_int(-(1 << 63), -(1 << 63)) and not is_int(True, 0, 1)


@pytest.mark.parametrize("value,expected", [
    (0, True), (2.5, True), (-1e300, True),
    (float("nan"), False), (float("inf"), False), (float("-inf"), False),
    (True, False), ("2.5", False), (None, False),
])
def test_a_number_is_finite_and_never_a_bool(value, expected):
    assert is_number(value) is expected


def test_what_json_parses_that_is_not_a_number():
    # Python's json reads NaN and Infinity; a peer may send them
    for text in ("NaN", "Infinity", "-Infinity", "true"):
        assert not is_number(json.loads(text))
    assert is_number(0.5, 0, 1) and not is_number(1.5, 0, 1)


@pytest.mark.parametrize("value,types,expected", [
    (1, int, True), (True, int, False), (True, (int, bool), True), (True, bool, True), (1, bool, False),
    (1.5, (int, float), True), (float("nan"), float, False), (True, (int, float), False),
    ("x", (str, type(None)), True), (None, (str, type(None)), True), ([], dict, False),
])
def test_a_type_check_lets_no_bool_pass_for_a_number(value, types, expected):
    assert is_a(value, types) is expected


@pytest.mark.parametrize("value,text", [
    (5, "a number (5)"), (True, "a boolean (True)"), (2.5, "a number (2.5)"), (10 ** 50, "a number"),
    ("secret-looking text", "a string of 19 characters"), ([1, [2, [3]]], "a list"), ({"a": 1}, "an object"),
    (None, "null"), (b"x", "bytes"),
])
def test_describe_names_a_value_without_repeating_a_peers_text(value, text):
    assert describe(value) == text


def test_shown_cuts_a_long_value():
    assert shown("abc") == "'abc'"
    long = shown("x" * 100)
    assert len(long) == 40 and long.endswith("...")


def test_wanted_names_each_type_once():
    assert wanted((str, type(None))) == "a string or null"
    assert wanted((int, float)) == "an integer or a number"
    assert wanted((list, tuple)) == "a list"


def test_a_field_is_returned_or_refused_with_what_and_the_key():
    data = {"epoch": 3, "name": "n", "flag": True, "note": None}
    assert field(data, "epoch", int, "resume") == 3
    assert field(data, "note", (str, type(None)), "resume") is None
    assert field(data, "missing", int, "resume", 7) == 7
    with pytest.raises(BadRequest, match=r"resume lacks 'missing'"):
        field(data, "missing", int, "resume")
    with pytest.raises(BadRequest, match=r"resume: flag must be an integer, not a boolean \(True\)"):
        field(data, "flag", int, "resume")
    with pytest.raises(ProtocolError, match=r"record: name must be an integer or null, not a string of 1 characters"):
        field(data, "name", (int, type(None)), "record", error=ProtocolError)
