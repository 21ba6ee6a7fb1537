"""The qemu-guest-agent fallback end to end: a VM built the way OpenStack
Nova builds them — qemu-guest-agent's channel and no accelmig channel — with
the accelmig agent running ``--port none``, a real accelerator session in the
guest, and the rehome delivered through ``guest-exec`` (accelmig.plugin.qga)
by real libvirt 9.0 to a real qemu-ga 7.2 (Debian's, unpacked into the guest
image).

- on its own host: the session resumes, the domain is marked tainted
  (custom-ga-command), broken documents and a missing agent give the agent's
  clear error and exit status;
- a guest whose qemu-ga blocks guest-exec (``--block-rpcs``, as
  distributions' policies do), a guest without qemu-ga, a domain without its
  channel: each a clear error, within the timeout;
- a live migration A→B, the host side played by hand as hostd would
  (attestation through ``accelmig-agent status``, record, tickets): the
  session resumes on B with its ticket, rehomed through guest-exec.

Every lab is torn down in a ``finally``.  About a minute here (TCG).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid

import pytest

pytestmark = [pytest.mark.root, pytest.mark.libvirt, pytest.mark.vm]

libvirt = pytest.importorskip("libvirt")

from accelmig.lab import netns  # noqa: E402
from accelmig.lab.image import ExtraFile, ImageSpec, build_image  # noqa: E402
from accelmig.lab.rig import POOL_CONTROL_PORT, POOL_DATA_PORT, Lab  # noqa: E402
from accelmig.lab.guest import agent_status, guest_ping  # noqa: E402
from accelmig.lab.topology import POOL_ADDRESS  # noqa: E402
from accelmig.plugin import qga  # noqa: E402
from accelmig.plugin.domain.model import DomainXML  # noqa: E402
from accelmig.wire.control import ControlClient  # noqa: E402
from accelmig.wire.errors import ErrorCode  # noqa: E402
from accelmig.wire.identity import GuestNic, HostIdentity  # noqa: E402
from tests.support.e2e import assert_clean, diagnostics, snapshot  # noqa: E402
from tests.support.wait import wait_for  # noqa: E402

TOOLS = ["ip", "unshare", "/usr/sbin/libvirtd", "qemu-system-x86_64", "busybox", "apt-get", "dpkg-deb"]
MISSING = [t for t in TOOLS if shutil.which(t) is None and not os.path.exists(t)]
RUN_ID = f"{os.getpid() % 100000}"
POOL_DATA = f"{POOL_ADDRESS}:{POOL_DATA_PORT}"

#: A guest application holding one accelerator session open and using it
#: every 0.2 s; its state in /run/e2e-session.json (read through guest-exec).
SESSION_PY = r'''
import json, os, sys, time
from accelmig.agent import driver
endpoint, token = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 60
while not os.path.exists("/run/accelmig/agent.sock") and time.monotonic() < deadline:
    time.sleep(0.1)                       # register with the agent, so a rehome reaches us
dev = driver.connect(endpoint, token, name="e2e-qga")   # the lab says how: $ACCELMIG_CAFILE (TLS) or $ACCELMIG_INSECURE (lib.sh)
print(f"e2e session {dev.sid} open at {endpoint}", flush=True)
calls, error = 0, None
while True:
    try:
        dev.info()
        calls, error = calls + 1, None
    except Exception as exc:              # shown to the test, which decides
        error = f"{type(exc).__name__}: {exc}"
    with open("/run/e2e-session.tmp", "w") as f:
        json.dump({"sid": dev.sid, "epoch": dev.epoch, "calls": calls, "error": error,
                   "endpoint": dev.endpoint, "resumes": dev.stats["resumes"]}, f)
    os.replace("/run/e2e-session.tmp", "/run/e2e-session.json")
    time.sleep(0.2)
'''

SESSION_INIT = r'''#!/bin/sh
# e2e: the session holder, when the kernel command line names a pool and token.
. /etc/accelmig/lib.sh
load_settings
[ -n "$ACCELMIG_E2E_ENDPOINT" ] && [ -n "$ACCELMIG_E2E_TOKEN" ] || exit 0
( exec python3 /usr/local/bin/accelmig-e2e-session "$ACCELMIG_E2E_ENDPOINT" "$ACCELMIG_E2E_TOKEN"
) </dev/null >/dev/console 2>&1 &
'''


def name(tag: str) -> str:
    return f"e2e{RUN_ID}-{tag}"


def session_state(dom) -> dict:
    """The guest application's session, read inside the guest through guest-exec."""
    _pid, status = qga.guest_exec(dom, ["/bin/cat", "/run/e2e-session.json"], timeout=10)
    assert status.exit_code == 0, status.stderr
    return json.loads(status.stdout)


