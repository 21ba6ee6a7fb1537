"""Render new domain XML from the jinja2 templates in ``accelmig.domain_templates``.

Rendering is for *new* domains only; existing XML is read and rewritten on a
model (``accelmig.plugin.domain.model``), never by string surgery.

Every value is checked before it reaches a template (a typo in a key, a
missing value, a MAC that is not one, a path that is not absolute all fail
here with a message naming the template and the value), the templates run
with ``StrictUndefined`` (a value the checks forgot still fails loudly
instead of rendering empty) and XML autoescaping (a kernel command line with
``<`` or ``&`` stays well-formed), and the output is parsed once as a last
check.

Templates:

- ``accelerator-domain.xml.j2`` — a whole domain (direct kernel boot, the
  accelmig metadata, the agent channel, the fabric NIC);
- ``agent-channel.xml.j2`` — the guest agent's virtio-serial channel alone;
- ``fabric-interface.xml.j2`` — the fabric NIC alone.

Example::

    xml = render("accelerator-domain.xml.j2", name="vm1", memory_mib=256,
                 kernel="/images/vmlinux", initrd="/images/initramfs.cpio",
                 fabric_mac="52:54:00:12:34:56")
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import re
import uuid as uuidlib
import xml.etree.ElementTree as ET
from typing import Any, Callable

import jinja2

from accelmig.plugin.domain import (ACCELMIG_NS, AGENT_CHANNEL_NAME, QEMU_GA_CHANNEL_NAME)
from accelmig.wire.errors import ConfigInvalid
from accelmig.wire.values import is_int

TEMPLATE_PACKAGE = "accelmig.domain_templates"

_REQUIRED = object()


class TemplateValueError(ConfigInvalid):
    """A value handed to a template is missing, unknown or malformed."""


# ---------------------------------------------------------------- validators

def _text(pattern: str, what: str) -> Callable[[Any], str]:
    regex = re.compile(pattern)

    def check(value):
        if not isinstance(value, str) or not regex.fullmatch(value):
            raise ValueError(f"{value!r} is not {what}")
        return value
    return check


def _choice(*options: str) -> Callable[[Any], str]:
    def check(value):
        if value not in options:
            raise ValueError(f"{value!r} is not one of {', '.join(options)}")
        return value
    return check


def _int(low: int, high: int) -> Callable[[Any], int]:
    def check(value):
        if not is_int(value) and not (isinstance(value, str) and value.isdigit()):
            raise ValueError(f"{value!r} is not an integer")
        value = int(value)
        if not low <= value <= high:
            raise ValueError(f"{value} is outside {low}..{high}")
        return value
    return check


def _bool(value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{value!r} is not true or false")
    return value


def _uuid(value) -> str:
    try:
        return str(uuidlib.UUID(str(value)))
    except ValueError:
        raise ValueError(f"{value!r} is not a UUID") from None


def _mac(value) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"([0-9A-Fa-f]{2}:){5}[0-9A-Fa-f]{2}", value):
        raise ValueError(f"{value!r} is not a MAC address (xx:xx:xx:xx:xx:xx)")
    if int(value[:2], 16) & 1:
        raise ValueError(f"{value} is a multicast MAC address (its first octet is odd)")
    return value.lower()


def _path(value) -> str:
    if not isinstance(value, str) or not value.startswith("/") or re.search(r"[\x00-\x1f\x7f]", value):
        raise ValueError(f"{value!r} is not an absolute path")
    return value


def _cmdline(value) -> str:
    if not isinstance(value, str) or re.search(r"[\x00-\x1f\x7f]", value):
        raise ValueError("a kernel command line is one line of printable text")
    if len(value) > 2048:
        raise ValueError(f"the kernel command line has {len(value)} characters (at most 2048)")
    return value


def _optional(check: Callable) -> Callable:
    def wrapped(value):
        return None if value is None or value == "" else check(value)
    return wrapped


NAME = _text(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}", "a domain name (letters, digits, . _ + -, at most 64)")
TENANT = _text(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", "a tenant name (letters, digits, . _ -)")
IFNAME = _text(r"[A-Za-z0-9_.:-]{1,15}", "a network interface name (at most 15 characters)")
MACHINE = _text(r"[a-z0-9][a-z0-9._-]{0,63}", "a QEMU machine type (pc, q35, pc-i440fx-7.2, ...)")


@dataclasses.dataclass(frozen=True)
class Value:
    check: Callable[[Any], Any]
    default: Any = _REQUIRED
    doc: str = ""


FABRIC_VALUES = {
    "fabric_mac": Value(_mac, doc="MAC address of the fabric NIC"),
    "fabric_type": Value(_choice("bridge", "direct"), "bridge", "bridge, or direct (macvtap)"),
    "fabric_source": Value(IFNAME, "fab0", "the host bridge, or the macvtap's lower device"),
    "fabric_direct_mode": Value(_choice("bridge", "vepa", "private", "passthrough"), "bridge",
                                "macvtap mode (type direct only)"),
}

DOMAIN_VALUES = {
    "name": Value(NAME, doc="domain name"),
    "uuid": Value(_uuid, None, "domain UUID (default: a new random one)"),
    "memory_mib": Value(_int(16, 1 << 22), 256, "guest memory, MiB"),
    "vcpus": Value(_int(1, 512), 1, "virtual CPUs"),
    "virt_type": Value(_choice("qemu", "kvm"), "qemu", "qemu (TCG) or kvm"),
    "arch": Value(_choice("x86_64", "aarch64"), "x86_64", "guest architecture"),
    "machine": Value(MACHINE, "pc", "QEMU machine type"),
    "cpu_mode": Value(_optional(_choice("host-model", "host-passthrough", "maximum")), None,
                      "CPU mode (default: the hypervisor's default model; KVM guests "
                      "usually want host-model)"),
    "emulator": Value(_optional(_path), None, "QEMU binary (default: libvirt's choice)"),
    "kernel": Value(_path, doc="guest kernel (direct kernel boot)"),
    "initrd": Value(_optional(_path), None, "initramfs"),
    "cmdline": Value(_optional(_cmdline), None, "kernel command line"),
    "console_log": Value(_optional(_path), None, "serial console to this file (default: a pty)"),
    "interfaces_owner": Value(_choice("accelmig", "external"), "accelmig",
                              "who owns the interface XML (external: Nova/Neutron)"),
    "tenant": Value(_optional(TENANT), None, "the pool tenant of this domain"),
    "qemu_guest_agent": Value(_bool, False, "add qemu-guest-agent's channel too"),
    "agent_channel": Value(_bool, True, "add the accelmig agent's channel (false: a VM like Nova's, "
                                        "with only qemu-guest-agent's, rehomed through guest-exec)"),
    # the fabric NIC is optional in a whole domain
    **{k: (Value(_optional(_mac), None, v.doc) if k == "fabric_mac" else v) for k, v in FABRIC_VALUES.items()},
}

#: template name -> the values it takes.
TEMPLATES: dict[str, dict[str, Value]] = {
    "accelerator-domain.xml.j2": DOMAIN_VALUES,
    "agent-channel.xml.j2": {},
    "fabric-interface.xml.j2": FABRIC_VALUES,
}

#: Constants every template sees (not values a caller sets).
GLOBALS = {
    "accelmig_ns": ACCELMIG_NS,
    "agent_channel_name": AGENT_CHANNEL_NAME,
    "qemu_ga_channel_name": QEMU_GA_CHANNEL_NAME,
}


# ---------------------------------------------------------------- rendering

def _load(name: str):
    """Templates come from the installed package (importlib.resources), so
    rendering works from a wheel, a zip or an editable checkout alike."""
    resource = importlib.resources.files(TEMPLATE_PACKAGE).joinpath(name)
    if not resource.is_file():
        return None
    return resource.read_text(encoding="utf-8")


_ENV = jinja2.Environment(
    loader=jinja2.FunctionLoader(_load),
    undefined=jinja2.StrictUndefined,
    autoescape=True,
    keep_trailing_newline=False,
)
_ENV.globals.update(GLOBALS)


def check_values(template_name: str, values: dict) -> dict:
    """The values a template gets: checked, normalised, defaults filled in."""
    if template_name not in TEMPLATES:
        raise TemplateValueError(source=f"template {template_name!r}",
                                 reason=f"no such template (known: {', '.join(sorted(TEMPLATES))})")
    spec = TEMPLATES[template_name]
    source = f"template {template_name}"
    unknown = sorted(set(values) - set(spec))
    if unknown:
        raise TemplateValueError(source=source, reason=f"unknown value(s) {', '.join(unknown)} "
                                 f"(known: {', '.join(sorted(spec)) or 'none'})")
    out = {}
    for key, value_spec in spec.items():
        if key in values:
            try:
                out[key] = value_spec.check(values[key])
            except ValueError as exc:
                raise TemplateValueError(source=source, reason=f"value {key}: {exc}") from None
        elif value_spec.default is _REQUIRED:
            raise TemplateValueError(source=source, reason=f"value {key} is required ({value_spec.doc})")
        else:
            out[key] = value_spec.default
    if template_name == "accelerator-domain.xml.j2" and out["uuid"] is None:
        out["uuid"] = str(uuidlib.uuid4())
    if out.get("fabric_type") == "bridge" and values.get("fabric_direct_mode") not in (None, "bridge"):
        raise TemplateValueError(source=source, reason="value fabric_direct_mode applies to fabric_type direct only")
    return out


def render(template_name: str, **values) -> str:
    """Render one template to an XML string (well-formed, checked)."""
    checked = check_values(template_name, values)
    try:
        text = _ENV.get_template(template_name).render(**checked)
    except jinja2.UndefinedError as exc:     # a template/spec mismatch: our bug, said clearly
        raise TemplateValueError(source=f"template {template_name}", reason=str(exc)) from None
    try:
        ET.fromstring(text)
    except ET.ParseError as exc:
        raise TemplateValueError(source=f"template {template_name}",
                                 reason=f"rendered XML is not well-formed: {exc}") from None
    return text + "\n"


def template_names() -> list[str]:
    return sorted(TEMPLATES)
