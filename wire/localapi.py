"""hostd's local API: the contract between hostd and the hook, the CLI and
anyone on the hypervisor host who may open its socket (root: it is 0600).

A unix socket (``[hostd] socket``, default /run/accelmig/hostd.sock), with
the line format of accelmig.wire.channel, one request per connection: a
request ``{"type", "id", ...}`` is answered by ``{"type": "result", "id",
"ok", "result"|"error"}``.

Requests (``accelmig.plugin.hostd.api`` answers them):
  ``ping``                          -> {"host", "pid", "pool": reachable?, "libvirt": connected?}
  ``hook``  op, sub, uuid, name, budget
                                    a gated libvirt hook step (``GATED_HOOK_STEPS``);
                                    answered once hostd has opened the record at
                                    the pool (or pinged it)
  ``status``                        domains watched, records, identity (bounded: per domain
                                    its session count and a few ids; records with counts)
  ``intent`` uuid, policy, dest_host  register an operator's migration intent
  ``wait_rehomed`` uuid, migration_id?, wait
                                    until the pool has every session of that
                                    migration resumed (or the record was aborted);
                                    the record lists its sessions inline while short
  ``sessions`` uuid, cursor?        a page of the pool's sessions of a domain, and
                                    ``next`` (pass it back as ``cursor``)
  ``metrics``                       Prometheus text
  ``rehome_here`` uuid, address?    rehome the guest of a domain that runs here (and no
                                    migration of it) to this host once more: the same
                                    delivery, agent and driver resume as a migration's,
                                    no tickets (each driver resumes at its epoch from
                                    the host it is bound to); ``address`` ``lease`` (the
                                    default) or ``spare`` (the domain's second address:
                                    a real re-addressing of its fabric NIC). The
                                    outcome, and the rehome's steps on hostd's clock
                                    (``timeline``): a warm guest's, for bench/blackout

Standard library only: the hook imports it and must start fast.
"""

from __future__ import annotations

from accelmig.wire.channel import LineClient

DEFAULT_HOSTD_SOCKET = "/run/accelmig/hostd.sock"

#: The hook steps that wait for hostd and may refuse: every other step of
#: every domain exits 0 at once (the installed script does not even start
#: Python for them) and hostd follows it through libvirt's events.
GATED_HOOK_STEPS = frozenset({("migrate", "begin"), ("restore", "begin")})

REQUESTS = frozenset({"ping", "hook", "status", "intent", "wait_rehomed", "sessions", "metrics",
                      "rehome_here"})

#: what ``rehome_here`` may give the guest's fabric NIC
HERE_ADDRESSES = ("lease", "spare")


class LocalClient:
    """Blocking; every call has a deadline (the hook has a time budget) and
    a connection of its own."""

    def __init__(self, path: str = DEFAULT_HOSTD_SOCKET, timeout: float = 3.0):
        self.path = path
        self.timeout = timeout

    def call(self, kind: str, timeout: float | None = None, **fields):
        timeout = self.timeout if timeout is None else timeout
        with LineClient(self.path, timeout=timeout, what=f"hostd at {self.path}", name="hostd") as conn:
            return conn.call(kind, timeout=timeout, **fields)

    def sessions(self, uuid: str, timeout: float | None = None, max_pages: int = 4096) -> list[dict]:
        """Every page of ``sessions`` (one connection each, as every call)."""
        out, cursor = [], None
        for _ in range(max_pages):
            page = self.call("sessions", timeout=timeout, uuid=uuid, cursor=cursor)
            out += page.get("sessions") or []
            cursor = page.get("next")
            if not cursor:
                return out
        return out