def host_identity(lab: Lab, host: str, with_nic: bool = False) -> HostIdentity:
    """What hostd would tell the guest on ``host``."""
    plan = lab.topology.host(host)
    nic = None
    if with_nic:
        address, prefix = plan.guest_address(10).split("/")
        nic = GuestNic(address=address, prefixlen=int(prefix), gateway=plan.gateway)
    return HostIdentity(host_id=host, pool_endpoint=POOL_DATA, host_address=plan.uplink_address,
                        guest_nic=nic)


def control(lab: Lab, host: str) -> ControlClient:
    """A control-plane client of ``host``, its socket made inside that
    host's network namespace (the pool's control port exists only there)."""
    client = ControlClient(f"{POOL_ADDRESS}:{POOL_CONTROL_PORT}", host,
                           lab.state["host_secrets"][host].encode(), tls=lab.control_tls(host))
    with netns.entered(lab.topology.host_ns[host]):
        client.call("ping")
    return client


@pytest.fixture(scope="module")
def image():
    if MISSING:
        pytest.skip(f"SKIPPED LOUDLY: not installed: {MISSING} (./dev.sh setup installs them)")
    t0 = time.monotonic()
    img = build_image(ImageSpec(with_qemu_ga=True, extra_files=(
        ExtraFile("/usr/local/bin/accelmig-e2e-session", SESSION_PY.lstrip().encode(), 0o755),
        ExtraFile("/etc/accelmig/init.d/70-e2e-session", SESSION_INIT.encode(), 0o755))))
    print(f"\nimage with qemu-ga: {time.monotonic() - t0:.2f} s (build {img.build_seconds})")
    return img


@pytest.fixture(scope="module")
def nova_lab(image):
    """A lab with its pool, and on hostA a VM with only qemu-guest-agent's
    channel, the agent on ``--port none`` and one open session."""
    before = snapshot()
    lab = Lab(f"e2e{RUN_ID}q", pool=True)
    vm = name("nova")
    try:
        lab.up()
        a = lab.topology.host("hostA")
        token = lab.tenants["alice"][0]
        cmdline = image.cmdline(net=a.guest_net(10), agent_port="none",
                                extra=f"accelmig.e2e_endpoint={POOL_DATA} accelmig.e2e_token={token}")
        xml = lab.domain_xml(vm, image, "hostA", agent_channel=False, qemu_guest_agent=True, cmdline=cmdline)
        t0 = time.monotonic()
        dom = lab.connect("hostA").createXML(xml, 0)
        try:
            wait_for(lambda: guest_ping(dom, 2) or True, 90, "qemu-ga answering guest-ping", 0.25,
                     errors=(Exception,))
            boot = time.monotonic() - t0
            state = wait_for(lambda: session_state(dom), 60, "the guest's session", 0.3, errors=(Exception,))
        except BaseException:
            print(diagnostics(lab, vm))
            raise
        print(f"lab up {lab.timings.get('up', 0):.2f} s, boot to guest-ping {boot:.2f} s, "
              f"session {state['sid']} after {time.monotonic() - t0:.2f} s")
        yield lab, vm, state["sid"]
    finally:
        lab.down()
        assert_clean(lab, before)


def test_the_domain_has_only_qemu_guest_agents_channel(nova_lab):
    lab, vm, _ = nova_lab
    live = lab.connect("hostA").lookupByName(vm).XMLDesc(0)
    assert DomainXML.parse(live).has_guest_agent()
    assert DomainXML.parse(live).guest_agent_channel().connected is True     # read from the live XML: no taint
    assert "org.accelmig.agent.0" not in live


