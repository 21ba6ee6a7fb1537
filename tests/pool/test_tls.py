"""TLS on both planes (issue 14, item 2): a real pool on a thread serving
TLS with certificates of a throwaway CA (``accelmig.lab.certs``: the
``openssl`` command), real drivers, real control-plane clients, real
relays on loopback."""

from __future__ import annotations

import logging
import os
import shutil
import select
import socket
import ssl
import threading

import pytest

from accelmig.agent.driver import connect
from accelmig.lab.cutproxy import CutProxy
from accelmig.lab.poolthread import PoolThread
from accelmig.wire import tls
from accelmig.wire.control import ControlClient
from accelmig.wire.errors import AuthFailed, ConfigInvalid, Unavailable
from tests.support.wait import wait_for

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="SKIPPED LOUDLY: the openssl command makes the test CA")

TOKEN = "alice-tls-token-0001"
TENANTS = {"alice": (TOKEN, "64MiB")}
HOST_SECRET = "hostA-tls-secret-0123456789"
HOSTB_SECRET = "hostB-tls-secret-9876543210"
HOSTS = {"hostA": HOST_SECRET, "hostB": HOSTB_SECRET}
SECRET_DATA = b"the-tenant's-confidential-buffer-" * 4


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    from accelmig.lab.certs import issue, make_pki
    base = tmp_path_factory.mktemp("pki")
    made = make_pki(base / "ca")
    other = make_pki(base / "other")          # another deployment's CA
    # a certificate from the right CA without the loopback IP: names only
    dns_only = issue(base / "ca", made.ca, made.ca_key, "dns-only", dns=("pool.example",))
    # what an attacker with a certificate of the same CA for its own address holds
    mitm = issue(base / "ca", made.ca, made.ca_key, "mitm", addresses=("127.0.0.1",))
    return {"pki": made, "other": other, "dns_only": dns_only, "mitm": mitm}


def tls_pool(pki, **extra):
    p = pki["pki"]
    return PoolThread(TENANTS, HOSTS, tls_cert=str(p.pool.cert), tls_key=str(p.pool.key),
                      tls_client_ca=str(p.ca), **extra)


@pytest.fixture(scope="module")
def pool(pki):
    with tls_pool(pki) as harness:
        yield harness


def host_context(pki, host="hostA", which="pki"):
    p = pki[which]
    return tls.client_context(str(pki["pki"].ca), str(p.hosts[host].cert), str(p.hosts[host].key))


def test_a_driver_computes_and_resumes_over_tls(pki, pool):
    with connect(pool.endpoint, TOKEN, cafile=str(pki["pki"].ca), agent=False) as dev:
        buf = dev.upload(SECRET_DATA)
        assert dev.read(buf) == SECRET_DATA
        assert dev._session.link.binding.startswith(b"tls-server-end-point:")
        result = dev.resume()                     # a new TLS connection, a proof bound to it
        assert result["epoch"] == 2 and dev.read(buf) == SECRET_DATA


def test_cafile_comes_from_the_environment_too(pki, pool, monkeypatch):
    monkeypatch.delenv(tls.INSECURE_ENV, raising=False)
    monkeypatch.setenv(tls.CAFILE_ENV, str(pki["pki"].ca))
    with connect(pool.endpoint, TOKEN, agent=False) as dev:
        assert dev.info()


@pytest.mark.parametrize("secure", [True, False], ids=["tls", "insecure"])
def test_a_passive_tap_reads_the_token_only_without_tls(pki, secure, tmp_path):
    """The relay records every byte both ways: with TLS neither the token,
    the session secret nor the buffer is in them; with --insecure all are."""
    harness = tls_pool(pki) if secure else PoolThread(TENANTS, HOSTS)
    with harness as pool:
        tap = CutProxy(pool.endpoint, record=True)
        try:
            options = {"cafile": str(pki["pki"].ca)} if secure else {"insecure": True}
            with connect(tap.endpoint, TOKEN, agent=False, **options) as dev:
                buf = dev.upload(SECRET_DATA)
                assert dev.read(buf) == SECRET_DATA
                secret = dev._session.secret.hex().encode()
                tap.cut()                                  # a resume: the proof crosses too
                dev.resume()
                assert dev.read(buf) == SECRET_DATA
            seen = bytes(tap.recorded)
        finally:
            tap.close()
    assert len(seen) > len(SECRET_DATA)
    for what in (TOKEN.encode(), secret, SECRET_DATA):
        assert (what in seen) is (not secure), what[:20]


