"""OpenStack Nova, for real: VMs built by Nova's own config classes and
live-migrated by Nova's own ``Guest.migrate()`` with the flags Nova's
driver computes (``accelmig.lab.nova``), in the lab — real libvirt, real
QEMU (TCG), qemu-guest-agent in the guest, no accelmig channel, nothing of
accelmig in the XML, the guest's address on the tenant network the same on
both hosts (Neutron's way: the pool cannot tell the host from it).

The guest's driver tells the pool its SMBIOS UUID (Nova's instance UUID);
the hosts' hostd learn from the pool that the instance holds sessions,
attest them, and rehome it through qemu-guest-agent ``guest-exec``.

- A->B->A with Nova's default flags: the session bit-identical, nothing
  rebuilt or re-sent; Nova's XML kept as Nova wrote it (no hook answer, no
  ``hook-script`` taint); strict mode refuses the move while B's hostd is down;
- post-copy (``live_migration_permit_post_copy``) switched mid-way with
  Nova's ``migrate_start_postcopy``;
- a migration Nova aborts (``Guest.abort_job``): the VM goes on at A;
- an instance without sessions: never touched (no record, no watch).

One lab for the module, torn down in a ``finally``.  About 2-3 minutes here.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import uuid as uuid_module

import pytest

pytestmark = [pytest.mark.root, pytest.mark.libvirt, pytest.mark.vm, pytest.mark.slow]

libvirt = pytest.importorskip("libvirt")
pytest.importorskip("nova", reason="SKIPPED LOUDLY: Nova's code is not installed (the nova-test extra)")

from accelmig.lab.accel import AccelLab, TENANT  # noqa: E402
from accelmig.lab.image import build_image  # noqa: E402
from accelmig.lab.nova import (nova_define_and_start, nova_destination_xml, nova_domain_xml,  # noqa: E402
                               nova_image_spec, nova_live_migration_flags, nova_migrate)
from accelmig.lab.rig import POOL_DATA_PORT  # noqa: E402
from accelmig.lab.topology import POOL_ADDRESS  # noqa: E402
from accelmig.plugin.domain.model import DomainXML  # noqa: E402
from tests.support.wait import wait_for  # noqa: E402

STEPS = 1000
PAUSE = 0.3


def nova_demo_command(token: str, steps: int, size: int = 128, report: int = 20, pause: float = PAUSE) -> str:
    """The demo solver as a tenant runs it in a Nova instance: it knows the
    pool's endpoint itself (no accelmig channel tells it); TLS as the lab's
    kernel command line says (``ACCELMIG_CAFILE``)."""
    return (f"python3 -m accelmig.agent.demoapp --endpoint {POOL_ADDRESS}:{POOL_DATA_PORT} --token {token} "
            f"--steps {steps} --size {size} --report {report} --pause {pause} --timeout 120 --prefix 'DEMO '")


@pytest.fixture(scope="module")
def accel():
    with AccelLab(f"nova{os.getpid() % 10000}") as lab:
        yield lab


@pytest.fixture(scope="module")
def image(accel):
    token = accel.lab.tenants[TENANT][0]
    return build_image(nova_image_spec(app_command=nova_demo_command(token, STEPS)), cache=accel.lab.cache)


@pytest.fixture(scope="module")
def reference(accel):
    return accel.reference(steps=STEPS, size=128)


@pytest.fixture
def instances(accel):
    """Nova instances a test boots (persistent domains): destroyed and
    undefined afterwards, wherever they are."""
    names: list[str] = []
    yield names
    for host in accel.lab.HOSTS:
        for name in names:
            with contextlib.suppress(libvirt.libvirtError):
                dom = accel.lab.connect(host).lookupByName(name)
                with contextlib.suppress(libvirt.libvirtError):
                    dom.destroy()
                dom.undefine()


def spawn(accel, instances, image, index: int, *, app: bool = True) -> tuple[str, str]:
    """Nova's spawn on hostA: its XML, defined then started.  (name, uuid)."""
    instance_uuid = str(uuid_module.uuid4())
    name = f"instance-{index:08x}"
    instances.append(name)
    xml = nova_domain_xml(name, instance_uuid, image, accel.lab, tenant_index=index,
                          cmdline_options={} if app else {"app": False})
    # nothing of accelmig's: no metadata, no channel (only the lab image's
    # paths and kernel words name it)
    assert not DomainXML.parse(xml).is_accelmig() and "org.accelmig" not in xml
    nova_define_and_start(accel.lab, "hostA", xml)
    return name, instance_uuid


