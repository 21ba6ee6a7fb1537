"""A guest built the way OpenStack Nova's libvirt driver builds it, with
Nova's own code (lab/nova.py).

- fast tier: the XML Nova's classes render for the lab (Nova's metadata,
  SMBIOS uuid = instance uuid, only qemu-guest-agent's channel, nothing of
  accelmig, the port on the tenant network ``ten0``) and how accelmig's own
  parser reads it; the live-migration flags Nova's driver computes; the
  destination XML Nova's ``get_updated_guest_xml`` makes of it;
- root + libvirt + vm: such a domain defined and started on hostA as Nova
  does, the instance uuid read inside the guest (SMBIOS, through
  qemu-guest-agent's guest-exec), the pool reached from its tenant address,
  then Nova's own ``Guest.migrate()`` with Nova's default flags moves it to
  hostB, where it reaches the pool from the same address.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import types
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

libvirt = pytest.importorskip("libvirt")

from accelmig.lab import nova as labnova  # noqa: E402
from accelmig.lab.image import GuestImage  # noqa: E402
from accelmig.lab.topology import TENANT_BRIDGE, TENANT_GATEWAY, tenant_address  # noqa: E402
from accelmig.plugin.domain import QEMU_GA_CHANNEL_NAME  # noqa: E402
from accelmig.plugin.domain.model import DomainXML  # noqa: E402
from tests.support.wait import wait_for  # noqa: E402

try:
    import nova.virt.libvirt.config  # noqa: F401
    NOVA_MISSING = None
except ImportError as exc:
    NOVA_MISSING = str(exc)

needs_nova = pytest.mark.skipif(NOVA_MISSING is not None, reason=f"SKIPPED LOUDLY: Nova is not importable "
                                f"({NOVA_MISSING}): {labnova.NOVA_HINT}")

NOVA_NS = "http://openstack.org/xmlns/libvirt/nova/1.1"
INSTANCE_UUID = "5f0c7e8e-1d2b-4c4e-9a51-3c1f0d7e6a10"


def fake_image() -> GuestImage:
    return GuestImage(key="0123456789abcdef0123", dir=Path("/nonexistent/image"),
                      kernel=Path("/nonexistent/image/vmlinux"), initrd=Path("/nonexistent/image/initrd"),
                      kernel_release="6.1.0-test-amd64", size=1, build_seconds=None)


def fake_lab(word: str = "accelmig.insecure=1"):
    """What nova_domain_xml reads of a Lab: its virt type and the guest's TLS word."""
    return types.SimpleNamespace(virt_type="qemu", guest_tls_word=lambda: word)


@pytest.fixture(scope="module")
def rendered() -> str:
    if NOVA_MISSING is not None:
        pytest.skip(f"SKIPPED LOUDLY: Nova is not importable ({NOVA_MISSING}): {labnova.NOVA_HINT}")
    return labnova.nova_domain_xml("instance-0000000a", INSTANCE_UUID, fake_image(), fake_lab(),
                                   tenant_address=tenant_address(23), mac="fa:16:3e:00:00:23")


