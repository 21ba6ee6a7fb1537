"""Test support: a pool with two hypervisor hosts that need neither root nor namespaces:
hostA is IPv4 loopback (127.0.0.0/8), hostB is IPv6 loopback (::1).  The
pool listens on both, so a driver "moves" from A to B by reconnecting to the
other address family — its connections really come from the other host's
addresses as far as the pool can tell.  (tests/continuity/test_netns_moves.py
does the same with real network namespaces.)  Also ``Raw``, a
hand-driven data-plane connection."""

from __future__ import annotations

import contextlib
import socket

from accelmig.lab.poolthread import PoolThread
from accelmig.wire.control import ControlClient
from accelmig.wire.frames import FrameReader, encode_frame
from tests.support.attest import bind
from tests.support.tenants import ALICE, TENANTS
from tests.support.wait import wait_for

SECRETS = {"hostA": "hostA-secret-0123456789", "hostB": "hostB-secret-9876543210"}
HOSTS = {"hostA": (SECRETS["hostA"], ["127.0.0.0/8"]), "hostB": (SECRETS["hostB"], ["::1/128"])}


class Host:
    """A hypervisor host's view of the pool (what hostd does, by hand)."""

    def __init__(self, pool: PoolThread, name: str):
        self.name = name
        self.client = ControlClient(pool.control_endpoint, name, SECRETS[name].encode())
        port = pool.endpoint.rsplit(":", 1)[1]
        self.endpoint = f"127.0.0.1:{port}" if name == "hostA" else f"[::1]:{port}"

    def call(self, method, **args):
        return self.client.call(method, **args)


class TwoHosts:
    def __init__(self, pool: PoolThread):
        self.pool = pool
        self.a = Host(pool, "hostA")
        self.b = Host(pool, "hostB")

    def other(self, host: Host) -> Host:
        return self.b if host is self.a else self.a

    def migrate(self, domain: str, src: Host, dst: Host, *, close: bool = True) -> dict:
        """Open, switch over and complete a migration record: the tickets."""
        record = dst.call("open_migration", domain_uuid=domain)
        src.call("switchover", domain_uuid=domain)
        done = dst.call("complete", domain_uuid=domain, migration_id=record["migration_id"])
        if close:
            src.call("close", domain_uuid=domain, migration_id=record["migration_id"])
        return done

    def close(self):
        self.a.client.close()
        self.b.client.close()


def make_pool(**config) -> PoolThread:
    config.setdefault("listen", "127.0.0.1:0,[::1]:0")
    return PoolThread(TENANTS, HOSTS, **config)


@contextlib.contextmanager
def drivers_bound_at_host_a(agent, domain: str, count: int = 2):
    """A pool and its two hosts, and ``count`` drivers connected at hostA,
    registered with ``agent`` and bound to ``domain``, driver i holding a
    buffer of ``b"state-<i>"``: ``(pool, hosts, drivers, buffers)``.  The
    drivers and the hosts are closed at the end, whatever happened."""
    from accelmig.agent.driver import connect
    with make_pool() as pool:
        hosts = TwoHosts(pool)
        devs = [connect(hosts.a.endpoint, ALICE, agent=agent.socket_path, timeout=15) for _ in range(count)]
        try:
            wait_for(lambda: len(agent.sessions()) == count, what=f"{count} driver(s) registered with the agent")
            for dev in devs:
                bind(hosts.a, dev, domain)
            yield pool, hosts, devs, [dev.upload(b"state-%d" % i) for i, dev in enumerate(devs)]
        finally:
            for dev in devs:
                dev.close()
            hosts.close()


class Raw:
    """A hand-driven data-plane connection, to say what a driver never would."""

    def __init__(self, endpoint: str):
        host, port = endpoint.rsplit(":", 1)
        self.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=5)
        self.reader = FrameReader()
        self.pending: list = []
        self.payloads: dict = {}        # a reply's payload by its seq
        self.send({"op": "hello", "versions": [1]})
        self.challenge = self.recv()["challenge"]

    def send(self, header, payload=b""):
        self.sock.sendall(encode_frame(header, payload))

    def recv(self) -> dict:
        """The next frame's header; a "done" range comes as one reply per command."""
        while not self.pending:
            n = self.sock.recv_into(self.reader.get_buffer())
            if n == 0:
                raise EOFError("closed")
            for frame in self.reader.feed(n):
                if frame.op == "done":
                    self.pending += [{"op": "reply", "seq": seq, "ok": True}
                                     for seq in range(frame.header["from"], frame.header["to"] + 1)]
                else:
                    self.pending.append(frame.header)
                    if frame.payload:
                        self.payloads[frame.header.get("seq")] = bytes(frame.payload)
        return self.pending.pop(0)

    def open(self, secret=b"s" * 32):
        self.secret = secret
        self.send({"op": "open", "token": ALICE, "secret": secret.hex()})
        opened = self.recv()
        self.sid = opened["sid"]
        return opened

    def resume(self, sid, secret, epoch, last_seen, **extra):
        from accelmig.wire.dataplane import ownership_proof
        self.send({"op": "resume", "sid": sid, "epoch": epoch, "last_seen": last_seen,
                   "proof": ownership_proof(secret, self.challenge, sid, epoch), **extra})
        return self.recv()

    def close(self):
        self.sock.close()
