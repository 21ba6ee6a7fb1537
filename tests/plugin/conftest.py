"""A real hostd (against libvirt's in-process test:///default driver, which
has domains and lifecycle events but no migration) beside a real pool."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time

import pytest

from accelmig.pool.harness import PoolThread
from tests.conftest import TENANTS

SECRET = "hostA-secret-0123456789"


def write_config(tmp_path, pool: PoolThread, *, strict: bool = True, libvirt_uri: str = "test:///default",
                 fabric: str = "", control: str | None = None) -> str:
    secret = tmp_path / "host.secret"
    secret.write_text(SECRET)
    os.chmod(secret, 0o600)
    port = pool.endpoint.rsplit(":", 1)[1]
    config = tmp_path / "host.toml"
    config.write_text(f"""
[host]
id = "hostA"
[pool]
endpoint = "127.0.0.1:{port}"
control = "{control or pool.control_endpoint}"
secret_file = "{secret}"
{fabric}
[hostd]
socket = "{tmp_path}/hostd.sock"
state_dir = "{tmp_path}/state"
strict = {"true" if strict else "false"}
hook_timeout = 2.0
libvirt_uri = "{libvirt_uri}"
""")
    return str(config)


class HostdThread:
    """A real HostDaemon on its own event loop thread."""

    def __init__(self, config_path: str, **options):
        from accelmig.plugin.config import HostConfig
        from accelmig.plugin.hostd.daemon import HostDaemon
        self.config = HostConfig.load(config_path)
        self.daemon = HostDaemon(self.config, **options)
        self.loop = asyncio.new_event_loop()
        self._done = concurrent.futures.Future()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.daemon.run())
        finally:
            self._done.set_result(True)

    def start(self) -> "HostdThread":
        self.thread.start()
        deadline = time.time() + 10
        while not os.path.exists(self.config.hostd.socket) and time.time() < deadline:
            time.sleep(0.02)
        return self

    def call(self, coro_fn, timeout: float = 10):
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout)

    def stop(self):
        self.loop.call_soon_threadsafe(self.daemon.stop)
        self._done.result(15)
        self.thread.join(5)


@pytest.fixture
def pool_a():
    with PoolThread(TENANTS, {"hostA": (SECRET, ["127.0.0.0/8"])}) as pool:
        yield pool
