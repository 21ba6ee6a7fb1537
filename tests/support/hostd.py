"""Test support for hostd.

``HostdThread``: a real hostd (against libvirt's in-process test:///default
driver, which has domains and lifecycle events but no migration) on its own
event loop, beside a real pool; ``write_config``: its host.toml, pointing at
that pool.  ``HostdStub``: hostd's real local API (``LocalServer``) serving
canned answers, for the CLI's tests; ``write_host_config``: a host.toml for
those (no pool needed)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from pathlib import Path

from accelmig.lab.poolthread import PoolThread
from accelmig.plugin.hostd.api import LocalServer
from tests.support.wait import wait_for

SECRET = "hostA-secret-0123456789"


def write_config(tmp_path, pool: PoolThread, *, strict: bool = True, libvirt_uri: str = "test:///default",
                 fabric: str = "", control: str | None = None, host: str = "hostA", secret: str = SECRET,
                 tls=None) -> str:
    """``tls``: ``(ca, cert, key)`` paths (the pool's CA, this host's client
    certificate and key); None: plain TCP (``insecure``)."""
    secret_file = tmp_path / "host.secret"
    secret_file.write_text(secret)
    os.chmod(secret_file, 0o600)
    port = pool.endpoint.rsplit(":", 1)[1]
    config = tmp_path / "host.toml"
    transport = "insecure = true" if tls is None else \
        f'ca_file = "{tls[0]}"\ncert_file = "{tls[1]}"\nkey_file = "{tls[2]}"'
    config.write_text(f"""
[host]
id = "{host}"
[pool]
endpoint = "127.0.0.1:{port}"
control = "{control or pool.control_endpoint}"
secret_file = "{secret_file}"
{transport}
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
        wait_for(lambda: os.path.exists(self.config.hostd.socket), 10,
                 f"hostd's socket {self.config.hostd.socket}", interval=0.02)
        return self

    def call(self, coro_fn, timeout: float = 10):
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout)

    def stop(self):
        self.loop.call_soon_threadsafe(self.daemon.stop)
        self._done.result(15)
        self.thread.join(5)


def write_host_config(directory: Path, *, socket: str | None = None, control: str = "127.0.0.1:7071",
                 libvirt_uri: str = "test:///default", secret: str | None = "hostA-secret-0123456789",
                 host: str = "hostA") -> Path:
    """A host.toml (and its secret file, mode 0600) under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    secret_file = directory / "host.secret"
    if secret is not None:
        secret_file.write_text(secret + "\n")
        secret_file.chmod(0o600)
    path = directory / "host.toml"
    path.write_text(
        f'[host]\nid = "{host}"\n'
        f'[pool]\nendpoint = "127.0.0.1:7070"\ncontrol = "{control}"\nsecret_file = "{secret_file}"\ninsecure = true\n'
        f'[hostd]\nsocket = "{socket or directory / "hostd.sock"}"\nstate_dir = "{directory / "state"}"\n'
        f'libvirt_uri = "{libvirt_uri}"\nhook_timeout = 2.0\n')
    return path


class HostdStub:
    """A real ``LocalServer`` (hostd's local API) on its own thread serving
    canned answers and recording every request it gets."""

    def __init__(self, path: str | Path, answers: dict | None = None):
        self.path = str(path)
        self.answers = dict(answers or {})
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        kinds = set(self.answers) | {"hook", "ping", "status"}
        self.server = LocalServer(self.path, {kind: self._handler(kind) for kind in kinds})
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.server.start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name="hostd-stub", daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def _handler(self, kind):
        async def handle(message):
            with self._lock:
                self.requests.append(message)
            answer = self.answers.get(kind, {"noted": True})
            if isinstance(answer, Exception):
                raise answer
            return answer
        return handle

    def received(self, kind: str) -> list[dict]:
        with self._lock:
            return [m for m in self.requests if m.get("type") == kind]

    def close(self):
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()
