"""DomainXML: reading libvirt domain XML as a model and the fabric NIC rewrite.

The golden inputs are libvirt 9.0's own output (see golden/rewrite/cases.toml).
"""

from __future__ import annotations

import difflib
import os
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from accelmig.plugin.config import FabricConfig, HostConfig
from accelmig.plugin.domain import ACCELMIG_NS, AGENT_CHANNEL_NAME
from accelmig.plugin.domain.model import (MAX_XML_BYTES, AccelmigMetadata, DomainXML,
                                          rewrite_for_host)
from accelmig.wire.errors import AccelmigError, BadRequest, InternalError

GOLDEN = Path(__file__).parent / "golden" / "rewrite"
CASES = tomllib.loads((GOLDEN / "cases.toml").read_text())
REGEN = os.environ.get("ACCELMIG_REGEN_GOLDEN") == "1"


def golden(name: str, kind: str = "in") -> str:
    return (GOLDEN / f"{name}.{kind}.xml").read_text()


def fabric(**table) -> FabricConfig:
    """``[fabric]`` as host.toml gives it (through the host's own loader)."""
    return HostConfig.from_dict({"pool": {"endpoint": "10.88.0.1:7070"}, "fabric": table}).fabric


# ---------------------------------------------------------------------------
# golden files


def test_every_golden_file_has_a_case_and_every_case_its_files():
    inputs = {p.name[: -len(".in.xml")] for p in GOLDEN.glob("*.in.xml")}
    outputs = {p.name[: -len(".out.xml")] for p in GOLDEN.glob("*.out.xml")}
    assert inputs == set(CASES)
    assert outputs == set(CASES) or REGEN


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_rewrite(case):
    spec = CASES[case]
    source = golden(case)
    out, changes = rewrite_for_host(source, fabric(**spec["host"]))
    assert [str(c) for c in changes] == spec["changes"], spec["about"]
    expected_path = GOLDEN / f"{case}.out.xml"
    if REGEN:
        expected_path.write_text(out if out is not None else DomainXML.parse(source).to_xml())
    expected = expected_path.read_text()
    if not changes:
        # Nothing to print: the hook leaves libvirt's XML alone.
        assert out is None
        assert expected == source
        assert DomainXML.parse(source).to_xml() == source, "an unchanged document must round-trip"
        return
    assert out == expected
    # Exactly one line per change differs, and it carries the new value.
    diff = [line for line in difflib.unified_diff(source.splitlines(), out.splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert len(diff) == 2 * len(changes), diff
    for change in changes:
        assert any(change.new in line for line in diff if line.startswith("+"))
        assert any(change.old in line for line in diff if line.startswith("-"))
    before, after = DomainXML.parse(source), DomainXML.parse(out)
    assert after.device_signature() == before.device_signature()
    assert after.name == before.name and after.uuid == before.uuid
    assert after.accelmig_metadata == before.accelmig_metadata


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_rewrite_is_idempotent(case):
    spec = CASES[case]
    dom = DomainXML.parse(golden(case, "out"))
    assert dom.rewrite_fabric_for_host(fabric(**spec["host"])) == []


@pytest.mark.parametrize("case", sorted(CASES))
def test_libvirt_itself_accepts_every_output(case):
    """libvirt's own parser (the in-process test driver) takes each output,
    finds accelmig's metadata by its namespace, and keeps the rewritten source."""
    libvirt = pytest.importorskip("libvirt")
    libvirt.registerErrorHandler(lambda *_: None, None)
    conn = libvirt.open("test:///default")
    try:
        ours = DomainXML.parse(golden(case, "out"))
        dom = conn.defineXML(ours.to_xml())
        try:
            theirs = DomainXML.parse(dom.XMLDesc(0))
            if ours.accelmig_metadata is not None:
                # libvirt finds it by namespace (and answers without the prefix).
                element = ET.fromstring(dom.metadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, ACCELMIG_NS))
                assert element.tag == "domain"
                assert element.find("fabric").get("mac") == ours.accelmig_metadata.fabric_mac
                assert theirs.accelmig_metadata == ours.accelmig_metadata
            assert [(n.mac, n.source_bridge, n.source_dev) for n in theirs.interfaces()] == \
                   [(n.mac, n.source_bridge, n.source_dev) for n in ours.interfaces()]
        finally:
            dom.undefine()
    finally:
        conn.close()


# ---------------------------------------------------------------------------
# reading


def test_live_xml_agent_channel_path_and_state():
    dom = DomainXML.parse(golden("live-two-nics"))
    chan = dom.agent_channel()
    assert chan is not None and chan.name == AGENT_CHANNEL_NAME
    assert chan.path == "/var/lib/libvirt/qemu/channel/target/domain-3-accel-vm3/org.accelmig.agent.0"
    assert chan.source_mode == "bind"
    assert chan.state == "connected" and chan.connected is True
    assert not dom.has_guest_agent()

    disconnected = DomainXML.parse(golden("live-two-nics").replace("state='connected'", "state='disconnected'"))
    assert disconnected.agent_channel().connected is False


def test_migratable_xml_channel_has_no_path_or_state():
    dom = DomainXML.parse(golden("two-nics"))
    chan = dom.agent_channel()
    assert chan is not None
    assert chan.path is None and chan.state is None and chan.connected is None


def test_identity_and_metadata():
    dom = DomainXML.parse(golden("bridge-rewrite"))
    assert dom.name == "accel-vm1"
    assert dom.uuid == "7c2f6a4e-1d3b-4c8e-9a5f-0b1c2d3e4f51"
    assert dom.accelmig_metadata == AccelmigMetadata(fabric_mac="52:54:00:a1:00:01",
                                                     interfaces_owner="accelmig", tenant="alice")
    assert dom.is_accelmig()
    assert dom.guest_agent_channel() is not None


def test_uuid_is_normalised():
    text = golden("bridge-rewrite").replace("7c2f6a4e-1d3b-4c8e-9a5f-0b1c2d3e4f51",
                                            "7C2F6A4E1D3B4C8E9A5F0B1C2D3E4F51")
    assert DomainXML.parse(text).uuid == "7c2f6a4e-1d3b-4c8e-9a5f-0b1c2d3e4f51"


def test_foreign_and_external_domains():
    foreign = DomainXML.parse(golden("foreign-domain"))
    assert not foreign.is_accelmig()
    assert foreign.accelmig_metadata is None
    assert foreign.has_guest_agent()
    nova = DomainXML.parse(golden("external-owner"))
    assert nova.is_accelmig() and nova.accelmig_metadata.external
    assert nova.agent_channel() is None


def test_channel_alone_makes_a_domain_accelmig():
    dom = DomainXML.parse(golden("channel-only"))
    assert dom.accelmig_metadata is None
    assert dom.is_accelmig()
    assert dom.fabric_interface().mac == "52:54:00:a1:00:01"


def test_interfaces():
    dom = DomainXML.parse(golden("two-nics"))
    nics = dom.interfaces()
    assert [(n.type, n.mac, n.source_bridge, n.model, n.mtu) for n in nics] == [
        ("bridge", "52:54:00:a3:00:01", "br-mgmt", "virtio", None),
        ("bridge", "52:54:00:a3:00:02", "fab-a", "virtio", 9000),
    ]
    assert dom.fabric_interface().mac == "52:54:00:a3:00:02"

    live = DomainXML.parse(golden("live-two-nics"))
    mgmt, fab = live.interfaces()
    assert (mgmt.type, mgmt.source_network, mgmt.source_bridge, mgmt.host_binding) == \
           ("bridge", "mgmt", "fab1", None)
    assert (fab.target_dev, fab.alias, fab.host_binding) == ("vnet2", "net1", "bridge")

    macvtap = DomainXML.parse(golden("macvtap-rewrite")).interfaces()[0]
    assert (macvtap.type, macvtap.source_dev, macvtap.source_mode, macvtap.host_binding) == \
           ("direct", "eth1", "bridge", "direct")

    network = DomainXML.parse(golden("fabric-on-network-live").replace("type='bridge'>\n      <mac address='52:54:00:a3:00:01'/>\n      <source network='mgmt' portid='63d418a2-f23e-4ab5-a21d-e1f332c6d1e8' bridge='fab1'/>",
                                                                      "type='network'>\n      <mac address='52:54:00:a3:00:01'/>\n      <source network='mgmt'/>"))
    assert network.fabric_interface().type == "network"
    assert network.rewrite_fabric_for_host(fabric(mode="bridge", bridge="fab-b")) == []


def test_read_only_properties_refuse_writes():
    nic = DomainXML.parse(golden("two-nics")).interfaces()[0]
    with pytest.raises(AttributeError):
        nic.mac = "52:54:00:00:00:99"


def test_fabric_interface_with_several_nics_and_no_metadata_is_unknown():
    text = golden("two-nics")
    start, end = text.index("  <metadata>"), text.index("</metadata>\n") + len("</metadata>\n")
    dom = DomainXML.parse(text[:start] + text[end:])
    assert dom.is_accelmig()                      # by its channel
    assert dom.fabric_interface() is None
    assert dom.rewrite_fabric_for_host(fabric(mode="bridge", bridge="fab-b")) == []


def test_metadata_naming_a_missing_mac_is_an_error():
    dom = DomainXML.parse(golden("two-nics").replace('mac="52:54:00:a3:00:02"', 'mac="52:54:00:ff:ff:ff"'))
    with pytest.raises(BadRequest, match="52:54:00:ff:ff:ff.*no <interface> has that MAC"):
        dom.fabric_interface()


@pytest.mark.parametrize("old, new, message", [
    ('owner="accelmig"', 'owner="nova"', "interfaces owner 'nova'"),
    ('mac="52:54:00:a1:00:01"', 'mac="52:54:00:a1"', "is not a MAC address"),
])
def test_bad_metadata_is_a_clear_error(old, new, message):
    dom = DomainXML.parse(golden("bridge-rewrite").replace(old, new))
    with pytest.raises(BadRequest, match=message):
        dom.accelmig_metadata


def test_mode_mismatch_is_refused_not_papered_over():
    dom = DomainXML.parse(golden("macvtap-rewrite"))
    with pytest.raises(BadRequest, match="type='direct'.*fabric mode is 'bridge'"):
        dom.rewrite_fabric_for_host(fabric(mode="bridge", bridge="fab0"))


def test_fabric_mode_none_changes_nothing():
    dom = DomainXML.parse(golden("bridge-rewrite"))
    assert dom.rewrite_fabric_for_host(fabric(mode="none")) == []
    assert dom.to_xml() == golden("bridge-rewrite")


def test_device_signature_lists_every_device_in_order():
    sig = DomainXML.parse(golden("macvtap-rewrite")).device_signature()
    kinds = [key.kind for key in sig]
    assert kinds == ["disk", "controller", "interface", "serial", "console", "channel", "input",
                     "memballoon", "rng"]
    disk = sig[0]
    assert dict(disk.extra) == {"device": "disk", "target.dev": "vda", "target.bus": "virtio"}
    assert dict(disk.address)["slot"] == "0x04"
    nic = sig[2]
    assert (nic.mac, nic.model, dict(nic.address)["slot"]) == ("52:54:00:a2:00:02", "virtio", "0x02")
    # It sees a change of the ABI.
    moved = DomainXML.parse(golden("macvtap-rewrite").replace("slot='0x02'", "slot='0x07'"))
    assert moved.device_signature() != sig


def test_rewrite_is_undone_when_the_device_set_would_change():
    class Drifting(DomainXML):
        """A model whose signature changes after the first look (a unit test of the guard)."""
        calls = 0

        def device_signature(self):
            Drifting.calls += 1
            sig = super().device_signature()
            return sig if Drifting.calls == 1 else sig[:-1]

    original = DomainXML.parse(golden("bridge-rewrite"))
    dom = Drifting(original.root, original._nsdecls)
    with pytest.raises(InternalError, match="changed the device set.*undone"):
        dom.rewrite_fabric_for_host(fabric(mode="bridge", bridge="fab-b"))
    assert dom.to_xml() == golden("bridge-rewrite")


# ---------------------------------------------------------------------------
# writing


def test_namespaces_stay_where_they_were_declared():
    text = golden("external-owner")
    out = DomainXML.parse(text).to_xml()
    assert out == text
    assert out.startswith("<domain type='qemu'>")
    assert '<nova:instance xmlns:nova="http://openstack.org/xmlns/libvirt/nova/1.1">' in out
    assert f'<accelmig:domain xmlns:accelmig="{ACCELMIG_NS}">' in out


def test_comments_unknown_elements_and_escapes_survive():
    text = golden("bridge-rewrite").replace(
        "  <devices>\n",
        "  <devices>\n    <!-- managed by accelmig & friends -->\n"
        "    <watchdog model='i6300esb' action='reset'/>\n    <shmem name='it&apos;s &amp; &lt;x&gt;'/>\n")
    dom = DomainXML.parse(text)
    dom.rewrite_fabric_for_host(fabric(mode="bridge", bridge="fab-b"))
    out = dom.to_xml()
    assert "<!-- managed by accelmig & friends -->" in out
    assert "<watchdog model='i6300esb' action='reset'/>" in out
    again = ET.fromstring(out)
    assert again.find("devices/shmem").get("name") == "it's & <x>"
    assert again.find("devices/interface/source").get("bridge") == "fab-b"


def test_new_element_in_accelmig_namespace_gets_its_prefix():
    text = golden("channel-only")
    dom = DomainXML.parse(text)
    metadata = ET.SubElement(dom.root, "metadata")
    ET.SubElement(ET.SubElement(metadata, f"{{{ACCELMIG_NS}}}domain"), f"{{{ACCELMIG_NS}}}tenant",
                  name="carol")
    out = dom.to_xml()
    assert f'<accelmig:domain xmlns:accelmig="{ACCELMIG_NS}"><accelmig:tenant name="carol"/>' in out
    assert DomainXML.parse(out).accelmig_metadata.tenant == "carol"


# ---------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("text, message", [
    ("", "empty"),
    ("   \n", "empty"),
    ("<domain type='qemu'><name>x</name>", "not well-formed: no element found: line 1"),
    ("<domain><name>x</nam></domain>", "not well-formed: mismatched tag: line 1, column 17"),
    ("<network><name>default</name></network>", "root element is <network>, not <domain>"),
    ("<domain xmlns='http://example.org/x'><name>x</name></domain>", "root element is <{http://example.org/x}domain>"),
    ("<!DOCTYPE domain [<!ENTITY a 'aaaa'>]><domain><name>&a;</name></domain>", "DOCTYPE"),
    ("<domain><name>\x00</name></domain>", "not well-formed"),
])
def test_malformed_xml_is_a_clear_bad_request(text, message):
    with pytest.raises(BadRequest) as info:
        DomainXML.parse(text)
    assert message in str(info.value)
    assert isinstance(info.value, AccelmigError) and info.value.code.value == "BAD_REQUEST"