def test_a_driver_with_another_ca_refuses_the_pool(pki, pool):
    with pytest.raises(AuthFailed, match="does not verify"):
        connect(pool.endpoint, TOKEN, cafile=str(pki["other"].ca), agent=False)


def test_a_certificate_without_the_endpoints_ip_is_refused(pki):
    """Endpoints are addresses: a certificate that names only a DNS name
    does not match 127.0.0.1 (IP SANs: docs/deploy.md)."""
    with PoolThread(TENANTS, tls_cert=str(pki["dns_only"].cert), tls_key=str(pki["dns_only"].key),
                    control_listen="") as p:
        with pytest.raises(AuthFailed, match="does not verify.*(IP address mismatch|SAN)"):
            connect(p.endpoint, TOKEN, cafile=str(pki["pki"].ca), agent=False)


def test_a_host_presenting_its_certificate_is_served(pki, pool):
    with ControlClient(pool.control_endpoint, "hostA", HOST_SECRET.encode(),
                       tls=host_context(pki)) as client:
        assert client.call("ping")["caller"] == "hostA"


@pytest.mark.parametrize("how", ["no certificate", "another CA's certificate"])
def test_a_host_without_a_certificate_of_the_client_ca_is_refused(pki, pool, how):
    context = tls.client_context(str(pki["pki"].ca)) if how == "no certificate" else \
        host_context(pki, which="other")
    with ControlClient(pool.control_endpoint, "hostA", HOST_SECRET.encode(), tls=context) as client:
        with pytest.raises(Unavailable, match="refused this host's TLS|refused this client's certificate"
                                              "|requires a client certificate"):
            client.call("ping")


def test_the_hmac_still_counts_under_mutual_tls(pki, pool):
    """A host with a good certificate and the wrong secret is still refused."""
    with ControlClient(pool.control_endpoint, "hostA", b"not-the-secret-of-hostA",
                       tls=host_context(pki)) as client:
        with pytest.raises(AuthFailed):
            client.call("ping")


def test_a_host_acts_only_as_the_name_its_certificate_gives(pki, pool):
    """Issue 28, item 5: hostA's certificate with hostB's secret was served
    as ``caller: hostB``.  The certificate names the host; the secret is a
    second factor, never a way to be someone else."""
    with ControlClient(pool.control_endpoint, "hostB", HOSTB_SECRET.encode(),
                       tls=host_context(pki, host="hostA")) as client:
        with pytest.raises(AuthFailed, match="the client certificate names 'hostA', not this host"):
            client.call("ping")
    with ControlClient(pool.control_endpoint, "hostB", HOSTB_SECRET.encode(),
                       tls=host_context(pki, host="hostB")) as client:
        assert client.call("ping")["caller"] == "hostB"


def test_a_dns_name_in_the_certificate_is_its_name_before_the_common_name(pki, pool, tmp_path):
    """RFC 6125: where a certificate has DNS subjectAltNames, they are its
    names and its CommonName is not."""
    from accelmig.lab.certs import issue
    made = pki["pki"]
    odd = issue(tmp_path, made.ca, made.ca_key, "hostA", dns=("hostB",), client=True)
    context = tls.client_context(str(made.ca), str(odd.cert), str(odd.key))
    with ControlClient(pool.control_endpoint, "hostA", HOST_SECRET.encode(), tls=context) as client:
        with pytest.raises(AuthFailed, match="names 'hostB', not this host"):
            client.call("ping")
    with ControlClient(pool.control_endpoint, "hostB", HOSTB_SECRET.encode(), tls=context) as client:
        assert client.call("ping")["caller"] == "hostB"


def test_certificate_names_reads_what_ssl_decoded():
    assert tls.certificate_names(None) == ()
    cert = {"subject": ((("organizationName", "x"),), (("commonName", "hostA"),))}
    assert tls.certificate_names(cert) == ("hostA",)
    cert["subjectAltName"] = (("IP Address", "10.0.0.1"), ("DNS", "hostB"), ("DNS", "hostC"))
    assert tls.certificate_names(cert) == ("hostB", "hostC")


def test_async_client_over_mutual_tls(pki, pool):
    import asyncio
    from accelmig.wire.control import AsyncControlClient

    async def run():
        client = AsyncControlClient(pool.control_endpoint, "hostA", HOST_SECRET.encode(),
                                    tls=host_context(pki))
        try:
            return await client.call("ping")
        finally:
            await client.close()
    assert asyncio.run(run())["caller"] == "hostA"


