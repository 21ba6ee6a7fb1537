"""etcd's own access control on top of the certificates: a real etcd on
https only with ``--client-cert-auth`` and its users and roles on
(``auth enable``), real ``accelmig-pool serve`` processes that authenticate
as an etcd user whose role grants ``/accelmig/v1/`` and nothing else, and
every way a node's etcd user can be wrong refused clearly before it serves.

A fact of etcd 3.4 these tests pin down: once auth is on, its JSON gateway
(what etcd3gw speaks) refuses any client certificate with a CommonName, so
a node with an etcd user presents one without (``pki.anonymous``)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("etcd3gw", reason="the cluster extra (pip install 'accelmig[cluster]')")

from accelmig.agent.driver import connect  # noqa: E402
from accelmig.pool.cluster.keys import PREFIX  # noqa: E402
from accelmig.pool.cluster.registry import live_nodes  # noqa: E402
from accelmig.pool.cluster.store import ClusterAuth, ClusterStore, ClusterTLS  # noqa: E402
from accelmig.pool.config import PoolConfig  # noqa: E402
from accelmig.wire.errors import ConfigInvalid, Unavailable  # noqa: E402
from tests.support.etcd import assert_never_served, etcd_tls_server, serve_against  # noqa: E402,F401
from tests.support.processes import PoolProcess, tenants_toml  # noqa: E402

POOL_PASSWORD = "pool-password-" + "7" * 16


def password_file(tmp_path, text: str, mode: int = 0o600, name: str = "etcd-password"):
    path = tmp_path / name
    path.write_text(text)
    os.chmod(path, mode)
    return path


def auth_flags(etcd, tmp_path, user: str = "pool", password: str = POOL_PASSWORD, *, cert=None) -> tuple:
    pki = etcd.tls
    cert = cert or pki.anonymous
    return ("--cluster-tls-ca", str(pki.ca), "--cluster-tls-cert", str(cert.cert),
            "--cluster-tls-key", str(cert.key), "--cluster-user", user,
            "--cluster-password-file", str(password_file(tmp_path, password + "\n", name=f"{user}-password")))


def store_as(etcd, user: str, password: str) -> ClusterStore:
    pki = etcd.tls
    return ClusterStore([("127.0.0.1", etcd.client_port)],
                        tls=ClusterTLS(str(pki.ca), str(pki.anonymous.cert), str(pki.anonymous.key)),
                        auth=ClusterAuth(user, password))


@pytest.fixture
def etcd_with_auth(etcd_tls_server):
    """etcd with access control on: ``pool`` may read and write the pool's
    prefix, ``norole`` exists but may touch nothing; ``etcd.root``: root's password."""
    etcd_tls_server.root = etcd_tls_server.enable_auth({"pool": (POOL_PASSWORD, PREFIX),
                                                        "norole": ("norole-password-1234", None)})
    return etcd_tls_server


def node(tmp_path, etcd, name: str) -> PoolProcess:
    directory = tmp_path / name
    directory.mkdir()
    return PoolProcess(directory, tenants_toml(alice="alice-token-0001"),
                       extra=("--cluster", etcd.url, "--node-name", name, "--cluster-ttl", "2",
                              "--device-isolation", "none", *auth_flags(etcd, directory)))


def test_nodes_with_an_etcd_user_register_and_place_and_the_user_is_held_to_its_prefix(tmp_path, etcd_with_auth):
    n1 = node(tmp_path, etcd_with_auth, "n1")
    n2 = node(tmp_path, etcd_with_auth, "n2")
    try:
        root = store_as(etcd_with_auth, "root", etcd_with_auth.root)
        assert set(live_nodes(root)) == {"n1", "n2"}            # both registered, under their leases
        first = connect(n1.endpoint, "alice-token-0001", agent=False, timeout=10, auto_reconnect=False)
        second = connect(n1.endpoint, "alice-token-0001", agent=False, timeout=10, auto_reconnect=False)
        try:                                                     # placement read etcd as "pool": spread
            assert {first.endpoint, second.endpoint} == {n1.endpoint, n2.endpoint}
        finally:
            first.close()
            second.close()
        pool = store_as(etcd_with_auth, "pool", POOL_PASSWORD)
        with pytest.raises(Unavailable) as refused:             # a shared etcd's other keys stay others'
            pool.put("/other-service/config", {"x": 1})
        assert "denied user 'pool'" in str(refused.value)
        assert f"--prefix readwrite {PREFIX}" in str(refused.value)
    finally:
        assert n1.stop() == 0
        assert n2.stop() == 0
    assert live_nodes(root) == {}                     # both left: their leases revoked as "pool"


def test_an_etcd_users_watch_sees_its_prefix(etcd_with_auth):
    store = store_as(etcd_with_auth, "pool", POOL_PASSWORD)
    revision = store.put(PREFIX + "watched/a", {"n": 0})
    events, cancel = store.watch_prefix(PREFIX + "watched/", start_revision=revision + 1)
    try:
        store.put(PREFIX + "watched/b", {"n": 1})
        event = next(iter(events))                      # the stream carried the token too
        assert event["kv"]["key"].decode() == PREFIX + "watched/b"
    finally:
        cancel()


