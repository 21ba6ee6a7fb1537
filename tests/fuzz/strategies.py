"""What the fuzz tests send, as hypothesis strategies, and the one settings
profile they all run under: a fixed seed (``derandomize``), a bounded number
of examples, no deadline (real sockets on shared CI cores), no example
database (nothing written outside the test's own directories).

``ACCELMIG_FUZZ_EXAMPLES`` scales every test's number of examples (a longer
local run: ``ACCELMIG_FUZZ_EXAMPLES=10``); CI runs the default, 1."""

from __future__ import annotations

import json
import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

SCALE = max(1, int(os.environ.get("ACCELMIG_FUZZ_EXAMPLES", "1")))


def fuzz_settings(max_examples: int) -> settings:
    return settings(max_examples=max_examples * SCALE, derandomize=True, deadline=None,
                    database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


#: text as a hostile peer writes it: any code point, a lone surrogate now and then
text = st.one_of(st.text(max_size=12), st.sampled_from(["", "\ud800", "\udfff x", "a" * 300, "1" * 5000]))
#: integers at the edges a runtime or a C binding cares about
integers = st.one_of(st.integers(-3, 70), st.sampled_from([2**31, 2**32, 2**63 - 1, 2**63, 2**64, -2**63,
                                                          10**30, -1]),
                     st.integers(-2**70, 2**70))
scalars = st.one_of(st.none(), st.booleans(), integers,
                    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1e300, -0.0, 5e-324]),
                    text)
json_values = st.recursive(scalars, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(text, children, max_size=4)), max_leaves=12)


def objects(known: dict, *, extra: bool = True):
    """A JSON object whose keys are mostly ``known``'s (name -> strategy of
    likely values), each value the likely one or anything at all."""
    fields = {name: st.one_of(values, json_values) for name, values in known.items()}
    base = st.fixed_dictionaries({}, optional=fields)
    if not extra:
        return base
    return st.tuples(base, st.dictionaries(text, json_values, max_size=2)).map(
        lambda pair: {**pair[1], **pair[0]})


# -- frames, as any peer may write them (the data plane and the control plane share the framing) --

def frame_prefixes(hlen=st.integers(0, 600), plen=st.integers(0, 5000)):
    """A frame prefix, sometimes a wrong one (magic, version, a TLS record's first bytes)."""
    from accelmig.wire.frames import MAGIC, PREFIX
    return st.builds(lambda magic, version, flags, h, p: PREFIX.pack(magic, version, flags, h, p),
                     st.sampled_from([MAGIC, MAGIC, MAGIC, b"MA", b"\x16\x03"]),
                     st.sampled_from([1, 1, 1, 0, 2, 255]), st.integers(0, 255), hlen, plen)


#: header bytes no encoder of ours would write: not JSON, not an object, no 'op',
#: numbers that overflow, lone surrogates, nesting past any recursion limit
odd_header_bytes = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.sampled_from([b'{"op":"x","n":1e400}', b'{"op":NaN}', b'{"op":"x","s":"\\ud800"}',
                     b"[" * 50000 + b"]" * 50000, b'{"op":"hello","a":' + b"[" * 3000 + b"]" * 3000 + b"}",
                     b'{"op":"\xff"}', b'{"op":"hello","op":"call"}', b"{}", b"null", b'{"op":1}',
                     b'{"op":"hello","versions":[1],"n":' + b"1" * 5000 + b"}"]))


def raw_header_frame(raw: bytes) -> bytes:
    """``raw`` as a frame's header, behind a valid prefix."""
    from accelmig.wire.frames import MAGIC, PREFIX
    return PREFIX.pack(MAGIC, 1, 0, len(raw), 0) + raw