# -- insecure on one side only: a clear error ------------------------------------------
def test_a_plain_driver_at_a_tls_pool_is_told_so(pool):
    with pytest.raises(Unavailable, match="serves TLS closes plain connections: this driver is insecure"):
        connect(pool.endpoint, TOKEN, insecure=True, agent=False)


def test_a_tls_driver_at_a_plain_pool_is_told_so(pki, caplog):
    with PoolThread(TENANTS) as plain:
        with caplog.at_level(logging.WARNING, logger="accelmig"):
            with pytest.raises(AuthFailed, match="does not speak TLS.*--insecure"):
                connect(plain.endpoint, TOKEN, cafile=str(pki["pki"].ca), agent=False)
            wait_for(lambda: any("the peer speaks TLS, this pool plain TCP" in r.getMessage()
                                 for r in caplog.records), what="the pool's log line")


def test_a_plain_host_at_a_tls_pool_is_told_so(pool):
    with ControlClient(pool.control_endpoint, "hostA", HOST_SECRET.encode()) as client:
        with pytest.raises(Unavailable, match="serves TLS closes plain connections"):
            client.call("ping")


def test_a_tls_host_at_a_plain_pool_is_told_so(pki):
    with PoolThread(TENANTS, HOSTS) as plain:
        with ControlClient(plain.control_endpoint, "hostA", HOST_SECRET.encode(),
                           tls=host_context(pki)) as client:
            with pytest.raises(Unavailable, match="does not speak TLS"):
                client.call("ping")


def test_insecure_is_a_warning_on_both_ends(caplog):
    with caplog.at_level(logging.WARNING):
        with PoolThread(TENANTS) as plain:
            with connect(plain.endpoint, TOKEN, insecure=True, agent=False) as dev:
                assert dev.info()
    insecure = [r for r in caplog.records if r.levelno == logging.WARNING and "INSECURE" in r.getMessage()]
    assert {r.name for r in insecure} >= {"accelmig.pool", "accelmig.agent.driver.device"}


def test_a_driver_without_cafile_or_insecure_uses_tls(pool, monkeypatch):
    """No silent plain TCP: without either, the driver speaks TLS (the system
    store does not know the test CA, so it refuses)."""
    monkeypatch.delenv(tls.INSECURE_ENV, raising=False)
    monkeypatch.delenv(tls.CAFILE_ENV, raising=False)
    with pytest.raises(AuthFailed, match="does not verify"):
        connect(pool.endpoint, TOKEN, agent=False)


def test_the_pool_cli_wants_tls_or_insecure(tmp_path, pki):
    from tests.support.tenants import run_cli
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tenants.a]\ntoken = "{TOKEN}"\nquota = "1MiB"\n')
    tokens.chmod(0o600)
    base = ["accelmig-pool", "serve", "--listen", "127.0.0.1:0", "--control-listen", "",
            "--admin-socket", "", "--tokens", str(tokens)]
    neither = run_cli(*base, timeout=60)
    assert neither.returncode == 2 and "give tls_cert and tls_key" in neither.stderr
    both = run_cli(*base, "--insecure", "--tls-cert", str(pki["pki"].pool.cert), timeout=60)
    assert both.returncode == 2 and "choose one" in both.stderr


def test_the_control_plane_is_mutual_tls_or_insecure_said(tmp_path, pki):
    """Issue 28, item 6: without --tls-client-ca the pool only warned and
    took any host's secret alone.  It refuses to start now, unless there is
    no control plane or ``insecure`` is said, and its ready line says what
    protects each plane."""
    from tests.support.tenants import run_cli
    from tests.support.processes import LoggedProcess
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tenants.a]\ntoken = "{TOKEN}"\nquota = "1MiB"\n')
    tokens.chmod(0o600)
    made = pki["pki"]
    base = ["accelmig-pool", "serve", "--listen", "127.0.0.1:0", "--admin-socket", "", "--tokens", str(tokens),
            "--device-isolation", "none", "--log-format", "text"]
    tls_args = ["--tls-cert", str(made.pool.cert), "--tls-key", str(made.pool.key)]
    refused = run_cli(*base, "--control-listen", "127.0.0.1:0", *tls_args, timeout=60)
    assert refused.returncode == 2, refused.stderr
    assert "the control plane is mutual TLS: give tls_client_ca" in refused.stderr
    for extra, security in (
            (["--control-listen", "", *tls_args], {"data": "TLS"}),
            (["--control-listen", "127.0.0.1:0", *tls_args, "--tls-client-ca", str(made.ca)],
             {"data": "TLS", "control": "mutual TLS (hosts' certificates name them)"}),
            (["--control-listen", "127.0.0.1:0", "--insecure"],
             {"data": "INSECURE plain TCP", "control": "INSECURE plain TCP"})):
        proc = LoggedProcess([*base, *extra], ready_line=True)
        try:
            assert proc.ready["security"] == security
        finally:
            proc.stop()


