"""Accelerator VMs that nobody marked (a Nova instance: Nova's XML, Nova's
qemu-guest-agent channel, nothing of accelmig's): the guest's driver tells
the pool its SMBIOS UUID at open, the pool lists the domains that hold
sessions (``accel_domains``), every hostd learns them, attests the ones
running on its host and caches the list for the hook, which is then strict
for them even with hostd down — and answers Nova's XML unchanged, byte for
byte.  A real pool, a real hostd against libvirt's test:///default driver,
the hook as libvirt runs it (a process)."""

from __future__ import annotations

import json
import sys
import uuid as uuid_module

import libvirt
import pytest

from accelmig.agent.driver import connect
from accelmig.lab.poolthread import PoolThread
from accelmig.plugin.domain.model import DomainXML
from accelmig.wire.control import ControlClient
from accelmig.wire.dataplane import domain_claim
from accelmig.wire.errors import BadRequest, TicketRequired, WrongHost
from tests.conftest import ALICE, TENANTS
from tests.plugin.test_hook import run_hook
from tests.plugin.test_qga import fake_qga, local_agent  # noqa: F401  (fixtures)
from tests.support.attest import bind
from tests.support.hostd import SECRET, HostdThread, write_config
from tests.support.wait import wait_for

#: Nova's shape, as far as this test driver can hold it: Nova's metadata
#: namespace, its SMBIOS sysinfo, qemu-guest-agent's channel, no accelmig
NOVA_XML = """<domain type='test'>
  <name>{name}</name>
  <uuid>{uuid}</uuid>
  <metadata>
    <nova:instance xmlns:nova="http://openstack.org/xmlns/libvirt/nova/1.1">
      <nova:name>{name}</nova:name>
    </nova:instance>
  </metadata>
  <memory>65536</memory><vcpu>1</vcpu>
  <sysinfo type='smbios'><system><entry name='uuid'>{uuid}</entry></system></sysinfo>
  <os><type arch='x86_64'>hvm</type><smbios mode='sysinfo'/></os>
  <devices>
    <interface type='bridge'><mac address='fa:16:3e:2a:00:01'/><source bridge='br-int'/></interface>
    <channel type='unix'><source mode='bind'/><target type='virtio' name='org.qemu.guest_agent.0'/></channel>
  </devices>
</domain>
"""


@pytest.fixture
def neutron_pool():
    """A pool whose host knows no guest networks: on a Neutron tenant network
    a guest's address says nothing about its host (bindings come from hostd)."""
    with PoolThread(TENANTS, {"hostA": (SECRET, [])}) as pool:
        yield pool


def accel_domains(pool, since=None) -> dict:
    with ControlClient(pool.control_endpoint, "hostA", SECRET.encode()) as client:
        return client.call("accel_domains", since=since)


def with_interval(config: str, seconds: float) -> str:
    with open(config, "a") as handle:
        handle.write(f"accel_domains_interval = {seconds}\n")      # [hostd] is the file's last table
    return config


def test_a_session_tells_the_pool_which_domain_it_is_and_the_pool_lists_it(neutron_pool):
    domain = str(uuid_module.uuid4())
    assert accel_domains(neutron_pool)["domains"] == {}
    with connect(neutron_pool.endpoint, ALICE, agent=False, domain=domain.upper()) as dev:
        answer = accel_domains(neutron_pool)
        # canonical (lower case); one session waiting to be attested, never its id
        assert answer["domains"] == {domain: 1} and dev.sid not in str(answer)
        assert accel_domains(neutron_pool, since=answer["version"]) == {"version": answer["version"],
                                                                       "unchanged": True}
        described = neutron_pool.session(dev.sid)
        assert described["claimed_domain"] == domain
        assert described["domain_uuid"] is None and described["bound_host"] is None   # a claim binds nothing
        with connect(neutron_pool.endpoint, ALICE, agent=False, domain=False) as silent:
            assert accel_domains(neutron_pool, since=answer["version"])["unchanged"] is True
            assert neutron_pool.session(silent.sid)["claimed_domain"] is None
    wait_for(lambda: accel_domains(neutron_pool)["domains"] == {}, what="the closed session's domain gone")


