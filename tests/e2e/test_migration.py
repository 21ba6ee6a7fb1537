"""End to end: real libvirt daemons, real QEMU guests (TCG) computing on a
real pool, real live migrations — and every way they go wrong.

One lab for the module: pool + hostA + hostB, hostd and the hook on each.
Each test boots its own VM running the demo solver (state in device
memory, intermediate variables in the guest) and checks its final result
against a run that never migrated.  Tests that abort or kill something
mid-migration first slow the migration down (virsh migrate-setspeed), so
they are not races.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time

import libvirt
import pytest

from accelmig.lab.accel import AccelLab, demo_command
from accelmig.lab.image import ImageSpec, build_image

pytestmark = [pytest.mark.root, pytest.mark.libvirt, pytest.mark.vm, pytest.mark.slow]

STEPS = 1000
PAUSE = 0.3          # seconds between progress reports: the solver runs ~15-20 s (outlives
                     # a second VM's boot and a migration or two)
LEASE = 6            # the lab pool's record lease, for the tests that wait it out


@pytest.fixture(scope="module")
def accel():
    with AccelLab(f"e2e{os.getpid() % 10000}", pool_args=["--lease-ttl", str(LEASE)]) as lab:
        yield lab


@pytest.fixture(scope="module")
def reference(accel):
    return accel.reference(steps=STEPS)


@pytest.fixture(scope="module")
def image(accel):
    return accel.demo_image(steps=STEPS, pause=PAUSE)


@pytest.fixture
def vms(accel):
    """Names of VMs a test boots; destroyed afterwards wherever they are."""
    names: list[str] = []
    yield names
    for host in accel.lab.HOSTS:
        for name in names:
            with contextlib.suppress(libvirt.libvirtError):
                accel.lab.connect(host).lookupByName(name).destroy()


def boot(accel, vms, name, image, host="hostA", **values):
    vms.append(name)
    accel.boot(name, image, host, **values)
    return accel.wait_demo(name, lambda ls: [l for l in ls if "step" in l], timeout=120,
                           what=f"{name}'s solver to start")


def uuid_of(accel, name):
    return accel.lab.connect(accel.where(name)).lookupByName(name).UUIDString()


def diagnosis(accel, *vms) -> str:
    out = [f"--- hostd {h} ---\n" + "\n".join(accel.hostd_log(h).splitlines()[-30:]) for h in accel.lab.HOSTS]
    for vm in vms:
        out.append(f"--- console {vm} ---\n" + "\n".join(accel.console(vm)[-40:]))
    return "\n".join(out)


def check_hot(result, accel, *vms):
    """What a hot move must be: rehomed, nothing re-sent, nothing rebuilt."""
    assert result["ok"], f"{result}\n{diagnosis(accel, *vms)}"
    assert result["resumed"] == result["sessions"] >= 1, f"{result}\n{diagnosis(accel, *vms)}"
    assert result["bytes_resent"] == 0 and result["rebuilds"] == 0, result


def slow(accel, host, name, mib_per_s=4):
    out = accel.virsh(host, "migrate-setspeed", name, str(mib_per_s))
    assert out.returncode == 0, out.stderr


def start_migration(accel, name, src, dst, *extra):
    dest_uri, migrate_uri = accel.lab.migration_uris(dst)
    return subprocess.Popen(["virsh", "-c", accel.lab.uri(src), "migrate", "--live", "--p2p", *extra, name,
                             dest_uri, "--migrateuri", migrate_uri],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_job(accel, host, name, timeout=20):
    dom = accel.lab.connect(host).lookupByName(name)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if dom.jobInfo()[0] != libvirt.VIR_DOMAIN_JOB_NONE:
            return dom
        time.sleep(0.05)
    raise AssertionError(f"no migration job on {host} for {name}")


def wait_transferring(accel, host, name, timeout=20):
    """Until QEMU's migration stream of ``name`` really flows from ``host``
    (the destination's QEMU is up and receiving): the job exists before that."""
    dom = wait_job(accel, host, name, timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if dom.jobStats().get("memory_processed"):
            return dom
        time.sleep(0.05)
    raise AssertionError(f"{name}'s migration from {host} transfers nothing: {dom.jobStats()}")


def hostd_status(accel, host, timeout=20):
    """``accelmig status`` as hostd answers it (its ``status`` request)."""
    from accelmig.wire.localapi import LocalClient
    return LocalClient(str(accel.hostd_socket(host)), timeout=timeout).call("status")


def hostd_domain(accel, host, uuid, predicate, timeout=60, what="hostd's view of the domain"):
    """hostd's own ``status`` entry of domain ``uuid``, once ``predicate`` holds."""
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline:
        seen = next((d for d in hostd_status(accel, host)["domains"] if d["uuid"] == uuid), None)
        if seen is not None and predicate(seen):
            return seen
        time.sleep(0.1)
    raise AssertionError(f"{what} on {host}: {json.dumps(seen)}\n{diagnosis(accel)}")


def check_timeline(data: dict, what: str) -> None:
    """A real migration's timeline: every step there (the lab's fabric is
    host-bound, so the guest's NIC is re-addressed), in causal order within
    the uncertainties, the guest's claims marked as such."""
    from accelmig.wire.records import STEP_NAMES, Side, Timeline
    timeline = Timeline.from_wire(data)
    assert set(STEP_NAMES) - set(timeline.steps) == set(), f"{what}: missing steps\n{timeline.table()}"
    assert timeline.out_of_order() == [], f"{what}: out of order\n{timeline.table()}"
    assert {s for s, stamp in timeline.steps.items() if stamp.side is Side.GUEST} == \
        {"agent_received", "nic_readdressed", "driver_connected"}, timeline.table()


def record_by_id(accel, uuid, mid, predicate, timeout=30, what="record state"):
    """Record ``mid`` of domain ``uuid`` once ``predicate`` holds for it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = next((r for r in accel.records(uuid) if r["migration_id"] == mid), None)
        if record is not None and predicate(record):
            return record
        time.sleep(0.2)
    raise AssertionError(f"{what}: {accel.records(uuid)}\n{diagnosis(accel)}")


def record_of(accel, uuid, predicate, timeout=30, what="record state"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = accel.records(uuid)
        if records:
            latest = max(records, key=lambda r: r["times"]["opened"])
            if predicate(latest):
                return latest
        time.sleep(0.2)
    raise AssertionError(f"{what}: {accel.records(uuid)}\n{diagnosis(accel)}")


def begin_slow_migration(accel, vms, image, name):
    """Boot ``name`` on A and start a throttled A->B migration (a failure
    injected now lands mid-migration, not after it)."""
    boot(accel, vms, name, image)
    uuid = uuid_of(accel, name)
    slow(accel, "hostA", name, 4)
    migration = start_migration(accel, name, "hostA", "hostB")
    wait_job(accel, "hostA", name)
    return uuid, migration


def assert_failed_and_still_at_a(accel, migration, name):
    migration.communicate(timeout=60)
    assert migration.returncode != 0, "the migration should have failed"
    assert accel.where(name) == "hostA"


def test_a_to_b_to_a_bit_identical_with_zero_rebuilds_and_reuploads(accel, vms, image, reference):
    boot(accel, vms, "vm-aba", image)
    moves = [accel.migrate_virsh("vm-aba", "hostA", "hostB"),
             accel.migrate_virsh("vm-aba", "hostB", "hostA"),
             accel.migrate_accelmig("vm-aba", "hostA", "hostB")]
    for move in moves:
        check_hot(move, accel)
        assert move["downtime_ms"] is not None and max(move["blackout_ms"].values()) > 0
    assert moves[2]["cli"]["rehomed"] and moves[2]["cli"]["resumed"] == 1, json.dumps(moves[2]["cli"])
    # every step of each real migration, on the pool's clock, in causal order
    uuid = uuid_of(accel, "vm-aba")
    for move in moves:
        mid = move["record"]["migration_id"]
        record = record_by_id(accel, uuid, mid, lambda r: {"answered", "first_command"} <= set(r["timeline"]),
                              what=f"the timeline of {mid}")
        check_timeline(record["timeline"], f"{move['via']} -> {move['to']}")
    cli_timeline = moves[2]["cli"]["timeline"]          # accelmig migrate --json carries it
    assert {"switchover", "resumed_seen", "agent_received", "resume_answered"} <= set(cli_timeline), cli_timeline
    status_records = [r for r in hostd_status(accel, "hostB")["records"]    # so does accelmig status --json
                      if r["migration_id"] == moves[2]["record"]["migration_id"]]
    assert status_records and "resume_answered" in status_records[0]["timeline"], status_records
    from accelmig.wire.localapi import LocalClient
    metrics = LocalClient(str(accel.hostd_socket("hostB"))).call("metrics")["text"]
    assert 'accelmig_host_rehomes_total{result="ok"}' in metrics
    done = accel.demo_done("vm-aba")
    assert done["sha256"] == reference["sha256"], "the result differs from a run that never migrated"
    assert done["resumes"] == 3 and done["epoch"] == 4
    # (zero rebuilds and zero re-uploads per move: check_hot, from the pool's counters)


def test_a_guest_rehomed_where_it_runs_moves_nothing_and_migrates_hot_afterwards(accel, vms, image, reference):
    """hostd's rehome_here (bench/blackout's warm baseline) in a real guest:
    its NIC re-addressed to the spare address and back, its driver resumed
    over a new connection each time, at a new epoch, still bound to hostA;
    a migration afterwards is as hot as ever, the result bit-identical."""
    boot(accel, vms, "vm-here", image)
    uuid = uuid_of(accel, "vm-here")
    epochs = []
    for address in ("spare", "lease"):
        answer = accel.rehome_here("vm-here", "hostA", address)
        assert answer["ok"] and (answer["sessions"], answer["resumed"]) == (1, 1), \
            f"{answer}\n{diagnosis(accel, 'vm-here')}"
        assert any(change.endswith(f"added {answer['address']}/24") for change in answer["network"]), answer
        steps = answer["timeline"]
        assert [s for s in ("delivering", "agent_received", "nic_readdressed", "driver_connected", "answered")
                if s in steps] == ["delivering", "agent_received", "nic_readdressed", "driver_connected",
                                   "answered"], steps
        assert all(steps[a]["t"] <= steps[b]["t"] for a, b in zip(("delivering", "agent_received"),
                                                                    ("agent_received", "answered")))
        (session,) = accel.sessions(uuid)
        assert session["bound_host"] == "hostA", session
        epochs.append(session["epoch"])
    assert epochs[1] == epochs[0] + 1
    assert not [r for r in accel.records(uuid)], "a rehome here opens no migration record"
    check_hot(accel.migrate_virsh("vm-here", "hostA", "hostB"), accel, "vm-here")
    done = accel.demo_done("vm-here")
    assert done["sha256"] == reference["sha256"], "the result differs from a run that never migrated"
    assert done["resumes"] == 3


def test_migrations_over_qemu_ssh_as_operators_type_them(accel, vms, image, reference):
    """``virsh migrate --live --p2p vm qemu+ssh://root@hostB/system`` and
    ``accelmig migrate`` with such a URI: the source's libvirtd reaches the
    destination's through that host's real sshd (lab/ssh.py), host key
    checked; the hook, hostd and the rehome are the same as over TCP."""
    if not accel.lab.ssh:
        pytest.skip("SKIPPED LOUDLY: the lab runs no sshd (openssh-server missing: ./dev.sh setup installs it)")
    boot(accel, vms, "vm-ssh", image)
    there = accel.migrate_virsh("vm-ssh", "hostA", "hostB", transport="ssh")
    check_hot(there, accel, "vm-ssh")
    back = accel.migrate_accelmig("vm-ssh", "hostB", "hostA", transport="ssh")
    check_hot(back, accel, "vm-ssh")
    assert back["cli"]["rehomed"] and back["cli"]["resumed"] == 1, json.dumps(back["cli"])
    assert accel.where("vm-ssh") == "hostA"
    # it really went over ssh: each destination's sshd let the other host's root in
    for host, peer in (("hostB", "10.88.3.1"), ("hostA", "10.88.3.2")):
        log = (accel.lab.nodes[host].root / "sshd" / "sshd.log").read_text(errors="replace")
        assert f"Accepted publickey for root from {peer}" in log, log[-2000:]
    done = accel.demo_done("vm-ssh")
    assert done["sha256"] == reference["sha256"] and done["resumes"] == 2, done


def test_postcopy_rehomes_when_the_guest_runs_on_b(accel, vms, image, reference):
    boot(accel, vms, "vm-post", image)
    uuid = uuid_of(accel, "vm-post")
    # Pre-copy throttled hard, then post-copy at once: the guest runs on B
    # long before its memory is there (switching late could find pre-copy done).
    slow(accel, "hostA", "vm-post", 2)
    migration = start_migration(accel, "vm-post", "hostA", "hostB", "--postcopy")
    dom = wait_job(accel, "hostA", "vm-post")
    deadline = time.monotonic() + 20        # QEMU's migration itself running (capabilities set)
    while time.monotonic() < deadline and not dom.jobStats().get("memory_processed"):
        time.sleep(0.05)
    switch = accel.virsh("hostA", "migrate-postcopy", "vm-post")
    assert switch.returncode == 0, switch.stderr
    out, err = migration.communicate(timeout=180)
    assert migration.returncode == 0, err
    record = record_of(accel, uuid, lambda r: r["state"] in ("completed", "closed") and r["resumed"],
                       what="post-copy rehome")
    # The source's SUSPENDED_POSTCOPY is the point of no return (the destination
    # may see RESUMED_POSTCOPY or, racing libvirt's own status event, RESUMED_MIGRATED).
    assert "domain vm-post: SUSPENDED_POSTCOPY" in accel.hostd_log("hostA"), diagnosis(accel, "vm-post")
    assert "committed" in record["times"], "post-copy must commit the record (no way back)"
    assert record["postcopy"] and record["times"]["committed"] <= record["times"]["completed"]
    assert accel.where("vm-post") == "hostB"
    assert accel.demo_done("vm-post")["sha256"] == reference["sha256"]


def test_a_third_host_changes_nothing_of_a_real_migration_and_the_token_vouches_for_its_destination(
        accel, vms, image, reference):
    """hostA's hostd, once its guest's session is its own, writes a migration
    token into the running domain; the real ``virsh migrate`` carries it to
    hostB, whose hook opens the record with it (vouched).  Meanwhile hostC —
    a host the pool knows, with its own certificate and secret — opens the
    same domain's migration with the pause policy ``start`` and tries every
    step of the real one: nothing of it takes.  hostB then writes a token of
    its own."""
    from accelmig.lab.netns import entered
    from accelmig.lab.rig import POOL_CONTROL_PORT
    from accelmig.lab.topology import POOL_ADDRESS
    from accelmig.plugin.domain.model import DomainXML
    from accelmig.wire.control import ControlClient
    from accelmig.wire.errors import AccelmigError, Forbidden
    boot(accel, vms, "vm-third", image)
    uuid = uuid_of(accel, "vm-third")
    seen = hostd_domain(accel, "hostA", uuid, lambda d: d["migration_token"]["registered"],
                        what="hostA's token written and registered")
    dom_a = accel.lab.connect("hostA").lookupByName("vm-third")
    token_a = DomainXML.parse(dom_a.XMLDesc(0)).migration_token()
    assert token_a and seen["session_count"] >= 1
    lab = accel.lab
    c = ControlClient(f"{POOL_ADDRESS}:{POOL_CONTROL_PORT}", "hostC", lab.state["host_secrets"]["hostC"].encode(),
                      tls=lab.control_tls("hostC"))
    try:
        with entered(lab.topology.host_ns["hostB"]):       # (hostC calls from a host's network)
            c.call("ping")
        slow(accel, "hostA", "vm-third", 4)
        migration = start_migration(accel, "vm-third", "hostA", "hostB")
        record = record_of(accel, uuid, lambda r: r["state"] == "open" and r["dest_host"] == "hostB",
                           what="record opened by B's hook")
        assert record["vouched"], record
        wait_transferring(accel, "hostA", "vm-third")
        refused = []
        for method, args in (("open_migration", {"policy": "start"}),
                             ("complete", {"migration_id": record["migration_id"]}),
                             ("switchover", {"migration_id": record["migration_id"]}),
                             ("abort", {"migration_id": record["migration_id"], "reason": "hostC"}),
                             ("park", {"retention": 3600})):
            try:
                c.call(method, domain_uuid=uuid, **args)
            except Forbidden as exc:
                refused.append((method, str(exc)))
            except AccelmigError as exc:
                raise AssertionError(f"hostC's {method}: {exc}") from None
            else:
                raise AssertionError(f"hostC's {method} was taken\n{diagnosis(accel, 'vm-third')}")
        assert [m for m, _ in refused] == ["open_migration", "complete", "switchover", "abort", "park"], refused
        assert not any(s["paused"] for s in accel.sessions(uuid)), accel.sessions(uuid)
        slow(accel, "hostA", "vm-third", 8192)       # done: the rest at full speed, the solver still runs
        out, err = migration.communicate(timeout=120)
        assert migration.returncode == 0, err
        done = record_by_id(accel, uuid, record["migration_id"],
                            lambda r: r["state"] in ("completed", "closed") and r["resumed_count"] >= 1,
                            timeout=60, what="the real migration rehomed")
        assert [r["migration_id"] for r in accel.records(uuid)] == [record["migration_id"]], accel.records(uuid)
        assert done["session_count"] == done["resumed_count"]
        # the domain is hostB's now: a token of its own, not the one that came with it
        hostd_domain(accel, "hostB", uuid, lambda d: d["migration_token"]["registered"],
                     what="hostB's token written and registered")
        token_b = DomainXML.parse(accel.lab.connect("hostB").lookupByName("vm-third").XMLDesc(0)).migration_token()
        assert token_b and token_b != token_a
        assert accel.demo_done("vm-third")["sha256"] == reference["sha256"]
    finally:
        c.close()


def test_an_aborted_precopy_leaves_the_vm_running_at_the_source(accel, vms, image, reference):
    uuid, migration = begin_slow_migration(accel, vms, image, "vm-abort")
    # B's hook opened the record and QEMU's stream flows: a migration in pre-copy for real
    record_of(accel, uuid, lambda r: r["state"] == "open" and r["dest_host"] == "hostB", what="record opened by B")
    wait_transferring(accel, "hostA", "vm-abort")
    abort = accel.virsh("hostA", "domjobabort", "vm-abort")
    assert abort.returncode == 0, abort.stderr
    assert_failed_and_still_at_a(accel, migration, "vm-abort")
    record = record_of(accel, uuid, lambda r: r["state"] == "aborted", what="abort")
    # aborted before it completed: no session was frozen, no ticket minted
    assert record["dest_host"] == "hostB" and record["sessions"] == [] and "completed" not in record["times"]
    done = accel.demo_done("vm-abort")
    assert done["sha256"] == reference["sha256"] and done["resumes"] == 0   # never even reconnected


def test_the_destination_qemu_dies_mid_migration(accel, vms, image, reference):
    uuid, migration = begin_slow_migration(accel, vms, image, "vm-qemu")
    record_of(accel, uuid, lambda r: r["state"] == "open", what="record opened by B")
    wait_transferring(accel, "hostA", "vm-qemu")      # B's QEMU runs and receives
    pid_file = accel.lab.node("hostB").host_path("/run/libvirt/qemu/vm-qemu.pid")
    killed = time.time()
    os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)
    assert_failed_and_still_at_a(accel, migration, "vm-qemu")
    record = record_of(accel, uuid, lambda r: r["state"] == "aborted", what="abort by B's hostd")
    # B's hostd saw its incoming domain stop (libvirt's STOPPED event while
    # arriving) and aborted at once: not the source's job check, not the lease
    assert record["abort_reason"] == "the incoming migration failed on the destination (by hostB)", record
    assert record["times"]["aborted"] - killed < 3, record       # the lease would take >= LEASE s
    log = accel.hostd_log("hostB")
    assert "domain vm-qemu: STOPPED_" in log and \
        f"record {record['migration_id']} aborted: the incoming migration failed" in log, diagnosis(accel)
    assert accel.demo_done("vm-qemu")["sha256"] == reference["sha256"]


def test_the_destination_libvirtd_dies_mid_migration(accel, vms, image, reference):
    before = hostd_status(accel, "hostB")["libvirt"]
    assert before["connected"], before
    reconciled = accel.hostd_log("hostB").count("reconciled in")
    uuid, migration = begin_slow_migration(accel, vms, image, "vm-lvd")
    record_of(accel, uuid, lambda r: r["state"] == "open", what="record opened by B")
    node = accel.lab.node("hostB")
    os.kill(node.pid, signal.SIGKILL)
    try:
        # B's hostd notices: blind to its libvirt (and so it vouches for nothing)
        deadline = time.monotonic() + 20
        while hostd_status(accel, "hostB")["libvirt"]["connected"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not hostd_status(accel, "hostB")["libvirt"]["connected"], "B's hostd never saw libvirtd die"
        assert_failed_and_still_at_a(accel, migration, "vm-lvd")
        # A's hostd sees its migration job gone with the guest running there: it
        # aborts (within its vouch grace and a renewal or two; never the lease)
        record = record_of(accel, uuid, lambda r: r["state"] == "aborted", timeout=LEASE * 4,
                           what="abort")
        assert record["abort_reason"].startswith("no migration job on the source any more") and \
            record["abort_reason"].endswith("(by hostA)"), record
    finally:
        node.stop()
        node.start()
        node.wait_ready()
        accel.lab.state["nodes"]["hostB"] = node.state()
        accel.lab._write_state()
        accel.lab._conns.pop("hostB", None)
    accel.wait_hostd("hostB")
    # B's hostd reconnected to the new libvirtd and reconciled after it
    after = hostd_status(accel, "hostB")["libvirt"]
    assert after["connected"] and after["reconnects"] > before["reconnects"], (before, after)
    deadline = time.monotonic() + 20
    while accel.hostd_log("hostB").count("reconciled in") <= reconciled and time.monotonic() < deadline:
        time.sleep(0.1)
    assert accel.hostd_log("hostB").count("reconciled in") > reconciled, diagnosis(accel)
    assert accel.demo_done("vm-lvd")["sha256"] == reference["sha256"]


def test_hostd_down_strict_refuses_lenient_reconciles_later(accel, vms, image, reference):
    boot(accel, vms, "vm-hostd", image)
    uuid = uuid_of(accel, "vm-hostd")
    accel.stop_hostd("hostB")
    try:
        refused = accel.migrate_virsh("vm-hostd", "hostA", "hostB")
        assert not refused["ok"] and "refusing migrate of vm-hostd to host hostB" in refused["error"]
        assert accel.where("vm-hostd") == "hostA"
        accel.set_strict("hostB", False)
        dest_uri, migrate_uri = accel.lab.migration_uris("hostB")
        out = accel.virsh("hostA", "migrate", "--live", "--p2p", "vm-hostd", dest_uri, "--migrateuri", migrate_uri)
        assert out.returncode == 0, out.stderr
        assert accel.where("vm-hostd") == "hostB"
    finally:
        accel.set_strict("hostB", True)
        accel.start_hostd("hostB")
    accel.wait_hostd("hostB")
    record = record_of(accel, uuid, lambda r: r["dest_host"] == "hostB" and r["resumed"], timeout=60,
                       what="rehome after reconciliation")
    assert record["state"] in ("completed", "closed")
    assert accel.demo_done("vm-hostd")["sha256"] == reference["sha256"]


def test_save_restore_and_a_second_restore_refused_as_diverged(accel, vms, reference, tmp_path):
    # a solver that runs long enough for the first restored copy to still be
    # computing when the second copy comes
    image = accel.demo_image(steps=4000, pause=PAUSE)
    boot(accel, vms, "vm-save", image)
    uuid = uuid_of(accel, "vm-save")
    saved = accel.lab.dir / "vm-save.img"
    out = accel.virsh("hostA", "save", "vm-save", str(saved))
    assert out.returncode == 0, out.stderr
    deadline = time.monotonic() + 20          # hostd parks at the STOPPED_SAVED event
    while time.monotonic() < deadline:
        parked = accel.sessions(uuid)
        if parked and all(s["parked"] for s in parked):
            break
        time.sleep(0.1)
    assert parked and all(s["parked"] for s in parked), parked
    sid = parked[0]["sid"]
    out = accel.virsh("hostA", "restore", str(saved))
    assert out.returncode == 0, out.stderr
    # the first copy resumes and computes on
    # (the restored guest's console log starts afresh: its lines are all new)
    accel.wait_demo("vm-save", lambda ls: len([l for l in ls if "step" in l]) >= 3, timeout=120,
                    what="the restored solver computing on")
    epoch = next(s for s in accel.sessions(uuid) if s["sid"] == sid)["epoch"]
    assert epoch >= 2 and not next(s for s in accel.sessions(uuid) if s["sid"] == sid)["parked"]
    # the same image restored a second time: an older copy of the session
    accel.lab.connect("hostA").lookupByName("vm-save").destroy()
    out = accel.virsh("hostA", "restore", str(saved))
    assert out.returncode == 0, out.stderr
    refusal = accel.wait_demo("vm-save", lambda ls: next((l for l in ls if l.get("done") is False), None),
                              timeout=120, what="the second copy refused")
    assert refusal["error"]["code"] == "SESSION_DIVERGED" and "older copy" in refusal["error"]["message"]
    # loudly: the pool logs the refusal (the driver's own reconnect or hostd's
    # resume after the restore, whichever comes first, meets it)
    pool_log = (accel.lab.dir / "pool" / "pool.log").read_text()
    assert f"resume of {sid}" in pool_log and "SESSION_DIVERGED" in pool_log
    # the pool's session is untouched by the refusal
    after = next((s for s in accel.sessions() if s["sid"] == sid), None)
    assert after is not None, (sid, accel.sessions(), pool_log[-3000:])
    assert after["epoch"] == epoch


def test_two_vms_migrated_at_once(accel, vms, image, reference):
    # both booted before either is waited for: booted one after the other on
    # a loaded machine, the first solver (~15-20 s) once ended before the move
    for name in ("vm-e1", "vm-e2"):
        vms.append(name)
        accel.boot(name, image, "hostA")
    for name in ("vm-e1", "vm-e2"):
        accel.wait_demo(name, lambda ls: [l for l in ls if "step" in l], timeout=120,
                        what=f"{name}'s solver to start")
    results = {}

    def move(name):
        results[name] = accel.migrate_virsh(name, "hostA", "hostB")

    threads = [threading.Thread(target=move, args=(n,)) for n in ("vm-e1", "vm-e2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    for name in ("vm-e1", "vm-e2"):
        check_hot(results[name], accel, name)
        assert accel.where(name) == "hostB"
        assert accel.demo_done(name)["sha256"] == reference["sha256"]


def test_a_vm_with_two_applications(accel, vms, reference):
    one = demo_command(accel.token, STEPS, 128, 20, PAUSE)
    image = accel.image(app_command=f"({one}) & ({one}); wait")
    boot(accel, vms, "vm-two", image)
    uuid = uuid_of(accel, "vm-two")
    # both applications past their upload (each launches after it): a move
    # while one still uploads would count its first upload as re-sent
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        sessions = accel.sessions(uuid)
        if len(sessions) == 2 and all(s["counters"]["launches"] > 0 for s in sessions):
            break
        time.sleep(0.2)
    result = accel.migrate_virsh("vm-two", "hostA", "hostB")
    check_hot(result, accel)
    assert result["sessions"] == 2
    dones = accel.wait_demo("vm-two", lambda ls: [l for l in ls if "done" in l] if
                            len([l for l in ls if "done" in l]) == 2 else None, timeout=300, what="both apps")
    assert {d["sha256"] for d in dones} == {reference["sha256"]} and len({d["sid"] for d in dones}) == 2


def test_a_vm_with_only_qemu_guest_agent_is_rehomed_through_guest_exec(accel, vms, reference):
    from accelmig.lab.topology import POOL_ADDRESS
    app = demo_command(accel.token, STEPS, 128, 20, PAUSE).replace(
        "--wait-endpoint 120", f"--endpoint {POOL_ADDRESS}:7070")
    image = build_image(ImageSpec(app_command=app, with_qemu_ga=True), cache=accel.lab.cache)
    plan = accel.lab.topology.host("hostA")
    boot(accel, vms, "vm-nova", image, agent_channel=False, qemu_guest_agent=True,
         cmdline_options={"agent_port": "none", "net": f"{plan.guest_address(50)},{plan.gateway}"})
    result = accel.migrate_virsh("vm-nova", "hostA", "hostB")
    check_hot(result, accel, "vm-nova")
    log = accel.hostd_log("hostB")
    assert "domain vm-nova has no accelmig channel: rehoming through qemu-guest-agent guest-exec" in log
    assert "custom-ga-command" in log          # the taint libvirt records, said out loud
    assert accel.demo_done("vm-nova")["sha256"] == reference["sha256"]


def test_a_pool_blip_at_resumed_is_retried_until_the_sessions_resume(accel, vms, image, reference):
    """The pool's control plane swallows the destination's first ``complete``
    (a relay in hostB's namespace holds it, then drops it): hostd must not
    strand the sessions — it retries the rehome until they resume."""
    from accelmig.lab import netns
    from accelmig.lab.cutproxy import CutProxy
    from accelmig.lab.rig import POOL_CONTROL_PORT
    from accelmig.lab.topology import POOL_ADDRESS
    boot(accel, vms, "vm-blip", image)
    uuid = uuid_of(accel, "vm-blip")
    control = f"{POOL_ADDRESS}:{POOL_CONTROL_PORT}"
    # the relay lives in hostB's network namespace (its threads too), where hostd runs, on
    # its loopback: an address the lab pool's certificate names (hostd verifies it, TLS)
    proxy = netns.in_thread(accel.lab.ns_of("hostB"), CutProxy, control, "127.0.0.1:0")
    config = accel.config_path("hostB")
    original = config.read_text()
    assert f'control = "{control}"' in original
    try:
        accel.stop_hostd("hostB")
        config.write_text(original.replace(f'control = "{control}"', f'control = "{proxy.endpoint}"'))
        accel.start_hostd("hostB")
        accel.wait_hostd("hostB")                 # it reached the pool: through the relay
        assert hostd_status(accel, "hostB")["pool"]["control"] == proxy.endpoint
        slow(accel, "hostA", "vm-blip", 4)
        migration = start_migration(accel, "vm-blip", "hostA", "hostB")
        # B's hook opened the record (through the relay) and B's hostd awaits the guest
        record_of(accel, uuid, lambda r: r["state"] == "open" and r["dest_host"] == "hostB",
                  what="record opened by B")
        hostd_domain(accel, "hostB", uuid, lambda d: d["phase"] == "incoming", what="B awaiting the guest")
        wait_transferring(accel, "hostA", "vm-blip")
        proxy.hold()                              # from now on nothing B's hostd sends reaches the pool
        slow(accel, "hostA", "vm-blip", 100000)   # let the migration finish now
        out, err = migration.communicate(timeout=120)
        assert migration.returncode == 0, err
        assert accel.where("vm-blip") == "hostB"
        # the guest runs on B; B's first complete got no answer, and hostd says it will retry
        seen = hostd_domain(accel, "hostB", uuid,
                            lambda d: d["phase"] == "rehoming" and d["rehome_retry"]
                            and "complete" in d["rehome_retry"]["why"], timeout=90,
                            what="B's rehome waiting to be retried")
        assert seen["rehome_retry"]["attempts"] >= 1 and seen["rehome_retry"]["why"].startswith("Unavailable")
        record = accel.records(uuid)
        record = max(record, key=lambda r: r["times"]["opened"])
        # stranded: the pool never saw a complete (switched over by A, no tickets, nobody resumed)
        assert record["state"] == "switched_over" and not record["resumed"], record
        assert "completed" not in record["times"], record
        # the blip ends: what the relay held (that first complete) is dropped, never delivered
        assert proxy.cut() >= 1
        proxy.release()
        record = record_of(accel, uuid, lambda r: r["state"] in ("completed", "closed") and r["sessions"]
                           and set(r["sessions"]) <= set(r["resumed"]), timeout=60, what="rehome after the blip")
        after = hostd_domain(accel, "hostB", uuid, lambda d: d["phase"] == "running", timeout=30,
                             what="B's rehome done")
        assert after["rehome_retry"] is None and after["last_rehome"]["ok"], after
        log = accel.hostd_log("hostB")
        assert "rehome failed" in log and "will retry" in log, diagnosis(accel, "vm-blip")
        assert f"rehome {record['migration_id']} succeeded on attempt" in log, diagnosis(accel, "vm-blip")
        done = accel.demo_done("vm-blip")
        assert done["sha256"] == reference["sha256"] and done["resumes"] == 1, done
    finally:
        proxy.release()
        accel.stop_hostd("hostB")
        config.write_text(original)
        accel.start_hostd("hostB")
        accel.wait_hostd("hostB")
        proxy.close()