@needs_nova
def test_novas_metadata_sysinfo_and_direct_boot(rendered):
    root = ET.fromstring(rendered)
    assert root.get("type") == "qemu"
    assert root.findtext("uuid") == INSTANCE_UUID and root.findtext("name") == "instance-0000000a"
    # Nova's metadata, in Nova's namespace (flavor with its id, owner, image, the port's fixed IP)
    meta = root.find(f"metadata/{{{NOVA_NS}}}instance")
    assert meta is not None, rendered
    flavor = meta.find(f"{{{NOVA_NS}}}flavor")
    assert flavor.get("name") == "m1.accel" and flavor.get("id") == "accel-1"
    assert flavor.findtext(f"{{{NOVA_NS}}}memory") == "256"
    assert meta.find(f"{{{NOVA_NS}}}owner/{{{NOVA_NS}}}project").text == "accel-lab"
    ip = meta.find(f"{{{NOVA_NS}}}ports/{{{NOVA_NS}}}port/{{{NOVA_NS}}}ip")
    assert (ip.get("type"), ip.get("address")) == ("fixed", "10.90.0.23")
    # the SMBIOS system uuid (and serial: [libvirt] sysinfo_serial = unique) is the instance uuid
    system = {e.get("name"): e.text for e in root.findall("sysinfo[@type='smbios']/system/entry")}
    assert system["uuid"] == root.findtext("uuid") == system["serial"]
    assert system["product"] == "OpenStack Nova"
    assert root.find("os/smbios").get("mode") == "sysinfo"
    # direct kernel boot from the lab image, with the words the lab guest needs
    assert root.findtext("os/kernel") == "/nonexistent/image/vmlinux"
    assert root.findtext("os/initrd") == "/nonexistent/image/initrd"
    cmdline = root.findtext("os/cmdline").split()
    assert f"accelmig.net=10.90.0.23/24,{TENANT_GATEWAY}" in cmdline
    assert "accelmig.agent_port=none" in cmdline and "accelmig.insecure=1" in cmdline
    assert "console=ttyS0" in cmdline
    # the serial console: a pty whose output QEMU logs to the lab's console log
    serial = root.find("devices/serial")
    assert serial.get("type") == "pty"
    assert serial.find("log").get("file") == "/var/log/libvirt/qemu/instance-0000000a-console.log"


@needs_nova
def test_only_qemu_guest_agents_channel_and_nothing_of_accelmig(rendered):
    root = ET.fromstring(rendered)
    channels = root.findall("devices/channel")
    assert [c.find("target").get("name") for c in channels] == [QEMU_GA_CHANNEL_NAME]
    assert channels[0].get("type") == "unix" and channels[0].find("target").get("type") == "virtio"
    assert channels[0].find("source").get("mode") == "bind"
    # accelmig appears only in the guest kernel's command line (the image's
    # os_command_line property, shown again in Nova's image metadata): the
    # lab image's own settings, nothing the host side would see as accelmig's
    stripped = rendered.replace(root.findtext("os/cmdline"), "")
    assert "accelmig" not in stripped.lower(), stripped
    parsed = DomainXML.parse(rendered)
    assert parsed.is_accelmig() is False and parsed.accelmig_metadata is None
    assert parsed.has_guest_agent() is True and parsed.agent_channel() is None
    assert parsed.uuid == INSTANCE_UUID and parsed.name == "instance-0000000a"


@needs_nova
def test_the_port_is_on_the_tenant_bridge(rendered):
    root = ET.fromstring(rendered)
    nics = root.findall("devices/interface")
    assert len(nics) == 1
    nic = nics[0]
    assert nic.get("type") == "bridge" and nic.find("source").get("bridge") == TENANT_BRIDGE == "ten0"
    assert nic.find("model").get("type") == "virtio"
    assert nic.find("driver").get("name") == "qemu"          # Nova's TCG workaround (no vhost)
    assert nic.find("mac").get("address") == "fa:16:3e:00:00:23"
    assert nic.find("target").get("dev").startswith("tap") and len(nic.find("target").get("dev")) <= 14
    parsed = DomainXML.parse(rendered)
    assert [i.mac for i in parsed.interfaces()] == ["fa:16:3e:00:00:23"]


@needs_nova
def test_defaults_are_stable_and_the_address_must_be_on_the_tenant_subnet():
    a = labnova.nova_domain_xml("instance-0000000b", INSTANCE_UUID, fake_image(), fake_lab())
    b = labnova.nova_domain_xml("instance-0000000b", INSTANCE_UUID, fake_image(), fake_lab())
    mac = ET.fromstring(a).find("devices/interface/mac").get("address")
    assert mac.startswith("fa:16:3e:") and mac == ET.fromstring(b).find("devices/interface/mac").get("address")
    assert f"accelmig.net={tenant_address(10)},{TENANT_GATEWAY}" in ET.fromstring(a).findtext("os/cmdline")
    with pytest.raises(ValueError, match="not in the tenant subnet"):
        labnova.nova_domain_xml("instance-0000000c", INSTANCE_UUID, fake_image(), fake_lab(),
                                tenant_address="10.89.1.10/24")
    # a lab without a pool: no TLS word
    plain = labnova.nova_guest_cmdline(fake_lab(""), fake_image(), tenant_address(11))
    assert "accelmig.insecure" not in plain and "accelmig.pool_ca" not in plain
    assert labnova.nova_image_spec().with_qemu_ga is True


