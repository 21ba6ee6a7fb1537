"""``accelmig domain``: render accelerator-ready domain XML from the templates.

``accelmig domain render accelerator-domain --set name=vm1 --set kernel=/images/vmlinux
--set fabric_mac=52:54:00:12:34:56`` prints a whole domain: the accelmig
metadata, the guest agent's virtio-serial channel and a bridge or macvtap
fabric NIC.  Never a VFIO hostdev: a passed-through device pins a VM to its
host (libvirt refuses to migrate it); accelmig's accelerator is remote.

Values are checked by accelmig.plugin.domain.render (unknown keys, missing
required ones, malformed values all fail with a message naming the value).
``--set key=value`` turns ``true``/``false`` into booleans and digits into
integers where the value's check wants one, and keeps the text otherwise;
``--set-json key=JSON`` passes any JSON value as it is.
"""

from __future__ import annotations

import json
import os
import re

import click

from accelmig.plugin.commands.install import cli_errors, print_json
from accelmig.plugin.domain import render as rendering
from accelmig.plugin.domain.model import DomainXML
from accelmig.runtime.files import atomic_write
from accelmig.wire.errors import BadRequest

#: Keys people reach for to pass a device through: refused with the reason.
_PASSTHROUGH_KEY = re.compile(r"(hostdev|vfio|passthrough|pci_?dev|mdev)", re.I)
_PASSTHROUGH_VALUES = {"hostdev", "vfio", "pci", "passthrough-pci"}
_TRUE = {"true", "yes", "on"}
_FALSE = {"false", "no", "off"}


def resolve_template(name: str) -> str:
    """``accelerator-domain`` and ``accelerator-domain.xml.j2`` alike."""
    names = rendering.template_names()
    for candidate in (name, f"{name}.xml.j2", f"{name}.j2"):
        if candidate in names:
            return candidate
    short = ", ".join(_short(n) for n in names)
    raise BadRequest(f"no template {name!r} (known: {short}; 'accelmig domain templates' lists them)")


def _short(name: str) -> str:
    return name[:-len(".xml.j2")] if name.endswith(".xml.j2") else name


def _guesses(text: str) -> list:
    """What ``--set key=text`` may mean, most specific first (the text itself last)."""
    out = []
    low = text.strip().lower()
    if low in _TRUE:
        out.append(True)
    elif low in _FALSE:
        out.append(False)
    elif re.fullmatch(r"[+-]?\d+", text.strip()):
        out.append(int(text))
    elif text.strip()[:1] in "[{":
        try:
            out.append(json.loads(text))
        except ValueError:
            pass
    out.append(text)
    return out


def parse_values(template: str, sets: tuple[str, ...], set_jsons: tuple[str, ...]) -> dict:
    """The values of ``--set``/``--set-json`` for ``template`` (not yet checked)."""
    spec = rendering.TEMPLATES[template]
    values: dict = {}

    def split(item: str, option: str) -> tuple[str, str]:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise BadRequest(f"{option} {item!r}: expected KEY=VALUE")
        if _PASSTHROUGH_KEY.search(key):
            raise BadRequest(f"{option} {key}: accelmig domains have no VFIO/PCI passthrough "
                                    f"device: a hostdev pins the VM to its host (libvirt refuses to "
                                    f"live-migrate it); the accelerator is reached over the fabric NIC")
        if key in values:
            raise BadRequest(f"value {key} is given twice")
        return key, text

    for item in sets:
        key, text = split(item, "--set")
        guesses = _guesses(text)
        chosen = guesses[-1]           # the text as typed: what an error message quotes
        check = spec[key].check if key in spec else None
        if check is not None:
            for guess in guesses:
                try:
                    check(guess)
                except (ValueError, TypeError):
                    continue
                chosen = guess
                break
        values[key] = chosen
    for item in set_jsons:
        key, text = split(item, "--set-json")
        try:
            values[key] = json.loads(text)
        except ValueError as exc:
            raise BadRequest(f"--set-json {key}: not valid JSON ({exc})") from None
    if str(values.get("fabric_type", "")).lower() in _PASSTHROUGH_VALUES:
        raise BadRequest(f"fabric_type {values['fabric_type']!r}: a passed-through device blocks "
                                f"live migration; use bridge or direct (macvtap)")
    return values