def hostd_status(accel, host):
    from accelmig.wire.localapi import LocalClient
    return LocalClient(str(accel.hostd_socket(host)), timeout=20).call("status")


def diagnosis(accel, *names) -> str:
    out = [f"--- hostd {h} ---\n" + "\n".join(accel.hostd_log(h).splitlines()[-30:]) for h in accel.lab.HOSTS]
    for name in names:
        out.append(f"--- console {name} ---\n" + "\n".join(accel.console(name)[-30:]))
    return "\n".join(out)


def attested(accel, name, uuid):
    """The instance's session, once hostA attested it and hostB knows the
    instance holds sessions (B's hook is strict for it from then on)."""
    wait_for(lambda: [l for l in accel.demo_lines(name) if "step" in l], 120, f"{name}'s solver started", 0.2,
             explain=lambda: diagnosis(accel, name))
    sessions = wait_for(lambda: [s for s in accel.sessions(uuid) if s["bound_host"] == "hostA"], 30,
                        f"{name}'s session attested by hostA", 0.2, explain=lambda: diagnosis(accel, name))
    wait_for(lambda: uuid in hostd_status(accel, "hostB")["accel_domains"], 30, "hostB knows the instance", 0.2)
    assert len(sessions) == 1 and sessions[0]["claimed_domain"] == uuid
    return sessions[0]


def record_of(accel, uuid, predicate, timeout=60, what="record"):
    def latest():
        records = accel.records(uuid)
        record = max(records, key=lambda r: r["times"]["opened"]) if records else None
        return record if record is not None and predicate(record) else None
    return wait_for(latest, timeout, what, 0.2,
                    explain=lambda: json.dumps(accel.records(uuid)) + "\n" + diagnosis(accel))


def qemu_log(accel, host, name) -> str:
    path = accel.lab.node(host).host_path(f"/var/log/libvirt/qemu/{name}.log")
    return path.read_text(errors="replace") if path.exists() else ""


