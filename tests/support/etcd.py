"""A real etcd (Debian's ``etcd-server``) for tests: one member on loopback,
its own data directory and free ports, started as a child process and
waited on by its own "ready to serve client requests" log line (an event,
not a sleep); always stopped by its PID.

::

    with EtcdServer(tmp_path) as etcd:
        ClusterStore([etcd.endpoint])

With ``tls`` (an ``EtcdPKI``: ``make_etcd_pki(directory)``), it listens on
https only and requires a client certificate of its CA (``--client-cert-auth``),
as a deployment's etcd does; ``url`` is then ``etcds://``.  ``enable_auth``
then turns on etcd's own access control (users, roles), through the same
JSON gateway the pool uses (Debian's etcd-server ships no etcdctl).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import threading

import pytest

from accelmig.lab.certs import Issued, issue, make_ca

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class EtcdPKI:
    """etcd's CA (``ca``), etcd's certificate (``server``: IP SAN 127.0.0.1
    only, so ``localhost`` is the wrong name), a pool node's client
    certificate (``client``), one signed by another CA (``stranger``) and
    one of etcd's CA without a CommonName (``anonymous``: what a node with an
    etcd user presents, since etcd's gateway refuses a CN once auth is on)."""

    ca: object
    server: Issued
    client: Issued
    other_ca: object
    stranger: Issued
    anonymous: Issued


def make_etcd_pki(directory) -> EtcdPKI:
    from pathlib import Path
    directory = Path(directory)
    ca, ca_key = make_ca(directory / "etcd-ca", "etcd test CA")
    other, other_key = make_ca(directory / "other-ca", "some other CA")
    return EtcdPKI(ca=ca, server=issue(directory / "etcd-ca", ca, ca_key, "etcd", addresses=("127.0.0.1",),
                                                  server_and_client=True),
                   client=issue(directory / "etcd-ca", ca, ca_key, "pool-node", client=True),
                   other_ca=other, stranger=issue(directory / "other-ca", other, other_key, "stranger",
                                                  client=True),
                   anonymous=issue(directory / "etcd-ca", ca, ca_key, "anonymous", client=True,
                                   subject="/O=accelmig pool"))


class EtcdServer:
    def __init__(self, directory, tls: EtcdPKI | None = None):
        if not os.access(ETCD, os.X_OK):
            pytest.skip("etcd is not installed (Debian: etcd-server; ./dev.sh setup installs it)")
        self.data_dir = os.path.join(str(directory), "etcd-data")
        self.client_port, self.peer_port = _free_port(), _free_port()
        self.tls = tls
        self.proc: subprocess.Popen | None = None
        self.log: list[dict] = []

    @property
    def endpoint(self) -> str:
        """host:port of its client URL (what ``--cluster etcd://...`` names)."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"{'etcds' if self.tls else 'etcd'}://{self.endpoint}"

    def start(self, timeout: float = 30.0) -> "EtcdServer":
        client = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        tls = [] if self.tls is None else [
            "--cert-file", self.tls.server.cert, "--key-file", self.tls.server.key,
            "--trusted-ca-file", self.tls.ca, "--client-cert-auth"]
        self.proc = subprocess.Popen(
            [ETCD, "--name", "test", "--data-dir", self.data_dir,
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"test={peer}", "--logger", "zap", "--log-outputs", "stderr", *map(str, tls)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        ready: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, ready), daemon=True).start()
        try:
            outcome = ready.get(timeout=timeout)
        except queue.Empty:
            outcome = f"not ready within {timeout} s"
        if outcome is not True:
            self.stop()
            raise AssertionError(f"etcd did not start: {outcome}; its log: "
                                 f"{[e.get('msg') for e in self.log][-10:]}")
        return self

    def _read(self, proc, ready: queue.Queue) -> None:
        for line in proc.stderr:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            self.log.append(entry)
            # 3.4 with zap says it serves; later versions also "ready to serve client requests"
            if str(entry.get("msg", "")).startswith(("serving client traffic", "ready to serve client")):
                ready.put(True)
        ready.put(f"exited with {proc.wait()}")

    def stop(self) -> None:
        """SIGTERM to its PID, SIGKILL past 10 s."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def admin(self, path: str, body: dict, token: str | None = None) -> dict:
        """One call of etcd's v3 gateway as the test's administrator (TLS:
        the certificate without a CN); an error answer fails the test."""
        import requests
        session = requests.Session()
        session.trust_env = False
        if self.tls:
            session.verify = str(self.tls.ca)
            session.cert = (str(self.tls.anonymous.cert), str(self.tls.anonymous.key))
        scheme = "https" if self.tls else "http"
        answer = session.post(f"{scheme}://{self.endpoint}/v3{path}", json=body, timeout=10,
                              headers={"Authorization": token} if token else {})
        assert answer.status_code == 200, f"etcd {path}: {answer.status_code} {answer.text[:300]}"
        return answer.json()

    def enable_auth(self, users: dict[str, tuple[str, str | None]]) -> str:
        """etcd's access control on, with ``root`` and ``users``: name ->
        (password, the key prefix its role may read and write, or None: a
        user with no role).  Returns root's password."""
        root = "root-" + os.urandom(8).hex()
        self.admin("/auth/user/add", {"name": "root", "password": root})
        self.admin("/auth/user/grant", {"user": "root", "role": "root"})
        for name, (password, prefix) in users.items():
            self.admin("/auth/user/add", {"name": name, "password": password})
            if prefix is not None:
                end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
                self.admin("/auth/role/add", {"name": f"{name}-role"})
                self.admin("/auth/role/grant", {"name": f"{name}-role", "perm": {
                    "permType": "READWRITE", "key": _b64(prefix), "range_end": _b64(end)}})
                self.admin("/auth/user/grant", {"user": name, "role": f"{name}-role"})
        self.admin("/auth/enable", {})
        return root

    def restart(self) -> "EtcdServer":
        """Stop and start on the same data and ports: nothing stored is lost."""
        self.stop()
        return self.start()

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_against(tmp_path, cluster: str, *flags):
    """``accelmig-pool serve`` joining ``cluster``, expected to stop before
    it serves (its ``CompletedProcess``)."""
    from tests.support.processes import tenants_toml
    from tests.support.tenants import run_cli
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(tenants_toml(alice="alice-token-0001"))
    return run_cli("accelmig-pool", "serve", "--listen", "127.0.0.1:0", "--control-listen", "",
                   "--admin-socket", "", "--insecure", "--tokens", tokens, "--cluster", cluster,
                   "--node-name", "intruder", "--device-isolation", "none", "--log-format", "text",
                   *flags, timeout=60)


def assert_never_served(out, reason: str) -> None:
    """It stopped with exit status 2 saying ``reason``, and never listened."""
    assert out.returncode == 2, out.stderr[-2000:]
    assert reason in out.stderr, out.stderr[-2000:]
    assert '"ready"' not in out.stdout                 # the supervisor's line never came
    assert " serving" not in out.stderr                 # no listener was opened


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.fixture
def etcd_server(tmp_path):
    with EtcdServer(tmp_path) as server:
        yield server


@pytest.fixture
def etcd_tls_server(tmp_path):
    """etcd on https only, client certificates required (``server.tls``: its PKI)."""
    with EtcdServer(tmp_path, tls=make_etcd_pki(tmp_path / "pki")) as server:
        yield server