def test_a_token_etcd_forgot_at_a_restart_is_renewed_and_the_node_goes_on(tmp_path, etcd_with_auth):
    store = store_as(etcd_with_auth, "pool", POOL_PASSWORD)
    store.put(PREFIX + "probe", {"n": 1})
    session = store._clients[0].session
    before = session._token
    assert before                                               # authenticated once, token kept
    n1 = node(tmp_path, etcd_with_auth, "n1")
    try:
        etcd_with_auth.restart()                                # simple tokens live in etcd's memory only
        store.put(PREFIX + "probe", {"n": 2})                   # 401 "invalid auth token", renewed, sent again
        assert session._token and session._token != before
        assert store.range(PREFIX + "probe")[0][0][1] == {"n": 2}
        # the node's own session renewed its token too: an open is placed by reading etcd again
        opened = connect(n1.endpoint, "alice-token-0001", agent=False, timeout=10, auto_reconnect=False)
        try:
            assert opened.endpoint == n1.endpoint
        finally:
            opened.close()
        assert "n1" in live_nodes(store)
    finally:
        n1.stop()


@pytest.mark.parametrize("case,reason", [
    ("wrong password", "refused user 'pool': no such user or a wrong password"),
    ("no such user", "refused user 'mallory': no such user or a wrong password"),
    ("a user without a role", "denied user 'norole'"),
    ("no user", "has authentication on: give this node an etcd user"),
    ("a certificate with a CN", "refuses, on its JSON gateway, a client certificate that carries a CommonName"),
])
def test_etcd_refuses_a_node_whose_etcd_user_is_wrong_before_it_serves(tmp_path, etcd_with_auth, case, reason):
    etcd, pki = etcd_with_auth, etcd_with_auth.tls
    flags = {                                     # made for this case only: each writes its password file
        "wrong password": lambda: auth_flags(etcd, tmp_path, "pool", "not-the-password-123"),
        "no such user": lambda: auth_flags(etcd, tmp_path, "mallory", POOL_PASSWORD),
        "a user without a role": lambda: auth_flags(etcd, tmp_path, "norole", "norole-password-1234"),
        "no user": lambda: ("--cluster-tls-ca", str(pki.ca), "--cluster-tls-cert", str(pki.anonymous.cert),
                            "--cluster-tls-key", str(pki.anonymous.key)),
        "a certificate with a CN": lambda: auth_flags(etcd, tmp_path, cert=pki.client),
    }[case]()
    assert_never_served(serve_against(tmp_path, etcd.url, *flags), reason)
    root = store_as(etcd, "root", etcd.root)
    assert root.range(PREFIX)[0] == []                         # nothing was written to etcd


def test_an_etcd_user_for_an_etcd_without_access_control_is_refused(tmp_path, etcd_tls_server):
    """Credentials that protect nothing are a misconfiguration, said before serving."""
    out = serve_against(tmp_path, etcd_tls_server.url, *auth_flags(etcd_tls_server, tmp_path))
    assert_never_served(out, "has no authentication enabled, so cluster_user 'pool' would protect nothing")


@pytest.mark.parametrize("values,reason", [
    ({"cluster": "etcds://127.0.0.1:2379", "cluster_tls_ca": "ca", "cluster_tls_cert": "c",
      "cluster_user": "pool"}, "cluster_user without cluster_password_file"),
    ({"cluster": "etcds://127.0.0.1:2379", "cluster_tls_ca": "ca", "cluster_tls_cert": "c",
      "cluster_password_file": "p"}, "cluster_password_file without cluster_user"),
    ({"cluster": "etcd://127.0.0.1:2379", "cluster_user": "pool", "cluster_password_file": "p"},
     "an etcd password goes over TLS only"),
    ({"cluster_user": "pool", "cluster_password_file": "p"}, "cluster_user without cluster"),
    ({"cluster": "etcds://127.0.0.1:2379", "cluster_tls_ca": "ca", "cluster_tls_cert": "c",
      "cluster_user": "pool\nroot", "cluster_password_file": "p"}, "cluster_user: 1 to 64 of"),
])
def test_an_etcd_user_and_its_password_go_together_over_tls_only(values, reason):
    with pytest.raises(ConfigInvalid) as refused:
        PoolConfig.load(None, values)
    assert reason in str(refused.value)


@pytest.mark.parametrize("text,mode,reason", [
    (POOL_PASSWORD + "\n", 0o604, "other users may read the password"),
    ("\n", 0o600, "must be 1 to 1024 bytes"),
    ("x" * 1025, 0o600, "must be 1 to 1024 bytes"),
])
def test_a_password_file_others_may_read_or_without_a_password_is_refused(tmp_path, etcd_tls_server,
                                                                           text, mode, reason):
    pki = etcd_tls_server.tls
    path = password_file(tmp_path, text, mode)
    out = serve_against(tmp_path, etcd_tls_server.url, "--cluster-tls-ca", str(pki.ca),
                "--cluster-tls-cert", str(pki.anonymous.cert), "--cluster-tls-key", str(pki.anonymous.key),
                "--cluster-user", "pool", "--cluster-password-file", str(path))
    assert out.returncode == 2, out.stderr[-2000:]
    assert reason in out.stderr, out.stderr[-2000:]
    assert '"ready"' not in out.stdout


def test_the_password_is_never_in_the_stores_repr_or_the_nodes_log(tmp_path, etcd_with_auth):
    assert POOL_PASSWORD not in repr(ClusterAuth("pool", POOL_PASSWORD))
    n1 = node(tmp_path, etcd_with_auth, "n1")
    try:
        n1.wait_log(lambda e: "registered" in e["msg"])      # it joined: it authenticated
    finally:
        n1.stop()
    logged = "\n".join(map(str, n1.entries()))
    assert "registered" in logged and POOL_PASSWORD not in logged