def test_oversized_and_non_text_input():
    with pytest.raises(BadRequest, match="exceeds"):
        DomainXML.parse(b"<domain>" + b" " * MAX_XML_BYTES + b"</domain>")
    with pytest.raises(BadRequest, match="must be text"):
        DomainXML.parse(None)


def test_bytes_input_with_declaration():
    text = "<?xml version='1.0' encoding='UTF-8'?>\n" + golden("bridge-rewrite")
    assert DomainXML.parse(text.encode()).name == "accel-vm1"


def test_missing_uuid_and_name_are_named():
    text = golden("bridge-rewrite").replace("  <uuid>7c2f6a4e-1d3b-4c8e-9a5f-0b1c2d3e4f51</uuid>\n", "")
    dom = DomainXML.parse(text)                 # a model still (a template may omit it) ...
    with pytest.raises(BadRequest, match=r"has no <uuid>"):
        dom.uuid                                 # ... but asking for it says what is missing
    assert dom.name == "accel-vm1"
    bad = DomainXML.parse(golden("bridge-rewrite").replace("7c2f6a4e-1d3b-4c8e-9a5f-0b1c2d3e4f51", "not-a-uuid"))
    with pytest.raises(BadRequest, match="'not-a-uuid' is not a UUID"):
        bad.uuid
    with pytest.raises(BadRequest, match="has no <name>"):
        DomainXML.parse("<domain type='qemu'/>").name


def test_default_namespace_metadata_and_xml_lang_round_trip():
    text = ("<domain type='kvm'><name>x</name><description xml:lang='en'>hi</description>"
            "<metadata><app xmlns=\"http://example.org/app\"><item k=\"v\"/></app></metadata></domain>\n")
    assert DomainXML.parse(text).to_xml() == text


def test_a_fabric_nic_without_source_gets_one():
    text = golden("channel-only").replace("      <source bridge='fab-a'/>\n", "")
    dom = DomainXML.parse(text)
    changes = dom.rewrite_fabric_for_host(fabric(mode="bridge", bridge="fab-b"))
    assert [str(c) for c in changes] == ["interface 52:54:00:a1:00:01: source bridge None -> 'fab-b'"]
    out = dom.to_xml()
    assert "      <address type='pci' domain='0x0000' bus='0x00' slot='0x02' function='0x0'/>\n" \
           "      <source bridge='fab-b'/>\n    </interface>" in out
    assert DomainXML.parse(out).fabric_interface().source_bridge == "fab-b"
