"""``accelmig domain render`` / ``templates``: golden output, value parsing,
clear errors.  Regenerate the golden files after an intended template change
with ``ACCELMIG_UPDATE_GOLDEN=1 pytest tests/plugin/test_cli_domain.py`` and
review the diff."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from accelmig.plugin.cli import main as cli
from accelmig.plugin.domain import AGENT_CHANNEL_NAME
from accelmig.plugin.domain.model import DomainXML
from accelmig.plugin.domain.render import render, template_names
from tests.conftest import run_cli

GOLDEN = Path(__file__).parent / "golden" / "cli"
UUID = "5e3b1f7c-9a41-4d2e-8c0a-3f6d2b9e1a77"
MAC = "52:54:00:12:34:56"

#: --set words -> the typed values render() gets for them.
DOMAIN_SETS = ["name=vm1", f"uuid={UUID}", "kernel=/images/vmlinux", "initrd=/images/initramfs.cpio",
               "memory_mib=512", "vcpus=2", "qemu_guest_agent=true", f"fabric_mac={MAC}",
               "fabric_source=br-fab", "tenant=alice", "cmdline=console=ttyS0 quiet a<b&c"]
DOMAIN_VALUES = dict(name="vm1", uuid=UUID, kernel="/images/vmlinux", initrd="/images/initramfs.cpio",
                     memory_mib=512, vcpus=2, qemu_guest_agent=True, fabric_mac=MAC,
                     fabric_source="br-fab", tenant="alice", cmdline="console=ttyS0 quiet a<b&c")

CASES = {
    "accelerator-domain.xml": ("accelerator-domain", DOMAIN_SETS),
    "fabric-interface-direct.xml": ("fabric-interface.xml.j2", [
        f"fabric_mac={MAC}", "fabric_type=direct", "fabric_source=enp3s0", "fabric_direct_mode=vepa"]),
    "agent-channel.xml": ("agent-channel", []),
}


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def render_cli(template, sets, *extra):
    args = ["domain", "render", template, *extra]
    for item in sets:
        args += ["--set", item]
    return invoke(*args)


@pytest.mark.parametrize("golden", sorted(CASES))
def test_golden(golden):
    template, sets = CASES[golden]
    result = render_cli(template, sets)
    assert result.exit_code == 0, result.output
    path = GOLDEN / golden
    if os.environ.get("ACCELMIG_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(result.stdout)
    assert path.exists(), f"no golden file {path}: run with ACCELMIG_UPDATE_GOLDEN=1"
    assert result.stdout == path.read_text(), f"{golden} differs (ACCELMIG_UPDATE_GOLDEN=1 to accept)"


def test_set_values_are_typed_like_render_wants_them():
    """--set turns digits into ints and true/false into booleans where the
    value's check wants them: the CLI's output is render()'s, byte for byte."""
    result = render_cli("accelerator-domain", DOMAIN_SETS)
    assert result.stdout == render("accelerator-domain.xml.j2", **DOMAIN_VALUES)
    # a name of digits stays a name; --set-json passes JSON as it is
    result = render_cli("accelerator-domain", ["name=1234", "kernel=/k", f"uuid={UUID}"],
                        "--set-json", "memory_mib=1024", "--set-json", "qemu_guest_agent=false")
    assert result.exit_code == 0, result.output
    assert result.stdout == render("accelerator-domain.xml.j2", name="1234", kernel="/k", uuid=UUID,
                                   memory_mib=1024)


def test_an_accelerator_ready_domain():
    """Agent channel (no fixed path), metadata, a bridge or macvtap NIC, no hostdev."""
    for extra in ([], ["fabric_type=direct", "fabric_source=eth1"]):
        result = render_cli("accelerator-domain", ["name=vm1", "kernel=/k", f"fabric_mac={MAC}", *extra])
        assert result.exit_code == 0, result.output
        dom = DomainXML.parse(result.stdout)
        assert dom.is_accelmig() and dom.accelmig_metadata.fabric_mac == MAC
        chan = dom.agent_channel()
        assert chan.name == AGENT_CHANNEL_NAME and chan.path is None and chan.type == "unix"
        assert dom.fabric_interface().type == ("direct" if extra else "bridge")
        assert dom.root.find("devices/hostdev") is None