def check_rendered(template: str, xml: str) -> None:
    """What an accelerator-ready domain must (not) have, checked on the output."""
    if template != "accelerator-domain.xml.j2":
        return
    dom = DomainXML.parse(xml)
    if dom.root.find("devices/hostdev") is not None:     # pragma: no cover - templates never do
        raise BadRequest("the rendered domain has a <hostdev>: it could not be live-migrated")
    if dom.accelmig_metadata is None:                    # pragma: no cover
        raise BadRequest("the rendered domain lacks accelmig's metadata")


def _templates_listing(only: str | None = None) -> list[dict]:
    out = []
    for name in rendering.template_names():
        if only is not None and name != only:
            continue
        values = []
        for key, value in rendering.TEMPLATES[name].items():
            required = value.default is rendering._REQUIRED
            values.append({"key": key, "required": required,
                           "default": None if required else value.default, "doc": value.doc})
        out.append({"template": name, "short": _short(name), "values": values})
    return out


def _print_listing(listing: list[dict]) -> None:
    for entry in listing:
        click.echo(f"{entry['short']}  ({entry['template']})")
        if not entry["values"]:
            click.echo("    (takes no values)")
        width = max((len(v["key"]) for v in entry["values"]), default=0)
        for value in entry["values"]:
            if value["required"]:
                default = "required"
            elif value["default"] is None:
                default = "optional"
            else:
                default = f"default {json.dumps(value['default'])}"
            click.echo(f"    {value['key']:<{width}}  {default}: {value['doc']}")


@click.group("domain")
def domain():
    """Accelerator-ready domain XML.

    An accelerator-ready domain has the accelmig metadata (its XML
    namespace), the guest agent's virtio-serial channel
    (org.accelmig.agent.0, no fixed socket path: libvirt makes one per host)
    and a bridge or macvtap fabric NIC, and never a VFIO hostdev (that
    blocks live migration).  Define it with 'virsh define FILE'.
    """


@domain.command("templates")
@click.option("--json", "as_json", is_flag=True, help="print the list as JSON")
def templates(as_json):
    """List the templates and the values each one takes."""
    listing = _templates_listing()
    if as_json:
        print_json(listing)
    else:
        _print_listing(listing)


@domain.command("render")
@click.argument("template", required=False)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="a template value (repeatable); true/false and integers are converted where "
                   "the value wants them")
@click.option("--set-json", "set_jsons", multiple=True, metavar="KEY=JSON",
              help="a template value given as JSON (repeatable)")
@click.option("-o", "--output", type=click.Path(dir_okay=False), metavar="FILE",
              help="write the XML to FILE (atomically) instead of stdout")
@click.option("--list", "list_templates", is_flag=True,
              help="list the templates (or TEMPLATE's values) instead of rendering")
@cli_errors
def render(template, sets, set_jsons, output, list_templates):
    """Render TEMPLATE to domain XML.

    TEMPLATE is a name from 'accelmig domain templates' (the .xml.j2 suffix
    may be left out): accelerator-domain (a whole domain), agent-channel or
    fabric-interface (fragments, e.g. for 'virsh attach-device').

    \b
    Example:
      accelmig domain render accelerator-domain --set name=vm1 \\
          --set kernel=/images/vmlinux --set initrd=/images/initramfs.cpio \\
          --set fabric_mac=52:54:00:12:34:56 --set fabric_source=fab0 -o vm1.xml
    """
    if list_templates:
        listing = _templates_listing(resolve_template(template) if template else None)
        _print_listing(listing)
        return
    if template is None:
        raise click.UsageError("TEMPLATE is required (or --list); 'accelmig domain templates' lists them")
    name = resolve_template(template)
    values = parse_values(name, sets, set_jsons)
    xml = rendering.render(name, **values)
    check_rendered(name, xml)
    if output:
        atomic_write(os.path.abspath(output), xml, 0o644)
        click.echo(f"wrote {output}", err=True)
    else:
        click.echo(xml, nl=False)
