"""Which domain this guest is, as its hypervisor tells it: the SMBIOS system
UUID.  libvirt gives a domain's UUID to QEMU, which puts it in SMBIOS type 1
unless ``<sysinfo>`` says otherwise; Nova's ``<sysinfo>`` sets it to the
instance UUID.  Linux shows it at ``/sys/class/dmi/id/product_uuid``,
readable by root only: the agent (root) reads it and tells the drivers of
other users (``where``).

It is the guest's word, never proof: the pool uses it to let hosts find the
sessions of domains that nobody marked, and binds a session to a host only
on that host's attestation.  Standard library only.
"""

from __future__ import annotations

from accelmig.wire.dataplane import domain_claim
from accelmig.wire.errors import BadRequest

PRODUCT_UUID = "/sys/class/dmi/id/product_uuid"
#: what firmware without a real UUID writes there
_NOT_SET = {"00000000-0000-0000-0000-000000000000", "ffffffff-ffff-ffff-ffff-ffffffffffff",
            "03000200-0400-0500-0006-000700080009"}


def system_uuid(path: str = PRODUCT_UUID) -> str | None:
    """The SMBIOS system UUID in canonical lower case; None where there is
    none, it is a placeholder, or this process may not read it (not root)."""
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            text = handle.read(64)
    except OSError:
        return None
    try:
        uuid = domain_claim(text)          # what the pool accepts at open, canonical
    except BadRequest:
        return None
    return None if uuid is None or uuid in _NOT_SET else uuid
