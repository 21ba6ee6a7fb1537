"""hostd's one libvirt connection, in the manner of nova's ``host.py``.

``LibvirtSession`` holds the host daemon's single libvirt connection on
asyncio (libvirtaio, registered before the connection opens): it opens the
connection with keepalive, registers the domain event callbacks, notices
when the connection closes (the daemon restarted or died), reconnects with
backoff and registers the callbacks again, and tells its owner each time it
is connected again so the owner can reconcile (libvirt replays no events).
Reconnection is handled here and nowhere else.

Lifecycle events reach the owner as typed ``DomainEvent``s, made here once.
``call()`` runs a libvirt API call on this session's own threads (never the
loop's default executor, which the rest of hostd shares) and turns a
``libvirtError`` into an ``accelmig.wire.errors.LibvirtFailure`` with a
``kind``: no-domain, connection, invalid-state, agent, other.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading

import libvirt

from accelmig.plugin.hostd.events import DomainEvent
from accelmig.wire.errors import LibvirtFailure

LOG = logging.getLogger(__name__)

_KINDS = {
    "no-domain": {"VIR_ERR_NO_DOMAIN"},
    "connection": {"VIR_ERR_NO_CONNECT", "VIR_ERR_SYSTEM_ERROR", "VIR_ERR_RPC", "VIR_ERR_AUTH_FAILED",
                   "VIR_ERR_INVALID_CONN"},
    "invalid-state": {"VIR_ERR_OPERATION_INVALID", "VIR_ERR_OPERATION_FAILED"},
    "agent": {"VIR_ERR_AGENT_UNRESPONSIVE", "VIR_ERR_AGENT_UNSYNCED", "VIR_ERR_AGENT_COMMAND_TIMEOUT",
              "VIR_ERR_AGENT_COMMAND_FAILED"},
    "unsupported": {"VIR_ERR_OPERATION_UNSUPPORTED", "VIR_ERR_NO_SUPPORT", "VIR_ERR_ARGUMENT_UNSUPPORTED"},
}
_CODE_KIND = {getattr(libvirt, name): kind for kind, names in _KINDS.items() for name in names
              if hasattr(libvirt, name)}


def classify(exc: libvirt.libvirtError) -> LibvirtFailure:
    code = exc.get_error_code()
    kind = _CODE_KIND.get(code, "other")
    return LibvirtFailure(what=exc.get_error_message() or str(exc), kind=kind,
                          details={"kind": kind, "libvirt_code": code})


_EVENT_LOOP: asyncio.AbstractEventLoop | None = None
_EVENT_LOCK = threading.Lock()


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's libvirt event loop.

    libvirt takes one event implementation per process, registered before
    any connection opens, for good: libvirtaio bound to one asyncio loop.
    That loop runs on a thread of its own, so any number of sessions, on any
    loops (tests run several daemons in one process), get their events;
    each session hands them on to its own loop.
    """
    global _EVENT_LOOP
    with _EVENT_LOCK:
        if _EVENT_LOOP is None:
            # libvirt-python prints every error to stderr by default; ours are
            # raised (classified) and logged where they matter.
            libvirt.registerErrorHandler(lambda ctx, err: None, None)
            import libvirtaio
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def heartbeat():
                # libvirtaio is not thread-safe: a timer or handle that libvirt
                # arms from another thread (an API call in an executor, an
                # in-process driver) is only noticed when this loop wakes up.
                # Wake it often, so an event waits 50 ms at most.
                loop.call_later(0.05, heartbeat)

            def run():
                asyncio.set_event_loop(loop)
                libvirtaio.virEventRegisterAsyncIOImpl(loop=loop)
                loop.call_soon(ready.set)
                loop.call_soon(heartbeat)
                loop.run_forever()

            threading.Thread(target=run, name="libvirt-events", daemon=True).start()
            ready.wait()
            _EVENT_LOOP = loop
        return _EVENT_LOOP


