"""Daemons of this virtualenv as child processes, whose JSON log lines a test
waits on (``wait_log``), never on time: ``LoggedProcess``, ``PoolProcess``
(``accelmig-pool serve`` with a tenants file and a hosts file) and
``AgentProcess`` (``accelmig-agent run``)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading


class LoggedProcess:
    """A console script run with ``--log-format json``: a reader thread
    collects its stderr log entries; ``wait_log`` takes them in order."""

    def __init__(self, argv: list, *, ready_line: bool = False, env: dict | None = None, wrapper=()):
        """``wrapper``: a command that runs it (``prlimit --nofile=300:300 --``, ``setpriv ...``)."""
        exe = os.path.join(os.path.dirname(sys.executable), argv[0])
        self.proc = subprocess.Popen([*map(str, wrapper), exe, *map(str, argv[1:])], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     env=None if env is None else {**os.environ, **env})
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = None
        if ready_line:                     # the pool's {"ready": true, ...} on stdout
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait(15)
                raise AssertionError(f"{argv[0]} did not start (exit {self.proc.returncode}): "
                                     f"{self.drain()}")
            self.ready = json.loads(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self):
        for line in self.proc.stderr:
            if line.startswith("{"):
                self.lines.put(json.loads(line))
        self.lines.put(None)

    def drain(self) -> str:
        """Every message seen so far (for an assertion's message)."""
        return "; ".join(entry["msg"] for entry in self.seen)

    def wait_log(self, predicate, timeout: float = 20.0) -> dict:
        """The next log entry (after those already taken) that ``predicate`` accepts."""
        while True:
            try:
                entry = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no such log line within {timeout} s; seen: {self.drain()}") from None
            if entry is None:
                self.lines.put(None)          # stays at the end for the next caller
                raise AssertionError(f"the process exited ({self.proc.wait()}); seen: {self.drain()}")
            self.seen.append(entry)
            if predicate(entry):
                return entry

    def entries(self) -> list[dict]:
        """Every log entry so far, those no ``wait_log`` took yet included."""
        while True:
            try:
                entry = self.lines.get_nowait()
            except queue.Empty:
                return self.seen
            if entry is None:
                self.lines.put(None)
                return self.seen
            self.seen.append(entry)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> int:
        """SIGTERM, then its exit status (killed if it does not exit within 15 s)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(15)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(5)


class PoolProcess(LoggedProcess):
    """``accelmig-pool serve`` on loopback with ``tokens.toml`` and ``hosts.toml``
    in ``directory`` (written from the texts given); plain TCP, or TLS and
    mutual TLS with ``tls`` (an ``accelmig.lab.certs.LabPKI``); ``env``: more
    environment (``POCL_DEVICES``); ``wrapper``: what runs it (``prlimit``)."""

    def __init__(self, directory, tokens: str, hosts: str = "", *, control_listen: str = "127.0.0.1:0",
                 extra: tuple = (), tls=None, env: dict | None = None, wrapper=()):
        self.tokens, self.hosts = directory / "tokens.toml", directory / "hosts.toml"
        self.tokens.write_text(tokens)
        self.hosts.write_text(hosts)
        super().__init__(["accelmig-pool", "serve", "--listen", "127.0.0.1:0",
                          "--control-listen", control_listen, "--tokens", self.tokens,
                          "--hosts", self.hosts, "--admin-socket", directory / "pool.sock",
                          "--log-format", "json",
                          *(["--tls-cert", tls.pool.cert, "--tls-key", tls.pool.key, "--tls-client-ca", tls.ca]
                            if tls is not None else ["--insecure"]), *extra], ready_line=True, env=env,
                         wrapper=wrapper)

    @property
    def endpoint(self) -> str:
        return self.ready["data"]

    @property
    def control_endpoint(self) -> str:
        return self.ready["control"]

    def hup(self) -> dict:
        """SIGHUP, and the log line of the reload it caused."""
        self.signal(signal.SIGHUP)
        return self.wait_log(lambda e: e["msg"].startswith("reload"))


class AgentProcess(LoggedProcess):
    """``accelmig-agent run`` on a unix-socket channel (``channel``, the
    host's end, as hostd connects to QEMU's chardev) and its local socket
    (``socket``) in ``directory``.  Also keeps what it writes to stderr that
    is no JSON log line (``raw``): a thread that died of an exception prints
    its traceback there, not in the log.  ``env`` and ``wrapper``: as
    ``LoggedProcess``'s."""

    def __init__(self, directory, *extra, env: dict | None = None, wrapper=()):
        self.channel, self.socket = directory / "channel.sock", directory / "agent.sock"
        self.raw: list[str] = []
        super().__init__(["accelmig-agent", "run", "--port", self.channel, "--socket", self.socket,
                          "--state-dir", directory / "state", "--log-format", "json", *extra], env=env,
                         wrapper=wrapper)
        self.wait_log(lambda e: e["msg"].startswith("agent "))

    def _read(self):
        for line in self.proc.stderr:
            if line.startswith("{"):
                self.lines.put(json.loads(line))
            elif line.strip():
                self.raw.append(line.rstrip("\n"))
        self.lines.put(None)


def tenants_toml(**tenants) -> str:
    return "".join(f'[tenants.{name}]\ntoken = "{token}"\nquota = "64MiB"\n' for name, token in tenants.items())


def hosts_toml(**hosts) -> str:
    return "".join(f'[hosts.{name}]\nsecret = "{secret}"\n' for name, secret in hosts.items())
