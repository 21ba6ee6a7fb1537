"""A test fixture, not production code: run a real pool on a background
thread of this process, for tests, benchmarks and demos that want a pool
without a second process.  It is the lab's (``accelmig-lab``), so the
pool's distribution ships no test fixture; a deployed pool runs as its own
process (``accelmig-pool``).  ``accelmig.lab.cutproxy`` cuts or holds its
connections.

::

    with PoolThread(tenants={"alice": ("alice-token-1", "1GiB")}) as pool:
        dev = connect(pool.endpoint, "alice-token-1")
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import tempfile
import threading

from accelmig.pool.config import HostSpec, PoolConfig, TenantSpec, parse_size, parse_networks


class PoolThread:
    def __init__(self, tenants: dict | None = None, hosts: dict | None = None, *,
                 listen: str = "127.0.0.1:0", control_listen: str = "127.0.0.1:0",
                 device: str = "", backend=None, data_versions: tuple | None = None, **config):
        tenants = tenants or {"tenant": ("tenant-token-0001", "4GiB")}
        # (token, quota) or (token, quota, max_sessions)
        self.tenant_specs = {name: TenantSpec(name, spec[0], parse_size(spec[1]), *spec[2:])
                             for name, spec in tenants.items()}
        self.host_specs = {}
        for name, value in (hosts or {}).items():
            secret, addresses = (value, []) if isinstance(value, str) else value
            self.host_specs[name] = HostSpec(name, secret.encode(), parse_networks(addresses, "harness"))
        self._tmp = tempfile.mkdtemp(prefix="accelmig-pool-")
        config.setdefault("admin_socket", os.path.join(self._tmp, "admin.sock"))
        config.setdefault("log_format", "text")
        # plain TCP unless the caller gives the pool a certificate (tls_cert=...)
        config.setdefault("insecure", not config.get("tls_cert"))
        self.config = PoolConfig(listen=listen, control_listen=control_listen, device=device, **config)
        self._backend = backend
        # the data-plane versions the pool agrees to: (1,) stands for a pool
        # from before launch batches (wire.batch)
        self.data_versions = data_versions
        self.pool = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "PoolThread":
        from accelmig.pool.devices import devices_for
        from accelmig.pool.listeners import PoolServer
        from accelmig.pool.state import Pool
        os.makedirs(self._tmp, exist_ok=True)      # again after a stop (restart)
        self._own_backend = self._backend is None
        if self._own_backend:
            self._backend = devices_for(self.config)     # a DeviceSet: every device it serves
        self.pool = Pool(self.config, self._backend, self.tenant_specs, self.host_specs)
        if self.data_versions is not None:
            self.pool.data_versions = tuple(self.data_versions)
        self.server = PoolServer(self.pool)
        ready = concurrent.futures.Future()
        self.loop = asyncio.new_event_loop()

        def run():
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(self.server.start())
            except BaseException as exc:  # report a failed start to the caller
                ready.set_exception(exc)
                return
            ready.set_result(True)
            self.loop.run_forever()

        self._thread = threading.Thread(target=run, name="pool-loop", daemon=True)
        self._thread.start()
        ready.result(timeout=30)
        return self

    def call(self, fn, *args, timeout: float = 10):
        """Run ``fn(*args)`` on the pool's loop (its state is only safe there)."""
        future = concurrent.futures.Future()

        def run():
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

        self.loop.call_soon_threadsafe(run)
        return future.result(timeout)

    def stop(self) -> None:
        if self.loop is None or self.pool is None:
            return
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
        self.loop = None
        if self._own_backend:            # its device processes too
            self._backend.close()
            self._backend = None
        shutil.rmtree(self._tmp, ignore_errors=True)

    def restart(self) -> "PoolThread":
        """Stop and start on the same addresses: a new pool instance, no sessions."""
        data, control = self.server.endpoints["data_all"], self.control_endpoint
        self.stop()
        self.config.listen = ",".join(data)
        if control:
            self.config.control_listen = control
        return self.start()

    @property
    def endpoint(self) -> str:
        return self.server.endpoints["data"]

    @property
    def control_endpoint(self) -> str | None:
        return self.server.endpoints.get("control")

    @property
    def admin_endpoint(self) -> str | None:
        return self.server.endpoints.get("admin")

    @property
    def backend(self):
        """The running pool's first device's backend (its device processes)."""
        return self.pool.devices.devices[0].backend

    def session(self, sid: str) -> dict:
        return self.call(lambda: self.pool.sessions[sid].describe())

    def __enter__(self) -> "PoolThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