@pytest.mark.timeout(120)
def test_rehome_through_guest_exec_resumes_the_session(nova_lab):
    lab, vm, sid = nova_lab
    dom = lab.connect("hostA").lookupByName(vm)
    before = session_state(dom)
    document = {"migration_id": f"same-host-{uuid.uuid4().hex[:6]}",
                "identity": host_identity(lab, "hostA").to_wire(), "tickets": {}}
    t0 = time.monotonic()
    result = qga.deliver_rehome(dom, document, timeout=30)
    wall = time.monotonic() - t0
    assert result["ok"], json.dumps(result, indent=1)
    session = result["sessions"][sid]
    assert session["ok"] and session["epoch"] == before["epoch"] + 1 and session["ticket"] is False
    assert result["delivery"]["exit_code"] == 0 and result["host_id"] == "hostA"
    print(f"\nrehome through guest-exec: {wall * 1000:.0f} ms wall, agent {result['seconds'] * 1000:.0f} ms, "
          f"session resumed in {session['seconds'] * 1000:.0f} ms")
    # The application goes on, on the new connection.  It writes its state
    # every 0.2 s: a snapshot written just before the resume can still be
    # the newest when guest-exec returns (two CI runs read epoch 1 and no
    # resume here, its calls already past any count taken before the
    # rehome), so wait for the rehome's epoch first, then for calls after it.
    def seen() -> str:
        try:
            now, agent = session_state(dom), agent_status(dom).get("sessions")
        except Exception as exc:          # (what the guest says, or why it could not)
            now = agent = f"unreadable: {exc}"
        return f"before {before}, rehome {session}, now {now}, agent {agent}"
    resumed = wait_for(lambda: (s := session_state(dom))["epoch"] == session["epoch"] and s, 20,
                       "the application to be on the rehome's epoch", 0.2, errors=(Exception,), explain=seen)
    after = wait_for(lambda: (s := session_state(dom))["calls"] > resumed["calls"] + 2 and s, 20,
                     "the session to make progress after the rehome", 0.2, errors=(Exception,), explain=seen)
    assert after["sid"] == sid and after["resumes"] == before["resumes"] + 1, seen()
    assert after["error"] is None and after["epoch"] == session["epoch"], seen()
    # the agent keeps the identity; libvirt marked the domain tainted, as the module warns
    status = agent_status(dom)
    assert status["identity"]["host_id"] == "hostA" and [s["sid"] for s in status["sessions"]] == [sid]
    log = lab.node("hostA").qemu_log(vm).read_text()
    assert "is tainted: custom-ga-command" in log


@pytest.mark.timeout(60)
def test_broken_document_and_missing_agent_are_clear_errors(nova_lab):
    lab, vm, _ = nova_lab
    dom = lab.connect("hostA").lookupByName(vm)
    with pytest.raises(qga.RehomeDocumentRefused) as info:
        qga.deliver_rehome(dom, {"identity": {"host_id": "x"}}, timeout=30)
    assert info.value.exit_code == 2 and info.value.code is ErrorCode.BAD_REQUEST
    assert "accelmig-agent: bad rehome document" in info.value.stderr
    assert "migration_id must be a non-empty string" in str(info.value)
    # an agent socket nobody listens on: exit 3
    document = {"migration_id": "m-x", "identity": host_identity(lab, "hostA").to_wire(), "tickets": {}}
    with pytest.raises(qga.AgentNotRunning) as info:
        qga.deliver_rehome(dom, document, socket="/run/accelmig/nobody.sock", timeout=30)
    assert info.value.exit_code == 3 and "no agent answers at /run/accelmig/nobody.sock" in info.value.stderr
    # an interpreter that is not there: qemu-ga cannot start it
    with pytest.raises(qga.GuestCommandFailed, match="could not start it: .*No such file"):
        qga.deliver_rehome(dom, document, command=("/usr/bin/python9", "-m", "accelmig.agent"), timeout=10)



@pytest.mark.timeout(120)
def test_a_rehome_of_a_thousand_tickets_goes_through_guest_exec(nova_lab):
    """A VM of 1,000 sessions rehomed where only qemu-guest-agent reaches
    the guest: a ~340 KB document on guest-exec's stdin (past the agent's
    256 KiB line, so ``rehome --stdin`` hands it on in ticket pieces) and
    the outcome within its answer's bound.  The guest's one real session
    resumes; the 1,000 others are no driver's, each said so."""
    lab, vm, sid = nova_lab
    dom = lab.connect("hostA").lookupByName(vm)
    before = session_state(dom)
    strangers = {f"{uuid.uuid4().hex}{i:04d}": "t" * 300 for i in range(1000)}
    document = {"migration_id": f"big-{uuid.uuid4().hex[:6]}",
                "identity": host_identity(lab, "hostA").to_wire(), "tickets": dict(strangers)}
    size = len(json.dumps(document, separators=(",", ":")))
    assert size > 300_000, size
    result = qga.deliver_rehome(dom, document, timeout=60)
    assert result["delivery"]["exit_code"] == 1 and result["ok"] is False   # 1,000 no driver holds
    assert result["session_count"] == 1001 and result["resumed_count"] == 1, {
        k: v for k, v in result.items() if k != "sessions"}
    listed = result["sessions"]
    assert len(listed) + result.get("sessions_omitted", 0) == 1001
    assert all(listed[s]["error"]["code"] == "NO_SUCH_OBJECT" for s in listed if s in strangers)
    assert len(json.dumps(result)) < 256 * 1024                # the answer stayed within its bound
    # the real session was rehomed once and goes on
    after = wait_for(lambda: (s := session_state(dom))["epoch"] == before["epoch"] + 1
                     and s["calls"] > before["calls"] + 2 and s, 30,
                     "the session to resume and make progress after the big rehome", 0.2, errors=(Exception,))
    assert after["sid"] == sid and after["error"] is None
    print(f"\nrehome of {size} bytes through guest-exec: {result['delivery']['seconds'] * 1000:.0f} ms")