def test_plain_etcd_is_refused_unless_insecure_is_said(tmp_path, pki):
    """Issue 28, item 6: ``etcd://`` was taken silently next to a TLS pool."""
    from accelmig.pool.config import PoolConfig
    made = pki["pki"]
    tls_keys = {"tls_cert": str(made.pool.cert), "tls_key": str(made.pool.key), "tls_client_ca": str(made.ca)}
    with pytest.raises(ConfigInvalid, match="plain etcd:// .*or say insecure = true"):
        PoolConfig.load(None, {**tls_keys, "cluster": "etcd://127.0.0.1:2379"})
    config = PoolConfig.load(None, {"insecure": True, "cluster": "etcd://127.0.0.1:2379"})
    assert config.cluster == "etcd://127.0.0.1:2379"


def test_host_toml_insecure_excludes_tls_keys(tmp_path, pki):
    from accelmig.plugin.config import HostConfig
    base = '[pool]\nendpoint = "127.0.0.1:7070"\n'
    with pytest.raises(ConfigInvalid, match="pool.ca_file: is a TLS setting and insecure = true"):
        HostConfig.from_toml(base + f'insecure = true\nca_file = "{pki["pki"].ca}"\n')
    config = HostConfig.from_toml(base + f'ca_file = "{pki["pki"].ca}"\n'
                                  f'cert_file = "{pki["pki"].hosts["hostA"].cert}"\n'
                                  f'key_file = "{pki["pki"].hosts["hostA"].key}"\n')
    assert isinstance(config.control_tls(), ssl.SSLContext)
    assert HostConfig.from_toml(base + "insecure = true\n").control_tls() is None


# -- a relayed proof --------------------------------------------------------------------
class TlsRelay:
    """An active man in the middle with a certificate the driver trusts (one
    of the same CA, for the relay's own address): it terminates the driver's
    TLS, opens its own to the pool, and forwards every byte both ways."""

    def __init__(self, target: str, cert, key, ca):
        from accelmig.wire.dataplane import parse_endpoint
        self.target = parse_endpoint(target)
        self.server = tls.server_context(str(cert), str(key))
        self.client = tls.client_context(str(ca))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.socks: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                raw, _ = self.listener.accept()
                down = self.server.wrap_socket(raw, server_side=True)
                up = self.client.wrap_socket(socket.create_connection(self.target), server_hostname="127.0.0.1")
            except OSError:
                return
            self.socks += [down, up]
            threading.Thread(target=self._pump, args=(down, up), daemon=True).start()

    @staticmethod
    def _pump(down, up):
        """Both directions on one thread: an SSLSocket read on one thread
        while another writes to it is not safe (CI once saw the pool's
        welcome never forwarded)."""
        peer = {down: up, up: down}
        try:
            while True:
                # bytes already decrypted inside a socket are not seen by select
                ready = [s for s in peer if s.pending()] or select.select(list(peer), [], [])[0]
                for src in ready:
                    data = src.recv(65536)
                    if not data:
                        raise EOFError
                    peer[src].sendall(data)
        except (OSError, EOFError):
            pass
        for s in peer:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        self.listener.close()
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass


def test_a_proof_relayed_by_a_man_in_the_middle_is_refused(pki, pool):
    """The proof is bound to the pool's certificate (tls-server-end-point):
    a relay with any other certificate, even one the driver trusts, hands
    the pool a proof it refuses — the challenge it forwarded is not enough."""
    relay = TlsRelay(pool.endpoint, pki["mitm"].cert, pki["mitm"].key, pki["pki"].ca)
    try:
        with connect(pool.endpoint, TOKEN, cafile=str(pki["pki"].ca), agent=False,
                     auto_reconnect=False) as dev:
            buf = dev.upload(SECRET_DATA)
            with pytest.raises(AuthFailed, match="ownership proof does not verify"):
                dev.resume(relay.endpoint)
            # the session itself is unharmed: straight to the pool it resumes
            dev.resume(pool.endpoint)
            assert dev.read(buf) == SECRET_DATA
    finally:
        relay.close()


