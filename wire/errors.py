"""accelmig's error codes and its one exception family.

Every error that crosses a wire (data plane, control plane, guest channel)
carries one of the codes below; every exception accelmig raises is an
``AccelmigError`` whose ``code`` is one of them.  In the manner of os-vif,
each exception class has a ``msg_fmt`` filled from keyword arguments, so the
message a user reads is the same wherever the error was raised.

Standard library only: this module ships inside guest images.
"""

from __future__ import annotations

import enum


class ErrorCode(str, enum.Enum):
    """Codes on the wire.  Values are stable strings: never renumber."""

    # framing and protocol
    BAD_FRAME = "BAD_FRAME"                      # malformed prefix/header
    FRAME_TOO_LARGE = "FRAME_TOO_LARGE"          # header or payload over the limit
    UNKNOWN_OP = "UNKNOWN_OP"                    # an op this peer does not know
    BAD_REQUEST = "BAD_REQUEST"                  # well-formed frame, invalid fields
    VERSION_UNSUPPORTED = "VERSION_UNSUPPORTED"  # no common protocol version
    PROTOCOL_ERROR = "PROTOCOL_ERROR"            # valid frame at the wrong moment

    # authentication and authorisation
    AUTH_FAILED = "AUTH_FAILED"                  # bad tenant token, host MAC, proof
    FORBIDDEN = "FORBIDDEN"                      # a known caller asking what it may not
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"            # tenant device-memory quota
    NO_SUCH_OBJECT = "NO_SUCH_OBJECT"            # handle unknown in this session
    OBJECT_EXISTS = "OBJECT_EXISTS"              # handle already in use

    # device
    DEVICE_ERROR = "DEVICE_ERROR"                # the device runtime failed
    BUILD_FAILED = "BUILD_FAILED"                # program build failed (log attached)
    OUT_OF_RANGE = "OUT_OF_RANGE"                # offset/size outside a buffer
    KILLED = "KILLED"                            # the tenant's device process was killed
    NO_SUCH_DEVICE = "NO_SUCH_DEVICE"            # no device of the pool matches a selector

    # session continuity
    SESSION_LOST = "SESSION_LOST"                # the pool restarted: the session is gone
    SESSION_EXPIRED = "SESSION_EXPIRED"          # released after its grace period
    SESSION_DIVERGED = "SESSION_DIVERGED"        # an older copy of the session came back
    STALE_EPOCH = "STALE_EPOCH"                  # a frame from a fenced connection
    TICKET_REQUIRED = "TICKET_REQUIRED"          # the session moved: a ticket is needed
    TICKET_INVALID = "TICKET_INVALID"            # forged, expired, used, revoked, wrong host
    WRONG_HOST = "WRONG_HOST"                    # resume from a host the session is not bound to
    WINDOW_FULL = "WINDOW_FULL"                  # driver-side: command window stayed full
    DISCONNECTED = "DISCONNECTED"                # driver-side: no connection in time
    TIMEOUT = "TIMEOUT"                          # a reply did not come in time
    CLOSED = "CLOSED"                            # the object was closed

    # control plane
    NO_SUCH_HOST = "NO_SUCH_HOST"
    NO_SUCH_RECORD = "NO_SUCH_RECORD"
    RECORD_STATE = "RECORD_STATE"                # transition not allowed in this state
    CONFLICT = "CONFLICT"

    # host side and guest agent
    CONFIG_INVALID = "CONFIG_INVALID"
    UNAVAILABLE = "UNAVAILABLE"                  # a needed service cannot be reached
    LIBVIRT_ERROR = "LIBVIRT_ERROR"
    INTERNAL = "INTERNAL"


#: Codes after which a driver may retry the same resume later (the move is
#: still being prepared, or the network is not there yet).
RETRIABLE_CODES = frozenset({
    ErrorCode.TICKET_REQUIRED,
    ErrorCode.WRONG_HOST,
    ErrorCode.UNAVAILABLE,
    ErrorCode.DISCONNECTED,
    ErrorCode.TIMEOUT,
})

#: Codes that end a session for good: nothing the driver can do brings it back.
TERMINAL_SESSION_CODES = frozenset({
    ErrorCode.SESSION_LOST,
    ErrorCode.SESSION_EXPIRED,
    ErrorCode.SESSION_DIVERGED,
    ErrorCode.STALE_EPOCH,
    ErrorCode.KILLED,
})


