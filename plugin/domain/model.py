"""Domain XML as a model, in the manner of virt-manager's virtinst.

A ``DomainXML`` wraps the parsed element tree of one libvirt domain and reads
and writes it through small property objects (``Interface.source_bridge`` is
``./source/@bridge`` of one ``<interface>``), never by string surgery.  What
it does not model it keeps as it was: unknown elements, comments, other
applications' metadata, namespace declarations where they were declared and
with their prefixes.  ``to_xml()`` writes in libvirt's own style (single
quotes; double quotes inside ``<metadata>``, which libvirt dumps through
libxml2), so the unchanged XML of ``virsh dumpxml`` comes back byte for byte.

The one rewrite it offers, ``rewrite_fabric_for_host``, is what the
``migrate begin`` hook does on the destination: give the accelerator-fabric
NIC this host's bridge (``type='bridge'``) or macvtap source device
(``type='direct'``).  It never touches a domain that is not accelmig's, nor
one whose interface XML another system owns (``owner='external'`` in the
domain's metadata or in this host's config: Nova/Neutron), and it never
changes the device set: libvirt refuses a migration whose XML changes the
guest ABI, so the ``device_signature()`` is checked before and after.

Usage::

    dom = DomainXML.parse(sys.stdin.read())
    changes = dom.rewrite_fabric_for_host(config.fabric)
    if changes:                      # print nothing: libvirt keeps its XML
        sys.stdout.write(dom.to_xml())
"""

from __future__ import annotations

import copy
import dataclasses
import re
import uuid as uuid_module
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING, Iterator

from accelmig.plugin.domain import (ACCELMIG_NS, ACCELMIG_NS_PREFIX, AGENT_CHANNEL_NAME,
                                    QEMU_GA_CHANNEL_NAME)
from accelmig.wire.attestation import MIGRATION_NS, TOKEN_ELEMENT, check_hex
from accelmig.wire.errors import BadRequest, InternalError

if TYPE_CHECKING:  # pragma: no cover
    from accelmig.plugin.config import FabricConfig

__all__ = [
    "AccelmigMetadata", "Change", "Channel", "DeviceKey", "DomainXML", "Interface",
    "MAX_XML_BYTES", "OWNER_ACCELMIG", "OWNER_EXTERNAL", "rewrite_for_host",
]

#: A domain's XML is a few KiB; a hook's stdin larger than this is not one.
MAX_XML_BYTES = 8 << 20

OWNER_ACCELMIG = "accelmig"
OWNER_EXTERNAL = "external"
OWNERS = (OWNER_ACCELMIG, OWNER_EXTERNAL)

_MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
#: Prefixes for namespaces that an edit introduces where none is in scope.
_KNOWN_PREFIXES = {ACCELMIG_NS: ACCELMIG_NS_PREFIX}
_XML_NS = "http://www.w3.org/XML/1998/namespace"      # bound to ``xml:`` everywhere


def _mac(value: str) -> str:
    text = value.strip().lower()
    if not _MAC.match(text):
        raise BadRequest(reason=f"domain XML: {value!r} is not a MAC address")
    return text


def _int(value: str) -> int:
    try:
        return int(value.strip(), 0)
    except ValueError:
        raise BadRequest(reason=f"domain XML: {value!r} is not a number") from None


def _qname(tag: str) -> str:
    return f"{{{ACCELMIG_NS}}}{tag}"


# ---------------------------------------------------------------------------
# parsing and writing


class _Builder(ET.TreeBuilder):
    """A TreeBuilder that remembers on which element each namespace was declared."""

    def __init__(self):
        super().__init__(insert_comments=True, insert_pis=True)
        self.nsdecls: dict[ET.Element, list[tuple[str, str]]] = {}
        self._pending: list[tuple[str, str]] = []

    def start_ns(self, prefix, uri):
        self._pending.append((prefix or "", uri))

    def start(self, tag, attrs):
        elem = super().start(tag, attrs)
        if self._pending:
            self.nsdecls[elem] = self._pending
            self._pending = []
        return elem

    def doctype(self, name, pubid, system):
        # libvirt never writes one; refusing it here also refuses entity tricks.
        raise BadRequest(reason="domain XML must not have a DOCTYPE")


