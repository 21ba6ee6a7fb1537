"""The driver's side of the guest agent's local socket.

Each session registers with the agent (if one runs in this
guest) over a connection of its own, kept open for the session's life: the
agent notices a driver that dies when that connection closes.  Over it the
agent asks the driver to ``resume`` (new endpoint, ticket, migration id)
after a migration, and the driver answers with the outcome.  When the agent
restarts, the driver registers again.

Standard library only.
"""

from __future__ import annotations

import logging
import os
import threading

from accelmig.agent import dmi
from accelmig.wire import attestation as att
from accelmig.wire import channel as ch
from accelmig.wire.dataplane import domain_claim
from accelmig.wire.errors import AccelmigError, BadRequest, Conflict

LOG = logging.getLogger(__name__)
DEFAULT_AGENT_SOCKET = ch.DEFAULT_AGENT_SOCKET


def agent_socket_path(agent) -> str | None:
    """``agent``: False (none), a path, or None (the environment or the default)."""
    if agent is False:
        return None
    if isinstance(agent, str):
        return agent
    return os.environ.get("ACCELMIG_AGENT_SOCKET", DEFAULT_AGENT_SOCKET)


def _where(agent=None) -> dict:
    """The guest agent's ``where`` answer ({} without an agent that answers)."""
    path = agent_socket_path(agent)
    if path is None or not os.path.exists(path):
        return {}
    try:
        with agent_connection(path) as conn:
            answer = conn.call("where")
        return answer if isinstance(answer, dict) else {}
    except AccelmigError as exc:
        LOG.info("guest agent at %s does not answer: %s", path, exc)
        return {}


def endpoint_from_agent(agent=None) -> str | None:
    """Where the pool is, as the host told this guest's agent (None: no agent
    or no identity yet)."""
    return _where(agent).get("endpoint")


#: the domain the agent said this guest is, by agent socket: a guest's UUID
#: does not change while it runs (a migration keeps it), so a process asks
#: once, not at every session it opens
_AGENT_DOMAIN: dict[str, str] = {}


def domain_of_this_guest(agent=None) -> str | None:
    """This guest's SMBIOS system UUID: read from ``/sys`` (root), else as
    the guest agent read it (root only may read the file)."""
    uuid = dmi.system_uuid()
    if uuid is not None:
        return uuid
    path = agent_socket_path(agent)
    if path in _AGENT_DOMAIN:
        return _AGENT_DOMAIN[path]
    try:
        uuid = domain_claim(_where(agent).get("domain"))
    except AccelmigError:                # an agent's odd answer: claim nothing
        return None
    if uuid is not None and path is not None:
        _AGENT_DOMAIN[path] = uuid
    return uuid


def agent_connection(path: str, timeout: float | None = 5.0) -> ch.LineClient:
    """A line connection to the agent (also what ``accelmig-agent`` uses to
    ask the running agent); ``Unavailable`` when none answers."""
    return ch.LineClient(path, timeout=timeout, what=f"the guest agent at {path}", name="agent")


class AgentRegistration:
    """Keeps one session (``accelmig.agent.driver.session.Session``)
    registered with the guest agent."""

    RETRY = 1.0
    #: While no agent socket exists at all: the wait between looks, first and
    #: longest.  An application started at boot may come up before the agent
    #: (both start at once); it must still be registered once the agent is
    #: there, yet a guest with no agent pays only a rare stat().
    ABSENT_BACKOFF = (1.0, 30.0)

    def __init__(self, session, path: str):
        self.session = session
        self.path = path
        self._stop = threading.Event()
        self._conn: ch.LineClient | None = None
        self.registered = threading.Event()
        self.resumes = 0
        self._thread = threading.Thread(target=self._run, name=f"accelmig-{session.sid}-agent", daemon=True)

    @classmethod
    def start(cls, session, agent) -> "AgentRegistration | None":
        path = agent_socket_path(agent)
        if path is None:
            return None      # told not to: the driver works on its own
        registration = cls(session, path)
        registration._thread.start()
        if os.path.exists(path):
            registration.registered.wait(2.0)
        # else: no agent yet (or none in this guest): registered when one comes
        return registration

    def _run(self) -> None:
        absent_wait = self.ABSENT_BACKOFF[0]
        while not self._stop.is_set():
            if not os.path.exists(self.path):
                self._stop.wait(absent_wait)
                absent_wait = min(absent_wait * 2, self.ABSENT_BACKOFF[1])
                continue
            absent_wait = self.ABSENT_BACKOFF[0]
            try:
                conn = agent_connection(self.path, timeout=None)
            except AccelmigError:
                self._stop.wait(self.RETRY)
                continue
            self._conn = conn
            try:
                s = self.session
                conn.send({"type": "register", "id": conn.next_id(), "sid": s.sid, "endpoint": s.endpoint,
                           "pid": os.getpid(), "name": s.name, "epoch": s.epoch})
                while not self._stop.is_set():
                    message = conn.recv()
                    if message is None:
                        break
                    if message.get("type") == "result":
                        if (message.get("result") or {}).get("registered"):
                            self.registered.set()
                        continue
                    if message.get("type") == "resume":
                        self._resume(conn, message)
                    elif message.get("type") == "prove":
                        conn.send(self._prove(message))
            except (OSError, AccelmigError):
                pass                  # the agent went away: register again below
            finally:
                self._conn = None
                self.registered.clear()
                conn.close()
            if not self._stop.is_set():
                LOG.info("session %s: the guest agent went away; registering again", self.session.sid)
                self._stop.wait(self.RETRY)

    def _resume(self, conn: ch.LineClient, message: dict) -> None:
        try:
            mid = message.get("migration_id")
            outcome = self.session.resume(message.get("endpoint"), message.get("ticket"),
                                          mid if isinstance(mid, str) else None)
            self.resumes += 1
            answer = ch.result(message.get("id"), result=outcome)
        except AccelmigError as exc:
            answer = ch.result(message.get("id"), ok=False, error=exc.to_wire())
        conn.send(answer)

    def _prove(self, message: dict) -> dict:
        """The agent asks, for a host, the proof that binds this session to
        this guest's domain (``wire.attestation``): made with the session's
        secret, for the domain this driver itself reads (SMBIOS, or what the
        application said at open) and no other."""
        try:
            host = message.get("host")
            if not isinstance(host, str) or not 0 < len(host) <= 256:
                raise BadRequest(reason="prove: host must be the asking host's name")
            challenges = att.parse_challenges(message.get("challenges"))
            session = self.session
            domain = session.domain or domain_of_this_guest(self.path)
            if domain is None:
                raise Conflict(reason=f"session {session.sid}: this guest has no SMBIOS system UUID, so the "
                                      f"driver cannot say which domain it proves the session for")
            challenge = challenges.get(session.pool_instance or "")
            if challenge is None:
                raise Conflict(reason=f"session {session.sid}: no challenge of its pool instance "
                                      f"{session.pool_instance} (a node it does not live on asked)")
            proof = att.bind_proof(session.secret, challenge=challenge, instance=session.pool_instance,
                                   host=host, domain=domain, sid=session.sid)
            return ch.result(message.get("id"), result={"sid": session.sid, "domain": domain, "proof": proof})
        except AccelmigError as exc:
            return ch.result(message.get("id"), ok=False, error=exc.to_wire())

    def stop(self) -> None:
        self._stop.set()
        conn = self._conn
        if conn is not None:
            try:
                conn.send({"type": "unregister", "id": conn.next_id(), "sid": self.session.sid})
            except AccelmigError:
                pass                  # already gone: closing says the same
            conn.close()