def test_output_file(tmp_path):
    out = tmp_path / "vm1.xml"
    result = render_cli("accelerator-domain", DOMAIN_SETS, "-o", str(out))
    assert result.exit_code == 0, result.output
    assert result.stdout == "" and f"wrote {out}" in result.stderr
    assert out.read_text() == render("accelerator-domain.xml.j2", **DOMAIN_VALUES)
    assert [p.name for p in tmp_path.iterdir()] == ["vm1.xml"]          # no temporary file left


@pytest.mark.parametrize("sets, extra, message", [
    (["name=vm1"], [], "value kernel is required"),
    (["name=vm1", "kernel=/k", "colour=blue"], [], "unknown value(s) colour (known: "),
    (["name=vm1", "kernel=/k", "memory_mib=lots"], [], "value memory_mib: 'lots' is not an integer"),
    (["name=vm1", "kernel=/k", "memory_mib=8"], [], "value memory_mib: 8 is outside 16.."),
    (["name=vm1", "kernel=/k", "qemu_guest_agent=maybe"], [], "'maybe' is not true or false"),
    (["name=vm1", "kernel=relative/k"], [], "value kernel: 'relative/k' is not an absolute path"),
    (["name=vm1", "kernel=/k", "fabric_mac=01:00:5e:00:00:01"], [], "is a multicast MAC address"),
    (["name"], [], "--set 'name': expected KEY=VALUE"),
    (["=x"], [], "expected KEY=VALUE"),
    (["name=a", "name=b"], [], "value name is given twice"),
    (["name=vm1", "kernel=/k"], ["--set-json", "vcpus=[1"], "--set-json vcpus: not valid JSON"),
    (["name=vm1", "kernel=/k", "hostdev=0000:3b:00.0"], [], "no VFIO/PCI passthrough device"),
    (["name=vm1", "kernel=/k", "fabric_type=hostdev"], [], "blocks live migration"),
])
def test_bad_values_are_clear_errors(sets, extra, message):
    result = render_cli("accelerator-domain", sets, *extra)
    assert result.exit_code == 1, result.output
    assert result.stdout == ""
    assert result.stderr.startswith("accelmig: ") and message in result.stderr, result.stderr
    assert "Traceback" not in result.output and len(result.stderr.splitlines()) == 1


def test_unknown_and_missing_template():
    result = invoke("domain", "render", "nope")
    assert result.exit_code == 1
    assert "no template 'nope' (known: accelerator-domain, agent-channel, fabric-interface" in result.stderr
    result = invoke("domain", "render")
    assert result.exit_code == 2 and "TEMPLATE is required" in result.stderr


def test_listing_templates():
    listing = invoke("domain", "templates")
    assert listing.exit_code == 0
    for name in template_names():
        assert name in listing.stdout
    assert "kernel" in listing.stdout and "required" in listing.stdout
    assert invoke("domain", "render", "--list").stdout == listing.stdout
    one = invoke("domain", "render", "--list", "fabric-interface")
    assert one.stdout.startswith("fabric-interface  (fabric-interface.xml.j2)")
    assert "accelerator-domain" not in one.stdout
    data = json.loads(invoke("domain", "templates", "--json").stdout)
    domain = next(t for t in data if t["template"] == "accelerator-domain.xml.j2")
    keys = {v["key"]: v for v in domain["values"]}
    assert keys["name"]["required"] and keys["memory_mib"]["default"] == 256


def test_console_script_and_help():
    proc = run_cli("accelmig", "domain", "render", "agent-channel", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (GOLDEN / "agent-channel.xml").read_text()
    for args in (["domain", "--help"], ["domain", "render", "--help"], ["domain", "templates", "--help"]):
        result = invoke(*args)
        assert result.exit_code == 0 and "Usage:" in result.stdout
    assert "hostdev" in invoke("domain", "--help").stdout
