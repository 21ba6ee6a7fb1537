"""What etcd holds of a lab's pool of two nodes, seen from inside the lab.

etcd listens only on the lab's cluster network (lab/topology.py), which the
machine's own namespace cannot reach, so the lab runs this module inside a
pool node's namespace (``python -m accelmig.lab.etcdview``) and reads its
JSON lines.  It reads etcd with the pool's own client
(``accelmig.pool.cluster``): what a test sees is what the nodes see.

``nodes``: the live nodes, one JSON object (name -> name, instance, data,
control, devices, sessions, lease).  ``watch PREFIX``: first
``{"watching": REVISION}`` once the watch is in place (a caller synchronises
on it), then one line per event from that revision on: ``{"type": "PUT" or
"DELETE", "key": ..., "value": ... or null}``; it ends when etcd does (a
restart ends every watch).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import queue
import subprocess
import sys
import threading

from . import netns


def _store(endpoint: str, ca: str | None, cert: str | None, key: str | None):
    from accelmig.pool.cluster.store import ClusterStore, ClusterTLS
    from accelmig.wire.dataplane import parse_endpoint
    tls = ClusterTLS(ca, cert, key or "") if ca else None
    return ClusterStore([parse_endpoint(endpoint)], tls=tls)


def _print(record: dict) -> None:
    sys.stdout.write(json.dumps(record, sort_keys=True) + "\n")
    sys.stdout.flush()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m accelmig.lab.etcdview", description=__doc__.split("\n")[0])
    parser.add_argument("--endpoint", required=True, help="etcd's client endpoint, HOST:PORT")
    parser.add_argument("--ca", help="etcds://: the CA that verifies etcd (with --cert and --key)")
    parser.add_argument("--cert", help="etcds://: the client certificate etcd asks for")
    parser.add_argument("--key", help="etcds://: its key")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("nodes", help="the live pool nodes, as one JSON object")
    watch = sub.add_parser("watch", help="events under a key prefix, one JSON line each")
    watch.add_argument("prefix", help="a key prefix, e.g. /accelmig/v1/nodes/")
    args = parser.parse_args(argv)
    store = _store(args.endpoint, args.ca, args.cert, args.key)
    if args.command == "nodes":
        from accelmig.pool.cluster.registry import live_nodes
        _print({name: dataclasses.asdict(view) for name, view in live_nodes(store).items()})
        return 0
    _, revision = store.range(args.prefix)
    events, cancel = store.watch_prefix(args.prefix, start_revision=revision + 1)
    _print({"watching": revision})
    try:
        for event in events:
            kv = event["kv"]
            kind = event.get("type", "PUT")
            value = kv.get("value", b"")
            _print({"type": kind, "key": kv["key"].decode(errors="replace"),
                    "value": json.loads(value) if kind != "DELETE" and value else None})
    finally:
        cancel()
    return 0


class EtcdWatch:
    """``watch PREFIX`` run in a lab namespace, its lines in a queue.

    ::

        with EtcdWatch(ns, endpoint, prefix) as watch:      # returns once the watch is in place
            ...
            watch.wait(lambda e: e["type"] == "DELETE" and e["key"] == key, timeout=30)
    """

    def __init__(self, ns: str, endpoint: str, prefix: str, timeout: float = 30.0, tls_args: list = ()):
        self.seen: queue.Queue = queue.Queue()
        self.proc = subprocess.Popen(netns.exec_argv(ns, [sys.executable, "-m", "accelmig.lab.etcdview",
                                                          "--endpoint", endpoint, *tls_args, "watch", prefix]),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            self.wait(lambda e: "watching" in e, timeout, "the watch to be in place")
        except BaseException:
            self.close()
            raise

    def _pump(self):
        try:
            for line in self.proc.stdout:
                try:
                    self.seen.put(json.loads(line))
                except ValueError:
                    continue
        except (OSError, ValueError):   # closed under us by close()
            pass
        self.seen.put(None)          # it ended

    def wait(self, predicate, timeout: float = 30.0, what: str = "such an etcd event") -> dict:
        """The first event from now on for which ``predicate`` holds."""
        while True:
            try:
                event = self.seen.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no {what} within {timeout} s") from None
            if event is None:
                raise AssertionError(f"the etcd watch ended before {what}: {self.proc.stderr.read()[-2000:]}")
            if predicate(event):
                return event

    def close(self) -> None:
        """Stop the watcher by its PID (it is our child)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            stream.close()

    def __enter__(self) -> "EtcdWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def live_nodes(ns: str, endpoint: str, timeout: float = 30.0, tls_args: list = ()) -> dict:
    """``nodes`` run once in namespace ``ns``: the live nodes as etcd holds
    them (``tls_args``: ``--ca``, ``--cert``, ``--key`` for etcds://)."""
    out = subprocess.run(netns.exec_argv(ns, [sys.executable, "-m", "accelmig.lab.etcdview", "--endpoint",
                                              endpoint, *tls_args, "nodes"]),
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"reading etcd's nodes failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


if __name__ == "__main__":
    sys.exit(main())
