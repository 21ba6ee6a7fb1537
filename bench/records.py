"""Migration records across pool nodes: what a migration's control steps
cost when the VM's sessions live on two nodes of a pool on etcd (every step
one etcd transaction at the node reached first, then followed by the
other; ``complete`` at both, the tickets' union), beside the same steps at
a single node with no etcd (the baseline), in one run: a real etcd and
real ``accelmig-pool serve`` processes on loopback, hostd's own routing
(``PoolNodes``) as the host's control client, four sessions (two per node
in the pool).  Each row is the median over ``--repeat`` migrations of the
step's time as hostd sees it (the call and every node's answer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

from bench.common import Table, driver_proofs, report
from tests.support.etcd import EtcdServer  # the tests' one etcd toolkit

TOKEN = "bench-token-0001"
SECRETS = {"hostA": "hostA-bench-secret-0123456789", "hostB": "hostB-bench-secret-9876543210"}
STEPS = ("open_migration", "switchover", "complete", "close")


class Node:
    def __init__(self, workdir: str, name: str, *cluster: str):
        directory = os.path.join(workdir, name)
        os.makedirs(directory)
        tokens, hosts = os.path.join(directory, "tokens.toml"), os.path.join(directory, "hosts.toml")
        with open(tokens, "w") as handle:
            handle.write(f'[tenants.bench]\ntoken = "{TOKEN}"\nquota = "16GiB"\nmax_sessions = 4096\n')
        with open(hosts, "w") as handle:
            handle.write("".join(f'[hosts.{h}]\nsecret = "{s}"\n' for h, s in SECRETS.items()))
        exe = os.path.join(os.path.dirname(sys.executable), "accelmig-pool")
        self.proc = subprocess.Popen([exe, "serve", "--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0",
                                      "--admin-socket", "", "--insecure", "--tokens", tokens, "--hosts", hosts,
                                      "--device-isolation", "none", "--log-level", "WARNING", *cluster],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"pool {name} did not start ({self.proc.wait()})")
        self.ready = json.loads(line)
        self.endpoint, self.control = self.ready["data"], self.ready["control"]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


async def bind(routing, devs, domain: str) -> None:
    """hostd's binds with its guest's proofs: each session at the node that made it."""
    by_node: dict = {}
    for dev in devs:
        by_node.setdefault(await routing.node_for_sid(dev.sid), []).append(dev)
    for client, group in by_node.items():
        issued = await client.call("bind_challenge")
        answer = await client.call("bind_sessions", domain_uuid=domain, challenge=issued["challenge"],
                                   sessions=driver_proofs(group, issued, client.host, domain))
        if answer["refused"]:
            raise RuntimeError(f"sessions not bound: {answer['refused']}")


async def measure(coordinator: str, devs, repeat: int) -> dict[str, list[float]]:
    """``repeat`` migrations A -> B of one domain holding ``devs``' sessions:
    each step's seconds as hostd's routing sees it."""
    from accelmig.plugin.hostd.nodes import PoolNodes
    from accelmig.wire.control import AsyncControlClient

    def routing(host):
        def make(endpoint):
            return AsyncControlClient(endpoint, host, SECRETS[host].encode())
        return PoolNodes(make(coordinator), make)

    a, b = routing("hostA"), routing("hostB")
    times: dict[str, list[float]] = {step: [] for step in STEPS}
    try:
        for nodes in (a, b):
            await nodes.refresh()
        for _ in range(repeat):
            domain = str(uuid.uuid4())
            await bind(a, devs, domain)
            start = time.perf_counter()
            mid = (await b.call("open_migration", domain_uuid=domain))["migration_id"]
            times["open_migration"].append(time.perf_counter() - start)
            start = time.perf_counter()
            await a.call("switchover", domain_uuid=domain, migration_id=mid)
            times["switchover"].append(time.perf_counter() - start)
            start = time.perf_counter()
            done = await b.call_all("complete", domain_uuid=domain, migration_id=mid)
            times["complete"].append(time.perf_counter() - start)
            assert len(done["tickets"]) == len(devs), done
            start = time.perf_counter()
            await a.call("close", domain_uuid=domain, migration_id=mid)
            times["close"].append(time.perf_counter() - start)
            for dev in devs:          # the sessions go on at A: each migration starts from there
                await a.call("unbind_session", sid=dev.sid, domain_uuid=domain)
    finally:
        for nodes in (a, b):
            await nodes.close()
            await nodes.coordinator.close()
    return times


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench records", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=30, help="migrations per setting [30]")
    args = parser.parse_args(argv)
    os.environ["ACCELMIG_INSECURE"] = "1"
    from accelmig.agent.driver import connect

    workdir = tempfile.mkdtemp(prefix="accelmig-bench-records-")
    etcd = EtcdServer(workdir).start()
    nodes, devs = [], []
    try:
        single = Node(workdir, "single")
        nodes.append(single)
        cluster = ("--cluster", f"etcd://{etcd.endpoint}", "--cluster-ttl", "10")
        n1 = Node(workdir, "n1", *cluster, "--node-name", "n1")
        n2 = Node(workdir, "n2", *cluster, "--node-name", "n2")
        nodes += [n1, n2]

        def sessions(*endpoints):
            return [connect(e, TOKEN, agent=False, auto_reconnect=False) for e in endpoints]

        alone = sessions(*[single.endpoint] * 4)
        spread = sessions(n1.endpoint, n2.endpoint, n1.endpoint, n2.endpoint)
        devs = alone + spread
        homes = sorted(d.endpoint for d in spread)
        if homes != sorted([n1.endpoint, n2.endpoint] * 2):
            raise SystemExit(f"the pool's sessions are not two per node: {homes}")
        baseline = asyncio.run(measure(single.control, alone, args.repeat))
        subject = asyncio.run(measure(n1.control, spread, args.repeat))
        table = Table("Migration records: a VM's sessions on two pool nodes (etcd) vs one node",
                      "one node", "two nodes")
        for step in STEPS:
            table.add(step, statistics.median(baseline[step]) * 1e3, statistics.median(subject[step]) * 1e3, "ms")
        whole = [sum(t) for t in zip(*baseline.values())], [sum(t) for t in zip(*subject.values())]
        table.add("the four steps", statistics.median(whole[0]) * 1e3, statistics.median(whole[1]) * 1e3, "ms")
        report(table, "records", {"args": vars(args), "sessions": 4})
    finally:
        for dev in devs:
            dev.close()
        for node in nodes:
            node.stop()
        etcd.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
