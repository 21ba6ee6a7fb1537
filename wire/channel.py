"""The guest channel (hostd <-> accelmig-agent) and the agent's local socket
(accelmig-agent <-> drivers inside the guest).

**Guest channel**: virtio-serial port ``org.accelmig.agent.0``; messages are
newline-delimited JSON objects, each with a ``type`` and an ``id``.  The host
end disconnects and reconnects across every migration, so every (re)connect
of the host opens with a resynchronising handshake, as qemu-guest-agent's
``guest-sync-delimited`` does: the host sends the sentinel byte ``0xFF``
(never valid in UTF-8 JSON), which makes the agent drop any partial line,
then ``{"type": "sync", "id": N, "nonce": X}``; the agent answers a ``sync``
with the same nonce, preceded by a sentinel of its own, then a ``hello``.
Everything the host reads before that answer is stale and dropped.

host -> guest: ``sync``, ``identity`` (where the pool is from this host),
``rehome`` (identity + a ticket per session + migration id; idempotent per
migration id), ``status``, ``ping``.  Each is answered by a ``result`` with
the request's ``id``.  guest -> host, unsolicited: ``hello`` (versions, guest
identity, registered sessions), ``session_opened``, ``session_closed``.

**Local socket** (``/run/accelmig/agent.sock``), the same line format:
drivers send ``register``/``unregister``/``where``; the agent sends
``resume`` (endpoint, ticket, migration id) and the driver answers with a
``result``.

Standard library only.
"""

from __future__ import annotations

import json
import logging

from accelmig.wire.errors import BadRequest
from accelmig.wire.identity import HostIdentity

LOG = logging.getLogger(__name__)

CHANNEL_NAME = "org.accelmig.agent.0"
CHANNEL_PROTOCOL = 1
SENTINEL = b"\xff"
MAX_LINE = 256 * 1024      # a rehome of many sessions stays far below this
DEFAULT_AGENT_SOCKET = "/run/accelmig/agent.sock"

HOST_TYPES = frozenset({"sync", "identity", "rehome", "status", "ping"})
GUEST_EVENTS = frozenset({"hello", "session_opened", "session_closed"})
DRIVER_TYPES = frozenset({"register", "unregister", "where", "result", "rehome_local", "status"})


def encode(message: dict) -> bytes:
    """One message as a line (compact JSON, ASCII only: no 0xFF can appear)."""
    return json.dumps(message, separators=(",", ":"), ensure_ascii=True).encode("ascii") + b"\n"


class LineParser:
    """Incremental parser of newline-delimited JSON with resynchronisation.

    ``feed(data)`` returns the complete messages; a sentinel byte drops any
    partial line; a line that is not a JSON object, or longer than
    ``max_line``, is dropped with its reason in ``self.dropped`` (and a log
    line) and parsing goes on at the next newline.
    """

    def __init__(self, max_line: int = MAX_LINE, name: str = "channel"):
        self.max_line = max_line
        self.name = name
        self._buf = bytearray()
        self._skipping = False     # inside an oversized line: drop until newline
        self.dropped: list[str] = []
        self.resyncs = 0

    def reset(self) -> None:
        self._buf.clear()
        self._skipping = False

    def _drop(self, reason: str) -> None:
        self.dropped.append(reason)
        del self.dropped[:-100]
        LOG.warning("%s: dropped input: %s", self.name, reason)

    def feed(self, data: bytes) -> list[dict]:
        messages: list[dict] = []
        while data:
            cut = data.find(SENTINEL)
            chunk, data = (data, b"") if cut < 0 else (data[:cut], data[cut + 1:])
            self._feed_chunk(chunk, messages)
            if cut >= 0:
                if self._buf or self._skipping:
                    self._drop(f"partial line of {len(self._buf)} bytes cut by a resync")
                self.reset()
                self.resyncs += 1
        return messages

    def _feed_chunk(self, chunk: bytes, messages: list) -> None:
        while chunk:
            newline = chunk.find(b"\n")
            if newline < 0:
                if self._skipping:
                    return
                self._buf += chunk
                if len(self._buf) > self.max_line:
                    self._drop(f"line longer than {self.max_line} bytes")
                    self._buf.clear()
                    self._skipping = True
                return
            line, chunk = chunk[:newline], chunk[newline + 1:]
            if self._skipping:
                self._skipping = False
                continue
            self._buf += line
            raw = bytes(self._buf)
            self._buf.clear()
            if len(raw) > self.max_line:
                self._drop(f"line longer than {self.max_line} bytes")
                continue
            if not raw.strip():
                continue
            try:
                message = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as exc:
                self._drop(f"not JSON ({exc.__class__.__name__}: {str(exc)[:60]}): {raw[:40]!r}")
                continue
            if not isinstance(message, dict) or not isinstance(message.get("type"), str):
                self._drop(f"not a message object with a 'type': {raw[:40]!r}")
                continue
            messages.append(message)


def result(request_id, ok: bool = True, result=None, error=None) -> dict:
    out = {"type": "result", "id": request_id, "ok": ok}
    if ok:
        out["result"] = result if result is not None else {}
    else:
        out["error"] = error
    return out


def parse_rehome(message: dict) -> tuple[str, HostIdentity, dict]:
    """(migration id, identity, {sid: ticket}) of a rehome, or BadRequest."""
    migration_id = message.get("migration_id")
    if not isinstance(migration_id, str) or not migration_id:
        raise BadRequest(reason="rehome: migration_id must be a non-empty string")
    identity = HostIdentity.from_wire(message.get("identity"))
    tickets = message.get("tickets") or {}
    if not isinstance(tickets, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in tickets.items()):
        raise BadRequest(reason="rehome: tickets must map session ids to ticket strings")
    return migration_id, identity, tickets
