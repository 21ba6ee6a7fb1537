"""What this host vouches for at the pool: which sessions are its guests',
and which host its domains may migrate to (``accelmig.wire.attestation``).

- **Sessions.**  The pool binds a session to a domain on this host only
  with the session's own proof.  hostd gets a challenge from each pool node,
  asks the domain's guest — its accelmig channel, or qemu-guest-agent's
  guest-exec — for its drivers' proofs (the agent asks every driver that
  registered one of them; each proves with its own secret, for the domain
  it reads itself) and hands them to ``bind_sessions``, a batch at a time.
  Session ids come from the guest (its hello, ``session_opened``, or the
  agent's whole list), never from the pool; a guest that names a neighbour's
  session cannot prove it.  A guest's report is attested only while its
  domain runs here (not while it arrives: the rehome's tickets move those
  sessions, and the blackout is no time for proofs); what came in meanwhile
  is attested once it runs here, and the pool acknowledges without a proof
  what is bound here already.
- **The migration token.**  Once the domain's sessions are this host's, hostd
  writes a fresh random token into the running domain's metadata (live
  only: ``wire.attestation.MIGRATION_NS``) and registers its digest at the
  pool.  The domain's XML carries it to the migration's real destination
  alone, whose hook opens the record with it: the pool vouches for that
  host.  A domain that arrived here carries its former host's token: a new
  one is written once its sessions are here.
"""

from __future__ import annotations

import asyncio
import logging
import time

import libvirt

from accelmig.plugin.hostd.watch import DomainWatch, Phase
from accelmig.wire import attestation as att
from accelmig.wire.errors import AccelmigError, Forbidden, LibvirtFailure, RecordState, from_wire

LOG = logging.getLogger("accelmig.hostd")

#: pages of "every session" a guest may answer (its agent keeps 4096 at most:
#: 16 pages of MAX_PROVE); a guest that never ends its list is cut here
MAX_PROVE_PAGES = 64
#: s the destination of a migration waits, within one rehome attempt, for the
#: source to switch over before it attests the source's sessions (it
#: normally has: the source pauses the guest before it runs here)
ARRIVAL_WAIT = 1.0
#: s before a token that could not be written or registered is tried again
TOKEN_RETRY = 30.0
#: sessions a guest's reports may leave waiting for their attestation (its
#: agent keeps 4096 at most): past it a report is dropped, said once
MAX_PENDING = 4096


def _chunks(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]


