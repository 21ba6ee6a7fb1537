"""Rendering domain XML from the templates: golden files, value checks,
escaping.  Regenerate the golden files after an intended template change
with ``ACCELMIG_UPDATE_GOLDEN=1 pytest tests/plugin/test_render.py`` and
review the diff."""

from __future__ import annotations

import os
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from accelmig.plugin.domain import ACCELMIG_NS, AGENT_CHANNEL_NAME, QEMU_GA_CHANNEL_NAME
from accelmig.plugin.domain.render import TemplateValueError, check_values, render, template_names
from accelmig.wire.errors import AccelmigError, ErrorCode

GOLDEN = Path(__file__).parent / "golden" / "render"
UUID = "5e3b1f7c-9a41-4d2e-8c0a-3f6d2b9e1a77"
MAC = "52:54:00:12:34:56"

BASE = dict(name="vm1", uuid=UUID, kernel="/var/cache/accelmig-lab/images/abc/vmlinux",
            initrd="/var/cache/accelmig-lab/images/abc/initramfs.cpio",
            cmdline="console=ttyS0 quiet accelmig.net=10.89.1.10/24,10.89.1.1",
            console_log="/var/log/libvirt/qemu/vm1-console.log", fabric_mac=MAC)

CASES = {
    "domain-bridge.xml": ("accelerator-domain.xml.j2", BASE),
    "domain-direct-kvm.xml": ("accelerator-domain.xml.j2", {
        **BASE, "name": "vm-kvm", "virt_type": "kvm", "cpu_mode": "host-model", "vcpus": 2,
        "memory_mib": 1024, "machine": "q35", "fabric_type": "direct", "fabric_source": "eth1",
        "fabric_direct_mode": "passthrough", "tenant": "alice", "interfaces_owner": "external",
        "qemu_guest_agent": True, "emulator": "/usr/bin/qemu-system-x86_64"}),
    "domain-minimal.xml": ("accelerator-domain.xml.j2", {"name": "bare", "uuid": UUID, "kernel": "/boot/vmlinux"}),
    "agent-channel.xml": ("agent-channel.xml.j2", {}),
    "fabric-interface-bridge.xml": ("fabric-interface.xml.j2", {"fabric_mac": MAC}),
    "fabric-interface-direct.xml": ("fabric-interface.xml.j2", {
        "fabric_mac": MAC, "fabric_type": "direct", "fabric_source": "enp3s0", "fabric_direct_mode": "vepa"}),
}