class LibvirtSession:
    """The daemon's one libvirt connection.

    ``on_lifecycle(dom, DomainEvent)`` and ``on_job_completed(dom, stats)``
    are called on the event loop; ``on_connected()`` (a coroutine function)
    after every (re)connection, callbacks already registered.
    """

    #: libvirt calls in flight at once (XMLDesc, job stats, lookups): bounded,
    #: and apart from the default executor
    THREADS = 4

    def __init__(self, uri: str, *, on_lifecycle, on_job_completed=None, on_connected=None,
                 keepalive: tuple[int, int] = (5, 3)):
        self.uri = uri
        self.on_lifecycle = on_lifecycle
        self.on_job_completed = on_job_completed
        self.on_connected = on_connected
        self.keepalive = keepalive
        self.conn: libvirt.virConnect | None = None
        self.connected = asyncio.Event()
        self.reconnects = 0
        self._closed = asyncio.Event()
        self._stop = False
        self._callback_ids: list[int] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(self.THREADS, thread_name_prefix="libvirt-call")
        self.calls: collections.Counter = collections.Counter()   # API calls made, by name

    async def run(self) -> None:
        """Connect, and connect again whenever the connection goes."""
        self._loop = asyncio.get_running_loop()
        event_loop()                       # before the first connection opens
        backoff = 0.2
        while not self._stop:
            try:
                await self._open()
            except LibvirtFailure as exc:
                LOG.warning("libvirt at %s: %s; retrying in %.1f s", self.uri, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.2
            if self.on_connected is not None:
                try:
                    await self.on_connected()
                except Exception:
                    LOG.exception("reconciliation after connecting to libvirt failed")
            await self._closed.wait()
            self._teardown()
            if not self._stop:
                self.reconnects += 1
                LOG.warning("libvirt connection to %s closed; reconnecting", self.uri)

    async def _open(self) -> None:
        self._closed.clear()
        try:
            conn = await asyncio.get_running_loop().run_in_executor(self._executor, libvirt.open, self.uri)
        except libvirt.libvirtError as exc:
            raise classify(exc) from None
        if conn is None:
            raise LibvirtFailure(what=f"libvirt.open({self.uri!r}) returned nothing", kind="connection")
        try:
            try:
                conn.setKeepAlive(*self.keepalive)   # notice a dead daemon within seconds
            except libvirt.libvirtError as exc:
                if classify(exc).kind != "unsupported":   # in-process drivers have none
                    raise
            conn.registerCloseCallback(self._on_close, None)
            self._callback_ids = [conn.domainEventRegisterAny(
                None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE, self._lifecycle, None)]
            if self.on_job_completed is not None:
                self._callback_ids.append(conn.domainEventRegisterAny(
                    None, libvirt.VIR_DOMAIN_EVENT_ID_JOB_COMPLETED, self._job_completed, None))
        except libvirt.libvirtError as exc:
            try:
                conn.close()
            except libvirt.libvirtError:
                pass
            raise classify(exc) from None
        self.conn = conn
        self.connected.set()
        LOG.info("connected to libvirt at %s (libvirt %s)", self.uri, _version(conn))

    def _on_close(self, conn, reason, opaque) -> None:
        self.connected.clear()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._closed.set)

    def _teardown(self) -> None:
        conn, self.conn = self.conn, None
        self.connected.clear()
        if conn is None:
            return
        for cid in self._callback_ids:
            try:
                conn.domainEventDeregisterAny(cid)
            except libvirt.libvirtError:
                pass
        self._callback_ids = []
        try:
            conn.unregisterCloseCallback()
        except libvirt.libvirtError:
            pass
        try:
            conn.close()
        except libvirt.libvirtError:
            pass

    # libvirt calls these on its event loop's thread: hand them to ours, in order.
    def _lifecycle(self, conn, dom, event, detail, opaque) -> None:
        self._loop.call_soon_threadsafe(self._safely, self.on_lifecycle, dom,
                                        DomainEvent.from_libvirt(event, detail))

    def _job_completed(self, conn, dom, params, opaque) -> None:
        self._loop.call_soon_threadsafe(self._safely, self.on_job_completed, dom, params)

    @staticmethod
    def _safely(handler, *args) -> None:
        try:
            handler(*args)
        except Exception:
            LOG.exception("libvirt event handler %s failed", getattr(handler, "__name__", handler))

    async def call(self, fn, *args, timeout: float = 30.0):
        """``fn(*args)`` (a libvirt API call) off the loop, errors classified."""
        self.calls[getattr(fn, "__name__", "?")] += 1
        def run():
            try:
                return fn(*args)
            except libvirt.libvirtError as exc:
                raise classify(exc) from None
        return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(self._executor, run),
                                      timeout)

    async def stop(self) -> None:
        self._stop = True
        self._closed.set()
        await asyncio.sleep(0)
        self._teardown()
        self._executor.shutdown(wait=False, cancel_futures=True)


def _version(conn) -> str:
    try:
        v = conn.getLibVersion()
        return f"{v // 1000000}.{v // 1000 % 1000}.{v % 1000}"
    except libvirt.libvirtError:
        return "?"

