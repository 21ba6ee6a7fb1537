"""``HostDaemon``: hostd's parts put together.

It owns the one libvirt connection (``LibvirtSession``: typed events,
reconnection), the one control-plane client to the pool, the watches of this
host's accelmig domains, and the local API.  A libvirt event becomes a
``Trigger`` (``watch.TRIGGERS``); the domain's watch says which ``Step``
that is in its phase (``watch.TRANSITIONS``); the step is one coroutine of
``MigrationSteps`` or of this class.  Each domain's events are taken one at
a time (its watch's lock); reconciliation takes the same path.

This host's identity towards the pool is discovered when hostd starts and
refreshed with every registration at the pool; a rehome uses it as it is
(no route lookup on the accelerator's blackout path) plus the domain's
guest address lease on a host-bound fabric.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import time

import libvirt

from accelmig.plugin.config import HostConfig
from accelmig.plugin.domain.model import DomainXML
from accelmig.plugin.hostd.api import LocalApi
from accelmig.plugin.hostd.attestation import Attestation
from accelmig.plugin.hostd.delivery import ChannelDelivery, GuestExecDelivery, NoDelivery
from accelmig.plugin.hostd.events import DomainEvent, EventKind
from accelmig.plugin.hostd.libvirt import LibvirtSession
from accelmig.plugin.hostd.metrics import HostMetrics
from accelmig.plugin.hostd.migration import MigrationSteps
from accelmig.plugin.hostd.nodes import PoolNodes
from accelmig.plugin.hostd.reconcile import Reconciler
from accelmig.plugin.hostd.watch import TRIGGERS, DomainWatch, Phase, Step, Trigger, WatchTable
from accelmig.runtime.backoff import FailureLog
from accelmig.runtime.files import atomic_write
from accelmig.wire.control import AsyncControlClient
from accelmig.wire.errors import AccelmigError, ConfigInvalid, LibvirtFailure, Unavailable
from accelmig.wire.identity import HostIdentity
from accelmig.wire.values import is_int

LOG = logging.getLogger("accelmig.hostd")

#: triggers after which the live XML may say something new (the channel's
#: socket path changes with every incoming migration)
_INSPECT = {Trigger.BOOTED, Trigger.ARRIVING, Trigger.RESUMED_HERE, Trigger.RESUMED_POSTCOPY, Trigger.RESTORED}
#: guest-exec deliveries in flight at once (each polls qemu-ga for up to seconds)
GUEST_EXEC_THREADS = 4


class HostDaemon:
    def __init__(self, config: HostConfig, *, rehome_timeout: float = 30.0, renew_interval: float = 3.0,
                 retry_first: float = 0.5, retry_max: float = 10.0, clock=time.time):
        self.config = config
        self.host = config.host_id
        self.rehome_timeout = rehome_timeout
        self.pool = AsyncControlClient(config.pool.control, config.host_id, config.read_secret(),
                                       tls=config.control_tls())
        # in a pool of several nodes, a client per node beside this one (the coordinator)
        self.nodes = PoolNodes(self.pool, lambda endpoint: AsyncControlClient(
            endpoint, self.host, self.pool.secret, tls=self.pool.tls))
        self._tls_files = None if config.pool.insecure else _tls_fingerprint(config)
        if config.pool.insecure:
            LOG.warning("INSECURE: plain TCP to the pool's control plane at %s ([pool] insecure = true "
                        "in %s): tickets and calls cross the network in clear", config.pool.control,
                        config.source, extra={"tls": False})
        self.pool_reachable = False
        # the pool-down warning: once, then "still failing (N times since ...)" ever more rarely
        self.registration = FailureLog(LOG, "pool registration", clock=clock)
        self.identity: HostIdentity | None = None
        self.allocator = None
        if config.fabric.host_bound:
            from accelmig.plugin.addresses import GuestAddressAllocator
            self.allocator = GuestAddressAllocator.for_config(config)
        self.watches = WatchTable()
        # Domains that hold sessions at the pool, marked or not (Nova's are
        # not): uuid -> how many of its sessions wait to be attested, as the
        # pool last said (accel_domains)
        self.accel_domains: dict[str, int] = {}
        self._accel_version: str | None = None
        self._absent: set[str] = set()       # of those, the ones not defined here (looked up once)
        # domain -> the accel_domains version at which its guest was last asked to prove
        # its sessions (asked again when the picture changes)
        self._proven_at: dict[str, str | None] = {}
        self.attestation = Attestation(self)
        # one domain's events, in libvirt's order: handled one after another
        # by a single task per domain (concurrent handlers would reorder them,
        # and each would read a foreign domain's XML before any marked it)
        self._pending_events: dict[str, collections.deque] = {}
        self.migrations = MigrationSteps(self, retry_first=retry_first, retry_max=retry_max)
        self.reconciler = Reconciler(self, renew_interval=renew_interval)
        self.libvirt = LibvirtSession(config.hostd.libvirt_uri, on_lifecycle=self._lifecycle,
                                      on_job_completed=self._job_completed,
                                      on_connected=self.reconciler.reconcile)
        self.api = LocalApi(self)
        self.metrics = HostMetrics(self)
        self.counters = collections.Counter()
        self.started = time.time()
        self._guest_exec = concurrent.futures.ThreadPoolExecutor(GUEST_EXEC_THREADS,
                                                                 thread_name_prefix="guest-exec")
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()
        m = self.migrations
        self._steps = {
            Step.NOTHING: _nothing,
            Step.ATTEST: self.first_contact,
            Step.PRECONNECT: self.prestage,
            Step.CHECK_OUTGOING: lambda dom, w: m.check_outgoing(dom, w, postcopy=False),
            Step.CHECK_OUTGOING_POSTCOPY: lambda dom, w: m.check_outgoing(dom, w, postcopy=True),
            Step.SWITCH_OVER: lambda dom, w: m.switch_over(dom, w, postcopy=False),
            Step.SWITCH_OVER_POSTCOPY: lambda dom, w: m.switch_over(dom, w, postcopy=True),
            Step.REHOME: lambda dom, w: m.rehome(dom, w),
            Step.REHOME_POSTCOPY: lambda dom, w: m.rehome(dom, w, postcopy=True),
            Step.ABORT_STAYED: m.abort_stayed,
            Step.CLOSE: m.close,
            Step.ABORT_ARRIVAL: m.abort_arrival,
            Step.PARK: m.park,
            Step.UNPARK: m.unpark,
            Step.FORGET: lambda dom, w: w.delivery.close(w),
        }

    # -- lifecycle ---------------------------------------------------------------------
    async def run(self) -> None:
        await self.api.server.start()          # first: a second hostd stops here, having touched nothing
        if self.config.hostd.metrics_listen:
            from prometheus_client import start_http_server
            from accelmig.wire.dataplane import parse_endpoint
            host, port = parse_endpoint(self.config.hostd.metrics_listen, listen=True)
            start_http_server(port, addr=host, registry=self.metrics.registry)
        LOG.info("hostd for host %s: libvirt %s, pool %s, local API %s", self.host,
                 self.config.hostd.libvirt_uri, self.config.pool.control, self.config.hostd.socket)
        self.spawn(self._register_loop(), "register")
        self.spawn(self.libvirt.run(), "libvirt")
        self.spawn(self.reconciler.renew_loop(), "renew")
        self.spawn(self._attest_loop(), "attest")
        self.spawn(self._accel_domains_loop(), "accel-domains")
        await self._stop.wait()
        await self.shutdown()

    def stop(self) -> None:
        self._stop.set()

    #: what a reload (SIGHUP) applies to the running hostd; ``hostd.hook_timeout``
    #: is read by the hook itself at every run, so it needs no hostd at all
    RELOADABLE = ("pool.secret_file", "pool.ca_file", "pool.cert_file", "pool.key_file", "hostd.strict",
                  "hostd.hook_timeout")

    def reload(self) -> dict:
        """SIGHUP: read host.toml and the secret file again.  The control-plane
        secret (rotated together with the pool's hosts file) and ``[hostd]
        strict`` take effect now, renewed TLS files from the next connection; every other key needs a restart and is
        named in the log; a file that does not load changes nothing."""
        try:
            fresh = HostConfig.load(self.config.source)
            secret = fresh.read_secret()
            # the TLS files too: a renewed certificate often keeps its path
            tls_files = _tls_fingerprint(fresh) if not fresh.pool.insecure else None
            tls_context = fresh.control_tls() if tls_files != self._tls_files else None
        except ConfigInvalid as exc:
            LOG.error("reload refused, running on as before: %s", exc, extra={"reload": "refused"})
            return {"refused": str(exc)}
        old, new = _settings(self.config), _settings(fresh)
        restart = [key for key in new if new[key] != old[key] and key not in self.RELOADABLE]
        applied = [f"{key} = {new[key]}" for key in self.RELOADABLE if new[key] != old[key]]
        self.config = dataclasses.replace(
            self.config, pool=dataclasses.replace(self.config.pool, secret_file=fresh.pool.secret_file,
                                                  ca_file=fresh.pool.ca_file, cert_file=fresh.pool.cert_file,
                                                  key_file=fresh.pool.key_file),
            hostd=dataclasses.replace(self.config.hostd, strict=fresh.hostd.strict,
                                      hook_timeout=fresh.hostd.hook_timeout))
        if secret != self.pool.secret:
            self.pool.rekey(secret)
            for client in self.nodes.clients():
                client.rekey(secret)
            applied.append(f"a new control-plane secret from {fresh.pool.secret_file}")
        if tls_context is not None and not self.config.pool.insecure:
            self.pool.tls = tls_context          # the next connection presents and checks these
            for client in self.nodes.clients():
                client.tls = tls_context
            self._tls_files = tls_files
            applied.append("new TLS files (ca_file, cert_file, key_file) for the next connection to the pool")
        summary = "; ".join(filter(None, [
            "applied " + ", ".join(applied) if applied else "",
            "changed but needs a restart of hostd (running with the old values): " + ", ".join(restart)
            if restart else ""])) or "nothing to reload (host.toml and the secret are unchanged)"
        (LOG.warning if restart else LOG.info)("reload of %s: %s", self.config.source, summary,
                                               extra={"reload": "done"})
        return {"applied": applied, "restart": restart}

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for watch in self.watches:
            await watch.delivery.close(watch)
        await self.libvirt.stop()
        await self.api.server.close()
        await self.nodes.close()
        await self.pool.close()
        self._guest_exec.shutdown(wait=False, cancel_futures=True)
        LOG.info("hostd stopped")

    def spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            LOG.error("task %s failed: %r", task.get_name(), task.exception(), exc_info=task.exception())

    async def pool_call(self, method: str, **args):
        return await self._pool(self.nodes.call, method, args)

    async def pool_call_all(self, method: str, **args):
        """A paged method with all its pages (``wire.control.PAGED``)."""
        return await self._pool(self.nodes.call_all, method, args)

    async def node_call(self, client, method: str, **args):
        """One call to one node of the pool (``nodes.every``, ``nodes.node_for_sid``)."""
        return await self._pool(client.call, method, args)

    async def _pool(self, call, method: str, args: dict):
        """One call to the pool, counted; its outcome says whether the pool is reachable."""
        self.metrics.record_steps.labels(method).inc()
        try:
            result = await call(method, **args)
        except Unavailable:
            self.pool_reachable = False
            raise
        self.pool_reachable = True
        return result

    # -- this host's identity ------------------------------------------------------------
    async def refresh_identity(self) -> HostIdentity:
        from accelmig.plugin.routes import host_identity
        self.identity = await asyncio.get_running_loop().run_in_executor(
            None, lambda: host_identity(self.config))
        return self.identity

    async def prestage(self, dom, watch: DomainWatch) -> None:
        """Destination, the incoming QEMU exists and the guest is still
        paused: make ready now what the rehome needs and can already know —
        this host's identity for the guest, and the channel's connection —
        so neither lies on the accelerator's blackout path.  The connection
        syncs only once the guest runs: it goes on in the background, never
        holding up the domain's next event (its RESUMED, which the rehome's
        delivery then awaits on the same connection)."""
        try:
            watch.staged_identity = await self.identity_for(watch)
        except AccelmigError as exc:
            LOG.info("domain %s: identity not staged (%s); taken at the rehome", watch.name, exc)
        self.spawn(watch.delivery.preconnect(dom, watch), f"preconnect:{watch.name}")

    async def identity_for(self, watch: DomainWatch, *, spare: bool = False) -> HostIdentity:
        """What the guest of ``watch`` is told: this host's identity, with
        its fabric NIC's address on a host-bound fabric (never for a domain
        nobody marked: Neutron owns its NICs and their addresses).
        ``spare``: the domain's second address (``rehome_here``)."""
        identity = self.identity or await self.refresh_identity()
        if self.allocator is None or not watch.marked:
            return identity
        from accelmig.plugin.addresses import guest_nic, spare_key
        key = spare_key(watch.uuid) if spare else watch.uuid
        address = await asyncio.get_running_loop().run_in_executor(None, self.allocator.allocate, key)
        return dataclasses.replace(identity, guest_nic=guest_nic(self.config.fabric, address, watch.fabric_mac))

    async def _register_loop(self) -> None:
        """Register this host's identity and addresses at the pool, and again
        whenever the pool restarted (a new instance forgot them).  While the
        pool is down it tries every 2 s; the warning backs off (``FailureLog``).
        The identity is refreshed here, never on a rehome's path: every 10 s,
        and at once when the kernel says a link, address or route changed."""
        registered_for = None
        changed = asyncio.Event()
        watch = self._watch_routes(changed)
        try:
            await self._register_forever(changed, registered_for)
        finally:
            if watch is not None:
                asyncio.get_running_loop().remove_reader(watch.fileno())
                watch.close()

    def _watch_routes(self, changed: asyncio.Event):
        from accelmig.plugin.routes import RouteChanges
        try:
            watch = RouteChanges()
        except Unavailable as exc:
            LOG.warning("no route change notifications (%s): the identity is refreshed every 10 s only", exc)
            return None
        asyncio.get_running_loop().add_reader(watch.fileno(), lambda: watch.drain() and changed.set())
        return watch

    async def _register_forever(self, changed: asyncio.Event, registered_for) -> None:
        while True:
            try:
                identity = await self.refresh_identity()
                addresses = [self.config.fabric.guest_subnet] if self.config.fabric.guest_subnet else []
                if identity.host_address:
                    addresses.append(f"{identity.host_address}/{32 if ':' not in identity.host_address else 128}")
                await self.pool_call("ping")
                await self._follow_nodes()
                # every node attributes this host's guests' connections: registered at each,
                # again when one restarted or joined
                wanted = (self.pool.instance, self.nodes.instances())
                if registered_for != wanted:
                    await self.pool_call("register_host", addresses=[str(a) for a in addresses],
                                         identity=identity.to_wire())
                    registered_for = wanted
                    LOG.info("registered at pool %s: %s", registered_for[0], ", ".join(map(str, addresses)))
                self.registration.ok()
            except AccelmigError as exc:
                self.registration.failed(exc)
                registered_for = None
            try:                # until the next round, or a route change (then refresh at once)
                await asyncio.wait_for(changed.wait(), 2.0 if registered_for is None else 10.0)
                LOG.info("a link, address or route changed: refreshing this host's identity")
            except asyncio.TimeoutError:
                pass
            changed.clear()

    async def _follow_nodes(self) -> None:
        """Which nodes the pool has (one, unless it is a cluster): off every migration's path."""
        try:
            await self.nodes.refresh()
        except AccelmigError as exc:
            LOG.warning("the pool's nodes could not be listed (keeping %s): %s",
                        ", ".join(sorted(self.nodes.nodes)) or "the coordinator alone", exc)

    # -- libvirt events ----------------------------------------------------------------
    #: events queued for one domain before the oldest are dropped (and the
    #: domain looked at afresh by the next reconcile): a bound on memory
    EVENT_BACKLOG = 1024

    def _lifecycle(self, dom, event: DomainEvent) -> None:
        uuid = dom.UUIDString()
        queue = self._pending_events.get(uuid)
        if queue is not None:
            if len(queue) >= self.EVENT_BACKLOG:
                dropped = queue.popleft()
                LOG.warning("domain %s: %d events queued; dropped %s", dom.name(), len(queue) + 1,
                            dropped[1].value)
            queue.append((dom, event, time.time()))
            return
        queue = self._pending_events[uuid] = collections.deque([(dom, event, time.time())])
        self.spawn(self._drain_events(uuid, queue), f"events:{dom.name()}")

    async def _drain_events(self, uuid: str, queue: collections.deque) -> None:
        try:
            while queue:
                dom, event, seen = queue.popleft()
                try:
                    await self._on_event(dom, event, seen)
                except Exception:                    # one bad event must not stall the domain's next
                    LOG.exception("domain %s: handling %s failed", dom.name(), event.value)
        finally:
            if self._pending_events.get(uuid) is queue:
                del self._pending_events[uuid]

    def _job_completed(self, dom, params: dict) -> None:
        uuid = dom.UUIDString()
        if self.watches.is_foreign(uuid):
            return
        stats = {k: v for k, v in params.items() if isinstance(v, (int, float, str))}
        self.watches.note_job(uuid, stats)
        LOG.info("domain %s: job completed (downtime %s ms)", dom.name(), params.get("downtime"),
                 extra={"domain": dom.name(), "downtime_ms": params.get("downtime")})

    async def _on_event(self, dom, event: DomainEvent, seen: float | None = None) -> None:
        uuid = dom.UUIDString()
        self._absent.discard(uuid)
        if event.kind in (EventKind.DEFINED, EventKind.UNDEFINED):
            self.watches.forget_foreign(uuid)        # its XML changed: look again
        trigger = TRIGGERS.get(event)
        if trigger is None:
            return
        watch = await self.watch_of(dom)
        if watch is None:
            if trigger is Trigger.UNDEFINED and not self.watches.is_foreign(uuid):
                await self._release_lease(uuid, dom.name())   # it left earlier; now it is gone for good
            return                                   # not accelmig's, or gone before we looked
        async with watch.lock:
            watch.event_seen[event.value] = seen or time.time()     # (at most one per event kind)
            if trigger in _INSPECT:
                await self.inspect(dom, watch)
            LOG.info("domain %s: %s (%s)", watch.name, event.value, watch.phase.value,
                     extra={"domain": watch.name, "event": event.value})
            self.metrics.events.labels(event.value).inc()
            await self.take(dom, watch, trigger)
            if watch.phase is Phase.GONE and await self.lookup(watch) is False:
                # no longer defined here (transient, undefined, or moved with
                # --undefinesource): its guest address is free again
                await self._release_lease(watch.uuid, watch.name)
        self.watches.evict(watch)

    async def take(self, dom, watch: DomainWatch, trigger: Trigger) -> None:
        """Fire ``trigger`` on the watch and take the step its table names.
        The caller holds the watch's lock."""
        step = watch.fire(trigger)
        if step is None:
            LOG.debug("domain %s: %s does not apply in phase %s", watch.name, trigger.value, watch.phase.value)
            return
        try:
            await self._steps[step](dom, watch)
        except AccelmigError as exc:
            LOG.error("domain %s: %s (%s) failed: %s", watch.name, step.value, trigger.value, exc,
                      extra={"domain": watch.name, "step": step.value})
        # what the guest reported while its domain was not running here (arriving)
        self.attestation.kick(watch)

    async def watch_of(self, dom) -> DomainWatch | None:
        """The domain's watch; made (one ``XMLDesc``) the first time an
        accelmig domain is seen.  A foreign domain is remembered as such."""
        uuid = dom.UUIDString()
        watch = self.watches.get(uuid)
        if watch is not None or self.watches.is_foreign(uuid):
            return watch
        model = await self._live_xml(dom)
        if model is None:
            return None
        if not model.is_accelmig() and uuid not in self.accel_domains:
            self.watches.mark_foreign(uuid)
            return None
        watch = self.watches.add(uuid, dom.name())
        self._apply(watch, model)
        return watch

    async def inspect(self, dom, watch: DomainWatch) -> None:
        model = await self._live_xml(dom)
        if model is not None:
            self._apply(watch, model)

    async def _live_xml(self, dom) -> DomainXML | None:
        try:
            return DomainXML.parse(await self.libvirt.call(dom.XMLDesc, 0, timeout=10))
        except (LibvirtFailure, asyncio.TimeoutError, AccelmigError):
            return None

    def _apply(self, watch: DomainWatch, model: DomainXML) -> None:
        """What the live XML says: how to reach the guest, the fabric NIC."""
        channel = model.agent_channel()
        if channel is not None and channel.path:
            watch.channel_path = channel.path
        kind = "channel" if channel is not None else "guest-exec" if model.has_guest_agent() else None
        if watch.delivery.name != kind:
            if kind == "channel":
                watch.delivery = ChannelDelivery(inspect=self.inspect, on_event=self._on_guest_event,
                                                 timeout=self.rehome_timeout)
            elif kind == "guest-exec":
                watch.delivery = GuestExecDelivery(executor=self._guest_exec, timeout=self.rehome_timeout,
                                                   command=self.config.hostd.guest_exec_command)
            else:
                watch.delivery = NoDelivery()
        token = model.migration_token()
        if token != watch.token:            # (written here, or another host's: it came with the domain)
            watch.token, watch.token_registered = token, False
        watch.marked = model.is_accelmig()
        nic = model.fabric_interface() if watch.marked else None
        watch.fabric_mac = nic.mac if nic is not None else None

    async def lookup(self, watch: DomainWatch):
        """The domain of ``watch``: None when libvirt does not answer, False when it is gone."""
        conn = self.libvirt.conn
        if conn is None:
            return None
        try:
            return await self.libvirt.call(conn.lookupByUUIDString, watch.uuid)
        except LibvirtFailure as exc:
            return False if exc.kind == "no-domain" else None

    # -- the guest's sessions ------------------------------------------------------------
    def _on_guest_event(self, watch: DomainWatch, message: dict) -> None:
        """The agent's reports on the channel: whatever it names is attested
        only with its drivers' proofs (``hostd.attestation``)."""
        kind = message.get("type")
        if kind == "hello":
            sessions = message.get("sessions")
            self.attestation.report(watch, [s.get("sid") for s in sessions if isinstance(s, dict)]
                                    if isinstance(sessions, list) else [], new=False)
        elif kind == "session_opened":
            self.attestation.report(watch, [message.get("sid")], new=True)
        elif kind == "session_closed":
            sid = message.get("sid")
            watch.sessions.discard(sid)
            watch.unattested.pop(sid, None)
            self.spawn(self._unbind(watch, sid), "unbind")

    async def _unbind(self, watch: DomainWatch, sid) -> None:
        try:
            await self.pool_call("unbind_session", sid=sid, domain_uuid=watch.uuid)
        except AccelmigError:
            pass

    async def first_contact(self, dom, watch: DomainWatch) -> None:
        """A domain running here: tell it where the pool is (its sessions are
        attested as the agent reports them)."""
        try:
            await watch.delivery.first_contact(dom, watch, await self.identity_for(watch))
        except AccelmigError as exc:
            LOG.info("domain %s: guest not reachable yet: %s", watch.name, exc)

    async def _attest_loop(self) -> None:
        """Guests running here whose channel is not up yet (they were still booting)."""
        while True:
            await asyncio.sleep(5.0)
            for watch in self.watches:
                channel_down = isinstance(watch.delivery, ChannelDelivery) and \
                    (watch.delivery.channel is None or watch.delivery.channel.hello is None)
                if watch.phase is not Phase.RUNNING or not channel_down or watch.lock.locked():
                    continue
                dom = await self.lookup(watch)
                if dom:
                    self.spawn(self._attest_now(dom, watch), f"attest:{watch.name}")

    async def _attest_now(self, dom, watch: DomainWatch) -> None:
        async with watch.lock:
            if watch.phase is Phase.RUNNING:
                await self.first_contact(dom, watch)

    # -- domains nobody marked: learned from the pool ------------------------------------
    async def _accel_domains_loop(self) -> None:
        while True:
            try:
                await self.follow_accel_domains()
            except AccelmigError as exc:      # the pool is down: the registration loop says so
                LOG.debug("accel_domains: %s", exc)
            await asyncio.sleep(self.config.hostd.accel_domains_interval)

    async def follow_accel_domains(self) -> None:
        """Which domains hold sessions, from the pool: kept for the hook
        (``accel-domains.json``, so it is strict for them even without
        hostd), and each one running here whose sessions wait to be
        attested has its guest prove them (once per picture of the pool's).
        A Nova instance carries nothing of accelmig in its XML; its guest's
        driver told the pool its SMBIOS UUID, and this is how its hosts learn
        it.  Domains without sessions are never looked at."""
        answer = await self.pool_call_all("accel_domains", since=self._accel_version)
        if not answer.get("unchanged"):
            domains = answer.get("domains") or {}
            fresh = {u: n for u, n in domains.items() if isinstance(u, str) and is_int(n)}
            if fresh.keys() != self.accel_domains.keys():
                await asyncio.get_running_loop().run_in_executor(None, self._write_accel_cache, sorted(fresh))
            for uuid in fresh.keys() - self.accel_domains.keys():
                self.watches.forget_foreign(uuid)   # looked at before it held sessions: look again
            self._absent &= fresh.keys()
            self._proven_at = {u: v for u, v in self._proven_at.items() if u in fresh}
            self.accel_domains = fresh
            self._accel_version = answer.get("version")
        for uuid, unattested in self.accel_domains.items():
            watch = self.watches.get(uuid)
            if watch is None:
                if uuid in self._absent or self.libvirt.conn is None:
                    continue
                try:
                    dom = await self.libvirt.call(self.libvirt.conn.lookupByUUIDString, uuid)
                    state, _reason = await self.libvirt.call(dom.state, 0)
                except LibvirtFailure as exc:
                    if exc.kind == "no-domain":
                        self._absent.add(uuid)      # runs elsewhere: an event tells us if it comes
                    continue
                watch = await self.watch_of(dom)
                if watch is None:
                    continue
                if state == libvirt.VIR_DOMAIN_RUNNING:
                    async with watch.lock:
                        await self.take(dom, watch, Trigger.FOUND_RUNNING)
            if watch.phase is not Phase.RUNNING:
                continue
            if unattested and self._proven_at.get(uuid, "") != self._accel_version:
                self._proven_at[uuid] = self._accel_version
                self.spawn(self._prove_all(watch), f"prove:{watch.name}")
            elif watch.sessions and not watch.token_registered:
                self.spawn(self.attestation.ensure_token(watch), f"token:{watch.name}")

    async def _prove_all(self, watch: DomainWatch) -> None:
        try:
            await self.attestation.attest(None, watch, None)
        except AccelmigError as exc:
            LOG.warning("domain %s: its guest's sessions not attested: %s", watch.name, exc,
                        extra={"domain": watch.name})

    def _write_accel_cache(self, uuids: list[str]) -> None:
        """Atomically, readable by the hook (root) and ``accelmig doctor``."""
        path = self.config.hostd.accel_domains_file
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, json.dumps({"host": self.host, "written": time.time(), "domains": uuids}), 0o644)
        LOG.info("%d domain(s) hold accelerator sessions (cached in %s)", len(uuids), path)

    async def _release_lease(self, uuid: str, name: str) -> None:
        if self.allocator is None:
            return
        from accelmig.plugin.addresses import spare_key
        loop = asyncio.get_running_loop()
        address = await loop.run_in_executor(None, self.allocator.release, uuid)
        spare = await loop.run_in_executor(None, self.allocator.release, spare_key(uuid))
        if spare:
            LOG.info("domain %s: its spare guest address %s released", name, spare, extra={"domain": name})
        if address:
            LOG.info("domain %s is no longer defined here: guest address %s released", name, address,
                     extra={"domain": name})


async def _nothing(dom, watch) -> None:
    return None


def _tls_fingerprint(config: HostConfig) -> str | None:
    """A digest of the control plane's TLS files as they are now (None
    when they cannot be read: control_tls then says why)."""
    digest = hashlib.sha256()
    try:
        for path in (config.pool.ca_file, config.pool.cert_file, config.pool.key_file):
            digest.update(path.encode() + b"\0")
            if path:
                with open(path, "rb") as handle:
                    digest.update(handle.read())
    except OSError:
        return None
    return digest.hexdigest()


def _settings(config: HostConfig) -> dict:
    """Every key of a host config, as ``section.key`` -> value (for a reload's diff)."""
    out = {"host.id": config.host_id}
    for section in ("pool", "fabric", "hostd"):
        table = getattr(config, section)
        for field in dataclasses.fields(table):
            out[f"{section}.{field.name}"] = getattr(table, field.name)
    return out
