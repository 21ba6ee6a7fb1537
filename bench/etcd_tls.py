"""etcd over TLS: what ``etcds://`` (TLS, client certificates) costs the
pool's etcd operations beside plain ``etcd://`` (the baseline), in one run:
two real etcd processes (Debian's etcd-server) on loopback, one plain, one
on https with ``--client-cert-auth``, a CA made for the run.

- one read of the node records (what placement does at every open) and one
  put (what a node's load update does), through ``ClusterStore``;
- an open at a pool node of a cluster (``accelmig-pool serve --cluster``,
  the session kept there: one etcd read on the way), plain vs TLS.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from bench.common import Table, median_of, report
from bench.placement import TOKEN, Node
from tests.support.etcd import EtcdServer, make_etcd_pki  # the tests' one etcd toolkit


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench etcd_tls", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=200, help="operations per store measurement [200]")
    parser.add_argument("--opens", type=int, default=30, help="opens per open measurement [30]")
    args = parser.parse_args(argv)
    os.environ["ACCELMIG_INSECURE"] = "1"
    from accelmig.agent.driver import connect
    from accelmig.pool.cluster.registry import NODES
    from accelmig.pool.cluster.store import ClusterStore, ClusterTLS

    workdir = tempfile.mkdtemp(prefix="accelmig-bench-etcd-tls-")
    pki = make_etcd_pki(Path(workdir) / "pki")
    plain = EtcdServer(Path(workdir) / "plain").start()
    secure = EtcdServer(Path(workdir) / "secure", tls=pki).start()
    nodes = []
    try:
        stores = {"plain": ClusterStore([("127.0.0.1", plain.client_port)]),
                  "tls": ClusterStore([("127.0.0.1", secure.client_port)],
                                      tls=ClusterTLS(str(pki.ca), str(pki.client.cert), str(pki.client.key)))}
        results = {}
        for kind, store in stores.items():
            store.put(NODES + "bench", {"name": "bench", "sessions": 0})       # the first: a handshake
            results[kind, "range"], _ = median_of(lambda: store.range(NODES), args.repeat)
            results[kind, "put"], _ = median_of(lambda: store.put(NODES + "bench", {"name": "bench", "sessions": 1}),
                                                args.repeat)
        tls_flags = ("--cluster-tls-ca", str(pki.ca), "--cluster-tls-cert", str(pki.client.cert),
                     "--cluster-tls-key", str(pki.client.key))
        for kind, etcd, flags in (("plain", plain, ()), ("tls", secure, tls_flags)):
            pool = Node(workdir, f"node-{kind}", "--cluster", etcd.url, "--node-name", "n1", *flags)
            nodes.append(pool)

            def open_close(endpoint=pool.endpoint):
                connect(endpoint, TOKEN, agent=False, auto_reconnect=False).close()
            results[kind, "open"], _ = median_of(open_close, args.opens)
        table = Table("etcd over TLS with client certificates vs plain etcd", "etcd:// (plain)",
                      "etcds:// (TLS)")
        table.add("read the node records", results["plain", "range"] * 1e6, results["tls", "range"] * 1e6, "µs")
        table.add("put a node's record", results["plain", "put"] * 1e6, results["tls", "put"] * 1e6, "µs")
        table.add("open at a cluster node (kept)", results["plain", "open"] * 1e6, results["tls", "open"] * 1e6,
                  "µs")
        report(table, "etcd_tls", {"args": vars(args)})
    finally:
        for node in nodes:
            node.stop()
        plain.stop()
        secure.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