@pytest.fixture(scope="module")
def side_vms(nova_lab, image):
    """On hostA, booted together: a guest whose qemu-ga blocks guest-exec,
    and one without qemu-ga (the channel is there, nobody listens)."""
    lab, _, _ = nova_lab
    a = lab.topology.host("hostA")
    conn = lab.connect("hostA")
    names = {"blocked": name("blocked"), "noqga": name("noqga")}
    xmls = {
        "blocked": lab.domain_xml(names["blocked"], image, "hostA", agent_channel=False, qemu_guest_agent=True,
                                  cmdline=image.cmdline(net=a.guest_net(11), agent=False,
                                                        qemu_ga_block="guest-exec")),
        "noqga": lab.domain_xml(names["noqga"], image, "hostA", agent_channel=False, qemu_guest_agent=True,
                                cmdline=image.cmdline(net=a.guest_net(12), agent=False, qemu_ga=False)),
    }
    t0 = time.monotonic()
    doms = {key: conn.createXML(xml, 0) for key, xml in xmls.items()}
    try:
        wait_for(lambda: guest_ping(doms["blocked"], 2) or True, 90, "the blocked guest's qemu-ga", 0.25,
                 errors=(Exception,))
        # the other guest is up when its init.d has said that qemu-ga stays off
        wait_for(lambda: "qemu-ga disabled" in lab.console_log(
            "hostA", names["noqga"]).read_text(errors="replace"), 90, "the guest without qemu-ga to boot", 0.2,
            errors=(Exception,))
        print(f"\ntwo side guests booted in {time.monotonic() - t0:.2f} s")
        yield lab, doms
    except BaseException:
        for vm in names.values():
            print(diagnostics(lab, vm))
        raise
    finally:
        for dom in doms.values():
            try:
                dom.destroy()
            except libvirt.libvirtError:
                pass


DOCUMENT = {"migration_id": "m-side", "identity": {"host_id": "hostA", "pool_endpoint": POOL_DATA},
            "tickets": {}}


@pytest.mark.timeout(150)
def test_guest_exec_blocked_by_policy(side_vms):
    _, doms = side_vms
    t0 = time.monotonic()
    with pytest.raises(qga.GuestExecDisabled) as info:
        qga.deliver_rehome(doms["blocked"], DOCUMENT, timeout=10)
    assert time.monotonic() - t0 < 5
    exc = info.value
    # what libvirt 9.0 passes on from QEMU 7.2's qemu-ga
    assert exc.details["libvirt_code"] == libvirt.VIR_ERR_INTERNAL_ERROR
    assert exc.details["agent_error"] == "Command guest-exec has been disabled"
    assert exc.code is ErrorCode.CONFIG_INVALID and not exc.retriable
    assert "refuses guest-exec" in str(exc) and "--block-rpcs" in str(exc)
    print(f"\nblocked guest-exec: {exc}")


@pytest.mark.timeout(150)
def test_no_qemu_ga_in_the_guest_and_no_channel(side_vms, nova_lab, image):
    lab, doms = side_vms
    t0 = time.monotonic()
    with pytest.raises(qga.QgaUnavailable) as info:
        qga.deliver_rehome(doms["noqga"], DOCUMENT, timeout=5)
    waited = time.monotonic() - t0
    assert waited < 6, waited                                   # within its timeout
    assert "QEMU guest agent is not connected" in str(info.value) and info.value.retriable
    assert info.value.details["libvirt_code"] == libvirt.VIR_ERR_AGENT_UNRESPONSIVE
    with pytest.raises(qga.QgaUnavailable):
        guest_ping(doms["noqga"], 2)
    # a domain with no qemu-guest-agent channel at all (running: libvirt checks that first;
    # no need to wait for its boot)
    xml = lab.domain_xml(name("nochan"), image, "hostA", guest_index=13)
    assert not DomainXML.parse(xml).has_guest_agent()
    dom = lab.connect("hostA").createXML(xml, 0)
    try:
        with pytest.raises(qga.QgaNotConfigured, match="QEMU guest agent is not configured"):
            qga.deliver_rehome(dom, DOCUMENT, timeout=5)
    finally:
        dom.destroy()
    print(f"\nno qemu-ga: {info.value} ({waited * 1000:.0f} ms)")