@pytest.mark.parametrize("bad", ["not-a-uuid", "7c2f6a4e-1d3b-4c8e-9a5f-0b1c2d3e4f5", 12, ["x"]])
def test_a_domain_that_is_no_uuid_is_refused(neutron_pool, bad):
    with pytest.raises(BadRequest, match="domain must be a UUID"):
        domain_claim(bad)
    with pytest.raises(BadRequest, match="domain must be a UUID"):
        connect(neutron_pool.endpoint, ALICE, agent=False, domain=bad)


def guest_exec_through(config: str, agent_socket: str) -> str:
    """hostd's guest-exec runs the agent command of this machine's Python
    against ``agent_socket`` (what qemu-ga runs in a Nova guest)."""
    with open(config, "a") as handle:
        handle.write(f'guest_exec_command = ["/bin/sh", "-c", '
                     f'"exec {sys.executable} -m accelmig.agent \\"$@\\" --socket {agent_socket}", "sh"]\n')
    return config


def test_hostd_attests_the_sessions_of_a_domain_nobody_marked_and_caches_it_for_the_hook(
        neutron_pool, tmp_path, local_agent, fake_qga):
    """The pool says which domains hold sessions waiting to be attested —
    never their ids; hostd asks the guest of the one running here, through
    guest-exec (``accelmig-agent prove --stdin``: a real agent and the
    session's real driver prove it), binds it with that proof, and writes
    the domain's migration token into it."""
    conn = libvirt.open("test:///default")
    domain = str(uuid_module.uuid4())
    dom = conn.defineXML(NOVA_XML.format(name="instance-0000002a", uuid=domain))
    dom.create()
    # a host-bound fabric here: its addresses are for accelmig's own NICs, never Neutron's
    fabric = '[fabric]\nmode = "bridge"\nbridge = "fab0"\nguest_subnet = "10.89.1.0/24"\n'
    config = guest_exec_through(with_interval(write_config(tmp_path, neutron_pool, fabric=fabric), 0.1),
                                local_agent)
    hostd = HostdThread(config).start()
    try:
        daemon = hostd.daemon
        wait_for(lambda: daemon.watches.is_foreign(domain), what="the instance seen, foreign (no sessions)")
        with connect(neutron_pool.endpoint, ALICE, agent=local_agent, domain=domain) as dev:
            wait_for(lambda: neutron_pool.session(dev.sid)["domain_uuid"] == domain, what="the session attested")
            assert neutron_pool.session(dev.sid)["bound_host"] == "hostA"
            assert "guest-exec" in fake_qga.calls          # proven by the guest, not taken from the pool
            watch = daemon.watches.get(domain)
            assert watch is not None and watch.delivery.name == "guest-exec"
            assert dev.sid in watch.sessions
            cache = json.loads((tmp_path / "state" / "accel-domains.json").read_text())
            assert cache["domains"] == [domain] and cache["host"] == "hostA"
            assert (tmp_path / "state" / "accel-domains.json").stat().st_mode & 0o777 == 0o644
            # what a rehome tells its guest: where the pool is, no NIC to re-address
            assert watch.marked is False and watch.fabric_mac is None
            identity = hostd.call(lambda: daemon.identity_for(watch))
            assert identity.guest_nic is None and identity.pool_endpoint
            # the domain's sessions are this host's: a migration token in the running domain, registered
            wait_for(lambda: watch.token_registered, what="the domain's migration token registered")
            assert DomainXML.parse(dom.XMLDesc(0)).migration_token() == watch.token
            assert not DomainXML.parse(dom.XMLDesc(0)).is_accelmig()       # it marks nothing
    finally:
        hostd.stop()
        dom.destroy()
        dom.undefine()
        conn.close()


