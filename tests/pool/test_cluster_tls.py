"""The pool's etcd connection authenticated and encrypted: a real etcd
(Debian's etcd-server) listening on https only with ``--client-cert-auth``,
real ``accelmig-pool serve`` processes joining it over ``etcds://`` with
their client certificates, and every way a node can be wrong (no
certificate, another CA's, etcd's certificate for another name, a key
others may read, plain HTTP) refused clearly before the node serves."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("etcd3gw", reason="the cluster extra (pip install 'accelmig[cluster]')")

from accelmig.agent.driver import connect  # noqa: E402
from accelmig.pool.cluster.quotas import QuotaLedger  # noqa: E402
from accelmig.pool.cluster.registry import live_nodes  # noqa: E402
from accelmig.pool.cluster.store import ClusterStore, ClusterTLS  # noqa: E402
from accelmig.pool.config import PoolConfig  # noqa: E402
from accelmig.wire.errors import ConfigInvalid, QuotaExceeded, Unavailable  # noqa: E402
from tests.support.etcd import assert_never_served, etcd_tls_server, serve_against  # noqa: E402,F401
from tests.support.processes import PoolProcess, tenants_toml  # noqa: E402

MiB = 1 << 20


def tls_flags(ca, cert, key=None) -> tuple:
    return ("--cluster-tls-ca", str(ca), "--cluster-tls-cert", str(cert),
            *(("--cluster-tls-key", str(key)) if key else ()))


def node_flags(etcd) -> tuple:
    pki = etcd.tls
    return tls_flags(pki.ca, pki.client.cert, pki.client.key)


def tls_store(etcd, host: str = "127.0.0.1", *, ca=None, cert=None, key="") -> ClusterStore:
    pki = etcd.tls
    return ClusterStore([(host, etcd.client_port)],
                        tls=ClusterTLS(str(ca or pki.ca), str(cert or pki.client.cert) if cert is not False else None,
                                       str(key or (pki.client.key if cert is None else ""))))


def node(tmp_path, etcd, name: str, *extra) -> PoolProcess:
    directory = tmp_path / f"{name}-{len(list(tmp_path.glob(name + '-*')))}"
    directory.mkdir()
    return PoolProcess(directory, tenants_toml(alice="alice-token-0001"),
                       extra=("--cluster", etcd.url, "--node-name", name, "--cluster-ttl", "2",
                              "--device-isolation", "none", *node_flags(etcd), *extra))


def test_two_nodes_register_place_and_share_a_quota_over_tls(tmp_path, etcd_tls_server):
    store = tls_store(etcd_tls_server)
    n1 = node(tmp_path, etcd_tls_server, "n1")
    n2 = node(tmp_path, etcd_tls_server, "n2")
    try:
        nodes = live_nodes(store)
        assert set(nodes) == {"n1", "n2"}
        assert nodes["n2"].instance == n2.ready["instance"]
        on_n1 = connect(n1.endpoint, "alice-token-0001", agent=False, timeout=10, auto_reconnect=False)
        on_n2 = connect(n1.endpoint, "alice-token-0001", agent=False, timeout=10, auto_reconnect=False)
        assert (on_n1.endpoint, on_n2.endpoint) == (n1.endpoint, n2.endpoint)   # placed through etcd
        on_n1.alloc(40 * MiB)
        on_n1.finish()
        on_n2.alloc(30 * MiB)        # 70 MiB > alice's 64 MiB, on two nodes: refused pool-wide
        with pytest.raises(QuotaExceeded, match="would use 41943040 of its 67108864-byte"):
            on_n2.finish()
        assert QuotaLedger(store, "reader").used("alice")[0] == 40 * MiB
        on_n1.close()
        on_n2.close()
    finally:
        assert n1.stop() == 0
        assert n2.stop() == 0
    assert live_nodes(store) == {}                     # both left (revoked) over TLS too


@pytest.mark.parametrize("who, reason", [
    ("no client certificate", "requires a client certificate"),
    ("another CA's certificate", "refused this node's client certificate"),
    ("etcd named otherwise", "Hostname mismatch"),
    ("etcd's CA unknown", "does not verify"),
])
def test_etcd_refuses_a_node_it_cannot_trust_before_that_node_serves(tmp_path, etcd_tls_server, who, reason):
    pki = etcd_tls_server.tls
    if who == "no client certificate":
        # the pool's own rule refuses this before dialing; etcd refuses it too (the store, bare)
        with pytest.raises(ConfigInvalid, match="give cluster_tls_cert"):
            PoolConfig.load(None, {"insecure": True, "cluster": etcd_tls_server.url, "cluster_tls_ca": str(pki.ca)})
        with pytest.raises(Unavailable, match="refused this node's client certificate|closed the TLS handshake"):
            tls_store(etcd_tls_server, cert=False).probe()
        out = serve_against(tmp_path, etcd_tls_server.url, "--cluster-tls-ca", str(pki.ca))
    elif who == "another CA's certificate":
        with pytest.raises(Unavailable, match="refused this node's client certificate|closed the TLS handshake"):
            tls_store(etcd_tls_server, cert=pki.stranger.cert, key=pki.stranger.key).probe()
        out = serve_against(tmp_path, etcd_tls_server.url, *tls_flags(pki.ca, pki.stranger.cert, pki.stranger.key))
        reason = "refused this node's client certificate" if "refused" in out.stderr else "closed the TLS handshake"
    elif who == "etcd named otherwise":      # its certificate names 127.0.0.1, not localhost
        out = serve_against(tmp_path, f"etcds://localhost:{etcd_tls_server.client_port}", *node_flags(etcd_tls_server))
    else:
        out = serve_against(tmp_path, etcd_tls_server.url, *tls_flags(pki.other_ca, pki.client.cert, pki.client.key))
    if who == "no client certificate":
        reason = "give cluster_tls_cert"
    assert_never_served(out, reason)
    assert live_nodes(tls_store(etcd_tls_server)) == {}      # nothing was written


def test_etcd_on_https_only_refuses_plain_http(tmp_path, etcd_tls_server):
    plain = f"etcd://{etcd_tls_server.endpoint}"
    with pytest.raises(Unavailable, match="etcd closed a plain HTTP request .* then etcds://"):
        ClusterStore([("127.0.0.1", etcd_tls_server.client_port)]).probe()
    assert_never_served(serve_against(tmp_path, plain), "then etcds://")


def test_a_client_key_other_users_may_read_is_refused_before_etcd_is_dialed(tmp_path, etcd_tls_server):
    pki = etcd_tls_server.tls
    key = tmp_path / "readable.key"
    key.write_bytes(pki.client.key.read_bytes())
    key.chmod(0o644)
    out = serve_against(tmp_path, etcd_tls_server.url, *tls_flags(pki.ca, pki.client.cert, key))
    assert_never_served(out, f"cluster_tls_key: {key} is mode 0644, other users may read")
    key.chmod(0o640)                                    # group-readable is the deploy's usual shape
    missing = serve_against(tmp_path, etcd_tls_server.url, *tls_flags(tmp_path / "no-ca.crt", pki.client.cert, key))
    assert missing.returncode == 2 and "cluster_tls_ca" in missing.stderr and "is not a file" in missing.stderr


@pytest.mark.parametrize("values, reason", [
    ({"cluster": "https://127.0.0.1:2379"}, "write etcds://HOST:PORT for TLS"),
    ({"cluster": "etcd://127.0.0.1:2379", "cluster_tls_ca": "/ca.crt"},
     "is plain etcd:// but cluster_tls_ca given"),
    ({"cluster": "etcds://127.0.0.1:2379", "cluster_tls_cert": "/c.crt"}, "give cluster_tls_ca"),
    ({"cluster": "etcds://127.0.0.1:2379", "cluster_tls_ca": "/ca.crt"}, "give cluster_tls_cert"),
    ({"cluster_tls_key": "/c.key"}, "cluster_tls_key without cluster"),
])
def test_cluster_tls_keys_are_all_or_nothing_with_the_url_that_says_tls(values, reason):
    with pytest.raises(ConfigInvalid, match=reason):
        PoolConfig.load(None, {"insecure": True, **values})
    assert PoolConfig.load(None, {"insecure": True, "cluster": "etcds://127.0.0.1:2379", "cluster_tls_ca": "/a",
                                  "cluster_tls_cert": "/b"}).cluster_tls_key == ""
