"""The few rtnetlink requests a guest's fabric NIC needs, on the standard
library's ``socket.AF_NETLINK``: list links and addresses, add and delete an
address, set a link up (and its MTU), replace a route.

Why not the ``ip`` tool: spawning a process in a guest that just migrated
under TCG costs 30-50 ms each (docs/DESIGN.md, the lab notes); these
requests cost microseconds from the agent's own process.  Why not pyroute2:
the guest side is standard library only.

Each request waits for the kernel's acknowledgement (``NLM_F_ACK``) and
raises ``Unavailable`` with the kernel's errno; a socket timeout bounds
every wait.  Linux only.  Standard library only; Python 3.9+.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import socket
import struct

from accelmig.wire.errors import Unavailable

# netlink(7), rtnetlink(7): the constants used here
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_MULTI, NLM_F_ACK = 0x1, 0x2, 0x4
NLM_F_DUMP = 0x300
NLM_F_REPLACE, NLM_F_EXCL, NLM_F_CREATE = 0x100, 0x200, 0x400
RTM_NEWLINK, RTM_GETLINK = 16, 18
RTM_NEWADDR, RTM_DELADDR, RTM_GETADDR = 20, 21, 22
RTM_NEWROUTE = 24
IFLA_ADDRESS, IFLA_IFNAME, IFLA_MTU = 1, 3, 4
IFA_ADDRESS, IFA_LOCAL = 1, 2
RTA_DST, RTA_OIF, RTA_GATEWAY = 1, 4, 5
IFF_UP = 0x1
ARPHRD_ETHER = 1
RT_TABLE_MAIN, RTPROT_BOOT, RT_SCOPE_UNIVERSE, RTN_UNICAST = 254, 3, 0, 1

_NLMSGHDR = struct.Struct("=IHHII")        # len, type, flags, seq, pid
_IFINFOMSG = struct.Struct("=BxHiII")      # family, type, index, flags, change
_IFADDRMSG = struct.Struct("=BBBBI")       # family, prefixlen, flags, scope, index
_RTMSG = struct.Struct("=BBBBBBBBI")       # family, dst_len, src_len, tos, table, protocol, scope, type, flags
_RTATTR = struct.Struct("=HH")             # len, type
#: the most a dump's answer may hold before we stop reading it (a guest has a few links)
MAX_DUMP_BYTES = 4 << 20


def _align(n: int) -> int:
    return (n + 3) & ~3


def attr(kind: int, data: bytes) -> bytes:
    size = _RTATTR.size + len(data)
    return _RTATTR.pack(size, kind) + data + b"\0" * (_align(size) - size)


def u32(value: int) -> bytes:
    return struct.pack("=I", value)


def parse_attrs(data: bytes) -> dict:
    """type -> raw value of a message's attributes (the first of each type)."""
    out, offset = {}, 0
    while offset + _RTATTR.size <= len(data):
        size, kind = _RTATTR.unpack_from(data, offset)
        if size < _RTATTR.size or offset + size > len(data):
            break
        out.setdefault(kind & 0x3FFF, data[offset + _RTATTR.size:offset + size])
        offset += _align(size)
    return out


def family_of(address) -> int:
    return socket.AF_INET if address.version == 4 else socket.AF_INET6


