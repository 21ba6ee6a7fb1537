"""How hostd reaches the guest agent of a domain: one interface, two ways.

- ``ChannelDelivery``: the accelmig virtio-serial channel
  (``org.accelmig.agent.0``), whose socket libvirt makes per domain and only
  hostd opens (a QEMU chardev serves one client).  It can connect before the
  guest runs (the destination's early connection), it tells the guest where
  the pool is at first contact, and the agent reports its sessions on it
  (``hello``, ``session_opened``) — hostd has them proven on the same
  channel and attests them to the pool as they come (``hostd.attestation``).
- ``GuestExecDelivery``: a VM with only qemu-guest-agent (a Nova-built VM):
  ``accelmig-agent rehome --stdin`` and ``accelmig-agent status`` run in the
  guest through ``guest-exec`` (libvirt marks the domain tainted: logged).
  The agent cannot report its sessions by itself here: its drivers prove
  them through ``accelmig-agent prove --stdin`` when the pool says the
  domain has sessions waiting to be attested.  These calls block for up to seconds each: they run on a
  bounded executor of their own, so a few such VMs in an evacuation never
  stall hostd's event handling.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import logging
import time

from accelmig.plugin.channel import AsyncGuestChannel
from accelmig.wire import channel as ch
from accelmig.wire.errors import AccelmigError, Timeout, Unavailable

LOG = logging.getLogger("accelmig.hostd")


class GuestDelivery(abc.ABC):
    #: shown in ``accelmig status``
    name: str
    #: the guest's sessions must be proven (and attested) when a migration
    #: completes, where some claim the domain unattested: its guest reports nothing by itself
    attests_at_migration = False
    #: when (hostd's clock) the last rehome left for the guest: the start of
    #: the round trip that carries the guest's clock (the timeline)
    rehome_sent: float | None = None

    async def preconnect(self, dom, watch) -> None:
        """Destination, before the guest runs (nothing by default)."""

    async def first_contact(self, dom, watch, identity) -> None:
        """A domain found running here: tell its agent where the pool is."""

    async def prove(self, dom, watch, request: dict) -> dict:
        """The guest's drivers' binding proofs (``wire.attestation``'s
        ``prove``): ``{proofs, refused, next}``."""
        raise Unavailable(what=f"the guest of {watch.name}",
                          reason="it has neither the accelmig channel nor qemu-guest-agent")

    @abc.abstractmethod
    async def rehome(self, dom, watch, document: dict) -> dict:
        """Deliver a rehome; the agent's outcome (``{"ok", "sessions", ...}``)."""

    async def close(self, watch) -> None:
        """Stop talking to this guest (it left, or switched over)."""


