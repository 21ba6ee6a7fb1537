"""The pool's listeners: the data plane for drivers, the control plane for
hosts, the local admin socket, Prometheus metrics — and the janitor that
expires sessions and leases.  ``PoolServer`` starts and stops them around
one ``Pool`` (the state model), on the pool's event loop."""

from __future__ import annotations

import asyncio
import logging
import time

from accelmig.pool.admission import AcceptedConnection, Admission, ConnectionLimits
from accelmig.pool.control import ControlServer
from accelmig.pool.dataplane import DataConnection
from accelmig.pool.state import Pool
from accelmig.runtime.sockets import OwnedUnixSocket
from accelmig.wire import dataplane as dp
from accelmig.wire import tls
from accelmig.wire.errors import ConfigInvalid

LOG = logging.getLogger("accelmig.pool")


class PoolServer:
    def __init__(self, pool: Pool):
        self.pool = pool
        self.control = ControlServer(pool)
        self.endpoints: dict = {}
        self._servers: list = []
        self._admin_socket: OwnedUnixSocket | None = None
        self._janitor: asyncio.Task | None = None

    @property
    def config(self):
        return self.pool.config

    async def start(self) -> None:
        pool = self.pool
        pool.loop = asyncio.get_running_loop()
        data_tls, control_tls, cert_der = self._tls_contexts()
        limits = ConnectionLimits(self.config)        # (ConfigInvalid: cannot fit the descriptor limit)
        admission = pool.admission = Admission(limits, pool.metrics)
        pool.metrics.connections.labels("unauthenticated").set_function(lambda: admission.unauthenticated)
        pool.metrics.connections.labels("authenticated").set_function(
            lambda: admission.total - admission.unauthenticated)
        LOG.info("connections: %s", limits.describe(),
                 extra={"max_connections": limits.max_connections, "descriptors": limits.descriptors,
                        "max_unauthenticated": limits.max_unauthenticated,
                        "max_unauthenticated_per_peer": limits.per_peer})
        admin_sock = None
        if self.config.admin_socket:
            # First: a second pool on the same admin socket stops here, having touched nothing.
            self._admin_socket = OwnedUnixSocket(self.config.admin_socket, mode=0o600,
                                                 what="accelmig-pool (admin socket)")
            admin_sock = self._admin_socket.open()
        # ``listen`` may name several addresses ("0.0.0.0:7070,[::]:7070"); a
        # port 0 after the first takes the port the first one got.
        first_port = None
        for item in [p.strip() for p in self.config.listen.split(",") if p.strip()]:
            host, port = dp.parse_endpoint(item, listen=True)
            if port == 0 and first_port is not None:
                port = first_port
            # plain TCP: the pool runs the TLS handshake itself, once the
            # connection is counted (pool.admission)
            server = await pool.loop.create_server(
                lambda: self._accepted("data", data_tls, lambda admitted: DataConnection(pool, cert_der, admitted)),
                host, port, reuse_address=True)
            self._servers.append(server)
            bound = _bound(server)
            first_port = first_port or server.sockets[0].getsockname()[1]
            self.endpoints.setdefault("data", bound)
            self.endpoints.setdefault("data_all", []).append(bound)
        if self.config.control_listen:
            chost, cport = dp.parse_endpoint(self.config.control_listen, listen=True)
            cserver = await pool.loop.create_server(
                lambda: self._accepted("control", control_tls, self._control_stream),
                chost, cport, reuse_address=True)
            self._servers.append(cserver)
            self.endpoints["control"] = _bound(cserver)
        if admin_sock is not None:
            aserver = await asyncio.start_unix_server(self.control.handle_admin, sock=admin_sock)
            self._servers.append(aserver)
            self.endpoints["admin"] = "unix:" + self.config.admin_socket
        if self.config.metrics_listen:
            from prometheus_client import start_http_server
            mhost, mport = dp.parse_endpoint(self.config.metrics_listen, listen=True)
            start_http_server(mport, addr=mhost, registry=pool.metrics.registry)
            self.endpoints["metrics"] = self.config.metrics_listen
        self._janitor = asyncio.ensure_future(self._janitor_loop())
        security = self.security()
        LOG.info("pool %s serving: %s", pool.instance, ", ".join(f"{k} {v}" for k, v in security.items()),
                 extra={"instance": pool.instance, **self.endpoints, "security": security,
                        "devices": [d.id for d in pool.devices]})

    def security(self) -> dict:
        """What protects each plane, in words an operator greps for: the
        ready line and the serving line say it, ``INSECURE`` where plain."""
        config = self.config
        out = {"data": "INSECURE plain TCP" if config.insecure else "TLS"}
        if config.control_listen:
            out["control"] = "INSECURE plain TCP" if config.insecure else \
                "mutual TLS (hosts' certificates name them)"
        if config.cluster:
            from accelmig.pool.cluster.keys import cluster_uses_tls
            out["cluster"] = "etcd over TLS" if cluster_uses_tls(config.cluster) else \
                "INSECURE plain etcd://"
        return out

    def _accepted(self, plane: str, tls_context, make_app) -> AcceptedConnection:
        return AcceptedConnection(self.pool.admission, make_app, plane=plane, tls_context=tls_context,
                                  timeout=self.config.handshake_timeout, metrics=self.pool.metrics)

    def _control_stream(self, admitted: AcceptedConnection) -> asyncio.StreamReaderProtocol:
        """The control plane's protocol for an admitted connection: what
        ``asyncio.start_server`` would have made, serving ``handle_host``."""
        reader = asyncio.StreamReader(loop=self.pool.loop)
        return asyncio.StreamReaderProtocol(
            reader, lambda r, w: self.control.handle_host(r, w, admitted), loop=self.pool.loop)

    def _tls_contexts(self):
        """(data plane's, control plane's, the pool's certificate), or Nones
        for plain TCP, said explicitly (``insecure``) and warned about."""
        config = self.config
        config.check_tls()
        if config.insecure:
            LOG.warning("INSECURE: the data and control planes are plain TCP (--insecure): anyone on "
                        "the path reads tenant tokens, session secrets, tickets and buffers",
                        extra={"tls": False})
            return None, None, None
        try:
            data_tls = tls.server_context(config.tls_cert, config.tls_key)
            control_tls = tls.server_context(config.tls_cert, config.tls_key, config.tls_client_ca or None)
            cert_der = tls.leaf_certificate_der(config.tls_cert)
        except (OSError, ValueError) as exc:      # ssl.SSLError is an OSError
            raise ConfigInvalid(source=config.tls_cert, reason=f"TLS: {exc}") from None
        return data_tls, control_tls, cert_der

    async def stop(self) -> None:
        pool = self.pool
        if self._janitor is not None:
            self._janitor.cancel()
        for server in self._servers:
            server.close()
        if pool.admission is not None:
            pool.admission.abort_strangers()
        for conn in list(pool.connections):
            conn.close()
        await self.control.close()
        for server in self._servers:
            try:
                await asyncio.wait_for(server.wait_closed(), 2)
            except (asyncio.TimeoutError, Exception):
                pass
        for session in list(pool.sessions.values()):
            session.release("pool stopping")
        for session in list(pool.sessions.values()):
            session.wait_released(5)
        if self._admin_socket is not None:
            self._admin_socket.close()
        LOG.info("pool %s stopped", pool.instance)

    def reload(self) -> bool:
        """SIGHUP: read the tenants file and the hosts file again (the paths
        the pool started with) and apply both, or neither: a file that does
        not load keeps the running tenants and hosts, and the log says why.
        Sessions are never touched (``Pool.reload`` says what a removed
        tenant or host means).  Other settings need a restart."""
        from accelmig.pool.config import load_hosts, load_tenants
        from accelmig.wire.errors import ConfigInvalid
        try:
            tenants = load_tenants(self.config.tokens)
            hosts = load_hosts(self.config.hosts)
        except ConfigInvalid as exc:
            LOG.error("reload refused, still serving the previous tenants and hosts: %s", exc,
                      extra={"reload": "refused"})
            return False
        changes = self.pool.reload(tenants, hosts)
        parts = []
        for kind in ("tenants", "hosts"):
            for what, names in changes[kind].items():
                if names:
                    parts.append(f"{kind} {what}: {', '.join(names)}")
        for name, count in changes["kept_sessions"].items():
            if count:
                parts.append(f"tenant {name}'s {count} session(s) keep running; it opens no new one")
        LOG.info("reload: tenants from %s, hosts from %s: %s", self.config.tokens,
                 self.config.hosts or "(none)", "; ".join(parts) or "nothing changed",
                 extra={"reload": "done", **{f"{kind}_{what}": ", ".join(names) for kind in ("tenants", "hosts")
                                             for what, names in changes[kind].items() if names}})
        return True

    async def _janitor_loop(self) -> None:
        period = janitor_period(self.config)
        while True:
            await asyncio.sleep(period)
            try:
                self.pool.sweep(time.time())
            except Exception:  # pragma: no cover - keep sweeping whatever happens
                LOG.exception("janitor failed")


def janitor_period(config) -> float:
    """Seconds between the janitor's sweeps: a quarter of the grace and of
    the lease, at most 1 s (a session is released at most this late)."""
    return max(0.05, min(1.0, config.grace / 4, config.lease_ttl / 4))


def _bound(server) -> str:
    sock = server.sockets[0]
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
