"""The cluster's key names and limits, and its endpoint syntax: standard
library only, so a pool's configuration is checked without the etcd client."""

from __future__ import annotations

import re

from accelmig.wire.dataplane import parse_endpoint
from accelmig.wire.errors import ConfigInvalid

#: every key accelmig writes lives under this prefix (a store may be shared)
PREFIX = "/accelmig/v1/"
#: the most bytes one gateway answer may take (a range of ``limit`` values)
MAX_ANSWER_BYTES = 8 << 20
#: the most bytes one stored value may take: a node's record is ~1 KiB
MAX_VALUE_BYTES = 16 << 10
#: the most keys one range reads; more is a store nobody of ours wrote
MAX_RANGE_KEYS = 4096

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}$")


def check_name(value, what: str) -> str:
    """A node or tenant name as it appears in a key: no '/', bounded."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"{what} must be 1-63 letters, digits, '_', '.', '-' (got {value!r:.80})")
    return value


#: the two spellings of a cluster URL: plain HTTP, or TLS with a client certificate
PLAIN_SCHEME, TLS_SCHEME = "etcd://", "etcds://"


def cluster_uses_tls(text: str) -> bool:
    """``etcds://...``: TLS to etcd with this node's client certificate."""
    return isinstance(text, str) and text.startswith(TLS_SCHEME)


def parse_cluster_url(text: str, source: str = "config") -> list[tuple[str, int]]:
    """``etcd://`` or ``etcds://`` ``host:port[,host:port...]`` -> endpoints,
    tried in order.  ``http(s)://`` is refused: one spelling per meaning, so
    a config never leaves it to a reader whether TLS is on."""
    if isinstance(text, str) and text.startswith(("http://", "https://")):
        raise ConfigInvalid(source=source, reason=f"cluster {text!r:.80}: write etcds://HOST:PORT for TLS "
                                                  f"to etcd, etcd://HOST:PORT for plain HTTP (not http/https)")
    if not isinstance(text, str) or not text.startswith((PLAIN_SCHEME, TLS_SCHEME)):
        raise ConfigInvalid(source=source, reason=f"cluster must be etcd://HOST:PORT[,HOST:PORT...] or "
                                                  f"etcds://... for TLS (got {text!r:.80})")
    out = []
    for item in text.split("://", 1)[1].split(","):
        try:
            out.append(parse_endpoint(item.strip(), 2379))
        except Exception as exc:
            raise ConfigInvalid(source=source, reason=f"cluster: {item!r:.80}: {exc}") from None
    if not out or len(out) > 16:
        raise ConfigInvalid(source=source, reason="cluster names 1 to 16 etcd endpoints")
    return out
