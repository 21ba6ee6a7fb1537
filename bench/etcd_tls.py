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
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import Table, median_of, report
from bench.placement import TOKEN, Node, _free_port


class PKI:
    """etcd's CA, its certificate (serverAuth and clientAuth: its gateway
    dials its own gRPC server with it) and a pool node's client certificate."""

    def __init__(self, directory: Path):
        from accelmig.lab.certs import issue, make_ca
        self.ca, key = make_ca(directory, "bench etcd CA")
        self.server = issue(directory, self.ca, key, "etcd", addresses=("127.0.0.1",), server_and_client=True)
        self.client = issue(directory, self.ca, key, "pool-node", client=True)


def make_pki(directory: Path) -> PKI:
    return PKI(directory)


class Etcd:
    def __init__(self, workdir: str, name: str, tls=None):
        client, peer = _free_port(), _free_port()
        self.port = client
        scheme = "https" if tls else "http"
        url = f"{scheme}://127.0.0.1:{client}"
        extra = [] if tls is None else ["--cert-file", str(tls.server.cert), "--key-file", str(tls.server.key),
                                        "--trusted-ca-file", str(tls.ca), "--client-cert-auth"]
        self.proc = subprocess.Popen(
            [shutil.which("etcd") or "/usr/bin/etcd", "--name", name, "--data-dir", os.path.join(workdir, name),
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
             f"http://127.0.0.1:{peer}", "--initial-cluster", f"{name}=http://127.0.0.1:{peer}",
             "--logger", "zap", "--log-outputs", "stderr", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for line in self.proc.stderr:           # its own "serving" line: ready
            if '"serving client traffic' in line or '"ready to serve client' in line:
                break
        else:
            raise SystemExit(f"etcd {name} did not start ({self.proc.wait()})")
        self.url = f"{'etcds' if tls else 'etcd'}://127.0.0.1:{client}"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(10)


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
    pki = make_pki(Path(workdir) / "pki")
    plain, secure = Etcd(workdir, "plain"), Etcd(workdir, "secure", tls=pki)
    nodes = []
    try:
        stores = {"plain": ClusterStore([("127.0.0.1", plain.port)]),
                  "tls": ClusterStore([("127.0.0.1", secure.port)],
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