def test_hostd_asks_libvirt_nothing_more_for_domains_without_sessions(neutron_pool, tmp_path):
    """50 foreign domains and a pool that lists sessions of domains elsewhere:
    hostd's libvirt calls stay where they were, poll after poll."""
    conn = libvirt.open("test:///default")
    created = [conn.defineXML(NOVA_XML.format(name=f"instance-{n:08x}", uuid=uuid_module.uuid4()))
               for n in range(50)]
    for dom in created:
        dom.create()
    config = with_interval(write_config(tmp_path, neutron_pool), 0.1)
    hostd = HostdThread(config).start()
    elsewhere = str(uuid_module.uuid4())      # a domain on another host holds a session
    try:
        daemon = hostd.daemon
        wait_for(lambda: all(daemon.watches.is_foreign(d.UUIDString()) for d in created),
                 what="the 50 instances seen")
        with connect(neutron_pool.endpoint, ALICE, agent=False, domain=elsewhere):
            wait_for(lambda: elsewhere in daemon.accel_domains, what="hostd learned the other domain")
            polls = daemon.metrics.record_steps.labels("accel_domains")._value.get()
            before = dict(daemon.libvirt.calls)
            wait_for(lambda: daemon.metrics.record_steps.labels("accel_domains")._value.get() >= polls + 10,
                     what="ten more polls")
            assert dict(daemon.libvirt.calls) == before
            assert len(daemon.watches) == 0
            assert daemon._absent == {elsewhere}       # looked up once: not here
    finally:
        hostd.stop()
        for dom in created:
            dom.destroy()
            dom.undefine()
        conn.close()


def write_cache(tmp_path, *domains: str) -> None:
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    (state / "accel-domains.json").write_text(json.dumps({"host": "hostA", "domains": list(domains)}))


def test_the_hook_is_strict_for_a_listed_domain_with_hostd_down(neutron_pool, tmp_path):
    domain = str(uuid_module.uuid4())
    xml = NOVA_XML.format(name="instance-0000002b", uuid=domain).encode()
    config = write_config(tmp_path, neutron_pool, strict=True)
    # not listed: somebody else's domain, passed silently, XML untouched
    write_cache(tmp_path, str(uuid_module.uuid4()))
    assert run_hook(config, "instance-0000002b", "migrate", "begin", "-", xml=xml)[:3] == (0, "", "")
    # listed (its guest holds sessions) and hostd down: refused
    write_cache(tmp_path, domain)
    code, out, err, _ = run_hook(config, "instance-0000002b", "migrate", "begin", "-", xml=xml)
    assert code == 1 and out == ""
    assert "refusing migrate of instance-0000002b to host hostA" in err and "strict mode" in err
    # the word in a path or a description is no mark: still Nova's, still refused
    named = xml.replace(b"<memory>", b"<description>from /var/cache/accelmig-lab/vmlinux</description><memory>")
    code, out, err, _ = run_hook(config, "instance-0000002b", "migrate", "begin", "-", xml=named)
    assert code == 1 and "refusing migrate of instance-0000002b" in err, err
    # lenient: it goes ahead, Nova's XML answered as it came
    lenient = write_config(tmp_path, neutron_pool, strict=False)
    code, out, err, _ = run_hook(lenient, "instance-0000002b", "migrate", "begin", "-", xml=xml)
    assert code == 0 and out == "" and "lenient mode" in err