def test_without_tls_the_same_relay_would_pass(monkeypatch):
    """The honest contrast (docs/DESIGN.md): on plain TCP nothing binds the
    proof to the pool, so a relay that forwards the challenge resumes."""
    with PoolThread(TENANTS) as plain:
        relay = CutProxy(plain.endpoint)        # forwards the challenge and the proof
        try:
            with connect(plain.endpoint, TOKEN, insecure=True, agent=False, auto_reconnect=False) as dev:
                buf = dev.upload(SECRET_DATA)
                assert dev.resume(relay.endpoint)["epoch"] == 2
                assert dev.read(buf) == SECRET_DATA
        finally:
            relay.close()


def test_many_cuts_and_resumes_over_tls(pki, pool):
    """A reader thread and senders share one TLS socket; cuts mid-stream."""
    proxy = CutProxy(pool.endpoint)
    try:
        with connect(proxy.endpoint, TOKEN, cafile=str(pki["pki"].ca), agent=False) as dev:
            expected = bytearray(4096)
            buf = dev.upload(bytes(expected))
            for round_ in range(8):
                chunk = os.urandom(512)
                dev.write(buf, chunk, offset=round_ * 512)
                expected[round_ * 512:(round_ + 1) * 512] = chunk
                proxy.cut()
                assert dev.read(buf) == bytes(expected)
            assert dev.stats["resumes"] >= 8
    finally:
        proxy.close()


# -- TLS session resumption (issue 11, item 4: the reconnect after a move) ---------------
def _resumed_handshake(dev) -> bool:
    sock = dev._session.link.sock
    return isinstance(sock, ssl.SSLSocket) and sock.session_reused


def test_a_resume_resumes_the_tls_session_of_the_last_connection(pki, pool, caplog):
    """A reconnect offers the pool's ticket of the last connection: the
    handshake resumes (no certificate chain, no signature), the proof is
    still bound to the pool's certificate, and each connection's ticket
    serves the next.  The pool's log says so too."""
    caplog.set_level(logging.INFO, logger="accelmig.pool")
    with connect(pool.endpoint, TOKEN, cafile=str(pki["pki"].ca), agent=False) as dev:
        buf = dev.upload(SECRET_DATA)
        assert not _resumed_handshake(dev)              # the first one is a full handshake
        binding = dev._session.link.binding
        for epoch in (2, 3):
            assert dev.resume()["epoch"] == epoch
            assert _resumed_handshake(dev) and dev._session.link.tls_resumed
            # the same certificate binds the proof: what the first handshake verified
            assert dev._session.link.binding == binding
            assert dev.read(buf) == SECRET_DATA
        assert dev.stats["tls_resumed"] == 2
    said = [r.getMessage() for r in caplog.records if f"session {dev.sid} resumed" in r.getMessage()]
    assert len(said) == 2 and all(line.endswith("TLS session resumed") for line in said), said


def test_a_tls_session_is_offered_only_to_the_endpoint_it_came_from(pki, pool):
    """Another endpoint gets a full handshake, even with the same pool behind it."""
    proxy = CutProxy(pool.endpoint)
    try:
        with connect(pool.endpoint, TOKEN, cafile=str(pki["pki"].ca), agent=False) as dev:
            buf = dev.upload(SECRET_DATA)
            dev.resume(proxy.endpoint)
            assert not _resumed_handshake(dev) and not dev._session.link.tls_resumed
            assert dev.read(buf) == SECRET_DATA
            dev.resume(proxy.endpoint)          # now the proxy's endpoint has a session of its own
            assert _resumed_handshake(dev)
            assert dev.stats["tls_resumed"] == 1
    finally:
        proxy.close()


def test_a_ticket_the_pool_does_not_know_is_a_full_handshake(pki):
    """A pool that restarted has a new ticket key: the driver's ticket is
    refused by the handshake itself and the connection is a full one (here
    the session is gone too, and the driver is told so)."""
    from accelmig.wire.errors import AccelmigError
    with tls_pool(pki) as first:
        dev = connect(first.endpoint, TOKEN, cafile=str(pki["pki"].ca), agent=False, auto_reconnect=False)
        kept = dev._session.link._tls_session
        assert kept is not None and kept.has_ticket
    with tls_pool(pki) as second:
        try:
            link = dev._session.link
            link._tls_session_endpoint = second.endpoint     # as if the restarted pool kept its address
            with pytest.raises(AccelmigError) as lost:
                dev.resume(second.endpoint)
            assert lost.value.code == "SESSION_LOST"
            assert not link.tls_resumed
        finally:
            dev.close()
