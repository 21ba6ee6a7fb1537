"""The binding-proof relay (issue 28; ``accelmig.wire.attestation``): a
host asks the agent (``prove`` on the channel, or root's ``accelmig-agent
prove --stdin`` through guest-exec: ``prove_local``) for the proofs of
sessions, the agent asks each driver that registered one, and the driver
answers with an HMAC of its own session secret.  The agent proves nothing
itself: only the driver holds a session's secret.
"""

from __future__ import annotations

import logging
import threading
import time

from accelmig.agent.daemon.drivers import MAX_SID, DriverRegistry
from accelmig.wire import attestation as att
from accelmig.wire.errors import Timeout

# the agent's logger, as before the split: operators' filters keep working
LOG = logging.getLogger("accelmig.agent.daemon.agent")


class ProofRelay:
    #: ``prove`` requests answered at once (each waits for its drivers), and
    #: how long one waits for them
    MAX_PROVING = 2
    PROVE_TIMEOUT = 10.0
    #: the longest reason a refused proof is given with (an answer stays within a line)
    PROVE_REASON = 120

    def __init__(self, registry: DriverRegistry, stats):
        self.registry = registry
        self.stats = stats
        self._proving = threading.BoundedSemaphore(self.MAX_PROVING)

    def prove(self, request: dict) -> dict:
        """Each driver's binding proof of the sessions ``request`` names (every
        session, a page at a time, when it names none) for the pool's
        challenges: ``{"proofs": {sid: proof}, "refused": {sid: reason},
        "next": the last sid listed when more follow}``.  The drivers are
        asked all at once; one that does not answer within PROVE_TIMEOUT is
        refused."""
        host, challenges, sids, after = att.parse_prove(request, MAX_SID)
        if not self._proving.acquire(timeout=self.PROVE_TIMEOUT):
            raise Timeout(what=f"a prove for host {host} (others still waiting for their drivers)",
                          timeout=self.PROVE_TIMEOUT)
        try:
            held = self.registry.holders()
            following = None
            if sids is None:
                order = sorted(sid for sid in held if after is None or sid > after)
                if len(order) > att.MAX_PROVE:
                    order, following = order[:att.MAX_PROVE], order[att.MAX_PROVE - 1]
                sids = order
            refused: dict[str, str] = {}
            asked = []
            for sid in dict.fromkeys(sids):
                link = held.get(sid)
                if link is None:
                    refused[sid] = "no driver in this guest holds that session"
                    continue
                ask = self.registry.ask(link, {"type": "prove", "sid": sid, "host": host, "challenges": challenges})
                asked.append(ask)
            deadline = time.monotonic() + self.PROVE_TIMEOUT
            proofs: dict[str, str] = {}
            for ask in asked:
                if not ask.event.wait(max(0.0, deadline - time.monotonic())):
                    refused[ask.sid] = f"its driver did not answer within {self.PROVE_TIMEOUT:.0f} s"
                    continue
                reply = ask.reply or {}
                result = reply.get("result") if reply.get("ok") else None
                proof = result.get("proof") if isinstance(result, dict) else None
                if isinstance(proof, str) and 0 < len(proof) <= att.MAX_TOKEN:
                    proofs[ask.sid] = proof
                else:
                    error = reply.get("error") if isinstance(reply.get("error"), dict) else {}
                    refused[ask.sid] = str(error.get("message") or "its driver answered no proof")[:self.PROVE_REASON]
            self.stats["proofs"] += len(proofs)
            LOG.info("prove for host %s: %d proof(s), %d refused", host, len(proofs), len(refused))
            return {"host": host, "proofs": proofs, "refused": refused, "next": following}
        finally:
            self._proving.release()