@pytest.mark.timeout(150)
def test_live_migration_then_rehome_through_guest_exec_on_B(nova_lab):
    """hostd's part by hand: attest the session (its driver's proof, asked
    through guest-exec: the agent has no channel to report it), open the
    record on B, migrate, switch over on A (which vouches for B), complete on
    B for the tickets, rehome through guest-exec on B."""
    lab, vm, sid = nova_lab
    dom_a = lab.connect("hostA").lookupByName(vm)
    domain_uuid = dom_a.UUIDString()
    ctl_a, ctl_b = control(lab, "hostA"), control(lab, "hostB")
    try:
        sessions = [s["sid"] for s in agent_status(dom_a)["sessions"]]
        assert sessions == [sid]
        challenge = ctl_a.call("bind_challenge")
        proven = qga.agent_prove(dom_a, {"host": "hostA", "challenges": {challenge["instance"]: challenge["challenge"]}})
        assert set(proven["proofs"]) == {sid} and proven["refused"] == {}, proven
        # a proof made for hostA proves nothing for another host
        other = ctl_b.call("bind_challenge")["challenge"]
        assert set(ctl_b.call("bind_sessions", domain_uuid=domain_uuid, challenge=other,
                              sessions=proven["proofs"])["refused"]) == {sid}
        bound = ctl_a.call("bind_sessions", domain_uuid=domain_uuid, domain_name=vm,
                           challenge=challenge["challenge"], sessions=proven["proofs"])
        assert bound["bound"] == [sid], bound
        record = ctl_b.call("open_migration", domain_uuid=domain_uuid, domain_name=vm)
        before = session_state(dom_a)
        moved = lab.migrate(vm, "hostA", "hostB")
        t_resumed = time.monotonic()
        ctl_a.call("switchover", domain_uuid=domain_uuid, migration_id=record["migration_id"])
        tickets = ctl_b.call("complete", domain_uuid=domain_uuid, migration_id=record["migration_id"])["tickets"]
        assert set(tickets) == {sid}
        dom_b = lab.connect("hostB").lookupByName(vm)
        ping = wait_for(lambda: guest_ping(dom_b, 2) or True, 20, "qemu-ga on B", 0.05, errors=(Exception,))
        t_ping = time.monotonic()
        document = {"migration_id": record["migration_id"],
                    "identity": host_identity(lab, "hostB", with_nic=True).to_wire(), "tickets": tickets}
        result = qga.deliver_rehome(dom_b, document, timeout=30)
        t_done = time.monotonic()
        assert result["ok"], json.dumps(result, indent=1) + diagnostics(lab, vm)
        session = result["sessions"][sid]
        assert session["ok"] and session["ticket"] is True and session["epoch"] == before["epoch"] + 1
        assert any("10.89.2.10/24" in step for step in result["network"]), result["network"]
        after = wait_for(lambda: (s := session_state(dom_b))["calls"] > before["calls"] + 2 and s, 20,
                         "the session to make progress on B", 0.2, errors=(Exception,))
        assert after["error"] is None and after["epoch"] == session["epoch"]
        ctl_a.call("close", domain_uuid=domain_uuid, migration_id=record["migration_id"])
        pool_view = {s["sid"]: s for s in ctl_b.call("list_sessions", domain_uuid=domain_uuid)["sessions"]}
        assert pool_view[sid]["bound_host"] == "hostB"
        print(f"\nA->B: migration {moved['wall']:.2f} s (downtime {moved['downtime_ms']} ms); after it "
              f"returned: qemu-ga answered on B +{(t_ping - t_resumed) * 1000:.0f} ms (ping {ping * 1000:.0f} ms), "
              f"rehome through guest-exec done +{(t_done - t_resumed) * 1000:.0f} ms "
              f"(guest-exec {result['delivery']['seconds'] * 1000:.0f} ms, agent {result['seconds'] * 1000:.0f} ms, "
              f"network {result['network_seconds'] * 1000:.0f} ms, session {session['seconds'] * 1000:.0f} ms)")
    finally:
        ctl_a.close()
        ctl_b.close()
