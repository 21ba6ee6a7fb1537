"""Pages of the control plane's listings (``accelmig.wire.control.PAGED``).

A listing whose size grows with the number of sessions (tickets, sessions,
records, a record's per-session detail, the domains holding sessions) is
answered a page at a time: items up to ``PAGE_BYTES`` of JSON (at least one,
at most the caller's ``limit``) and ``next``, a cursor for the page after.

A cursor is ``<position>.<mac>``: where the next page starts in the listing
(an index into a record's frozen, sorted session list, or a serial number
of sessions or records: the next page holds those at or past it) and an HMAC, with a secret of this pool instance,
over the method, the listing's scope (the record, the filter) and the
caller.  So a cursor is small (a page request costs the pool a bounded
parse), cannot be forged, and is refused for another listing, another
host, or another pool instance: ``BAD_REQUEST``, before anything is read.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from typing import Callable, Iterable

from accelmig.wire import control as wc
from accelmig.wire.errors import BadRequest
from accelmig.wire.values import describe, is_int, shown

#: hex digits of the cursor's MAC (128 bits)
MAC_CHARS = 32


class Pager:
    def __init__(self, secret: bytes | None = None):
        self._secret = secret or secrets.token_bytes(32)

    def _mac(self, method: str, scope: str, caller: str, position: int) -> str:
        message = "\0".join((method, scope, caller, str(position))).encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:MAC_CHARS]

    def cursor(self, method: str, scope: str, caller: str, position: int) -> str:
        return f"{position}.{self._mac(method, scope, caller, position)}"

    def position(self, method: str, scope: str, caller: str, cursor) -> int:
        """Where ``cursor`` says the next page starts (0 without one), or
        ``BadRequest`` for a cursor this listing did not hand to this caller."""
        if cursor is None:
            return 0
        text = cursor if isinstance(cursor, str) else ""
        head, dot, mac = text.partition(".")
        if not (dot and head.isdigit() and len(head) <= 12 and len(mac) == MAC_CHARS):
            raise BadRequest(reason=f"{method}: cursor {shown(cursor)} is not a cursor this pool "
                                    f"handed out")
        position = int(head)
        if not hmac.compare_digest(self._mac(method, scope, caller, position), mac):
            raise BadRequest(reason=f"{method}: this cursor is not for this listing (another record, "
                                    f"domain or filter, another host, or an earlier pool instance)")
        return position


def page_limit(method: str, limit) -> int:
    """The most items the caller wants in a page (``limit``), checked."""
    if limit is None:
        return wc.MAX_PAGE_ITEMS
    if not is_int(limit, 1, wc.MAX_PAGE_ITEMS):
        raise BadRequest(reason=f"{method}: limit must be an integer from 1 to {wc.MAX_PAGE_ITEMS}, "
                                f"not {describe(limit)}")
    return limit


def take(items: Iterable[tuple[int, object]], limit: int, size: Callable[[object], int] | None = None,
         budget: int = wc.PAGE_BYTES) -> tuple[list, int | None]:
    """A page out of ``(position, item)`` pairs in growing order: (the items,
    the position the next page starts at — one past the last item given —
    when more follow, else None).  At least one item, at most ``limit``, and
    no more than ``budget`` bytes of their JSON after the first."""
    size = size or _json_size
    page, used, last = [], 0, None
    for position, item in items:
        cost = size(item)
        if page and (len(page) >= limit or used + cost > budget):
            return page, last + 1
        page.append(item)
        used += cost
        last = position
    return page, None


def _json_size(item) -> int:
    return len(json.dumps(item, separators=(",", ":"))) + 1