@needs_nova
def test_live_migration_flags_are_novas_defaults():
    from nova.virt.libvirt import driver
    flags = labnova.nova_live_migration_flags()
    expected = (libvirt.VIR_MIGRATE_LIVE | libvirt.VIR_MIGRATE_PEER2PEER | libvirt.VIR_MIGRATE_UNDEFINE_SOURCE
                | libvirt.VIR_MIGRATE_PERSIST_DEST)
    assert flags == expected == labnova.NOVA_DEFAULT_LIVE_MIGRATION_FLAGS
    post = labnova.nova_live_migration_flags(postcopy=True)
    assert post == expected | libvirt.VIR_MIGRATE_POSTCOPY
    assert labnova.VIR_MIGRATE_POSTCOPY == libvirt.VIR_MIGRATE_POSTCOPY
    assert driver.CONF.libvirt.live_migration_permit_post_copy is False      # the override is gone
    assert not flags & (libvirt.VIR_MIGRATE_TUNNELLED | libvirt.VIR_MIGRATE_TLS | libvirt.VIR_MIGRATE_AUTO_CONVERGE
                        | libvirt.VIR_MIGRATE_NON_SHARED_INC)


@needs_nova
def test_destination_xml_is_novas_update_of_the_migratable_xml(rendered):
    asked = []

    class FakeDomain:
        def XMLDesc(self, flags=0):
            asked.append(flags)
            return rendered

        def UUIDString(self):
            return INSTANCE_UUID

        def name(self):
            return "instance-0000000a"

    out = labnova.nova_destination_xml(FakeDomain())
    assert asked == [libvirt.VIR_DOMAIN_XML_MIGRATABLE]
    parsed = DomainXML.parse(out)
    assert parsed.uuid == INSTANCE_UUID and parsed.has_guest_agent() and not parsed.is_accelmig()
    assert ET.fromstring(out).find("devices/interface/source").get("bridge") == TENANT_BRIDGE


def test_a_missing_nova_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "nova", None)          # "import nova..." fails as if absent
    with pytest.raises(labnova.NovaMissing, match=r"pip install nova .*nova-test"):
        labnova.nova_domain_xml("instance-0000000d", INSTANCE_UUID, fake_image(), fake_lab())
    with pytest.raises(labnova.NovaMissing):
        labnova.nova_live_migration_flags()


# ---------------------------------------------------------------- in the lab: boot, look inside, migrate

TOOLS = ["ip", "unshare", "/usr/sbin/libvirtd", "qemu-system-x86_64", "busybox", "dpkg-deb"]
MISSING_TOOLS = [t for t in TOOLS if shutil.which(t) is None and not os.path.exists(t)]

#: Run in the guest through guest-exec: connect to the pool's data port,
#: say from which address.
CONNECT = ("import json, socket, sys\n"
           "s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)\n"
           "print(json.dumps({'source': s.getsockname()[0], 'peer': s.getpeername()[0]}))\n")


def guest_run(dom, argv, timeout: float = 20.0) -> str:
    from accelmig.plugin import qga
    _pid, status = qga.guest_exec(dom, argv, timeout=timeout)
    assert status.exit_code == 0, f"{argv}: exit {status.exit_code}: {status.stderr}"
    return status.stdout


def pool_connect(dom) -> dict:
    from accelmig.lab.rig import POOL_DATA_PORT
    from accelmig.lab.topology import POOL_ADDRESS
    return json.loads(guest_run(dom, ["/usr/bin/python3", "-c", CONNECT, POOL_ADDRESS, str(POOL_DATA_PORT)]))