class Attestation:
    def __init__(self, daemon):
        self.daemon = daemon
        # node client -> (challenge, instance, monotonic time to ask for a new one):
        # one challenge serves every proof for half its life (each session is
        # proven once under it), so no guest makes hostd churn the pool's
        # challenges (a host holds MAX_CHALLENGES at most) under another's feet
        self._challenges: dict = {}

    @property
    def host(self) -> str:
        return self.daemon.host

    # -- the guest's reports -------------------------------------------------------------
    def report(self, watch: DomainWatch, sids, *, new: bool) -> None:
        """The guest says it holds ``sids`` (``new``: just opened; else its
        hello's list, mostly attested already): attested in the background,
        in batches (one task per domain takes what came meanwhile)."""
        for sid in sids:
            if isinstance(sid, str) and 0 < len(sid) <= 256 and sid not in watch.sessions:
                if len(watch.unattested) >= MAX_PENDING and sid not in watch.unattested:
                    if not watch.attest_dropped:
                        LOG.warning("domain %s: its guest reported over %d sessions not attested yet: "
                                    "the rest dropped until those are", watch.name, MAX_PENDING,
                                    extra={"domain": watch.name})
                    watch.attest_dropped = True
                    break
                # (a new one needs a proof; one from a hello may be bound here already)
                watch.unattested[sid] = watch.unattested.get(sid, False) or new
        self.kick(watch)

    def kick(self, watch: DomainWatch) -> None:
        """Attest what the guest reported, if its domain runs here now."""
        if watch.unattested and watch.phase is Phase.RUNNING and \
                (watch.attesting is None or watch.attesting.done()):
            watch.attesting = self.daemon.spawn(self._flush(watch), f"attest:{watch.name}")

    async def _flush(self, watch: DomainWatch) -> None:
        while watch.unattested and watch.phase is Phase.RUNNING:
            batch, watch.unattested, watch.attest_dropped = watch.unattested, {}, False
            try:
                await self.attest(None, watch, batch)
            except AccelmigError as exc:
                LOG.warning("domain %s: %d session(s) not attested: %s", watch.name, len(batch), exc,
                            extra={"domain": watch.name})

    # -- attesting -------------------------------------------------------------------------
    async def attest(self, dom, watch: DomainWatch, sids: dict | None) -> dict:
        """Bind the guest's sessions to ``watch``'s domain on this host.
        ``sids``: ``{sid: new}`` the guest reported (those not new are first
        asked about without a proof), or None: every session its agent holds.
        ``dom``: the domain (None: looked up when guest-exec needs it).
        Returns ``{"bound": [...], "refused": {sid: error}}``."""
        nodes = self.daemon.nodes
        bound: list[str] = []
        refused: dict[str, dict] = {}
        challenges: dict[str, tuple] = {}         # instance -> (client, challenge)
        if sids is None:
            for client in nodes.every():
                instance, challenge = await self._challenge(client)
                challenges[instance] = (client, challenge)
            wanted = None
        else:
            groups: dict = {}
            for sid, new in sids.items():
                groups.setdefault(await nodes.node_for_sid(sid), {})[sid] = new
            wanted = []
            for client, group in groups.items():
                known = [sid for sid, new in group.items() if not new]
                needed = [sid for sid, new in group.items() if new]
                for batch in att.bind_batches({sid: None for sid in known}):
                    answer = await self.daemon.node_call(client, "bind_sessions", domain_uuid=watch.uuid,
                                                         domain_name=watch.name, sessions=batch)
                    bound += answer.get("bound") or []
                    refused.update(answer.get("refused") or {})
                    needed += [sid for sid in answer.get("prove") or [] if sid in group]
                if needed:
                    instance, challenge = await self._challenge(client)
                    challenges[instance] = (client, challenge)
                    wanted += needed
        if wanted is None or wanted:
            proofs, unproven = await self._ask_guest(dom, watch, {i: c for i, (_, c) in challenges.items()},
                                                     wanted)
            for sid, reason in unproven.items():
                refused[sid] = {"code": "FORBIDDEN", "message": f"the guest gave no proof: {reason}"}
            for_client: dict = {}
            for sid, proof in proofs.items():
                client = await nodes.node_for_sid(sid)
                for_client.setdefault(client, {})[sid] = proof
            by_client = {id(client): challenge for client, challenge in challenges.values()}
            for client, group in for_client.items():
                challenge = by_client.get(id(client))
                if challenge is None:
                    continue                      # (a sid of a node we asked no challenge of)
                for batch in att.bind_batches(group):
                    try:
                        answer = await self.daemon.node_call(client, "bind_sessions", domain_uuid=watch.uuid,
                                                             domain_name=watch.name, challenge=challenge,
                                                             sessions=batch)
                    except Forbidden:
                        self.forget_challenges()      # (expired, or the pool restarted): the next report asks anew
                        raise
                    bound += answer.get("bound") or []
                    refused.update(answer.get("refused") or {})
        watch.sessions.update(bound)
        for sid, error in list(refused.items())[:3]:
            LOG.warning("domain %s: session %s (the guest says it is this domain's) not attested: %s",
                        watch.name, sid, (error or {}).get("message"), extra={"domain": watch.name})
        if bound:
            LOG.info("domain %s: %d session(s) attested%s", watch.name, len(bound),
                     f", {len(refused)} refused" if refused else "", extra={"domain": watch.name})
            if not watch.token_registered:
                self.daemon.spawn(self.ensure_token(watch), f"token:{watch.name}")
        return {"bound": bound, "refused": refused}

    async def _challenge(self, client) -> tuple[str, str]:
        """(instance, challenge) of ``client``'s node for this host's proofs."""
        held = self._challenges.get(client)
        if held is not None and time.monotonic() < held[2]:
            return held[1], held[0]
        answer = await self.daemon.node_call(client, "bind_challenge")
        life = float(answer.get("ttl") or att.CHALLENGE_TTL) / 2
        self._challenges[client] = (answer["challenge"], answer["instance"], time.monotonic() + life)
        return answer["instance"], answer["challenge"]

    def forget_challenges(self) -> None:
        """A challenge the pool no longer has (it restarted, it pushed it out): ask anew."""
        self._challenges.clear()

    async def _ask_guest(self, dom, watch: DomainWatch, challenges: dict, sids: list | None):
        """The guest's proofs of ``sids`` (None: of every session it holds):
        ``({sid: proof}, {sid: reason})``, every field checked (the guest's
        answer is input)."""
        if dom is None and watch.delivery.name == "guest-exec":
            dom = await self.daemon.lookup(watch)
            if not dom:
                raise LibvirtFailure(kind="no-domain", what=f"domain {watch.name} (to ask its guest)")
        proofs: dict[str, str] = {}
        refused: dict[str, str] = {}
        requests = ([{"sids": chunk} for chunk in _chunks(sids, att.MAX_PROVE)] if sids is not None
                    else [{}])
        pages = 0
        while requests and pages < MAX_PROVE_PAGES:
            extra = requests.pop(0)
            pages += 1
            answer = await watch.delivery.prove(dom, watch, {"host": self.host, "challenges": challenges, **extra})
            answer = answer if isinstance(answer, dict) else {}
            for kind, into in (("proofs", proofs), ("refused", refused)):
                got = answer.get(kind)
                for sid, value in (got.items() if isinstance(got, dict) else ()):
                    if isinstance(value, str) and len(value) <= 1024 and (sids is None or sid in extra["sids"]):
                        into[sid] = value if kind == "proofs" else value[:200]
            following = answer.get("next")
            if sids is None and isinstance(following, str) and following > extra.get("after", ""):
                requests.append({"after": following})
        return proofs, refused

    async def arrived(self, dom, watch: DomainWatch) -> str | None:
        """The destination of a migration, before it completes the record:
        sessions that claim this domain but were never attested (a VM whose
        guest reports nothing by itself, opened just before it left) would
        be left behind for good: the guest proves them here, as this
        migration's destination (the pool takes them only once their host
        switched the migration over: wait a moment for it).  Only when the
        pool says some wait: never a guest round trip on the blackout's path
        otherwise.  What still waits, for the next attempt, or None."""
        waiting = 0
        for client in self.daemon.nodes.every():
            answer = await self.daemon.node_call(client, "bind_challenge", domain_uuid=watch.uuid)
            waiting += answer.get("unattested") or 0
        if not waiting:
            return None
        try:
            deadline, delay = time.monotonic() + ARRIVAL_WAIT, 0.05
            while True:
                outcome = await self.attest(dom, watch, None)
                later = {sid: e for sid, e in outcome["refused"].items()
                         if (e or {}).get("code") == RecordState.code.value}
                if not later or time.monotonic() + delay > deadline:
                    break
                await asyncio.sleep(delay)
                delay *= 2
        except AccelmigError as exc:
            LOG.warning("domain %s: its sessions could not be proven by its guest: %s", watch.name, exc)
            return None
        return "; ".join(f"session {sid}: {from_wire(e)}" for sid, e in list(later.items())[:3]) or None

    # -- the migration token ---------------------------------------------------------------
    async def ensure_token(self, watch: DomainWatch) -> None:
        """The domain runs here with its sessions bound here: make sure the
        pool knows the token in its live XML as this host's, or write a new
        one (none there, or its former host's)."""
        if watch.token_registered or watch.phase is not Phase.RUNNING or watch.token_busy or \
                time.monotonic() < watch.token_retry_at:
            return
        watch.token_busy = True
        try:
            if watch.token is not None:
                state = await self._register(watch, watch.token)
                if state in ("fresh", "in_use"):
                    watch.token_registered = True
                    return
                if state is None:
                    return                # no session of it is bound here (yet)
            dom = await self.daemon.lookup(watch)
            if not dom:
                return
            # a domain in a job (a migration under way) cannot take new metadata now: later
            try:
                job = (await self.daemon.libvirt.call(dom.jobInfo, timeout=10))[0]
            except LibvirtFailure as exc:
                if exc.kind != "unsupported":        # (a driver without jobs has none under way)
                    raise
                job = libvirt.VIR_DOMAIN_JOB_NONE
            if job != libvirt.VIR_DOMAIN_JOB_NONE:
                return
            token = att.new_token()
            await self.daemon.libvirt.call(dom.setMetadata, libvirt.VIR_DOMAIN_METADATA_ELEMENT,
                                           f'<{att.TOKEN_ELEMENT} value="{token}"/>', att.MIGRATION_NS_PREFIX,
                                           att.MIGRATION_NS, libvirt.VIR_DOMAIN_AFFECT_LIVE, timeout=10)
            watch.token = token
            state = await self._register(watch, token)
            watch.token_registered = state is not None
            LOG.info("domain %s: a new migration token written into the running domain and registered",
                     watch.name, extra={"domain": watch.name})
        except (AccelmigError, asyncio.TimeoutError) as exc:
            watch.token_retry_at = time.monotonic() + TOKEN_RETRY
            LOG.warning("domain %s: its migration token is not registered (%s); its migrations are vouched "
                        "for by its switchover only; tried again in %.0f s", watch.name, exc, TOKEN_RETRY,
                        extra={"domain": watch.name})
        finally:
            watch.token_busy = False

    async def _register(self, watch: DomainWatch, token: str) -> str | None:
        """The token's state at the pool: the worst of every node's that holds
        sessions of the domain (``spent`` over ``in_use`` over ``fresh``);
        None where no node does."""
        order = {"fresh": 0, "in_use": 1, "spent": 2}
        state = None
        for client in self.daemon.nodes.every():
            answer = await self.daemon.node_call(client, "register_token", domain_uuid=watch.uuid,
                                                 digest=att.token_digest(token))
            mine = answer.get("state") if answer.get("registered") else None
            if mine in order and (state is None or order[mine] > order[state]):
                state = mine
        return state