def _escape_text(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("\r", "&#13;")


def _escape_attr(value: str, quote: str) -> str:
    out = value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    out = out.replace("\n", "&#10;").replace("\r", "&#13;").replace("\t", "&#9;")
    return out.replace(quote, "&apos;" if quote == "'" else "&quot;")


class _Writer:
    """Serialises an element tree keeping namespace declarations in place."""

    def __init__(self, nsdecls: dict):
        self.nsdecls = nsdecls
        self.out: list[str] = []

    def write(self, elem: ET.Element, scope: dict[str, str], quote: str) -> None:
        if elem.tag is ET.Comment:
            self.out.append(f"<!--{elem.text or ''}-->")
        elif elem.tag is ET.ProcessingInstruction:
            self.out.append(f"<?{elem.text or ''}?>")
        else:
            self._element(elem, scope, quote)
        if elem.tail:
            self.out.append(_escape_text(elem.tail))

    def _element(self, elem: ET.Element, scope: dict[str, str], quote: str) -> None:
        declared = list(self.nsdecls.get(elem, ()))
        scope = dict(scope)
        scope.update(declared)

        def name_of(qname: str, is_attr: bool) -> str:
            if not qname.startswith("{"):
                if not is_attr and scope.get("") is not None:
                    # An unqualified element inside a default namespace (only an
                    # edit can make one): undeclare the default for it.
                    declared.append(("", ""))
                    scope[""] = None
                return qname
            uri, local = qname[1:].split("}", 1)
            for prefix, bound in reversed(list(scope.items())):
                if bound == uri and (prefix or not is_attr):
                    return f"{prefix}:{local}" if prefix else local
            prefix = _KNOWN_PREFIXES.get(uri, "ns0")
            n = 0
            while prefix in scope and scope[prefix] != uri:
                n += 1
                prefix = f"ns{n}"
            declared.append((prefix, uri))
            scope[prefix] = uri
            return f"{prefix}:{local}"

        tag = name_of(elem.tag, False)
        attrs = [(name_of(k, True), v) for k, v in elem.attrib.items()]
        parts = [f"<{tag}"]
        for prefix, uri in declared:
            parts.append(f" xmlns:{prefix}=" if prefix else " xmlns=")
            parts.append(f"{quote}{_escape_attr(uri, quote)}{quote}")
        for key, value in attrs:
            parts.append(f" {key}={quote}{_escape_attr(value, quote)}{quote}")
        children = list(elem)
        if elem.text is None and not children:
            parts.append("/>")
            self.out.append("".join(parts))
            return
        parts.append(">")
        self.out.append("".join(parts))
        if elem.text:
            self.out.append(_escape_text(elem.text))
        # libvirt dumps <metadata> children with libxml2: double quotes there.
        inner = '"' if elem.tag == "metadata" else quote
        for child in children:
            self.write(child, scope, inner)
        self.out.append(f"</{tag}>")


# ---------------------------------------------------------------------------
# property objects (virtinst's XMLProperty, on ElementTree)


class _Prop:
    """One value of an element: ``path`` is a child (``"."`` for the element
    itself), ``attr`` an attribute of it (None: its text)."""

    def __init__(self, path: str, attr: str | None, convert=str, writable: bool = False):
        self.path, self.attr, self.convert, self.writable = path, attr, convert, writable

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        node = obj.node if self.path == "." else obj.node.find(self.path)
        if node is None:
            return None
        raw = node.get(self.attr) if self.attr else node.text
        if raw is None:
            return None
        return self.convert(raw)

    def __set__(self, obj, value):
        if not self.writable:
            raise AttributeError(f"{type(obj).__name__}.{self.name} is read-only")
        node = obj.node if self.path == "." else obj.node.find(self.path)
        if node is None:
            node = _insert_child(obj.node, self.path)
        if self.attr:
            node.set(self.attr, str(value))
        else:
            node.text = str(value)


def _insert_child(parent: ET.Element, tag: str) -> ET.Element:
    """A new child, placed after the last existing one, indented like its siblings."""
    children = list(parent)
    child = ET.Element(tag)
    if children:
        last = children[-1]
        child.tail = last.tail
        last.tail = children[-2].tail if len(children) > 1 else parent.text
    else:
        child.tail = parent.tail
        parent.text = (parent.tail or "") + "  "
    parent.append(child)
    return child


def _address(node: ET.Element) -> tuple[tuple[str, str], ...]:
    addr = node.find("address")
    return tuple(sorted(addr.attrib.items())) if addr is not None else ()


# ---------------------------------------------------------------------------
# the parts of a domain accelmig reads


@dataclasses.dataclass(frozen=True)
class AccelmigMetadata:
    """``<accelmig:domain>`` in the domain's ``<metadata>``."""

    fabric_mac: str | None = None
    interfaces_owner: str = OWNER_ACCELMIG
    tenant: str | None = None

    @property
    def external(self) -> bool:
        return self.interfaces_owner == OWNER_EXTERNAL


class Interface:
    """One ``<interface>`` device.  Only the host-bound source is writable."""

    type = _Prop(".", "type")
    mac = _Prop("mac", "address", _mac)
    source_bridge = _Prop("source", "bridge", writable=True)
    source_dev = _Prop("source", "dev", writable=True)
    source_mode = _Prop("source", "mode")
    source_network = _Prop("source", "network")
    model = _Prop("model", "type")
    mtu = _Prop("mtu", "size", _int)
    target_dev = _Prop("target", "dev")
    alias = _Prop("alias", "name")

    def __init__(self, node: ET.Element):
        self.node = node

    @property
    def host_binding(self) -> str | None:
        """``"bridge"`` or ``"direct"`` when this NIC names a host bridge or a
        macvtap source device itself; None for libvirt networks (their name
        means the same on every host; live XML shows them as ``type='bridge'``
        with ``source/@network``) and for every other type."""
        if self.type == "bridge" and self.source_network is None:
            return "bridge"
        if self.type == "direct":
            return "direct"
        return None

    def __repr__(self):
        source = self.source_bridge or self.source_dev or self.source_network
        return f"<Interface type={self.type!r} mac={self.mac!r} source={source!r}>"


class Channel:
    """One ``<channel>`` device (virtio-serial)."""

    type = _Prop(".", "type")
    source_mode = _Prop("source", "mode")
    path = _Prop("source", "path")          # filled in by libvirt in live XML
    target_type = _Prop("target", "type")
    name = _Prop("target", "name")
    state = _Prop("target", "state")        # live XML: 'connected' | 'disconnected'

    def __init__(self, node: ET.Element):
        self.node = node

    @property
    def connected(self) -> bool | None:
        """True/False from live XML's ``state``; None where libvirt says nothing."""
        if self.state is None:
            return None
        return self.state == "connected"

    def __repr__(self):
        return f"<Channel name={self.name!r} path={self.path!r} state={self.state!r}>"


@dataclasses.dataclass(frozen=True)
class DeviceKey:
    """What of one device must not change across a rewrite (the guest ABI)."""

    kind: str
    type: str | None
    model: str | None
    address: tuple[tuple[str, str], ...]
    mac: str | None
    extra: tuple[tuple[str, str], ...] = ()

    def __str__(self):
        bits = [self.kind] + [f"{k}={v}" for k, v in (("type", self.type), ("model", self.model),
                                                     ("mac", self.mac)) if v is not None]
        bits += [f"{k}={v}" for k, v in self.extra]
        if self.address:
            bits.append("@" + ",".join(f"{k}={v}" for k, v in self.address))
        return " ".join(bits)


#: Per device kind, further (path, attribute) pairs that are part of the ABI.
_ABI_EXTRA = {
    "disk": ((".", "device"), ("target", "dev"), ("target", "bus")),
    "controller": ((".", "index"),),
    "channel": (("target", "type"), ("target", "name")),
}


@dataclasses.dataclass(frozen=True)
class Change:
    """One rewritten value of the fabric NIC."""

    mac: str | None
    field: str          # "source bridge" | "source dev"
    old: str | None
    new: str

    def __str__(self):
        return f"interface {self.mac}: {self.field} {self.old!r} -> {self.new!r}"


# ---------------------------------------------------------------------------


class DomainXML:
    """One libvirt domain's XML as a model."""

    def __init__(self, root: ET.Element, nsdecls: dict):
        self.root = root
        self._nsdecls = nsdecls

    @classmethod
    def parse(cls, text: str | bytes) -> "DomainXML":
        """Parse a domain's XML; ``BadRequest`` says what is wrong with it."""
        if isinstance(text, str):
            size = len(text.encode("utf-8", "surrogatepass"))
        elif isinstance(text, (bytes, bytearray)):
            size = len(text)
        else:
            raise BadRequest(reason=f"domain XML must be text, not {type(text).__name__}")
        if size == 0 or not (text.strip() if isinstance(text, str) else bytes(text).strip()):
            raise BadRequest(reason="domain XML is empty")
        if size > MAX_XML_BYTES:
            raise BadRequest(reason=f"domain XML of {size} bytes exceeds {MAX_XML_BYTES} bytes")
        builder = _Builder()
        parser = ET.XMLParser(target=builder)
        try:
            parser.feed(text)
            root = parser.close()
        except ET.ParseError as exc:
            raise BadRequest(reason=f"domain XML is not well-formed: {exc}") from None
        if root.tag != "domain":
            raise BadRequest(reason=f"domain XML: the root element is <{root.tag}>, not <domain>")
        return cls(root, builder.nsdecls)

    def to_xml(self) -> str:
        """The whole document, as libvirt would print it, ending in a newline."""
        writer = _Writer(self._nsdecls)
        tail, self.root.tail = self.root.tail, None
        try:
            writer.write(self.root, {"xml": _XML_NS}, "'")
        finally:
            self.root.tail = tail
        return "".join(writer.out) + "\n"

    # -- identity ----------------------------------------------------------

    @property
    def name(self) -> str:
        text = (self.root.findtext("name") or "").strip()
        if not text:
            raise BadRequest(reason="domain XML has no <name>")
        return text

    @property
    def uuid(self) -> str:
        """The domain's UUID, canonical lower-case form."""
        text = (self.root.findtext("uuid") or "").strip()
        if not text:
            raise BadRequest(reason="domain XML has no <uuid>")
        try:
            return str(uuid_module.UUID(text))
        except ValueError:
            raise BadRequest(reason=f"domain XML: <uuid> {text!r} is not a UUID") from None

    # -- accelmig's own parts ----------------------------------------------

    def _metadata_element(self) -> ET.Element | None:
        return self.root.find(f"metadata/{_qname('domain')}")

    @property
    def accelmig_metadata(self) -> AccelmigMetadata | None:
        """The parsed ``<accelmig:domain>``, or None where the domain has none."""
        node = self._metadata_element()
        if node is None:
            return None
        fabric = node.find(_qname("fabric"))
        mac = fabric.get("mac") if fabric is not None else None
        if mac is not None:
            mac = _mac(mac)
        owner_node = node.find(_qname("interfaces"))
        owner = owner_node.get("owner", OWNER_ACCELMIG) if owner_node is not None else OWNER_ACCELMIG
        if owner not in OWNERS:
            raise BadRequest(reason=f"domain XML: accelmig interfaces owner {owner!r} is not "
                                    f"{' or '.join(OWNERS)}")
        tenant_node = node.find(_qname("tenant"))
        tenant = tenant_node.get("name") if tenant_node is not None else None
        return AccelmigMetadata(fabric_mac=mac, interfaces_owner=owner, tenant=tenant or None)

    def migration_token(self) -> str | None:
        """The migration token the domain's host wrote into the running
        domain (``wire.attestation``: ``<accelmig-migration:token value=…/>``
        in its own namespace, which marks nothing: a Nova instance carries
        one too); None where there is none or it is not one."""
        node = self.root.find(f"metadata/{{{MIGRATION_NS}}}{TOKEN_ELEMENT}")
        value = node.get("value") if node is not None else None
        try:
            return check_hex(value, "migration token") if value is not None else None
        except BadRequest:
            return None

    def is_accelmig(self) -> bool:
        """An accelmig domain has accelmig's metadata or the agent channel."""
        return self._metadata_element() is not None or self.agent_channel() is not None

    # -- devices -----------------------------------------------------------

    def _devices(self) -> ET.Element | None:
        return self.root.find("devices")

    def _device_nodes(self, tag: str) -> Iterator[ET.Element]:
        devices = self._devices()
        if devices is not None:
            yield from devices.findall(tag)

    def channels(self) -> list[Channel]:
        return [Channel(node) for node in self._device_nodes("channel")]

    def channel(self, name: str) -> Channel | None:
        for chan in self.channels():
            if chan.name == name:
                return chan
        return None

    def agent_channel(self) -> Channel | None:
        """The accelmig agent's virtio-serial channel."""
        return self.channel(AGENT_CHANNEL_NAME)

    def guest_agent_channel(self) -> Channel | None:
        """qemu-guest-agent's channel (the fallback path, ``guest-exec``)."""
        return self.channel(QEMU_GA_CHANNEL_NAME)

    def has_guest_agent(self) -> bool:
        return self.guest_agent_channel() is not None

    def interfaces(self) -> list[Interface]:
        return [Interface(node) for node in self._device_nodes("interface")]

    def interface_by_mac(self, mac: str) -> Interface | None:
        wanted = _mac(mac)
        for nic in self.interfaces():
            if nic.mac == wanted:
                return nic
        return None

    def fabric_interface(self) -> Interface | None:
        """The accelerator-fabric NIC: the one with the metadata's MAC, else
        the only interface.  None when there is none, or several and nothing
        says which; ``BadRequest`` when the metadata names a MAC no interface has."""
        meta = self.accelmig_metadata
        if meta is not None and meta.fabric_mac is not None:
            nic = self.interface_by_mac(meta.fabric_mac)
            if nic is None:
                raise BadRequest(reason=f"domain {self._label()}: accelmig metadata names fabric NIC "
                                        f"{meta.fabric_mac}, but no <interface> has that MAC")
            return nic
        nics = self.interfaces()
        return nics[0] if len(nics) == 1 else None

    def device_signature(self) -> list[DeviceKey]:
        """The ordered devices with what the guest ABI fixes about each: kind,
        type, model, address, MAC (and disk target, controller index, channel
        name).  A rewrite must leave this exactly as it was."""
        out = []
        devices = self._devices()
        if devices is None:
            return out
        for node in devices:
            if not isinstance(node.tag, str) or node.tag == "emulator":
                continue
            model = node.get("model")
            if model is None and node.find("model") is not None:
                model = node.find("model").get("type")
            mac_node = node.find("mac")
            extra = []
            for path, attr in _ABI_EXTRA.get(node.tag, ()):
                holder = node if path == "." else node.find(path)
                if holder is not None and holder.get(attr) is not None:
                    extra.append((attr if path == "." else f"{path}.{attr}", holder.get(attr)))
            out.append(DeviceKey(kind=node.tag, type=node.get("type"), model=model,
                                 address=_address(node),
                                 mac=mac_node.get("address", "").lower() if mac_node is not None else None,
                                 extra=tuple(extra)))
        return out

    # -- the host-bound rewrite --------------------------------------------

    def rewrite_fabric_for_host(self, fabric: "FabricConfig") -> list[Change]:
        """Give the fabric NIC this host's bridge or macvtap source device.

        ``fabric`` is this host's ``[fabric]`` config (``mode``, ``bridge``,
        ``device``, ``interfaces_owner``).  Returns what changed; an empty list
        means the XML is as it was (print nothing).  Nothing changes for a
        domain that is not accelmig's, where the interfaces are owned by
        another system (the domain's metadata or this host says
        ``external``), for ``mode = "none"``, for a libvirt-network NIC, or
        when the NIC already matches.  ``BadRequest`` when the NIC is of the
        other host-bound type (this host cannot give it its fabric without
        changing the device) or the metadata names a MAC no NIC has."""
        if not self.is_accelmig() or fabric.mode == "none" or fabric.interfaces_owner == OWNER_EXTERNAL:
            return []
        meta = self.accelmig_metadata
        if meta is not None and meta.external:
            return []
        nic = self.fabric_interface()
        if nic is None or nic.host_binding is None:
            return []
        if nic.host_binding != fabric.mode:
            raise BadRequest(reason=f"domain {self._label()}: fabric NIC {nic.mac} is "
                                    f"type='{nic.type}', but this host's fabric mode is "
                                    f"{fabric.mode!r}; accelmig rewrites only the NIC's host "
                                    f"source, never its type")
        if fabric.mode == "bridge":
            attr, field, want = "source_bridge", "source bridge", fabric.bridge
        else:
            attr, field, want = "source_dev", "source dev", fabric.device
        if not want:
            raise BadRequest(reason=f"this host's fabric mode is {fabric.mode!r} but names no "
                                    f"{'bridge' if fabric.mode == 'bridge' else 'device'}")
        old = getattr(nic, attr)
        if old == want:
            return []
        before = self.device_signature()
        devices = self._devices()
        position = list(devices).index(nic.node)
        saved = copy.deepcopy(nic.node)
        setattr(nic, attr, want)
        if self.device_signature() != before:
            devices[position] = saved
            raise InternalError(reason=f"rewriting {field} of {nic.mac} changed the device set "
                                       f"of domain {self._label()}; rewrite undone")
        return [Change(mac=nic.mac, field=field, old=old, new=want)]

    def _label(self) -> str:
        text = (self.root.findtext("name") or "").strip()
        return repr(text) if text else "(unnamed)"

    def __repr__(self):
        return f"<DomainXML {self._label()}>"


def rewrite_for_host(xml_text: str | bytes, fabric: "FabricConfig") -> tuple[str | None, list[Change]]:
    """What the ``migrate begin`` hook prints: the rewritten XML, or None when
    nothing changed (print nothing and libvirt keeps its own), with the changes."""
    dom = DomainXML.parse(xml_text)
    changes = dom.rewrite_fabric_for_host(fabric)
    return (dom.to_xml() if changes else None), changes
