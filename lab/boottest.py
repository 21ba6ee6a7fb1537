"""``boot-test``: the lab's whole path once, with timings — boot a guest on
hostA, talk to it over the agent channel, reach the pool's namespace from
its fabric NIC (un-NATed), live-migrate it to hostB, talk to it again there,
re-address it for B's subnet and reach the pool again.

Used by ``accelmig lab boot-test`` (a smoke test for a
person setting up a machine) and as the reference sequence the end-to-end
tests check step by step.
"""

from __future__ import annotations

import contextlib
import logging
import time

import libvirt

from .guest import echo_responder_files, peer_echo_argv
from .image import GuestImage, ImageSpec, build_image
from .topology import POOL_ADDRESS

LOG = logging.getLogger("accelmig.lab.boottest")

PEER_ECHO_PORT = 7090


def echo_image(cache=None) -> GuestImage:
    """The lab image plus the echo responder (agent off on its command line)."""
    kwargs = {"cache": cache} if cache else {}
    return build_image(ImageSpec(extra_files=echo_responder_files()), **kwargs)


def start_peer_echo(lab, port: int = PEER_ECHO_PORT, timeout: float = 10.0):
    """The peer-address echo server in the pool namespace (recorded in the
    lab's state: ``down()`` stops it)."""
    log = lab.dir / "peer-echo.log"
    log.write_bytes(b"")
    with open(log, "ab") as out:
        proc = lab.spawn("peer-echo", "pool", peer_echo_argv(POOL_ADDRESS, port), stdout=out, log=log)
    deadline = time.monotonic() + timeout
    while b"listening" not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"peer echo server did not start: {log.read_text()[-1000:]}")
        time.sleep(0.02)
    return proc


def readdress_argv(lab, host: str, index: int = 10) -> list[str]:
    """What a rehome does to the guest's fabric NIC (here by hand, through
    the test responder): the new host's subnet and gateway."""
    plan = lab.topology.host(host)
    return ["sh", "-c", f"ip addr flush dev eth0 && ip addr add {plan.guest_address(index)} dev eth0 "
                        f"&& ip route replace default via {plan.gateway} dev eth0"]


def run(lab, *, image: GuestImage | None = None, domain: str = "boot-test", migrate: bool = True) -> dict:
    """Run the sequence on a lab that is up; returns measurements."""
    out: dict = {}
    t0 = time.monotonic()
    image = image or echo_image(lab.cache)
    out["image_seconds"] = time.monotonic() - t0
    out["image_build_seconds"] = image.build_seconds
    start_peer_echo(lab)
    a = lab.topology.host("hostA")
    xml = lab.domain_xml(domain, image, "hostA", cmdline=image.cmdline(net=a.guest_net(10), agent=False))
    conn_a = lab.connect("hostA")
    t0 = time.monotonic()
    conn_a.createXML(xml, 0)
    out["define_start_seconds"] = time.monotonic() - t0
    try:
        with lab.channel("hostA", domain) as ch:
            ch.wait_ready(90)
            out["boot_to_channel_seconds"] = time.monotonic() - t0
            t1 = time.monotonic()
            ch.call("echo", data="x")
            out["channel_rtt_ms"] = (time.monotonic() - t1) * 1000
            reply = ch.call("connect", host=POOL_ADDRESS, port=PEER_ECHO_PORT, timeout=10)
            out["pool_saw_from_A"] = reply["reply"].strip()
            out["guest_address_A"] = a.guest_address(10).split("/")[0]
        if migrate:
            result = lab.migrate(domain, "hostA", "hostB")
            out["migration_wall_seconds"] = result["wall"]
            out["migration_downtime_ms"] = result["downtime_ms"]
            t1 = time.monotonic()
            with lab.channel("hostB", domain) as ch:
                ch.wait_ready(30)
                out["channel_after_migration_seconds"] = time.monotonic() - t1
                out["guest_hostname"] = ch.call("info")["hostname"]
                ch.call("run", argv=readdress_argv(lab, "hostB"))
                reply = ch.call("connect", host=POOL_ADDRESS, port=PEER_ECHO_PORT, timeout=10)
                out["pool_saw_from_B"] = reply["reply"].strip()
                out["guest_address_B"] = lab.topology.host("hostB").guest_address(10).split("/")[0]
            out["source_domains_left"] = [d.name() for d in conn_a.listAllDomains()]
    finally:
        for host in ("hostA", "hostB"):
            with contextlib.suppress(libvirt.libvirtError):
                lab.connect(host).lookupByName(domain).destroy()
        lab.stop_spawned("peer-echo")
    return out
