"""The data plane: what a guest's driver and the pool say to each other.

A connection opens with ``hello`` (protocol version negotiation and a
per-connection challenge), then either ``open`` (a new session, with the
tenant's token and, optionally, ``device``: a selector, ``wire.devices``;
``opened`` names the device the pool placed it on, for good) or ``resume``
(an existing session, proven with its secret; it stays on its device).
After that the driver sends *commands*; each carries the session's next
sequence number ``seq``, the session ``epoch`` it belongs to, and ``ack``, the
highest reply sequence the driver has received (so the pool may drop older
replies).  Every command gets exactly one ``reply`` with the same ``seq``, in
order.  ``ack`` frames carry only an acknowledgement.  Consecutive plain
successes (no result fields, no payload) may travel as one ``done`` frame
naming the range ``from``..``to``: it stands for one reply per command.

Until ``opened``/``resumed`` the peer is a stranger: it sends one frame at
a time and waits for the answer, frames carry no payload and a header of at
most 4 KiB, and the whole handshake (TLS included, counted from the TCP
accept) must end within the pool's ``handshake_timeout``.  Only then do the
negotiated limits apply.

An attached connection that sends nothing for the pool's ``idle_timeout``
(told in ``welcome``; older pools leave it out) is closed, and its session
detaches as for any lost connection.  A driver that has sent nothing for a
third of it sends an ``ack`` frame of what it has seen
(``keepalive_interval``): acknowledging again what was acknowledged is a
no-op for every pool, so the keepalive needs no new operation.

In a pool of several nodes an ``open`` may be answered ``redirect``
(``endpoint``, ``node``, ``instance``): the node reached placed the session
on another one.  The driver opens there, once, with ``placed`` naming that
node and instance (``parse_redirect``, ``placement_claim``).  A driver that
cannot open there (that node died less than a lease's TTL ago) opens again,
once, at the node that redirected it, with ``unreachable`` naming the node
it could not open at; that node places the open without it.

Handles of buffers and programs are chosen by the driver, so a re-sent
command names the same object and stays idempotent.

Standard library only.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
import re
import struct
import zlib

from accelmig.wire import opencl
from accelmig.wire.errors import BadRequest, ProtocolError, UnknownOp, VersionUnsupported
from accelmig.wire.values import is_a, is_int, is_number

#: data-plane protocol versions this code speaks, oldest first: 2 adds
#: ``launches``, pipelined launches in one frame (``wire.batch``); 3 what
#: the OpenCL API needs (``wire.opencl``: device listing, fill, rect
#: transfers, sub-buffers, kernel info, by-value arguments, profiling); 4 a
#: launch's global work offset (``wire.opencl``, ``goffset``)
PROTOCOL_VERSIONS = (1, 2, 3, 4)


class Op(str, enum.Enum):
    # connection-level (not sequenced)
    HELLO = "hello"
    OPEN = "open"
    RESUME = "resume"
    ACK = "ack"
    LIST_DEVICES = "list_devices"    # protocol 3: the devices a token may open on (``wire.opencl``)
    # pool -> driver
    WELCOME = "welcome"      # answer to hello
    OPENED = "opened"        # answer to open
    RESUMED = "resumed"      # answer to resume, replayed replies follow
    REDIRECT = "redirect"    # answer to open in a cluster: open at that node instead (once)
    REPLY = "reply"          # answer to one sequenced command
    DEVICES = "devices"      # answer to list_devices (protocol 3)
    DONE = "done"            # plain success of commands "from".."to" (coalesced replies)
    ERROR = "error"          # connection-level error; the pool closes after it
    # sequenced commands
    INFO = "info"
    ALLOC = "alloc"
    FREE = "free"
    WRITE = "write"
    READ = "read"
    COPY = "copy"
    BUILD = "build"                  # payload: OpenCL C source (UTF-8)
    BUILD_BINARY = "build_binary"    # payload: a device binary
    PROGRAM_BINARY = "program_binary"
    FREE_PROGRAM = "free_program"
    LAUNCH = "launch"
    FINISH = "finish"
    RELEASE = "release"              # end the session, free everything
    # a run of sequenced launches in one frame (protocol 2, ``wire.batch``)
    LAUNCHES = "launches"
    # protocol 3 (``wire.opencl``)
    FILL = "fill"
    WRITE_RECT = "write_rect"        # payload: the region, packed
    READ_RECT = "read_rect"
    COPY_RECT = "copy_rect"
    ALLOC_SUB = "alloc_sub"
    KERNEL_INFO = "kernel_info"


CONNECTION_OPS = frozenset({Op.HELLO, Op.OPEN, Op.RESUME, Op.ACK, Op.LIST_DEVICES})

# op -> {field: type(s)} of required fields; optional ones are checked where used
_REQUIRED: dict[Op, dict[str, tuple]] = {
    Op.INFO: {},
    Op.ALLOC: {"buf": (int,), "size": (int,)},
    Op.FREE: {"buf": (int,)},
    Op.WRITE: {"buf": (int,), "offset": (int,)},
    Op.READ: {"buf": (int,), "offset": (int,), "size": (int,)},
    Op.COPY: {"src": (int,), "dst": (int,), "src_offset": (int,), "dst_offset": (int,), "size": (int,)},
    Op.BUILD: {"prog": (int,), "options": (str,)},
    Op.BUILD_BINARY: {"prog": (int,), "options": (str,)},
    Op.PROGRAM_BINARY: {"prog": (int,)},
    Op.FREE_PROGRAM: {"prog": (int,)},
    Op.LAUNCH: {"prog": (int,), "kernel": (str,), "gsize": (list,), "args": (list,)},
    Op.FINISH: {},
    Op.RELEASE: {},
    Op.FILL: {"buf": (int,), "offset": (int,), "size": (int,), "pattern": (str,)},
    Op.WRITE_RECT: {"buf": (int,), "origin": (list,), "region": (list,), "row_pitch": (int,),
                    "slice_pitch": (int,)},
    Op.READ_RECT: {"buf": (int,), "origin": (list,), "region": (list,), "row_pitch": (int,),
                   "slice_pitch": (int,)},
    Op.COPY_RECT: {"src": (int,), "dst": (int,), "src_origin": (list,), "dst_origin": (list,),
                   "region": (list,), "src_row_pitch": (int,), "src_slice_pitch": (int,),
                   "dst_row_pitch": (int,), "dst_slice_pitch": (int,)},
    Op.ALLOC_SUB: {"buf": (int,), "parent": (int,), "origin": (int,), "size": (int,)},
    Op.KERNEL_INFO: {"prog": (int,), "kernel": (str,)},
}
SEQUENCED_OPS = frozenset(_REQUIRED)
#: commands the driver does not wait for (pipelined)
PIPELINED_OPS = frozenset({Op.ALLOC, Op.FREE, Op.WRITE, Op.COPY, Op.LAUNCH, Op.FREE_PROGRAM,
                           Op.FILL, Op.WRITE_RECT, Op.COPY_RECT, Op.ALLOC_SUB})
#: commands whose payload is data
PAYLOAD_OPS = frozenset({Op.WRITE, Op.BUILD, Op.BUILD_BINARY, Op.WRITE_RECT})
#: commands of protocol 3 (``wire.opencl``): refused on a connection of an older one
OPENCL_OPS = frozenset({Op.FILL, Op.WRITE_RECT, Op.READ_RECT, Op.COPY_RECT, Op.ALLOC_SUB, Op.KERNEL_INFO})


def negotiate(offered, supported=PROTOCOL_VERSIONS) -> int:
    """Pick the highest version both sides speak (``supported``: this side's)."""
    try:
        common = set(int(v) for v in offered) & set(supported)
    except (TypeError, ValueError, OverflowError):
        raise VersionUnsupported(offered=offered, supported=list(supported)) from None
    if not common:
        raise VersionUnsupported(offered=list(offered), supported=list(supported))
    return max(common)


def offered_versions(versions) -> tuple:
    """Versions a side chooses to offer: some of those this code speaks."""
    try:
        chosen = tuple(sorted({int(v) for v in versions}))
    except (TypeError, ValueError):
        raise BadRequest(reason=f"protocol versions must be integers, not {str(versions)[:40]!r}") from None
    if not chosen or not set(chosen) <= set(PROTOCOL_VERSIONS):
        raise BadRequest(reason=f"protocol versions {list(chosen)}: this code speaks {list(PROTOCOL_VERSIONS)}")
    return chosen


def parse_op(header: dict) -> Op:
    try:
        return Op(header["op"])
    except (KeyError, ValueError):
        raise UnknownOp(op=header.get("op")) from None


#: every integer in a command (handle, size, offset, range, sequence) fits
#: a signed 64-bit field: beyond it a device runtime's size_t or C++
#: binding fails in ways it cannot explain (std::bad_cast), not BAD_REQUEST
MAX_INT = (1 << 63) - 1

#: The smallest frame payload limit a pool may announce at hello (and an
#: operator may configure): a driver splits transfers into chunks of the
#: announced limit, so a pool announcing a few bytes would turn one upload
#: into millions of commands.
MIN_PAYLOAD_LIMIT = 4096


def announced_payload_limit(welcome: dict, own_limit: int) -> int:
    """The frame payload limit of a pool's ``welcome``: at most the driver's
    own; a missing one is the driver's; BadRequest for one that is not an
    integer of at least ``MIN_PAYLOAD_LIMIT``."""
    value = welcome.get("max_payload")
    if value is None:
        return own_limit
    if not is_int(value, MIN_PAYLOAD_LIMIT):
        raise BadRequest(reason=f"the pool announced max_payload {str(value)[:40]!r}: it must be an "
                                f"integer of at least {MIN_PAYLOAD_LIMIT}")
    return min(value, own_limit)


#: A driver sends its keepalive at most this often, whatever a pool says.
MIN_KEEPALIVE = 0.2


def keepalive_interval(welcome: dict) -> float | None:
    """Seconds of sending nothing after which a driver sends a keepalive: a
    third of the ``idle_timeout`` a pool's ``welcome`` announces; None when
    it announces none (an older pool: it cuts no idle connection)."""
    value = welcome.get("idle_timeout")
    if not is_number(value) or value <= 0:
        return None
    return max(MIN_KEEPALIVE, value / 3)


def validate_command(header: dict, payload_len: int, version: int = PROTOCOL_VERSIONS[-1]) -> Op:
    """Check a sequenced command's fields; return its op or raise BadRequest
    (``ProtocolError`` for something of a protocol newer than ``version``,
    the one the connection agreed to)."""
    op = parse_op(header)
    if op not in SEQUENCED_OPS:
        raise BadRequest(reason=f"{op.value!r} is not a sequenced command")
    if version < opencl.OPENCL_VERSION and (op in OPENCL_OPS or "prof" in header):
        raise ProtocolError(reason=f"{op.value}{' with prof' if op not in OPENCL_OPS else ''} on a connection "
                                   f"that agreed to protocol {version} (it needs {opencl.OPENCL_VERSION})")
    for key in ("seq", "epoch"):
        if not is_int(header.get(key), 0, MAX_INT):
            raise BadRequest(reason=f"{op.value}: {key!r} must be a non-negative integer")
    for name, types in _REQUIRED[op].items():
        value = header.get(name)
        if not is_a(value, types):
            raise BadRequest(reason=f"{op.value}: field {name!r} must be {types[0].__name__}")
        if types == (int,) and value < 0:
            raise BadRequest(reason=f"{op.value}: field {name!r} must not be negative")
        if types == (int,) and value > MAX_INT:
            raise BadRequest(reason=f"{op.value}: field {name!r} must be at most 2**63-1")
    if op not in PAYLOAD_OPS and payload_len:
        raise BadRequest(reason=f"{op.value} carries no payload ({payload_len} bytes sent)")
    if op == Op.LAUNCH:
        _validate_launch(header, version)
    if op in OPENCL_OPS or "prof" in header:
        opencl.validate(op.value, header, payload_len)
    return op


def _validate_range(name: str, value) -> list[int]:
    if not isinstance(value, list) or not 1 <= len(value) <= 3:
        raise BadRequest(reason=f"launch: {name} must list 1 to 3 dimensions")
    if not all(is_int(v, 1, MAX_INT) for v in value):
        raise BadRequest(reason=f"launch: {name} entries must be positive integers")
    return value


def _validate_launch(header: dict, version: int = PROTOCOL_VERSIONS[-1]) -> None:
    gsize = _validate_range("gsize", header["gsize"])
    lsize = header.get("lsize")
    if lsize is not None:
        lsize = _validate_range("lsize", lsize)
        if len(lsize) != len(gsize):
            raise BadRequest(reason="launch: lsize and gsize differ in dimensions")
    if "goffset" in header:
        if version < opencl.OFFSET_VERSION:
            raise ProtocolError(reason=f"launch with goffset on a connection that agreed to protocol {version} "
                                       f"(it needs {opencl.OFFSET_VERSION})")
        opencl.global_offset(header, gsize)
    for index, arg in enumerate(header["args"]):
        if not isinstance(arg, dict) or len(arg) == 0:
            raise BadRequest(reason=f"launch: argument {index} must be an object")
        if "buf" in arg:
            if arg["buf"] is None and version >= opencl.OPENCL_VERSION:
                continue                    # a NULL buffer (protocol 3)
            if not is_int(arg["buf"], -MAX_INT, MAX_INT):
                raise BadRequest(reason=f"launch: argument {index}: buf must be an integer")
        elif "local" in arg:
            if not is_int(arg["local"], 1, MAX_INT):
                raise BadRequest(reason=f"launch: argument {index}: local must be a positive size")
        elif "t" in arg:
            decode_scalar(arg, index)
        elif "raw" in arg and version >= opencl.OPENCL_VERSION:
            opencl.raw_arg(arg, index)
        else:
            raise BadRequest(reason=f"launch: argument {index} is none of buf/local/scalar")


# -- typed scalars ------------------------------------------------------------
#: scalar type -> struct code (little endian on the wire, as OpenCL devices are)
SCALAR_TYPES = {
    "i8": "b", "u8": "B", "i16": "h", "u16": "H", "i32": "i", "u32": "I",
    "i64": "q", "u64": "Q", "f32": "f", "f64": "d",
}
#: numpy dtype names for the same types (for sides that have numpy)
NUMPY_NAMES = {
    "i8": "int8", "u8": "uint8", "i16": "int16", "u16": "uint16", "i32": "int32",
    "u32": "uint32", "i64": "int64", "u64": "uint64", "f32": "float32", "f64": "float64",
}


def encode_scalar(type_name: str, value) -> dict:
    """A kernel scalar argument, bit-exact: its little-endian bytes in hex."""
    code = SCALAR_TYPES.get(type_name)
    if code is None:
        raise BadRequest(reason=f"unknown scalar type {type_name!r}")
    try:
        raw = struct.pack("<" + code, value)
    except struct.error as exc:
        raise BadRequest(reason=f"{type_name} cannot hold {value!r}: {exc}") from None
    return {"t": type_name, "x": raw.hex()}


def decode_scalar(arg: dict, index: int = 0) -> bytes:
    code = SCALAR_TYPES.get(arg.get("t"))
    if code is None:
        raise BadRequest(reason=f"launch: argument {index}: unknown scalar type {arg.get('t')!r}")
    try:
        raw = bytes.fromhex(arg.get("x", ""))
    except (TypeError, ValueError):
        raise BadRequest(reason=f"launch: argument {index}: scalar bytes are not hex") from None
    if len(raw) != struct.calcsize(code):
        raise BadRequest(reason=f"launch: argument {index}: {arg['t']} needs "
                                f"{struct.calcsize(code)} bytes, got {len(raw)}")
    return raw


# -- command identity ----------------------------------------------------------
#: header fields that change when a command is re-sent, and so are not part
#: of what the command *is*
VOLATILE_FIELDS = frozenset({"seq", "ack", "epoch"})


class CommandIdentity:
    """What a command is, for divergence checks: the same command re-sent
    after a reconnect has the same identity; an older copy of the guest that
    re-uses the sequence number for something else does not.

    It compares the header's stable fields (everything but seq/ack/epoch)
    and the payload's length and digest.  Both are kept cheap for the common
    case, where nothing is ever compared: the header is kept as it is, and
    the digest is computed lazily (``settle()``, on the worker thread, off
    the event loop).  The peer is a copy of the same driver, not an
    adversary: the session secret already proves ownership.

    ``digest`` maps the payload to an int: CRC-32 here (the standard
    library's); the pool passes a faster one (``pool.dataplane``: a 64 MiB
    upload is digested in full on its way to the device).  Identities are
    only ever compared with others made by the same process, so the
    function is that process's choice, not a contract.
    """

    __slots__ = ("_header", "length", "_crc", "_payload", "_digest")

    def __init__(self, header: dict, payload=b"", digest=zlib.crc32):
        self._header = header
        self.length = len(payload)
        self._payload = payload if self.length else None
        self._crc = None if self.length else 0
        self._digest = digest

    def stable_fields(self) -> dict:
        return {k: v for k, v in self._header.items() if k not in VOLATILE_FIELDS}

    def crc(self) -> int:
        crc = self._crc
        if crc is None:
            payload = self._payload
            if payload is None:          # settled meanwhile
                return self._crc
            crc = self._digest(payload)
            self._crc = crc
            self._payload = None         # the payload's buffer may be reused now
        return crc

    settle = crc

    def set_digest(self, value: int) -> None:
        """The payload's digest, taken elsewhere with this identity's
        function (a payload digested piece by piece as it arrived)."""
        self._crc = value
        self._payload = None

    def __eq__(self, other) -> bool:
        if not isinstance(other, CommandIdentity):
            return NotImplemented
        return (self.length == other.length and self.stable_fields() == other.stable_fields()
                and self.crc() == other.crc())

    def __hash__(self):  # identities are compared, never used as keys
        raise TypeError("CommandIdentity is not hashable")


def ownership_proof(secret: bytes, challenge: str, sid: str, epoch: int, binding: bytes = b"") -> str:
    """HMAC proving the resumer holds the session secret, bound to this
    connection's challenge (so a captured proof cannot be replayed) and,
    with TLS, to the channel (``wire.tls.channel_binding``: so a relay that
    is not the pool gets a proof the pool refuses)."""
    msg = f"{challenge}|{sid}|{epoch}".encode()
    if binding:
        msg += b"|" + binding
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def check_ownership_proof(secret: bytes, challenge: str, sid: str, epoch: int, proof,
                          binding: bytes = b"") -> bool:
    if not isinstance(proof, str):
        return False
    return hmac.compare_digest(ownership_proof(secret, challenge, sid, epoch, binding), proof)


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def domain_claim(value) -> str | None:
    """``open``'s optional ``domain``: the domain the guest says it is, its
    SMBIOS system UUID (``/sys/class/dmi/id/product_uuid``; libvirt and Nova
    set it to the domain's UUID).  Lower-case canonical form, or None."""
    if value is None:
        return None
    text = value.strip().lower() if isinstance(value, str) else None
    if text is None or not _UUID.fullmatch(text):
        raise BadRequest(reason=f"open: domain must be a UUID (the guest's SMBIOS system UUID) or "
                                f"absent, not {str(value)[:40]!r}" if isinstance(value, str)
                         else f"open: domain must be a UUID string or absent, not {type(value).__name__}")
    return text


#: a pool node's name and instance, as a redirect and a placed open carry them
_NODE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}")
_INSTANCE = re.compile(r"[0-9a-f]{4,32}")