def start_nova_migration(accel, name, src, dst, *, postcopy=False, bandwidth=2):
    """Nova's ``Guest.migrate`` on a thread (as Nova's driver runs it beside
    its monitor), throttled (``live_migration_bandwidth``, MiB/s) so that
    what the test does next lands mid-migration."""
    from nova.virt.libvirt.guest import Guest
    dest_uri, migrate_uri = accel.lab.migration_uris(dst)
    dom = accel.lab.connect(src).lookupByName(name)
    outcome: dict = {}

    def run():
        try:
            Guest(dom).migrate(dest_uri, migrate_uri=migrate_uri, flags=nova_live_migration_flags(postcopy),
                               migrate_disks=[], destination_xml=nova_destination_xml(dom),
                               bandwidth=bandwidth)
            outcome["ok"] = True
        except libvirt.libvirtError as exc:
            outcome["error"] = str(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    # QEMU's stream really flowing (the job exists before that)
    wait_for(lambda: dom.jobStats().get("memory_processed"), 30, f"{name}'s migration transferring", 0.05,
             errors=(libvirt.libvirtError,), explain=lambda: str(outcome))
    return Guest(dom), thread, outcome


def test_a_nova_instance_moves_a_b_a_with_novas_own_migrate_and_its_session_intact(
        accel, instances, image, reference):
    name, uuid = spawn(accel, instances, image, 21)
    session = attested(accel, name, uuid)
    before = accel.counters()[session["sid"]]
    # strict: B's hook refuses while B's hostd is down, though nothing in
    # Nova's XML says accelmig (B's cache of the pool's accel_domains does)
    accel.stop_hostd("hostB")
    try:
        with pytest.raises(libvirt.libvirtError, match=f"refusing migrate of {name} to host hostB"):
            nova_migrate(accel.lab, name, "hostA", "hostB")
        assert accel.where(name) == "hostA"
    finally:
        accel.start_hostd("hostB")
    accel.wait_hostd("hostB")
    xml_sent = {}
    for src, dst in (("hostA", "hostB"), ("hostB", "hostA")):
        dom = accel.lab.connect(src).lookupByName(name)
        xml_sent[dst] = nova_destination_xml(dom)
        move = nova_migrate(accel.lab, name, src, dst, destination_xml=xml_sent[dst])
        assert move["flags"] == nova_live_migration_flags()
        record = record_of(accel, uuid, lambda r: r["dest_host"] == dst and session["sid"] in r["resumed"],
                           what=f"{name} rehomed on {dst}")
        assert record["state"] in ("completed", "closed"), record
        assert accel.where(name) == dst
        # Nova's XML is what libvirt runs: its NIC, no accelmig, never
        # answered by the hook (an answer would taint the domain hook-script)
        live = accel.lab.connect(dst).lookupByName(name).XMLDesc(0)
        assert "org.accelmig" not in live and "accelmig:domain" not in live
        assert "<source bridge='ten0'/>" in live
        assert "hook-script" not in qemu_log(accel, dst, name), qemu_log(accel, dst, name)
        # Nova's flags: persistent at the destination, undefined at the source
        assert accel.lab.connect(dst).lookupByName(name).isPersistent()
        with pytest.raises(libvirt.libvirtError):
            accel.lab.connect(src).lookupByName(name)
    # (while the solver still runs: its session ends with it)
    after = accel.counters().get(session["sid"])
    assert after == before, f"rebuilt or re-sent across the moves: {before} -> {after}"
    sessions = accel.sessions(uuid)
    assert [s["bound_host"] for s in sessions] == ["hostA"], json.dumps(sessions)
    # rehomed through qemu-guest-agent (libvirt's taint for it is logged)
    assert "rehoming through qemu-guest-agent guest-exec" in accel.hostd_log("hostB")
    done = accel.demo_done(name)
    assert done["sha256"] == reference["sha256"], "the result differs from a run that never migrated"
    assert done["resumes"] == 2, done


def test_postcopy_switched_by_nova_mid_migration(accel, instances, image, reference):
    name, uuid = spawn(accel, instances, image, 22)
    session = attested(accel, name, uuid)
    guest, thread, outcome = start_nova_migration(accel, name, "hostA", "hostB", postcopy=True)
    guest.migrate_start_postcopy()            # what Nova's monitor calls (force-complete, or its timeout)
    thread.join(180)
    assert outcome.get("ok"), f"{outcome}\n{diagnosis(accel, name)}"
    record = record_of(accel, uuid, lambda r: session["sid"] in r["resumed"], what="post-copy rehome")
    assert record["postcopy"] and "committed" in record["times"], record
    assert accel.where(name) == "hostB"
    done = accel.demo_done(name)
    assert done["sha256"] == reference["sha256"] and done["resumes"] == 1, done


def test_a_migration_nova_aborts_leaves_the_instance_running_at_the_source(accel, instances, image, reference):
    name, uuid = spawn(accel, instances, image, 23)
    attested(accel, name, uuid)
    guest, thread, outcome = start_nova_migration(accel, name, "hostA", "hostB")
    record_of(accel, uuid, lambda r: r["state"] == "open" and r["dest_host"] == "hostB",
              what="the record B's hook opened")
    guest.abort_job()                         # Nova: live_migration_timeout_action = abort, or an operator
    thread.join(60)
    assert "error" in outcome, outcome
    record = record_of(accel, uuid, lambda r: r["state"] == "aborted", what="the aborted record")
    assert "completed" not in record["times"], record
    assert accel.where(name) == "hostA"
    done = accel.demo_done(name)
    assert done["sha256"] == reference["sha256"] and done["resumes"] == 0, done


def test_an_instance_without_sessions_is_never_touched(accel, instances, image):
    foreign = hostd_status(accel, "hostA")["foreign_domains"]
    name, uuid = spawn(accel, instances, image, 24, app=False)
    wait_for(lambda: hostd_status(accel, "hostA")["foreign_domains"] > foreign, 30, "hostA saw the instance", 0.2)
    calls = {h: dict(hostd_status(accel, h)["libvirt"]["calls"]) for h in accel.lab.HOSTS}
    nova_migrate(accel.lab, name, "hostA", "hostB")
    assert accel.where(name) == "hostB"
    for host in accel.lab.HOSTS:
        status = hostd_status(accel, host)
        assert uuid not in [d["uuid"] for d in status["domains"]] and uuid not in status["accel_domains"]
        grown = {k: v - calls[host].get(k, 0) for k, v in status["libvirt"]["calls"].items()
                 if v != calls[host].get(k, 0)}
        # Only looks at its XML, a few: where it arrived (new there), and once
        # more after Nova's PERSIST_DEST define and UNDEFINE_SOURCE undefine
        # (a redefined domain may have been marked since: hostd looks again).
        # No other call, no watch, no record.
        assert set(grown) <= {"XMLDesc"} and grown.get("XMLDesc", 0) <= 3, (host, grown)
    assert accel.records(uuid) == []
    assert "hook-script" not in qemu_log(accel, "hostB", name)


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:"))


def _polls(accel, host) -> float:
    from accelmig.wire.localapi import LocalClient
    text = LocalClient(str(accel.hostd_socket(host)), timeout=20).call("metrics")["text"]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('accelmig_host_record_steps_total{step="accel_domains"}'))