@pytest.mark.parametrize("golden", sorted(CASES))
def test_golden(golden):
    template, values = CASES[golden]
    text = render(template, **values)
    path = GOLDEN / golden
    if os.environ.get("ACCELMIG_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no golden file {path}: run with ACCELMIG_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{golden} differs from its golden file (ACCELMIG_UPDATE_GOLDEN=1 to accept)"


def test_every_template_has_a_golden_file():
    assert {t for t, _ in CASES.values()} == set(template_names())


def test_domain_structure():
    root = ET.fromstring(render("accelerator-domain.xml.j2", **BASE))
    assert root.get("type") == "qemu"
    meta = root.find(f"./metadata/{{{ACCELMIG_NS}}}domain")
    assert meta is not None
    assert meta.find(f"{{{ACCELMIG_NS}}}fabric").get("mac") == MAC
    assert meta.find(f"{{{ACCELMIG_NS}}}interfaces").get("owner") == "accelmig"
    assert meta.find(f"{{{ACCELMIG_NS}}}tenant") is None
    channels = root.findall("./devices/channel")
    assert len(channels) == 1
    # no path: libvirt makes a per-domain socket on each host
    assert channels[0].find("source").attrib == {"mode": "bind"}
    assert channels[0].find("target").attrib == {"type": "virtio", "name": AGENT_CHANNEL_NAME}
    nic = root.find("./devices/interface")
    assert nic.get("type") == "bridge" and nic.find("source").get("bridge") == "fab0"
    assert nic.find("model").get("type") == "virtio"
    assert root.find("./devices/hostdev") is None
    assert root.find("./os/kernel").text == BASE["kernel"]


def test_qemu_guest_agent_channel_is_optional():
    root = ET.fromstring(render("accelerator-domain.xml.j2", **BASE, qemu_guest_agent=True))
    names = [c.find("target").get("name") for c in root.findall("./devices/channel")]
    assert names == [AGENT_CHANNEL_NAME, QEMU_GA_CHANNEL_NAME]


def test_values_are_escaped():
    text = render("accelerator-domain.xml.j2", **{**BASE, "cmdline": "a<b & c='d' \"e\""})
    assert ET.fromstring(text).find("./os/cmdline").text == "a<b & c='d' \"e\""


def test_defaults_and_normalisation():
    values = check_values("accelerator-domain.xml.j2", {"name": "x", "kernel": "/k", "uuid": UUID.upper(),
                                                         "fabric_mac": MAC.upper(), "memory_mib": "512"})
    assert values["uuid"] == UUID and values["fabric_mac"] == MAC and values["memory_mib"] == 512
    assert values["virt_type"] == "qemu" and values["vcpus"] == 1 and values["fabric_source"] == "fab0"
    a = check_values("accelerator-domain.xml.j2", {"name": "x", "kernel": "/k"})["uuid"]
    b = check_values("accelerator-domain.xml.j2", {"name": "x", "kernel": "/k"})["uuid"]
    assert a != b     # a fresh UUID per domain when none is given


@pytest.mark.parametrize("values, message", [
    ({"kernel": "/k"}, "value name is required"),
    ({"name": "vm"}, "value kernel is required"),
    ({"name": "vm", "kernel": "/k", "memroy_mib": 1}, "unknown value(s) memroy_mib"),
    ({"name": "vm", "kernel": "k"}, "value kernel: 'k' is not an absolute path"),
    ({"name": "vm", "kernel": "/k", "uuid": "nope"}, "value uuid: 'nope' is not a UUID"),
    ({"name": "vm", "kernel": "/k", "fabric_mac": "52:54:00:12:34"}, "is not a MAC address"),
    ({"name": "vm", "kernel": "/k", "fabric_mac": "01:00:5e:00:00:01"}, "multicast"),
    ({"name": "vm", "kernel": "/k", "virt_type": "xen"}, "value virt_type: 'xen' is not one of qemu, kvm"),
    ({"name": "vm", "kernel": "/k", "memory_mib": 0}, "value memory_mib: 0 is outside"),
    ({"name": "vm", "kernel": "/k", "vcpus": True}, "value vcpus: True is not an integer"),
    ({"name": "bad name", "kernel": "/k"}, "value name: 'bad name' is not a domain name"),
    ({"name": "vm", "kernel": "/k", "cmdline": "a\nb"}, "one line of printable text"),
    ({"name": "vm", "kernel": "/k", "fabric_mac": MAC, "fabric_source": "a-very-long-ifname0"},
     "not a network interface name"),
    ({"name": "vm", "kernel": "/k", "qemu_guest_agent": "yes"}, "is not true or false"),
    ({"name": "vm", "kernel": "/k", "fabric_mac": MAC, "fabric_direct_mode": "vepa"},
     "applies to fabric_type direct only"),
])
def test_bad_values_fail_clearly(values, message):
    with pytest.raises(TemplateValueError) as info:
        render("accelerator-domain.xml.j2", **values)
    assert message in str(info.value)
    assert "template accelerator-domain.xml.j2" in str(info.value)
    assert isinstance(info.value, AccelmigError) and info.value.code == ErrorCode.CONFIG_INVALID


def test_unknown_template():
    with pytest.raises(TemplateValueError, match="no such template.*known: accelerator-domain.xml.j2"):
        render("nope.xml.j2")


def test_fragment_rejects_domain_values():
    with pytest.raises(TemplateValueError, match="unknown value"):
        render("agent-channel.xml.j2", name="vm")


@pytest.mark.skipif(shutil.which("virt-xml-validate") is None or shutil.which("xmllint") is None,
                    reason="virt-xml-validate/xmllint not installed")
def test_libvirt_schema_accepts_the_domains(tmp_path):
    for golden, (template, values) in CASES.items():
        if template != "accelerator-domain.xml.j2":
            continue
        path = tmp_path / golden
        path.write_text(render(template, **values))
        result = subprocess.run(["virt-xml-validate", str(path), "domain"], capture_output=True, text=True)
        assert result.returncode == 0, f"{golden}: {result.stdout}{result.stderr}"
