"""What a host must show the pool before it binds a session or opens a
migration: the session's own proof, and the domain's migration token.

**Binding proofs** (``bind_sessions``).  A session is bound to a domain on a
host only with a proof from the session itself: an HMAC-SHA256 with the
session's secret (the one the driver made at ``open``; it never leaves the
guest) over a challenge the pool issued to that host, the pool's instance,
the host's name, the domain's UUID and the session id::

    proof = HMAC-SHA256(secret, "accelmig-bind-1|<instance>|<challenge>|<host>|<domain>|<sid>")  (hex)

The domain is the one the *driver* says its guest is (its SMBIOS system
UUID, ``agent.dmi``, or what the application gave at open): it never
proves for another, and the host presents the proof with the UUID of the
domain whose guest it asked, so the pool's check fails unless both agree.
A host obtains a proof only by asking the guest it runs (the domain's own
channel, or qemu-guest-agent's guest-exec): a neighbour guest cannot prove
a session it does not hold, and a host cannot ask a guest that runs elsewhere.

The exchange, one batch at a time (never one round trip per session):

1. hostd -> pool ``bind_challenge`` -> ``{challenge, instance, ttl}`` (per
   pool node: each node issues its own; at most ``MAX_CHALLENGES`` live per
   host, each for ``CHALLENGE_TTL`` seconds, each session proven once under it);
2. hostd -> agent ``prove`` (guest channel, or ``accelmig-agent prove
   --stdin`` through guest-exec)::

       {"type": "prove", "id": N, "host": "hostA", "challenges": {"<instance>": "<challenge>"},
        "sids": ["s-...", ...]}          # or no "sids": every session, ``after`` the last one listed

   at most ``MAX_PROVE`` sessions a request;
3. agent -> each driver that registered one of them (local socket)::

       {"type": "prove", "id": M, "sid": "s-...", "host": "hostA", "challenges": {...}}

   the driver picks the challenge of its own pool instance and answers
   ``{"type": "result", "id": M, "ok": true, "result": {"sid", "domain", "proof"}}``
   (or an error: it knows no domain, no challenge of its instance);
4. agent -> hostd: ``{"proofs": {sid: proof}, "refused": {sid: reason}, "next": sid|null}``;
5. hostd -> pool ``bind_sessions {domain_uuid, challenge, sessions: {sid: proof}}``
   (at most ``MAX_BIND`` a call) -> ``{bound, prove, refused}``.  A session
   with ``null`` for its proof is acknowledged without one when it is bound
   to the caller in that domain already (a guest's hello after a reconnect,
   after a migration): ``prove`` lists those that need a proof.

**Migration tokens** (``register_token``, ``open_migration``'s ``token``).
The host where a domain's sessions are bound writes a fresh random token
into the running domain's metadata (``MIGRATION_NS``, live only) and
registers its SHA-256 at the pool.  The domain XML travels with a migration
to its real destination alone, whose hook reads the token there and opens
the record with it: the pool vouches for that destination (a record nobody
vouched for pauses, supersedes, completes and commits nothing of the
domain's sessions).  ``token_digest`` is what the pool keeps.

Standard library only: the guest's driver and agent import it.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

from accelmig.wire.errors import BadRequest

BIND_PROOF = "accelmig-bind-1"
#: sessions one ``bind_sessions`` call names (each proof 64 hex digits), and
#: the bytes of them a host puts in one (``bind_batches``): a call and its
#: answer stay within a page's bound (``wire.control.PAGED_ANSWER_MAX``)
MAX_BIND = 1024
BIND_BATCH_BYTES = 16 << 10
#: sessions one ``prove`` request to the agent names (its answer stays far within a line)
MAX_PROVE = 256
#: challenges one host may hold at the pool at once (the oldest go first), and their life
MAX_CHALLENGES = 64
CHALLENGE_TTL = 60.0
#: the longest challenge, instance, proof or token a message may carry
MAX_TOKEN = 128
#: pool instances one ``prove`` request carries challenges for (one per node)
MAX_INSTANCES = 128

#: the namespace and element of the migration token in a domain's metadata
MIGRATION_NS = "http://accelmig.dev/xmlns/migration/1"
MIGRATION_NS_PREFIX = "accelmig-migration"
TOKEN_ELEMENT = "token"

_HEX = re.compile(r"[0-9a-f]{16,128}")


def bind_proof(secret: bytes, *, challenge: str, instance: str, host: str, domain: str, sid: str) -> str:
    """The proof that the holder of ``secret`` binds ``sid`` to ``domain`` on ``host``."""
    msg = "|".join((BIND_PROOF, instance, challenge, host, domain, sid)).encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def check_bind_proof(secret: bytes, proof, *, challenge: str, instance: str, host: str, domain: str,
                     sid: str) -> bool:
    if not isinstance(proof, str):
        return False
    expected = bind_proof(secret, challenge=challenge, instance=instance, host=host, domain=domain, sid=sid)
    return hmac.compare_digest(expected, proof)


def bind_batches(sessions: dict) -> list[dict]:
    """``{sid: proof or None}`` in the batches a host binds them in: at most
    MAX_BIND sessions and BIND_BATCH_BYTES of them each."""
    batches, batch, size = [], {}, 0
    for sid in sorted(sessions):
        cost = len(sid) + 72
        if batch and (len(batch) >= MAX_BIND or size + cost > BIND_BATCH_BYTES):
            batches.append(batch)
            batch, size = {}, 0
        batch[sid] = sessions[sid]
        size += cost
    return batches + ([batch] if batch else [])


def new_token() -> str:
    """A fresh migration token (what goes into the domain's metadata)."""
    return secrets.token_hex(32)


def token_digest(token: str) -> str:
    """What the pool keeps of a token: its SHA-256, hex."""
    return hashlib.sha256(token.encode()).hexdigest()


def check_hex(value, what: str) -> str:
    """A challenge, an instance, a proof or a token: lower-case hex, bounded."""
    if not isinstance(value, str) or not _HEX.fullmatch(value):
        raise BadRequest(reason=f"{what} must be 16 to {MAX_TOKEN} lower-case hex digits")
    return value


def parse_challenges(value) -> dict[str, str]:
    """``{instance: challenge}`` of a ``prove`` request, checked."""
    if not isinstance(value, dict) or not 0 < len(value) <= MAX_INSTANCES:
        raise BadRequest(reason=f"prove: challenges must be an object of 1 to {MAX_INSTANCES} "
                                f"{{instance: challenge}}")
    for instance, challenge in value.items():
        if not isinstance(instance, str) or not re.fullmatch(r"[0-9a-f]{4,32}", instance):
            raise BadRequest(reason="prove: a pool instance is 4 to 32 hex digits")
        check_hex(challenge, "prove: a challenge")
    return dict(value)


def parse_prove(message: dict, max_sid: int = 256) -> tuple[str, dict[str, str], list[str] | None, str | None]:
    """(host, challenges, sids or None for every session, after) of a
    ``prove`` request, or BadRequest."""
    if not isinstance(message, dict):
        raise BadRequest(reason="prove: the request must be a JSON object")
    host = message.get("host")
    if not isinstance(host, str) or not 0 < len(host) <= 256:
        raise BadRequest(reason="prove: host must be the asking host's name (1 to 256 characters)")
    challenges = parse_challenges(message.get("challenges"))
    sids = message.get("sids")
    if sids is not None and (not isinstance(sids, list) or len(sids) > MAX_PROVE or not all(
            isinstance(sid, str) and 0 < len(sid) <= max_sid for sid in sids)):
        raise BadRequest(reason=f"prove: sids must be a list of at most {MAX_PROVE} session ids")
    after = message.get("after")
    if after is not None and (not isinstance(after, str) or len(after) > max_sid):
        raise BadRequest(reason="prove: after must be a session id")
    return host, challenges, sids, after