def test_a_compute_host_with_50_foreign_nova_instances_keeps_hostd_flat(accel, instances, image):
    """50 instances Nova defines on hostB, none holding a session, and their
    configs rewritten three times (define events): hostd makes no libvirt
    call for any of them, watches none, and its memory stays where it was,
    poll after poll of the pool."""
    conn = accel.lab.connect("hostB")
    pid = accel.hostd_pid("hostB")
    status = hostd_status(accel, "hostB")
    calls, rss, polls = dict(status["libvirt"]["calls"]), _rss_kib(pid), _polls(accel, "hostB")
    names = []
    for n in range(50):
        name = f"instance-{0x100 + n:08x}"
        instances.append(name)
        names.append(name)
        conn.defineXML(nova_domain_xml(name, str(uuid_module.uuid4()), image, accel.lab, tenant_index=100 + n))
    for _ in range(3):                        # Nova rewrites an instance's config: define events
        for name in names:
            conn.lookupByName(name).setMetadata(libvirt.VIR_DOMAIN_METADATA_DESCRIPTION, "resized",
                                                None, None, libvirt.VIR_DOMAIN_AFFECT_CONFIG)
    wait_for(lambda: _polls(accel, "hostB") >= polls + 5, 60, "five more polls of the pool", 0.2)
    status = hostd_status(accel, "hostB")
    grown = {k: v - calls.get(k, 0) for k, v in status["libvirt"]["calls"].items() if v != calls.get(k, 0)}
    assert grown == {}, grown
    assert not [d for d in status["domains"] if d["name"] in names]
    assert _rss_kib(pid) - rss < 2048, f"hostd grew from {rss} to {_rss_kib(pid)} KiB"