class AccelmigError(Exception):
    """Base of every accelmig exception.

    ``msg_fmt`` is formatted with the keyword arguments given at raise time;
    ``code`` is the wire error code.  ``details`` carries machine-readable
    extras (a build log, the sequence that diverged) and travels on the wire.
    """

    msg_fmt = "an unknown error occurred"
    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str | None = None, *, details: dict | None = None, **kwargs):
        self.kwargs = kwargs
        self.details = dict(details or {})
        if message is None:
            try:
                message = self.msg_fmt % kwargs
            except (KeyError, TypeError, ValueError):
                # A wrong format must never hide the error it describes.
                message = f"{self.msg_fmt} {kwargs!r}"
        self.message = message
        super().__init__(message)

    @property
    def retriable(self) -> bool:
        return self.code in RETRIABLE_CODES

    def to_wire(self) -> dict:
        out = {"code": self.code.value, "message": self.message}
        if self.details:
            out["details"] = self.details
        return out

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


class FrameError(AccelmigError):
    msg_fmt = "malformed frame: %(reason)s"
    code = ErrorCode.BAD_FRAME


class FrameTooLarge(FrameError):
    msg_fmt = "%(part)s of %(size)d bytes exceeds the limit of %(limit)d bytes"
    code = ErrorCode.FRAME_TOO_LARGE


class UnknownOp(AccelmigError):
    msg_fmt = "unknown operation %(op)r"
    code = ErrorCode.UNKNOWN_OP


class BadRequest(AccelmigError):
    msg_fmt = "invalid request: %(reason)s"
    code = ErrorCode.BAD_REQUEST


class VersionUnsupported(AccelmigError):
    msg_fmt = "no common protocol version: peer offers %(offered)s, we support %(supported)s"
    code = ErrorCode.VERSION_UNSUPPORTED


class ProtocolError(AccelmigError):
    msg_fmt = "protocol error: %(reason)s"
    code = ErrorCode.PROTOCOL_ERROR


class AuthFailed(AccelmigError):
    msg_fmt = "authentication failed: %(reason)s"
    code = ErrorCode.AUTH_FAILED


class Forbidden(AccelmigError):
    msg_fmt = "%(who)s may not %(what)s"
    code = ErrorCode.FORBIDDEN


class QuotaExceeded(AccelmigError):
    msg_fmt = ("tenant %(tenant)s: allocating %(size)d bytes would use %(used)d of "
               "its %(quota)d-byte device-memory quota")
    code = ErrorCode.QUOTA_EXCEEDED


class LimitExceeded(QuotaExceeded):
    """A count limit (objects per session, sessions per tenant): host
    memory and threads the device-memory quota does not see."""
    msg_fmt = "tenant %(tenant)s: %(reason)s"


class NoSuchObject(AccelmigError):
    msg_fmt = "no %(kind)s with handle %(handle)s in this session"
    code = ErrorCode.NO_SUCH_OBJECT


class SessionNotHere(NoSuchObject):
    """A rehome's ticket for a session no driver of this guest registered
    (the guest agent's answer for it)."""
    msg_fmt = "no driver in this guest holds session %(sid)s"


class ObjectExists(AccelmigError):
    msg_fmt = "a %(kind)s with handle %(handle)s already exists in this session"
    code = ErrorCode.OBJECT_EXISTS


class DeviceError(AccelmigError):
    msg_fmt = "device error: %(reason)s"
    code = ErrorCode.DEVICE_ERROR


class BuildFailed(AccelmigError):
    msg_fmt = "program build failed: %(reason)s"
    code = ErrorCode.BUILD_FAILED

    @property
    def build_log(self) -> str:
        return self.details.get("log", "")


class Killed(AccelmigError):
    """The pool killed the tenant's device process (a call ran past the
    device time limit, or the process died): its device state is gone."""
    msg_fmt = "tenant %(tenant)s: device work killed: %(reason)s; the session's device state is gone"
    code = ErrorCode.KILLED


class NoSuchDevice(AccelmigError):
    """An open whose device selector no device of the pool matches: the
    message names what the pool has, so the tenant can ask again."""
    msg_fmt = "no device of this pool matches %(selector)s; it has: %(available)s"
    code = ErrorCode.NO_SUCH_DEVICE


class OutOfRange(AccelmigError):
    msg_fmt = "%(what)s: offset %(offset)d + size %(size)d is outside %(limit)d bytes"
    code = ErrorCode.OUT_OF_RANGE


class SessionLost(AccelmigError):
    msg_fmt = ("session %(sid)s is lost: the pool restarted (now instance %(instance)s) "
               "and the session's device state is gone")
    code = ErrorCode.SESSION_LOST


class SessionExpired(AccelmigError):
    msg_fmt = "session %(sid)s expired and its device memory was released"
    code = ErrorCode.SESSION_EXPIRED