class RtNetlink:
    """One NETLINK_ROUTE socket; a context manager."""

    def __init__(self, timeout: float = 5.0):
        try:
            self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        except (AttributeError, OSError) as exc:
            raise Unavailable(what="netlink", reason=f"no NETLINK_ROUTE socket: {exc}") from None
        self.sock.settimeout(timeout)
        self.sock.bind((0, 0))
        self._seq = itertools.count(1)

    def __enter__(self) -> "RtNetlink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def _send(self, kind: int, flags: int, body: bytes) -> int:
        seq = next(self._seq)
        self.sock.send(_NLMSGHDR.pack(_NLMSGHDR.size + len(body), kind, flags | NLM_F_REQUEST, seq, 0) + body)
        return seq

    def _answers(self, seq: int, what: str):
        """(type, body) of the kernel's messages answering ``seq``, until its
        acknowledgement or the end of its dump; the kernel's error raised."""
        read = 0
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except socket.timeout:
                raise Unavailable(what=f"netlink {what}", reason="no answer from the kernel") from None
            read += len(data)
            if read > MAX_DUMP_BYTES:
                raise Unavailable(what=f"netlink {what}", reason=f"an answer over {MAX_DUMP_BYTES} bytes")
            offset = 0
            while offset + _NLMSGHDR.size <= len(data):
                size, kind, _flags, got_seq, _pid = _NLMSGHDR.unpack_from(data, offset)
                if size < _NLMSGHDR.size:
                    raise Unavailable(what=f"netlink {what}", reason="a malformed answer")
                body = data[offset + _NLMSGHDR.size:offset + size]
                offset += _align(size)
                if got_seq != seq:
                    continue                    # (an answer to nothing we wait for)
                if kind == NLMSG_DONE:
                    return
                if kind == NLMSG_ERROR:
                    error = -struct.unpack_from("=i", body)[0]
                    if error:
                        raise Unavailable(what=f"netlink {what}", reason=os.strerror(error))
                    return                      # the acknowledgement
                yield kind, body

    def request(self, kind: int, flags: int, body: bytes, what: str) -> None:
        """A change, acknowledged by the kernel (or its error raised)."""
        for _ in self._answers(self._send(kind, flags | NLM_F_ACK, body), what):
            pass

    # -- reading ------------------------------------------------------------------------
    def links(self) -> list[dict]:
        """Every link: index, name, type, MAC (``aa:bb:..``), MTU, flags."""
        out = []
        seq = self._send(RTM_GETLINK, NLM_F_DUMP, _IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0))
        for kind, body in self._answers(seq, "list links"):
            if kind != RTM_NEWLINK or len(body) < _IFINFOMSG.size:
                continue
            _family, link_type, index, flags, _change = _IFINFOMSG.unpack_from(body)
            attrs = parse_attrs(body[_IFINFOMSG.size:])
            mtu = attrs.get(IFLA_MTU)
            out.append({"index": index, "type": link_type, "flags": flags,
                        "name": attrs.get(IFLA_IFNAME, b"").split(b"\0", 1)[0].decode(errors="replace"),
                        "mac": ":".join(f"{b:02x}" for b in attrs.get(IFLA_ADDRESS, b"")),
                        "mtu": struct.unpack("=I", mtu)[0] if mtu and len(mtu) == 4 else None})
        return out

    def addresses(self, index: int, family: int) -> list:
        """The addresses (``ip_interface``) of link ``index`` in ``family``."""
        out = []
        seq = self._send(RTM_GETADDR, NLM_F_DUMP, _IFADDRMSG.pack(family, 0, 0, 0, 0))
        for kind, body in self._answers(seq, "list addresses"):
            if kind != RTM_NEWADDR or len(body) < _IFADDRMSG.size:
                continue
            got_family, prefixlen, _flags, _scope, got_index = _IFADDRMSG.unpack_from(body)
            if got_index != index or got_family != family:
                continue
            attrs = parse_attrs(body[_IFADDRMSG.size:])
            raw = attrs.get(IFA_LOCAL) or attrs.get(IFA_ADDRESS)
            if raw:
                out.append(ipaddress.ip_interface((ipaddress.ip_address(raw), prefixlen)))
        return out

    # -- changing -----------------------------------------------------------------------
    def _address_body(self, index: int, address) -> bytes:
        family, packed = family_of(address), address.ip.packed
        return (_IFADDRMSG.pack(family, address.network.prefixlen, 0, RT_SCOPE_UNIVERSE, index)
                + attr(IFA_LOCAL, packed) + attr(IFA_ADDRESS, packed))

    def add_address(self, index: int, address) -> None:
        self.request(RTM_NEWADDR, NLM_F_CREATE | NLM_F_REPLACE, self._address_body(index, address),
                     f"add address {address}")

    def delete_address(self, index: int, address) -> None:
        self.request(RTM_DELADDR, 0, self._address_body(index, address), f"delete address {address}")

    def set_link(self, index: int, *, up: bool = True, mtu: int | None = None) -> None:
        body = _IFINFOMSG.pack(socket.AF_UNSPEC, 0, index, IFF_UP if up else 0, IFF_UP)
        if mtu:
            body += attr(IFLA_MTU, u32(mtu))
        self.request(RTM_NEWLINK, 0, body, f"set link {index}")

    def replace_route(self, destination, gateway, index: int) -> None:
        """``ip route replace DESTINATION via GATEWAY dev INDEX``."""
        family = family_of(destination)
        body = _RTMSG.pack(family, destination.prefixlen, 0, 0, RT_TABLE_MAIN, RTPROT_BOOT,
                           RT_SCOPE_UNIVERSE, RTN_UNICAST, 0)
        if destination.prefixlen:
            body += attr(RTA_DST, destination.network_address.packed)
        body += attr(RTA_GATEWAY, gateway.packed) + attr(RTA_OIF, u32(index))
        self.request(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_REPLACE, body, f"route {destination} via {gateway}")
