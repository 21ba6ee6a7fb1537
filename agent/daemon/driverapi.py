"""What a process of the guest may ask the agent on its local socket
(``/run/accelmig/agent.sock``): one dispatch table over
``wire.channel.DRIVER_TYPES``.

Drivers ``register`` and ``unregister`` their sessions, ask ``where`` the
pool is and answer the agent's own requests (``result``); anyone asks for
``status`` (a user sees only its own sessions).  What qemu-guest-agent's
guest-exec relays as root's ``accelmig-agent`` (``tickets``,
``rehome_local``, ``prove_local``) is root's only.

Any process of the guest may connect (the socket is mode 0666): each field
it sends is checked for its type (``accelmig.wire.values``) before it is
used or kept; a wrong one is answered ``BAD_REQUEST`` (a ``result`` with a
wrong id, which cannot be answered, is dropped with its reason), and the
rest of the same read is still handled.
"""

from __future__ import annotations

import time

from accelmig.agent.daemon.drivers import LOG, MAX_SID, DriverLink, DriverRegistry, DriverState, driver_reply
from accelmig.agent.daemon.hostchannel import answer_later
from accelmig.runtime.dispatch import Dispatch
from accelmig.wire import attestation as att
from accelmig.wire import channel as ch
from accelmig.wire.errors import AccelmigError, BadRequest, Forbidden, InternalError
from accelmig.wire.values import describe, is_int

#: the longest ``endpoint`` a client may register with a session (a longer ``name`` is cut to it)
MAX_FIELD = 1024
MAX_EPOCH = 2**63 - 1


def sid_of(message: dict, kind: str) -> str:
    sid = message.get("sid")
    if not isinstance(sid, str) or not 1 <= len(sid) <= MAX_SID:
        raise BadRequest(reason=f"{kind}: sid must be a string of 1 to {MAX_SID} characters, not {describe(sid)}")
    return sid


def _optional_text(message: dict, key: str, kind: str, cut: bool = False):
    value = message.get(key)
    if isinstance(value, str) and cut:
        return value[:MAX_FIELD]
    if value is not None and (not isinstance(value, str) or len(value) > MAX_FIELD):
        raise BadRequest(reason=f"{kind}: {key} must be a string of at most {MAX_FIELD} characters or null, "
                                f"not {describe(value)}")
    return value


class DriverApi:
    """Answers what the guest's processes send.  ``agent`` answers what is
    not the registry's: the identity and domain (``where``), ``status``,
    ``stage_tickets``, ``rehome_answer``, ``prove``."""

    on_request = Dispatch("a request on the agent's local socket", ch.DRIVER_TYPES)

    def __init__(self, agent, registry: DriverRegistry):
        self.agent = agent
        self.registry = registry

    def read(self, link: DriverLink) -> None:
        """The poll thread: what ``link`` sent, each message answered."""
        try:
            data = link.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.registry.drop(link)
            return
        for message in link.parser.feed(data):
            try:
                answer = self.on_request.call(self, message.get("type"), link, message)
                if answer is not None:
                    link.send(ch.result(message.get("id"), result=answer))
            except AccelmigError as exc:
                self._answer(link, ch.result(message.get("id"), ok=False, error=exc.to_wire()))
            except OSError as exc:       # the driver went away, or does not read
                (LOG.warning if link.state is DriverState.OVERFLOWED else LOG.info)(
                    "driver %s dropped: %s", link.who, exc)
                self.registry.drop(link)
                return
            except Exception as exc:     # a bug costs only its message: the rest of the read is handled
                LOG.exception("driver %s: handling a %s failed", link.who, message.get("type"))
                self._answer(link, ch.result(message.get("id"), ok=False, error=InternalError(
                    reason=f"{type(exc).__name__} handling a {message.get('type')}").to_wire()))

    @staticmethod
    def _answer(link: DriverLink, answer: dict) -> None:
        try:
            link.send(answer)
        except OSError:
            pass

    # Each row returns its answer's result (None: answered later, or not at all).
    @on_request("register")
    def _register(self, link: DriverLink, message: dict):
        # every field is checked before any is used or kept (any process of the guest may send this)
        sid = sid_of(message, "register")
        # (the name is a label only: a long one is cut, not refused)
        info = {"endpoint": _optional_text(message, "endpoint", "register"),
                "name": _optional_text(message, "name", "register", cut=True)}
        epoch = message.get("epoch")
        if epoch is not None and not is_int(epoch, 0, MAX_EPOCH):
            raise BadRequest(reason=f"register: epoch must be an integer from 0 to 2**63-1 or null, "
                                    f"not {describe(epoch)}")
        info["epoch"] = epoch
        info["pid"] = link.peer_pid          # the kernel's word, not the message's
        info["uid"] = link.peer_uid
        self.registry.register(link, sid, info)
        return {"registered": sid}

    @on_request("unregister")
    def _unregister(self, link: DriverLink, message: dict):
        sid = sid_of(message, "unregister")
        self.registry.unregister(link, sid)
        return {"unregistered": sid}

    @on_request("where")
    def _where(self, link: DriverLink, message: dict):
        identity = self.agent.identity
        return {"endpoint": identity.pool_endpoint if identity else None,
                "identity": identity.to_wire() if identity else None, "domain": self.agent.domain}

    @on_request("result")
    def _result(self, link: DriverLink, message: dict):
        request_id = message.get("id")
        if not is_int(request_id):
            # an answer to nothing the agent asked: nothing to answer either
            link.parser.drop(f"a result from {link.who} whose id is {describe(request_id)}, "
                             f"not the id of a request of the agent's")
            return None
        ask = link.pending.pop(request_id, None)
        if ask is not None:
            ask.settle(driver_reply(message))
        return None

    @on_request("status")
    def _status(self, link: DriverLink, message: dict):
        return self.agent.status(link.peer_uid if link.peer_uid is not None else -1, after=message.get("after"))

    @on_request("tickets")
    def _tickets(self, link: DriverLink, message: dict):
        # the pieces of a big rehome_local (accelmig-agent rehome --stdin): root only, as it
        if not link.privileged:
            raise Forbidden(who=link.who, what="stage the tickets of a rehome (root only)")
        return self.agent.stage_tickets(message)

    @on_request("rehome_local")
    def _rehome_local(self, link: DriverLink, message: dict):
        # accelmig-agent rehome --stdin, relayed from qemu-guest-agent's
        # guest-exec (which runs as root).  It re-addresses the NIC, moves
        # the default route and hands out tickets: root only.
        if not link.privileged:
            raise Forbidden(who=link.who, what="rehome this guest (root only)")
        document = message.get("document")
        if not isinstance(document, dict):
            raise BadRequest(reason=f"rehome_local: document must be a rehome document (an object), "
                                    f"not {describe(document)}")
        answer_later(link.send, message.get("id"), self.agent.rehome_answer, document, time.time(),
                     what="a local rehome")
        return None

    @on_request("prove_local")
    def _prove_local(self, link: DriverLink, message: dict):
        # accelmig-agent prove --stdin, relayed from qemu-guest-agent's guest-exec:
        # the sessions' proofs go to the host that asked, as the channel's prove's
        if not link.privileged:
            raise Forbidden(who=link.who, what="ask this guest's drivers to prove their sessions (root only)")
        request = message.get("request")
        att.parse_prove(request, MAX_SID)       # a bad request is answered at once
        answer_later(link.send, message.get("id"), self.agent.prove, request, what="a local prove")
        return None
