"""What the pool checks before a host binds a session or is vouched for as
a migration's destination (the contract: ``accelmig.wire.attestation``).

- ``BindChallenges``: the challenges issued to hosts for binding proofs —
  at most ``MAX_CHALLENGES`` live per host (the oldest go first), each for
  ``CHALLENGE_TTL`` seconds, each session proven once under it.
- ``DomainTokens``: per domain, the digest of the migration token its host
  wrote into the running domain, which host registered it, and the record
  that opened with it (a token vouches for one destination: the retry of an
  aborted migration to that same host is the same destination).
"""

from __future__ import annotations

import collections
import dataclasses
import secrets

from accelmig.wire.attestation import CHALLENGE_TTL, MAX_CHALLENGES
from accelmig.wire.records import RecordStateName

S = RecordStateName


class BindChallenges:
    def __init__(self, ttl: float = CHALLENGE_TTL, per_host: int = MAX_CHALLENGES):
        self.ttl = ttl
        self.per_host = per_host
        # host -> challenge -> (expiry, the sessions bound under it)
        self._issued: dict[str, collections.OrderedDict[str, tuple[float, set]]] = {}

    def issue(self, host: str, now: float) -> str:
        challenge = secrets.token_hex(16)
        issued = self._issued.setdefault(host, collections.OrderedDict())
        for old, (expiry, _) in list(issued.items()):
            if expiry < now:
                del issued[old]
        issued[challenge] = (now + self.ttl, set())
        while len(issued) > self.per_host:
            issued.popitem(last=False)
        return challenge

    def valid(self, host: str, challenge, now: float) -> bool:
        """``challenge`` was issued to ``host`` and has not expired (nor
        been pushed out by newer ones)."""
        entry = self._issued.get(host, {}).get(challenge) if isinstance(challenge, str) else None
        return entry is not None and now <= entry[0]

    def used(self, host: str, challenge: str, sid: str) -> bool:
        entry = self._issued.get(host, {}).get(challenge)
        return entry is None or sid in entry[1]

    def use(self, host: str, challenge: str, sid: str) -> None:
        entry = self._issued.get(host, {}).get(challenge)
        if entry is not None:
            entry[1].add(sid)


@dataclasses.dataclass
class DomainToken:
    digest: str
    host: str                       # who registered it: the domain's host then
    spent_by: str | None = None     # the record key that opened with it


class DomainTokens:
    """The migration token of each domain that holds sessions."""

    def __init__(self):
        self._tokens: dict[str, DomainToken] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    def register(self, domain: str, digest: str, host: str, records: dict) -> str:
        """``host`` (the domain's host: the caller checked it) says the
        domain carries this token: ``fresh`` (it vouches for the next
        destination), ``in_use`` (a migration opened with it is under way, or
        was aborted: only its destination may open again with it) or
        ``spent`` (it moved a domain, or another host registered it: the
        host writes a new one)."""
        entry = self._tokens.get(domain)
        if entry is None or entry.digest != digest:
            self._tokens[domain] = DomainToken(digest, host)
            return "fresh"
        if entry.host != host:
            return "spent"
        if entry.spent_by is None:
            return "fresh"
        record = records.get(entry.spent_by)
        if record is None or record.state in (S.COMMITTED, S.COMPLETED, S.CLOSED):
            return "spent"
        return "in_use"

    def vouches(self, domain: str, digest: str | None, dest: str, records: dict) -> bool:
        """Whether ``digest`` is the domain's token and may open a migration to ``dest``."""
        entry = self._tokens.get(domain)
        if entry is None or digest is None or entry.digest != digest:
            return False
        if entry.spent_by is None:
            return True
        record = records.get(entry.spent_by)
        # the same destination again: its hook noted twice, or it retries an aborted migration
        return record is not None and record.dest_host == dest and \
            record.state in (S.OPEN, S.SWITCHED_OVER, S.ABORTED)

    def spend(self, domain: str, record_key: str) -> None:
        entry = self._tokens.get(domain)
        if entry is not None:
            entry.spent_by = record_key

    def unspent(self, domain: str) -> bool:
        """The domain has a token that nobody opened a migration with yet."""
        entry = self._tokens.get(domain)
        return entry is not None and entry.spent_by is None

    def keep(self, domains: set) -> None:
        """Forget the tokens of domains that hold no session any more."""
        for domain in [d for d in self._tokens if d not in domains]:
            del self._tokens[domain]