class SessionDiverged(AccelmigError):
    msg_fmt = ("session %(sid)s diverged: %(reason)s; this is an older copy of the "
               "session (snapshot revert, a save image restored twice, a revived source); "
               "the pool's state is untouched")
    code = ErrorCode.SESSION_DIVERGED


class StaleEpoch(AccelmigError):
    msg_fmt = ("session %(sid)s: frame from epoch %(got)d refused, the session is at "
               "epoch %(current)d (this connection was fenced by a later resume)")
    code = ErrorCode.STALE_EPOCH


class TicketRequired(AccelmigError):
    msg_fmt = ("session %(sid)s is moving to host %(host)s (migration %(migration)s): "
               "a resume ticket is required")
    code = ErrorCode.TICKET_REQUIRED


class TicketInvalid(AccelmigError):
    msg_fmt = "resume ticket refused: %(reason)s"
    code = ErrorCode.TICKET_INVALID


class WrongHost(AccelmigError):
    msg_fmt = ("session %(sid)s is bound to host %(bound)s; a resume from %(peer)s "
               "(host %(host)s) needs a ticket")
    code = ErrorCode.WRONG_HOST


class WindowFull(AccelmigError):
    msg_fmt = "the command window stayed full for %(timeout).1f s (%(count)d commands, %(bytes)d bytes)"
    code = ErrorCode.WINDOW_FULL


class Disconnected(AccelmigError):
    msg_fmt = "no connection to the pool within %(timeout).1f s (%(reason)s)"
    code = ErrorCode.DISCONNECTED


class Timeout(AccelmigError):
    msg_fmt = "%(what)s did not complete within %(timeout).1f s"
    code = ErrorCode.TIMEOUT


class Closed(AccelmigError):
    msg_fmt = "%(what)s is closed"
    code = ErrorCode.CLOSED


class NoSuchHost(AccelmigError):
    msg_fmt = "unknown host %(host)r"
    code = ErrorCode.NO_SUCH_HOST


class NoSuchRecord(AccelmigError):
    msg_fmt = "no migration record %(record)s"
    code = ErrorCode.NO_SUCH_RECORD


class RecordState(AccelmigError):
    msg_fmt = "migration record %(record)s is %(state)s: cannot %(action)s"
    code = ErrorCode.RECORD_STATE


class Conflict(AccelmigError):
    msg_fmt = "conflict: %(reason)s"
    code = ErrorCode.CONFLICT


class AlreadyRunning(AccelmigError):
    msg_fmt = ("%(what)s already runs on %(path)s (pid %(pid)s): "
               "not starting a second one (stop it first, or give this one another socket)")
    code = ErrorCode.CONFLICT


class ConfigInvalid(AccelmigError):
    msg_fmt = "invalid configuration in %(source)s: %(reason)s"
    code = ErrorCode.CONFIG_INVALID


class Unavailable(AccelmigError):
    msg_fmt = "%(what)s is unavailable: %(reason)s"
    code = ErrorCode.UNAVAILABLE


class LibvirtFailure(AccelmigError):
    msg_fmt = "libvirt (%(kind)s): %(what)s"
    code = ErrorCode.LIBVIRT_ERROR

    @property
    def kind(self) -> str:
        return self.details.get("kind") or self.kwargs.get("kind", "other")


class InternalError(AccelmigError):
    msg_fmt = "internal error: %(reason)s"
    code = ErrorCode.INTERNAL


def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


def from_wire(error: dict) -> AccelmigError:
    """Rebuild the exception a peer sent as ``{"code", "message", "details"}``.

    Unknown codes (a newer peer) come back as a plain ``AccelmigError`` that
    still carries the code string, so nothing is lost in translation.
    """
    code_text = str(error.get("code", ErrorCode.INTERNAL.value))
    message = str(error.get("message", ""))
    details = error.get("details") if isinstance(error.get("details"), dict) else None
    try:
        code = ErrorCode(code_text)
    except ValueError:
        exc = AccelmigError(message, details=details)
        exc.code = ErrorCode.INTERNAL
        exc.details.setdefault("unknown_code", code_text)
        return exc
    cls = _CLASS_BY_CODE.get(code, AccelmigError)
    exc = cls(message, details=details)
    if cls is AccelmigError:
        exc.code = code
    return exc


# The most general class for each code (FrameTooLarge is a FrameError, but
# owns its own code).
_CLASS_BY_CODE: dict[ErrorCode, type[AccelmigError]] = {}
for _cls in _all_subclasses(AccelmigError):
    _CLASS_BY_CODE.setdefault(_cls.code, _cls)