@needs_nova
@pytest.mark.root
@pytest.mark.libvirt
@pytest.mark.vm
@pytest.mark.timeout(240)
def test_a_nova_built_domain_boots_knows_its_uuid_reaches_the_pool_and_migrates_with_novas_call():
    if MISSING_TOOLS:
        pytest.skip(f"SKIPPED LOUDLY: not installed: {MISSING_TOOLS} (./dev.sh setup installs them)")
    from accelmig.lab.image import build_image
    from accelmig.lab.guest import guest_ping
    from accelmig.lab.rig import Lab
    from tests.support.e2e import assert_clean, diagnostics, snapshot

    run = os.getpid() % 100000
    t0 = time.monotonic()
    lab = Lab(f"nova{run}", pool=True)
    image = build_image(labnova.nova_image_spec(), cache=lab.cache)
    timings = {"image": time.monotonic() - t0}
    name = f"instance-{run:08x}"
    instance_uuid = str(uuid.uuid4())
    before = snapshot()
    try:
        t = time.monotonic()
        lab.up()
        timings["lab up"] = time.monotonic() - t
        xml = labnova.nova_domain_xml(name, instance_uuid, image, lab, tenant_index=10)
        t = time.monotonic()
        dom = labnova.nova_define_and_start(lab, "hostA", xml)      # defined persistent, then started
        assert dom.isPersistent() and dom.isActive() and dom.UUIDString() == instance_uuid
        try:
            wait_for(lambda: guest_ping(dom, 2) or True, 90, "qemu-ga answering on hostA", 0.25,
                     errors=(Exception,))
        except BaseException:
            print(diagnostics(lab, name))
            raise
        timings["boot to guest-ping"] = time.monotonic() - t
        live = DomainXML.parse(dom.XMLDesc(0))
        assert not live.is_accelmig() and live.has_guest_agent() and live.agent_channel() is None
        assert "accelmig-guest[init]" in lab.console_log("hostA", name).read_text(errors="replace")
        # inside the guest: its SMBIOS system uuid is the instance uuid
        product_uuid = guest_run(dom, ["/bin/cat", "/sys/class/dmi/id/product_uuid"]).strip()
        assert product_uuid.lower() == instance_uuid
        # the pool's data port, from the tenant address
        t = time.monotonic()
        seen = wait_for(lambda: pool_connect(dom), 30, "the guest to reach the pool", 0.5, errors=(Exception,))
        timings["pool connect on A"] = time.monotonic() - t
        assert seen == {"source": "10.90.0.10", "peer": "10.88.0.1"}

        # Nova's own Guest.migrate() with Nova's default flags, A -> B
        moved = labnova.nova_migrate(lab, name, "hostA", "hostB")
        timings["migration"] = moved["wall"]
        assert moved["flags"] == labnova.NOVA_DEFAULT_LIVE_MIGRATION_FLAGS
        dom_b = lab.connect("hostB").lookupByName(name)
        assert dom_b.isActive() and dom_b.isPersistent()                 # PERSIST_DEST
        with pytest.raises(libvirt.libvirtError):                        # UNDEFINE_SOURCE
            lab.connect("hostA").lookupByName(name)
        t = time.monotonic()
        wait_for(lambda: guest_ping(dom_b, 2) or True, 60, "qemu-ga answering on hostB", 0.25,
                 errors=(Exception,))
        # Spaced out: a try whose guest-exec-status failed may leave its
        # Python running in the guest, and a TCG guest just moved (on a loaded
        # CI machine) that gets a new one every 0.2 s only gets slower (CI saw
        # qemu-ga miss its guest-sync for 30 s that way).
        seen_b = wait_for(lambda: pool_connect(dom_b), 90, "the guest to reach the pool from B", 2.0,
                          errors=(Exception,))
        timings["pool connect on B after migration"] = time.monotonic() - t
        assert seen_b == seen                                            # the same address: a tenant network
        assert guest_run(dom_b, ["/bin/cat", "/sys/class/dmi/id/product_uuid"]).strip().lower() == instance_uuid
        print(f"\nNova-built {name} ({instance_uuid}): " + ", ".join(f"{k} {v:.2f} s" for k, v in timings.items())
              + f"; downtime {moved['downtime_ms']} ms")
    finally:
        lab.down()
    assert_clean(lab, before)
