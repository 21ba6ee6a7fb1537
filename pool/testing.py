"""A test fixture, not production code: run a pool on a background thread of
this process (``PoolThread``) and cut or hold its TCP connections on demand
(``CutProxy``), for tests, benchmarks and demos that want a real pool
without a second process.  Nothing in the pool, the driver, the plugin or
the agent imports this module (pool/demo.py, a demo, does); a deployed pool runs as its own process
(``accelmig-pool``).

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

    def session(self, sid: str) -> dict:
        return self.call(lambda: self.pool.sessions[sid].describe())

    def __enter__(self) -> "PoolThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class CutProxy:
    """A TCP relay whose connections can be cut on demand (with a reset), to
    lose a driver's connection for real without touching either end; or
    held (``hold()``: what the client sends waits in the relay until
    ``release()``), to make the far end slow for real.  ``record``: keep
    every byte relayed, both ways, in ``recorded`` (a passive tap).
    ``relayed`` counts the bytes relayed each way (``"up"``: client to
    target, ``"down"``: back); ``cut_after`` arms a cut at an exact byte
    count, to cut in the middle of a transfer without a race."""

    def __init__(self, target: str, listen: str = "127.0.0.1:0", *, record: bool = False):
        import socket
        from accelmig.wire.dataplane import parse_endpoint
        self.target = parse_endpoint(target)
        host, port = parse_endpoint(listen, listen=True)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family)
        bound_host, bound_port = self._listener.getsockname()[:2]
        self.endpoint = f"[{bound_host}]:{bound_port}" if ":" in bound_host else f"{bound_host}:{bound_port}"
        self._pairs: list = []
        self._lock = threading.Lock()
        self.recorded: bytearray | None = bytearray() if record else None
        self.cuts = 0
        self._closed = False
        self._flowing = threading.Event()
        self._flowing.set()
        self.relayed = {"up": 0, "down": 0}
        self._trip: tuple[str, int] | None = None      # (direction, cut when relayed reaches this)
        self.tripped = threading.Event()
        threading.Thread(target=self._accept, name="cut-proxy", daemon=True).start()

    def cut_after(self, nbytes: int, direction: str = "up") -> None:
        """Cut every connection once ``nbytes`` more bytes went ``direction``
        (``"up"`` or ``"down"``): that many are relayed, not a byte more,
        then a reset (which may lose the last of them still in the socket);
        ``tripped`` is set then."""
        if direction not in self.relayed:
            raise ValueError(f"direction {direction!r} is not 'up' or 'down'")
        with self._lock:
            self.tripped.clear()
            self._trip = (direction, self.relayed[direction] + nbytes)

    def hold(self) -> None:
        """Stop forwarding what clients send (their bytes wait here)."""
        self._flowing.clear()

    def release(self) -> None:
        self._flowing.set()

    def _accept(self) -> None:
        import socket
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, upstream))
            for a, b, gate, way in ((client, upstream, self._flowing, "up"), (upstream, client, None, "down")):
                threading.Thread(target=self._pump, args=(a, b, gate, way), daemon=True).start()

    def _pump(self, src, dst, gate: threading.Event | None, way: str) -> None:
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        try:
            while True:
                n = src.recv_into(buf)
                if n == 0:
                    break
                if gate is not None:
                    gate.wait()
                with self._lock:
                    trip = self._trip
                    if trip is not None and trip[0] == way:
                        n = min(n, trip[1] - self.relayed[way])   # up to the trip, not a byte more
                    self.relayed[way] += n
                    if self.recorded is not None:
                        self.recorded += view[:n]
                dst.sendall(view[:n])
                if trip is not None and trip[0] == way and self.relayed[way] >= trip[1]:
                    with self._lock:
                        self._trip = None
                    self.cut()
                    self.tripped.set()
                    break
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(2)
            except OSError:
                pass

    def cut(self) -> int:
        """Reset every relayed connection; return how many were cut."""
        import socket
        import struct as _struct
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for s in pair:
                try:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _struct.pack("ii", 1, 0))
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        self.cuts += len(pairs)
        return len(pairs)

    def close(self) -> None:
        import socket
        self._closed = True
        try:
            # close() alone leaves a thread blocked in accept() accepting
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self.cut()

    def __enter__(self) -> "CutProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