def placement_claim(value, field: str = "placed") -> tuple[str, str]:
    """``open``'s ``placed`` (``{"node", "instance"}``): the node a redirect
    sent this open to.  The node opens it only if that is itself, the same
    instance: never one that restarted since it was chosen.  The same shape
    is ``open``'s ``unreachable``: the node a redirect sent this open to and
    the driver could not open at, so that the node placing it again leaves
    that one out (a node killed less than its lease's TTL ago is still
    listed live in etcd)."""
    if not isinstance(value, dict) or set(value) != {"node", "instance"}:
        raise BadRequest(reason=f"open: {field} must be {{node, instance}}")
    node, instance = value["node"], value["instance"]
    if not isinstance(node, str) or not _NODE_NAME.fullmatch(node) or \
            not isinstance(instance, str) or not _INSTANCE.fullmatch(instance):
        raise BadRequest(reason=f"open: {field} names no node (name, 4-32 hex digit instance)")
    return node, instance


def parse_redirect(header: dict) -> dict:
    """A ``redirect`` answer, checked before the driver dials anything: the
    endpoint to open at and the node (name, instance) it names."""
    node, instance = placement_claim({"node": header.get("node"), "instance": header.get("instance")})
    endpoint = header.get("endpoint")
    if not isinstance(endpoint, str) or len(endpoint) > 300:
        raise BadRequest(reason="redirect: endpoint must be HOST:PORT")
    parse_endpoint(endpoint)
    return {"endpoint": endpoint, "node": node, "instance": instance}


_HOSTNAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,252})?")


def parse_endpoint(endpoint: str, default_port: int | None = None, *, listen: bool = False) -> tuple[str, int]:
    """``"HOST:PORT"`` (``"[v6]:PORT"`` for IPv6) -> (host, port).

    The one endpoint parser of every side (option types, config files,
    listeners, clients).  PORT is 1-65535; ``listen=True`` also allows 0
    (any free port, for a listening address).  HOST is a name or an IPv4
    address, or an IPv6 address in brackets."""
    if not isinstance(endpoint, str) or not endpoint:
        raise BadRequest(reason=f"endpoint {endpoint!r} is not HOST:PORT")
    if endpoint.startswith("["):
        host, sep, rest = endpoint[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise BadRequest(reason=f"endpoint {endpoint!r} is not [IPv6]:PORT")
        port_text = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise BadRequest(reason=f"endpoint {endpoint!r}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port_text = endpoint.rpartition(":")
        if not sep:
            host, port_text = endpoint, ""
        if ":" in host:
            raise BadRequest(reason=f"endpoint {endpoint!r}: an IPv6 address goes in brackets, "
                                    f"[ADDRESS]:PORT")
        if not host:
            raise BadRequest(reason=f"endpoint {endpoint!r} has no host (HOST:PORT)")
        if not _HOSTNAME.fullmatch(host):
            raise BadRequest(reason=f"endpoint {endpoint!r}: {host!r} is not a host name or address")
    if not port_text:
        if default_port is None:
            raise BadRequest(reason=f"endpoint {endpoint!r} has no port (HOST:PORT)")
        return host, default_port
    if not port_text.isdigit():          # int() would take " 80", "+80", "8_0"
        raise BadRequest(reason=f"endpoint {endpoint!r}: port {port_text!r} is not a number")
    port = int(port_text)
    low = 0 if listen else 1
    if not low <= port <= 65535:
        raise BadRequest(reason=f"endpoint {endpoint!r}: port {port} is not in {low}-65535")
    return host, port


def parse_listen_list(text: str) -> list[tuple[str, int]]:
    """A listening address list, ``"0.0.0.0:7070,[::]:7070"`` -> [(host, port), ...]."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise BadRequest(reason=f"{text!r} names no HOST:PORT")
    return [parse_endpoint(item, listen=True) for item in items]