def test_the_hook_leaves_novas_xml_to_libvirt_as_it_came_and_hostd_opens_the_record(neutron_pool, tmp_path):
    """No answer on stdout: libvirt keeps Nova's destination XML byte for byte
    (an answer, even the same bytes, would be re-parsed and taint the domain
    "hook-script"); tests/e2e/test_nova.py checks the arrived domain."""
    domain = str(uuid_module.uuid4())
    # Nova's destination XML as it comes: attribute order, quotes, blank
    # lines and a comment a model round trip would not keep
    xml = ("<!-- nova -->\n" + NOVA_XML.format(name="instance-0000002c", uuid=domain)
           .replace("<vcpu>1</vcpu>", "<vcpu  placement=\"static\">1</vcpu>\n\n")).encode()
    config = write_config(tmp_path, neutron_pool, strict=True)
    write_cache(tmp_path, domain)
    hostd = HostdThread(config).start()
    try:
        code, out, err, _ = run_hook(config, "instance-0000002c", "migrate", "begin", "-", xml=xml)
        assert code == 0, err
        assert out == ""
        records = ControlClient(neutron_pool.control_endpoint, "hostA", SECRET.encode()).call(
            "list_records", domain_uuid=domain)["records"]
        assert [(r["dest_host"], r["state"]) for r in records] == [("hostA", "open")]
    finally:
        hostd.stop()


def test_guest_exec_command_is_read_from_host_toml(tmp_path, neutron_pool):
    from accelmig.plugin.config import HostConfig
    from accelmig.wire.errors import ConfigInvalid
    config = write_config(tmp_path, neutron_pool)
    with open(config, "a") as handle:
        handle.write('guest_exec_command = ["/usr/bin/python3", "/opt/accelmig/accelmig-agent.pyz"]\n')
    assert HostConfig.load(config).hostd.guest_exec_command == ("/usr/bin/python3",
                                                                "/opt/accelmig/accelmig-agent.pyz")
    for bad in ('["python3", "-m", "accelmig.agent"]', "[]", '["/usr/bin/python3", ""]', '"/usr/bin/python3"'):
        text = write_config(tmp_path, neutron_pool)
        with open(text, "a") as handle:
            handle.write(f"guest_exec_command = {bad}\n")
        with pytest.raises(ConfigInvalid, match="guest_exec_command"):
            HostConfig.load(text)


def test_a_session_on_a_tenant_network_moves_by_attestation_and_ticket_not_by_address():
    """Neutron: the guest's address is the same on every host and names none
    (here 127.0.0.1, in no host's networks), so the pool cannot tell the
    host from it.  The binding is what hostA attested, the ticket that hostB's
    hostd delivered moves it; a reconnect from that address needs no ticket
    outside a move.  A session opened from a host's network (a host-bound
    fabric) is still checked by address."""
    from tests.support.twohosts import SECRETS
    hosts = {"hostA": (SECRETS["hostA"], []), "hostB": (SECRETS["hostB"], ["::1/128"])}
    domain = str(uuid_module.uuid4())
    with PoolThread(TENANTS, hosts, listen="127.0.0.1:0,[::1]:0") as pool:
        port = pool.endpoint.rsplit(":", 1)[1]
        tenant_net, host_b_net = f"127.0.0.1:{port}", f"[::1]:{port}"
        a = ControlClient(pool.control_endpoint, "hostA", SECRETS["hostA"].encode())
        b = ControlClient(pool.control_endpoint, "hostB", SECRETS["hostB"].encode())
        with a, b, connect(tenant_net, ALICE, agent=False, domain=domain, timeout=10) as dev:
            bind(a, dev, domain)
            assert pool.session(dev.sid)["bound_host"] == "hostA"
            dev.resume(tenant_net)                        # a blip: same address, no move, no ticket
            record = b.call("open_migration", domain_uuid=domain)
            a.call("switchover", domain_uuid=domain)
            tickets = b.call("complete", domain_uuid=domain, migration_id=record["migration_id"])["tickets"]
            with pytest.raises(TicketRequired):
                dev.resume(tenant_net)                    # moving: the ticket is needed
            assert dev.resume(tenant_net, tickets[dev.sid])["ticket"]
            assert pool.session(dev.sid)["bound_host"] == "hostB"
            assert dev.info()["name"]
            with connect(host_b_net, ALICE, agent=False, timeout=10) as pinned:
                assert pool.session(pinned.sid)["bound_host"] == "hostB"
                with pytest.raises(WrongHost, match="bound to host hostB"):
                    pinned.resume(tenant_net)
