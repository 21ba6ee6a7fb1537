"""Devices of a pool node as the sides see them: stable ids, types, and the
selector a session opens with (``connect(..., device="type=gpu")``).

The selector is a contract between the guest's driver and the pool, and it
is tenant input: parsed strictly and bounded here (length, terms, numbers
with units), the same code on both sides, so a driver refuses a bad one
before it leaves the guest and the pool refuses it whatever sent it.

Grammar (ASCII, at most ``MAX_SELECTOR`` characters)::

    selector := ID | term ("," term)*          at most MAX_TERMS terms, each key once
    term     := "id=" ID | "type=" TYPE | "vendor=" TEXT | "name=" TEXT
              | "min_memory=" SIZE
    TYPE     := gpu | cpu | accelerator | fpga | custom   (fpga: accelerator)
    TEXT     := 1..64 of [A-Za-z0-9 ._+/()-]           (case-insensitive substring)
    SIZE     := digits [B|K|KiB|M|MiB|G|GiB|T|TiB]      (at most 1 PiB)

A device **id** is ``TYPE-HHHHHHHH-K``: the type, the first 8 hex digits of
SHA-256 over ``platform NUL vendor NUL name``, and ``K``, the device's rank
among devices with that same platform, vendor and name, in the runtime's
order.  So an id survives a restart and does not move when another kind of
device appears or goes; only identical devices are told apart by order (they
are interchangeable until one holds sessions, and a restart loses sessions).

Standard library only, Python 3.9+: this module ships inside guest images.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

from accelmig.wire.errors import BadRequest

#: Longest selector text, and most terms in one.
MAX_SELECTOR = 256
MAX_TERMS = 5
MAX_TEXT = 64
#: Largest min_memory (1 PiB): a number past any device, not past any int.
MAX_MEMORY = 1 << 50

#: Device types, from CL_DEVICE_TYPE (FPGAs are OpenCL accelerators).
DEVICE_TYPES = ("gpu", "accelerator", "cpu", "custom")
TYPE_ALIASES = {"fpga": "accelerator"}

# CL_DEVICE_TYPE bits (cl.h): the most specific one names the device.
_CL_TYPE_BITS = ((1 << 2, "gpu"), (1 << 3, "accelerator"), (1 << 4, "custom"), (1 << 1, "cpu"))

ID_PATTERN = re.compile(r"^(gpu|accelerator|cpu|custom)-[0-9a-f]{8}-[0-9]{1,3}$")
_TEXT = re.compile(r"^[A-Za-z0-9 ._+/()-]{1,%d}$" % MAX_TEXT)
_SIZE = re.compile(r"^([0-9]{1,16})(B|K|KiB|M|MiB|G|GiB|T|TiB)?$")
_SIZE_UNITS = {None: 1, "B": 1, "K": 1 << 10, "KiB": 1 << 10, "M": 1 << 20, "MiB": 1 << 20,
               "G": 1 << 30, "GiB": 1 << 30, "T": 1 << 40, "TiB": 1 << 40}
_KEYS = ("id", "type", "vendor", "name", "min_memory")


def device_type(cl_type_bits: int) -> str:
    """The type of a device from its ``CL_DEVICE_TYPE`` bit field."""
    for bit, name in _CL_TYPE_BITS:
        if cl_type_bits & bit:
            return name
    return "custom"


def stable_device_id(type_name: str, platform: str, vendor: str, name: str, rank: int) -> str:
    """The id of a device (see the module's docstring)."""
    digest = hashlib.sha256("\0".join((platform, vendor, name)).encode("utf-8")).hexdigest()[:8]
    return f"{type_name}-{digest}-{rank}"


def assign_ids(devices: list) -> list:
    """Ids for devices described as dicts with ``type``, ``platform``,
    ``vendor`` and ``name``, in the runtime's order."""
    seen: dict = {}
    out = []
    for dev in devices:
        key = (dev["platform"], dev["vendor"], dev["name"])
        rank = seen.get(key, 0)
        seen[key] = rank + 1
        out.append(stable_device_id(dev["type"], *key, rank))
    return out


@dataclasses.dataclass(frozen=True)
class DeviceSelector:
    """What a session asks of its device; every field given must hold."""

    id: str | None = None
    type: str | None = None
    vendor: str | None = None
    name: str | None = None
    min_memory: int | None = None

    def matches(self, device: dict) -> bool:
        """``device``: a view with ``id``, ``type``, ``vendor``, ``name``,
        ``global_mem_size`` (``DeviceSet.describe``'s items)."""
        if self.id is not None and device.get("id") != self.id:
            return False
        if self.type is not None and device.get("type") != self.type:
            return False
        if self.vendor is not None and self.vendor.lower() not in str(device.get("vendor", "")).lower():
            return False
        if self.name is not None and self.name.lower() not in str(device.get("name", "")).lower():
            return False
        if self.min_memory is not None and int(device.get("global_mem_size", 0)) < self.min_memory:
            return False
        return True

    def __str__(self) -> str:
        """The canonical text (what the driver sends, what errors quote)."""
        terms = [f"{key}={getattr(self, key)}" for key in _KEYS if getattr(self, key) is not None]
        return ",".join(terms) or "any"


def parse_selector(text) -> DeviceSelector | None:
    """``None`` (the pool chooses) or a selector; anything else is
    ``BAD_REQUEST`` with the reason, before anything is looked up."""
    if text is None:
        return None
    if not isinstance(text, str):
        raise BadRequest(reason=f"device selector must be a string, not {type(text).__name__}")
    if not 0 < len(text) <= MAX_SELECTOR:
        raise BadRequest(reason=f"device selector must be 1 to {MAX_SELECTOR} characters, "
                                f"not {len(text)}")
    if not text.isascii() or not text.isprintable():
        raise BadRequest(reason="device selector must be printable ASCII")
    if "=" not in text:
        if not ID_PATTERN.match(text):
            raise BadRequest(reason=f"device selector {_quote(text)} is neither a device id "
                                    f"(TYPE-XXXXXXXX-K, see 'accelmig-pool devices') nor "
                                    f"key=value terms ({', '.join(_KEYS)})")
        return DeviceSelector(id=text)
    terms = text.split(",")
    if len(terms) > MAX_TERMS:
        raise BadRequest(reason=f"device selector has {len(terms)} terms, at most {MAX_TERMS}")
    fields: dict = {}
    for term in terms:
        key, sep, value = term.strip().partition("=")
        if not sep or key not in _KEYS:
            raise BadRequest(reason=f"device selector term {_quote(term)}: expected KEY=VALUE "
                                    f"with KEY one of {', '.join(_KEYS)}")
        if key in fields:
            raise BadRequest(reason=f"device selector names {key} twice")
        fields[key] = _parse_value(key, value.strip())
    return DeviceSelector(**fields)


def _parse_value(key: str, value: str):
    if key == "id":
        if not ID_PATTERN.match(value):
            raise BadRequest(reason=f"device id {_quote(value)} is not TYPE-XXXXXXXX-K")
        return value
    if key == "type":
        name = TYPE_ALIASES.get(value.lower(), value.lower())
        if name not in DEVICE_TYPES:
            raise BadRequest(reason=f"device type {_quote(value)}: one of "
                                    f"{', '.join(DEVICE_TYPES + tuple(TYPE_ALIASES))}")
        return name
    if key == "min_memory":
        match = _SIZE.match(value)
        if not match:
            raise BadRequest(reason=f"min_memory {_quote(value)} is not a size (e.g. 8GiB)")
        number = int(match.group(1)) * _SIZE_UNITS[match.group(2)]
        if number > MAX_MEMORY:
            raise BadRequest(reason=f"min_memory {_quote(value)} is over 1 PiB")
        return number
    if not _TEXT.match(value):
        raise BadRequest(reason=f"device {key} {_quote(value)} must be 1 to {MAX_TEXT} of "
                                f"letters, digits, space and ._+/()-")
    return value


def _quote(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")