class ChannelDelivery(GuestDelivery):
    name = "channel"

    def __init__(self, *, inspect, on_event, timeout: float):
        self._inspect = inspect          # coroutine (dom, watch): refreshes watch.channel_path
        self._on_event = on_event        # (watch, message): the agent's unsolicited messages
        self.timeout = timeout
        self.channel: AsyncGuestChannel | None = None
        self._connecting: asyncio.Future | None = None

    async def preconnect(self, dom, watch) -> None:
        try:
            await self._synced(dom, watch, self.timeout)
        except AccelmigError as exc:
            LOG.info("domain %s: early channel connection failed (%s); retrying at resume", watch.name, exc)

    async def first_contact(self, dom, watch, identity) -> None:
        fresh = self.channel is None or self.channel.hello is None
        channel = await self._synced(dom, watch, 15.0)
        if fresh:
            await channel.request("identity", identity=identity.to_wire(), timeout=10)

    async def rehome(self, dom, watch, document: dict) -> dict:
        deadline = time.monotonic() + self.timeout
        last_error = None
        # No line grows with the number of sessions: tickets that do not fit
        # in one go first, in pieces the agent stages (wire.channel)
        pieces, document = ch.rehome_pieces(document)
        while time.monotonic() < deadline:
            try:
                channel = await self._synced(dom, watch, max(1.0, deadline - time.monotonic()))
                for piece in pieces:
                    await channel.request("tickets", timeout=max(1.0, deadline - time.monotonic()), **piece)
                self.rehome_sent = time.time()
                return await channel.request("rehome", timeout=max(1.0, deadline - time.monotonic()),
                                             **document)
            except AccelmigError as exc:
                # The rehome is idempotent per migration id: trying again is safe.
                last_error = exc
                LOG.warning("domain %s: rehome delivery failed (%s); retrying", watch.name, exc)
                await self.close(watch)
                await asyncio.sleep(0.2)
        raise Timeout(what=f"the rehome of {watch.name} over its channel ({last_error})",
                      timeout=self.timeout)

    async def prove(self, dom, watch, request: dict) -> dict:
        # the channel the guest's report came on (reconnected only where the domain is known)
        if self.channel is not None and self.channel.hello is not None:
            channel = self.channel
        elif dom is not None:
            channel = await self._synced(dom, watch, 15.0)
        else:
            raise Unavailable(what=f"the accelmig channel of {watch.name}", reason="not connected")
        return await channel.request("prove", timeout=20.0, **request)

    async def close(self, watch) -> None:
        channel, self.channel = self.channel, None
        if channel is not None:
            await channel.close()

    async def _synced(self, dom, watch, sync_timeout: float) -> AsyncGuestChannel:
        """The synced channel: the one being connected already (the
        destination's early connection), or a new one."""
        if self.channel is not None and self.channel.hello is not None:
            return self.channel
        connecting = self._connecting
        if connecting is not None and not connecting.done():
            try:
                return await asyncio.shield(connecting)
            except AccelmigError:
                pass        # it failed: make our own below
        self._connecting = asyncio.ensure_future(self._connect(dom, watch, sync_timeout))
        return await asyncio.shield(self._connecting)

    async def _connect(self, dom, watch, sync_timeout: float) -> AsyncGuestChannel:
        await self.close(watch)
        await self._inspect(dom, watch)       # its path changes with every incoming migration
        if not watch.channel_path:
            raise Unavailable(what=f"the accelmig channel of {watch.name}", reason="no socket path in the live XML")
        channel = AsyncGuestChannel(watch.channel_path, on_event=lambda m: self._on_event(watch, m))
        self.channel = channel
        try:
            hello = await channel.connect(connect_timeout=5.0, sync_timeout=sync_timeout)
        except AccelmigError:
            await self.close(watch)
            raise
        LOG.info("domain %s: agent %s synced on %s, %d session(s)", watch.name, hello.get("agent_version"),
                 watch.channel_path, len(hello.get("sessions") or []), extra={"domain": watch.name})
        return channel


class GuestExecDelivery(GuestDelivery):
    name = "guest-exec"
    attests_at_migration = True

    def __init__(self, *, executor: concurrent.futures.Executor, timeout: float, command):
        self._executor = executor
        self.timeout = timeout
        self.command = tuple(command)

    async def prove(self, dom, watch, request: dict) -> dict:
        from accelmig.plugin import qga
        return await self._qga(lambda: qga.agent_prove(dom, request, command=self.command, timeout=15.0))

    async def rehome(self, dom, watch, document: dict) -> dict:
        from accelmig.plugin import qga
        LOG.warning("domain %s has no accelmig channel: rehoming through qemu-guest-agent guest-exec "
                    "(libvirt marks the domain tainted: custom-ga-command)", watch.name)
        self.rehome_sent = time.time()
        return await self._qga(lambda: qga.deliver_rehome(dom, document, command=self.command,
                                                          timeout=self.timeout))

    async def _qga(self, call):
        """A blocking qemu-guest-agent call on this delivery's own threads,
        retried while qemu-ga is not connected yet (right after a migration
        libvirt sees it tens of milliseconds after the guest resumed)."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return await loop.run_in_executor(self._executor, call)
            except AccelmigError as exc:
                if not exc.retriable or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)


class NoDelivery(GuestDelivery):
    """A domain whose guest hostd cannot reach (neither channel nor qemu-ga)."""

    name = None

    async def rehome(self, dom, watch, document: dict) -> dict:
        raise Unavailable(what=f"the guest of {watch.name}",
                          reason="it has neither the accelmig channel nor qemu-guest-agent")
