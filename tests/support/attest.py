"""Test support: what hostd does when a guest proves its sessions, by hand.

``bind(host, devs, domain)``: a challenge from the pool for ``host``, each
driver's proof made with its own session secret (``wire.attestation``, the
function the driver itself calls: the test process is the guest here, and
``domain`` stands for the SMBIOS UUID its drivers would read), and one
``bind_sessions`` with all of them.  The pool's answer; a session it refused
raises, as ``bind_session`` did (its error, typed)."""

from __future__ import annotations

from accelmig.wire import attestation as att
from accelmig.wire.errors import from_wire


def _host_name(client) -> str:
    return getattr(client, "host", None) or client.name


def _secrets(devs) -> dict:
    """``{sid: secret}`` of drivers (``Device``), of hand-driven connections
    (``Raw``: ``sid``, ``secret``), or given as such."""
    if isinstance(devs, dict):
        return devs
    devs = devs if isinstance(devs, (list, tuple)) else [devs]
    return {dev.sid: (dev._session.secret if hasattr(dev, "_session") else dev.secret) for dev in devs}


def _proofs(challenge: dict, host: str, devs, domain: str) -> dict:
    return {sid: att.bind_proof(secret, challenge=challenge["challenge"], instance=challenge["instance"],
                                host=host, domain=domain, sid=sid)
            for sid, secret in _secrets(devs).items()}


def bind(client, devs, domain: str, *, domain_name: str | None = None, strict: bool = True) -> dict:
    """``devs``: a driver (``Device``) or several, or ``{sid: secret}``."""
    challenge = client.call("bind_challenge")
    answer = {"bound": [], "prove": [], "refused": {}}
    for batch in att.bind_batches(_proofs(challenge, _host_name(client), devs, domain)):
        part = client.call("bind_sessions", domain_uuid=domain, challenge=challenge["challenge"],
                           sessions=batch, **({"domain_name": domain_name} if domain_name else {}))
        answer = {"bound": answer["bound"] + part["bound"], "prove": answer["prove"] + part["prove"],
                  "refused": {**answer["refused"], **part["refused"]}}
    if strict and answer["refused"]:
        raise from_wire(next(iter(answer["refused"].values())))
    return answer


async def bind_async(client, devs, domain: str) -> dict:
    """``bind`` through an ``AsyncControlClient``."""
    challenge = await client.call("bind_challenge")
    answer = await client.call("bind_sessions", domain_uuid=domain, challenge=challenge["challenge"],
                               sessions=_proofs(challenge, client.host, devs, domain))
    if answer["refused"]:
        raise from_wire(next(iter(answer["refused"].values())))
    return answer


def register_token(client, domain: str) -> str:
    """What hostd does once a domain's sessions are its own: a fresh
    migration token (it writes it into the running domain) registered at the
    pool; the token, as the destination's hook reads it from the XML."""
    token = att.new_token()
    answer = client.call("register_token", domain_uuid=domain, digest=att.token_digest(token))
    assert answer["registered"] and answer["state"] == "fresh", answer
    return token
