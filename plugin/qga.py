"""The qemu-guest-agent fallback: rehome a guest that has no accelmig channel.

VMs built by OpenStack Nova (and others) have no ``org.accelmig.agent.0``
channel, only qemu-guest-agent's ``org.qemu.guest_agent.0``.  There the
destination host delivers the rehome by running the guest agent's own
command inside the guest through qemu-guest-agent's ``guest-exec``::

    /usr/bin/python3 -m accelmig.agent rehome --stdin  <  {"migration_id", "identity", "tickets"}

(``python3 -m accelmig.agent`` is the ``accelmig-agent`` script: guest images
carry the package, not its console scripts.)  The command asks the agent
daemon running in the guest (``accelmig-agent run --port none``) to do what a
``rehome`` on the channel does, prints the outcome as JSON and exits 0 (all
sessions resumed), 1 (not all), 2 (a bad document) or 3 (no agent running).

How it goes, with libvirt's ``virDomainQemuAgentCommand``
(``libvirt_qemu.qemuAgentCommand``):

1. ``guest-exec`` with ``path``/``arg``, ``input-data`` (the document,
   base64) and ``capture-output``; qemu-ga answers ``{"pid": N}`` at once;
2. ``guest-exec-status`` every few tens of milliseconds until ``exited``
   (qemu-ga reports it once the process has exited *and* its output pipes
   are drained, then forgets the pid: asking again answers "Invalid
   parameter 'pid'");
3. ``out-data``/``err-data`` (base64) decoded, the outcome parsed from stdout.

Two things an operator must know, and which this module says in its logs
and errors:

- **libvirt taints the domain**: any arbitrary agent command marks it
  ``custom-ga-command`` (the domain log gets "Domain id=N is tainted:
  custom-ga-command", ``virsh dominfo`` and support tools show it).  That is
  expected on this path; a warning is logged once per domain.
- **guest-exec may be disabled by policy** (RHEL-like guests ship qemu-ga
  with ``--block-rpcs``/``BLACKLIST_RPC`` or, from QEMU 8.0,
  ``--allow-rpcs`` lists without it).  QEMU 7.2's qemu-ga then answers
  ``{"error": {"class": "CommandNotFound", "desc": "Command guest-exec has
  been disabled"}}``, which libvirt 9.0 reports as ``VIR_ERR_INTERNAL_ERROR``
  "internal error: unable to execute QEMU agent command 'guest-exec':
  Command guest-exec has been disabled" (measured): :class:`GuestExecDisabled`.

Everything here blocks (libvirt calls and short sleeps): hostd calls it in an
executor thread.  The rehome itself is idempotent in the guest (the agent
applies a migration id once and answers repeats with the first outcome), so
a delivery that timed out may simply be tried again.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import logging
import math
import re
import threading
import time

import libvirt
import libvirt_qemu

from accelmig.plugin.domain.model import DomainXML
from accelmig.wire import channel as ch
from accelmig.wire.errors import AccelmigError, ErrorCode
from accelmig.wire.values import is_int

LOG = logging.getLogger("accelmig.plugin.qga")

#: How to run the guest agent inside the guest (absolute: qemu-ga's PATH is
#: whatever its service manager gave it).
DEFAULT_COMMAND = ("/usr/bin/python3", "-m", "accelmig.agent")
REHOME_ARGS = ("rehome", "--stdin")
PIECE_ARGS = ("rehome", "--stdin", "--piece")

#: The most document one guest-exec carries on its stdin.  qemu-ga (7.2, in
#: the lab's TCG guests under load) stalled past libvirt's timeout on
#: guest-exec commands of ~350 KB of base64 and more, and once answered a
#: JSON parse error, leaving the agent unusable for the next command; 267 KB
#: never did.  A bigger rehome (a VM of ~400 sessions and more) goes in
#: ticket pieces of this size first, each staged by its own guest-exec.
GUEST_EXEC_STDIN_MAX = 128 << 10

#: The agent's exit codes (accelmig.agent.cli).
EXIT_OK, EXIT_NOT_ALL_RESUMED, EXIT_BAD_DOCUMENT, EXIT_NO_AGENT = 0, 1, 2, 3

#: libvirt's agent timeout is whole seconds; one call never waits longer
#: than this, so the overall deadline is re-checked between calls.
MAX_CALL_TIMEOUT = 10
#: guest-exec-status polling: first interval, growth, cap (seconds).  The
#: rehome is on the accelerator's blackout path: look often at first.
POLL_FIRST, POLL_GROWTH, POLL_MAX = 0.03, 1.5, 0.1


# ---------------------------------------------------------------- errors

class QgaError(AccelmigError):
    """Base of this module's errors: talking to qemu-guest-agent failed."""

    msg_fmt = "domain %(domain)s: qemu-guest-agent %(command)s failed: %(reason)s"
    code = ErrorCode.LIBVIRT_ERROR


class QgaUnavailable(QgaError):
    """qemu-guest-agent is not connected (not running in the guest, the
    guest still booting, the channel just reconnected) or did not answer in
    time.  Retriable."""

    msg_fmt = ("domain %(domain)s: qemu-guest-agent is not connected or not responding "
               "(%(reason)s); is qemu-ga running in the guest?")
    code = ErrorCode.UNAVAILABLE


class QgaNotConfigured(QgaError):
    """The domain has no qemu-guest-agent channel at all."""

    msg_fmt = ("domain %(domain)s has no qemu-guest-agent channel (org.qemu.guest_agent.0): "
               "%(reason)s; without accelmig's channel either, the guest cannot be rehomed")
    code = ErrorCode.CONFIG_INVALID


class GuestExecDisabled(QgaError):
    """qemu-ga refuses the command: disabled by the guest's policy, or not
    built in.  Not retriable: a person must change the guest."""

    msg_fmt = ("domain %(domain)s: qemu-guest-agent refuses %(command)s (%(reason)s): the guest's "
               "policy disables it, or its qemu-ga lacks it (qemu-ga --block-rpcs / --allow-rpcs, BLACKLIST_RPC in "
               "/etc/sysconfig/qemu-ga, qemu-ga.conf); allow guest-exec and guest-exec-status "
               "there, or give the VM accelmig's channel (org.accelmig.agent.0)")
    code = ErrorCode.CONFIG_INVALID


class GuestExecTimeout(QgaError):
    """The command did not finish in time (it may still be running in the
    guest: qemu-ga 7.2 cannot kill it)."""

    msg_fmt = ("domain %(domain)s: %(command)s (guest pid %(pid)s) did not finish within "
               "%(timeout).1f s")
    code = ErrorCode.TIMEOUT


class GuestCommandFailed(QgaError):
    """The command ran (or could not be started) and failed: its exit
    status, stdout and stderr are attributes and in ``details``."""

    msg_fmt = "domain %(domain)s: %(command)s failed in the guest: %(reason)s"
    code = ErrorCode.INTERNAL

    @property
    def exit_code(self) -> int | None:
        return self.details.get("exit_code")

    @property
    def stderr(self) -> str:
        return self.details.get("stderr", "")

    @property
    def stdout(self) -> str:
        return self.details.get("stdout", "")


class RehomeDocumentRefused(GuestCommandFailed):
    """``accelmig-agent rehome`` exited 2: it refused the document."""

    code = ErrorCode.BAD_REQUEST


class AgentNotRunning(GuestCommandFailed):
    """``accelmig-agent rehome`` exited 3: no accelmig agent daemon answers
    in the guest (``accelmig-agent run --port none`` is not running)."""

    code = ErrorCode.UNAVAILABLE


# ---------------------------------------------------------------- messages (pure)

def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def exec_request(command, args=(), input_data: bytes | None = None, capture_output: bool = True) -> str:
    """The ``guest-exec`` message: ``command[0]`` is the path, the rest of
    ``command`` and then ``args`` its arguments (qemu-ga's key is ``arg``)."""
    command = tuple(command)
    if not command or not isinstance(command[0], str) or not command[0]:
        raise ValueError("the command needs a path")
    arguments: dict = {"path": command[0], "arg": [str(a) for a in (*command[1:], *args)],
                       "capture-output": bool(capture_output)}
    if input_data is not None:
        arguments["input-data"] = _b64(input_data)
    return json.dumps({"execute": "guest-exec", "arguments": arguments})


def status_request(pid: int) -> str:
    """The ``guest-exec-status`` message for ``pid``."""
    return json.dumps({"execute": "guest-exec-status", "arguments": {"pid": int(pid)}})


def ping_request() -> str:
    return json.dumps({"execute": "guest-ping"})


def parse_reply(text: str, *, domain: str, command: str):
    """The ``return`` value of an agent reply (libvirt hands back the raw
    JSON text; it already turned ``error`` replies into libvirt errors, but
    say so clearly if one slips through)."""
    try:
        reply = json.loads(text)
    except (TypeError, ValueError):
        raise QgaError(domain=domain, command=command,
                       reason=f"the reply is not JSON: {str(text)[:200]!r}") from None
    if not isinstance(reply, dict):
        raise QgaError(domain=domain, command=command, reason=f"unexpected reply {reply!r}")
    if "error" in reply:
        error = reply["error"] if isinstance(reply["error"], dict) else {"desc": str(reply["error"])}
        raise _classify_agent_error(str(error.get("desc", "")), domain=domain, command=command,
                                    klass=error.get("class"))
    if "return" not in reply:
        raise QgaError(domain=domain, command=command, reason=f"a reply without 'return': {text[:200]!r}")
    return reply["return"]


def parse_exec_reply(value, *, domain: str) -> int:
    """The pid ``guest-exec`` returned."""
    pid = value.get("pid") if isinstance(value, dict) else None
    if not is_int(pid):
        raise QgaError(domain=domain, command="guest-exec", reason=f"no pid in its answer {value!r}")
    return pid


@dataclasses.dataclass(frozen=True)
class ExecStatus:
    """A decoded ``guest-exec-status`` answer."""

    exited: bool
    exit_code: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False


def _decode_data(value, what: str, domain: str) -> str:
    if value in (None, ""):
        return ""
    try:
        return base64.b64decode(value, validate=True).decode("utf-8", errors="replace")
    except (binascii.Error, TypeError, ValueError):
        raise QgaError(domain=domain, command="guest-exec-status",
                       reason=f"{what} is not base64: {str(value)[:80]!r}") from None


def decode_status(value, *, domain: str = "?") -> ExecStatus:
    """Decode a ``guest-exec-status`` return value.  While the process
    runs, qemu-ga answers only ``{"exited": false}``; at the end
    ``exitcode`` (normal exit) or ``signal`` (killed), and ``out-data``/
    ``err-data`` when output was captured (absent when empty)."""
    if not isinstance(value, dict) or not isinstance(value.get("exited"), bool):
        raise QgaError(domain=domain, command="guest-exec-status", reason=f"unexpected answer {value!r}")
    if not value["exited"]:
        return ExecStatus(exited=False)
    return ExecStatus(
        exited=True,
        exit_code=value.get("exitcode"), signal=value.get("signal"),
        stdout=_decode_data(value.get("out-data"), "out-data", domain),
        stderr=_decode_data(value.get("err-data"), "err-data", domain),
        stdout_truncated=bool(value.get("out-truncated")),
        stderr_truncated=bool(value.get("err-truncated")))


def _tail(text: str, limit: int = 2000) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


def _failure(status: ExecStatus, *, domain: str, command: str):
    """``failed(cls, reason)``: the error of an exited command, with its exit
    status and output in its details."""
    details = {"domain": domain, "exit_code": status.exit_code, "signal": status.signal,
               "stdout": _tail(status.stdout), "stderr": _tail(status.stderr)}

    def failed(cls, reason: str):
        return cls(domain=domain, command=command, reason=reason, details=details)
    return failed


def _agent_answer(status: ExecStatus, *, domain: str, command: str, ok_codes: tuple) -> dict:
    """The JSON object an exited ``accelmig-agent rehome`` printed, when it
    exited with one of ``ok_codes``; else the error its exit status means
    (see :func:`rehome_outcome`)."""
    failed = _failure(status, domain=domain, command=command)
    stderr = _tail(status.stderr, 500) or "no stderr"
    if status.signal is not None and status.exit_code is None:
        raise failed(GuestCommandFailed, f"killed by signal {status.signal} ({stderr})")
    if status.exit_code == EXIT_BAD_DOCUMENT:
        raise failed(RehomeDocumentRefused, f"exit status 2, the agent refused the document: {stderr}")
    if status.exit_code == EXIT_NO_AGENT:
        raise failed(AgentNotRunning, f"exit status 3, no accelmig agent runs in the guest: {stderr}")
    if status.exit_code not in ok_codes:
        raise failed(GuestCommandFailed, f"exit status {status.exit_code}: {stderr}")
    if status.stdout_truncated:
        raise failed(GuestCommandFailed, "its output was truncated by qemu-ga")
    try:
        outcome = json.loads(status.stdout)
    except ValueError:
        outcome = None
    if not isinstance(outcome, dict):
        # e.g. "/usr/bin/python3: No module named accelmig.agent" (exit 1)
        raise failed(GuestCommandFailed, f"exit status {status.exit_code} without an outcome on stdout: {stderr}")
    return outcome


def rehome_outcome(status: ExecStatus, *, domain: str, command: str = "accelmig-agent rehome") -> dict:
    """What an exited ``accelmig-agent rehome --stdin`` means.

    Exit 0, or exit 1 with a per-session outcome on stdout (some session did
    not resume: the caller reads ``sessions``), returns that outcome.
    Everything else raises: exit 2 :class:`RehomeDocumentRefused`, exit 3
    :class:`AgentNotRunning`, anything else (a signal, Python failing to
    start, output that is not the outcome) :class:`GuestCommandFailed`;
    each with the exit status and stderr."""
    outcome = _agent_answer(status, domain=domain, command=command, ok_codes=(EXIT_OK, EXIT_NOT_ALL_RESUMED))
    failed = _failure(status, domain=domain, command=command)
    if "sessions" not in outcome:
        # the agent answered its own error ({"ok": false, "error": {...}})
        error = outcome.get("error") if isinstance(outcome.get("error"), dict) else {}
        raise failed(GuestCommandFailed, f"exit status {status.exit_code}, the agent answered "
                     f"{error.get('code', '?')}: {error.get('message', json.dumps(outcome)[:300])}")
    if status.exit_code == EXIT_OK and not outcome.get("ok"):
        raise failed(GuestCommandFailed, "exit status 0 but the outcome says not ok")
    return outcome


# ---------------------------------------------------------------- libvirt errors

_DISABLED = re.compile(r"Command (\S+) has been disabled(?:[:,] *(.*))?")
_NOT_FOUND = re.compile(r"The command (\S+) has not been found")
_SPAWN_FAILED = re.compile(r"Failed to execute child process")


def _classify_agent_error(message: str, *, domain: str, command: str, klass: str | None = None,
                          details: dict | None = None) -> QgaError:
    """An error qemu-ga itself answered (libvirt 9.0 passes on its ``desc``
    inside VIR_ERR_INTERNAL_ERROR, without the error class)."""
    details = dict(details or {}, domain=domain, command=command, agent_error=message)
    if klass:
        details["agent_class"] = klass
    match = _DISABLED.search(message)
    if match and "frozen" in (match.group(2) or ""):
        # disabled only while the guest's filesystems are frozen (guest-fsfreeze-freeze)
        return QgaUnavailable(domain=domain, reason=message, details=details)
    if match:
        return GuestExecDisabled(domain=domain, command=match.group(1).strip("'\""),
                                 reason=match.group(0), details=details)
    match = _NOT_FOUND.search(message)
    if match:
        return GuestExecDisabled(domain=domain, command=match.group(1).strip("'\""),
                                 reason=f"{match.group(0)} (not in this qemu-ga)", details=details)
    if _SPAWN_FAILED.search(message):
        return GuestCommandFailed(domain=domain, command=command,
                                  reason=f"qemu-ga could not start it: {message} (is accelmig installed in "
                                         "the guest, and the interpreter path right?)", details=details)
    return QgaError(domain=domain, command=command, reason=message, details=details)


#: libvirt error codes meaning "no usable agent right now".
_UNAVAILABLE_CODES = {libvirt.VIR_ERR_AGENT_UNRESPONSIVE, libvirt.VIR_ERR_AGENT_UNSYNCED}
for _name in ("VIR_ERR_AGENT_COMMAND_TIMEOUT",):        # libvirt >= 9.x names a timeout apart
    if hasattr(libvirt, _name):
        _UNAVAILABLE_CODES.add(getattr(libvirt, _name))
#: ... and "this domain has no agent at all" / "cannot do that here".
_NOT_CONFIGURED_CODES = {libvirt.VIR_ERR_ARGUMENT_UNSUPPORTED, libvirt.VIR_ERR_OPERATION_UNSUPPORTED,
                         libvirt.VIR_ERR_NO_SUPPORT}


def classify_libvirt_error(exc: libvirt.libvirtError, *, domain: str, command: str) -> QgaError:
    """Turn a libvirt error of an agent command into this module's errors.

    Measured on libvirt 9.0 / QEMU 7.2:

    - qemu-ga not running (channel present, guest end closed):
      VIR_ERR_AGENT_UNRESPONSIVE "Guest agent is not responding: QEMU guest
      agent is not connected", at once;
    - no answer within the timeout: VIR_ERR_AGENT_UNRESPONSIVE too;
    - no qemu-ga channel in the domain: VIR_ERR_ARGUMENT_UNSUPPORTED
      "argument unsupported: QEMU guest agent is not configured";
    - qemu-ga's own errors: VIR_ERR_INTERNAL_ERROR "internal error: unable to
      execute QEMU agent command 'guest-exec': <qemu-ga's desc>".
    """
    code = exc.get_error_code()
    message = exc.get_error_message() or str(exc)
    details = {"libvirt_code": code, "libvirt_message": message}
    if code in _UNAVAILABLE_CODES:
        return QgaUnavailable(domain=domain, reason=message, details=dict(details, command=command))
    if code in _NOT_CONFIGURED_CODES or "guest agent is not configured" in message:
        return QgaNotConfigured(domain=domain, reason=message, details=dict(details, command=command))
    match = re.search(r"unable to execute QEMU agent command '[^']*': (.*)", message, re.S)
    if match:
        return _classify_agent_error(match.group(1).strip(), domain=domain, command=command,
                                     details=details)
    return QgaError(domain=domain, command=command, reason=message, details=details)


# ---------------------------------------------------------------- talking to the domain

_tainted_lock = threading.Lock()
_tainted_warned: set[str] = set()


def _domain_label(domain) -> str:
    try:
        return domain.name()
    except libvirt.libvirtError:
        return "?"


def _warn_taint(domain) -> None:
    """Once per domain (by UUID): libvirt marks a domain tainted
    (``custom-ga-command``) on its first arbitrary agent command."""
    try:
        key = domain.UUIDString()
    except libvirt.libvirtError:
        key = _domain_label(domain)
    with _tainted_lock:
        if key in _tainted_warned:
            return
        _tainted_warned.add(key)
    LOG.warning("domain %s (%s): talking to it through qemu-guest-agent (it has no accelmig channel); "
                "libvirt marks the domain TAINTED (custom-ga-command) on any arbitrary agent command: "
                "expected on this fallback path (Nova-built VMs), harmless, but visible in the domain's "
                "log and to support tools", _domain_label(domain), key)


def _call_timeout(deadline: float) -> int:
    """libvirt's per-call agent timeout: whole seconds, at least 1."""
    left = deadline - time.monotonic()
    return max(1, min(MAX_CALL_TIMEOUT, math.ceil(left)))


def agent_command(domain, message: str, *, timeout: int, label: str | None = None):
    """One agent command through libvirt; its ``return`` value, or one of
    this module's errors."""
    label = label or _domain_label(domain)
    command = json.loads(message).get("execute", "?")
    _warn_taint(domain)
    try:
        text = libvirt_qemu.qemuAgentCommand(domain, message, int(timeout), 0)
    except libvirt.libvirtError as exc:
        raise classify_libvirt_error(exc, domain=label, command=command) from None
    if text is None:
        raise QgaError(domain=label, command=command, reason="libvirt returned no reply")
    return parse_reply(text, domain=label, command=command)


def guest_ping(domain, timeout: float = 5.0) -> float:
    """``guest-ping``: seconds the round trip took; raises
    :class:`QgaUnavailable` when qemu-ga is not there."""
    t0 = time.monotonic()
    agent_command(domain, ping_request(), timeout=max(1, math.ceil(timeout)))
    return time.monotonic() - t0


def guest_exec(domain, command, *, input_data: bytes | None = None, timeout: float = 30.0,
               label: str | None = None) -> tuple[int, ExecStatus]:
    """Run ``command`` (path + arguments) in the guest through ``guest-exec``
    and wait for it: ``(pid, status)`` with its decoded output.  Raises
    :class:`GuestExecTimeout` when it has not exited within ``timeout``."""
    label = label or _domain_label(domain)
    deadline = time.monotonic() + timeout
    pid = parse_exec_reply(agent_command(domain, exec_request(command, input_data=input_data),
                                         timeout=_call_timeout(deadline), label=label), domain=label)
    interval = POLL_FIRST
    while True:
        status = decode_status(agent_command(domain, status_request(pid), timeout=_call_timeout(deadline),
                                             label=label), domain=label)
        if status.exited:
            return pid, status
        left = deadline - time.monotonic()
        if left <= 0:
            raise GuestExecTimeout(domain=label, command=" ".join(map(str, command)), pid=pid,
                                   timeout=timeout, details={"domain": label, "pid": pid})
        time.sleep(min(interval, left))
        interval = min(POLL_MAX, interval * POLL_GROWTH)


def deliver_rehome(domain, document: dict, *, command=DEFAULT_COMMAND, timeout: float = 30.0,
                   socket: str | None = None) -> dict:
    """Deliver a rehome document ``{"migration_id", "identity", "tickets"}``
    to the guest agent through qemu-guest-agent and return its outcome
    (``{"ok", "sessions": {sid: {"ok", ...}}, "network", ...}`` as the
    channel's rehome answers) plus ``"delivery"``: ``{"via": "guest-exec",
    "pid", "exit_code", "seconds"}``.

    An outcome with ``ok`` false (some session did not resume: exit status
    1) is returned, not raised: the per-session results are the point.
    Raises :class:`QgaUnavailable` (not connected / not responding),
    :class:`QgaNotConfigured`, :class:`GuestExecDisabled` (policy),
    :class:`GuestExecTimeout`, :class:`RehomeDocumentRefused` (exit 2),
    :class:`AgentNotRunning` (exit 3) or :class:`GuestCommandFailed`.
    ``timeout`` bounds the whole delivery (to within a second: libvirt's
    agent timeout counts whole seconds).  ``socket``: the agent's driver
    socket in the guest when it is not the default
    (``/run/accelmig/agent.sock``).  Blocking."""
    if not isinstance(document, dict):
        raise TypeError("the rehome document must be a dict")
    label = _domain_label(domain)
    on_socket = ("--socket", socket) if socket else ()
    argv = (*command, *REHOME_ARGS, *on_socket)
    shown = "accelmig-agent rehome --stdin"
    t0 = time.monotonic()
    deadline = t0 + timeout
    pieces, document = ch.rehome_pieces(document, line_budget=GUEST_EXEC_STDIN_MAX,
                                        piece_bytes=GUEST_EXEC_STDIN_MAX - 4096)
    LOG.info("domain %s: rehome %s through qemu-guest-agent guest-exec (%d ticket(s)%s)",
             label, document.get("migration_id"), document.get("ticket_count", len(document.get("tickets") or {})),
             f", {len(pieces)} staged first" if pieces else "")
    for number, piece in enumerate(pieces, 1):
        _pid, status = guest_exec(domain, (*command, *PIECE_ARGS, *on_socket),
                                  input_data=json.dumps(piece, separators=(",", ":")).encode(),
                                  timeout=max(0.0, deadline - time.monotonic()), label=label)
        staged = _agent_answer(status, domain=label, command="accelmig-agent rehome --stdin --piece",
                               ok_codes=(EXIT_OK,))
        LOG.debug("domain %s: rehome %s: piece %d/%d staged (%s ticket(s) so far)", label,
                  document.get("migration_id"), number, len(pieces), staged.get("staged"))
    payload = json.dumps(document, separators=(",", ":")).encode()
    pid, status = guest_exec(domain, argv, input_data=payload, timeout=max(0.0, deadline - time.monotonic()),
                             label=label)
    seconds = time.monotonic() - t0
    try:
        outcome = rehome_outcome(status, domain=label, command=shown)
    except QgaError as exc:
        LOG.error("domain %s: rehome %s through guest-exec failed after %.0f ms: %s", label,
                  document.get("migration_id"), seconds * 1000, exc)
        raise
    outcome["delivery"] = {"via": "guest-exec", "pid": pid, "exit_code": status.exit_code,
                           "pieces": len(pieces), "seconds": round(seconds, 6)}
    sessions = outcome.get("sessions") or {}
    # (an agent that lists only some sessions, within its answer's bound, counts them all)
    resumed = outcome.get("resumed_count", sum(1 for s in sessions.values() if s.get("ok")))
    LOG.info("domain %s: rehome %s through guest-exec: %d/%d session(s) resumed in %.0f ms (exit %s)",
             label, document.get("migration_id"), resumed, outcome.get("session_count", len(sessions)),
             seconds * 1000, status.exit_code)
    return outcome


def agent_status(domain, *, command=DEFAULT_COMMAND, timeout: float = 15.0,
                 socket: str | None = None) -> dict:
    """``accelmig-agent status`` through guest-exec: what the guest agent
    knows (its identity, and the sessions its drivers registered — what a
    host relays to the pool as attestation; without a channel the agent
    cannot report them itself)."""
    label = _domain_label(domain)
    argv = (*command, "status", *(("--socket", socket) if socket else ()))
    _pid, status = guest_exec(domain, argv, timeout=timeout, label=label)
    details = {"domain": label, "exit_code": status.exit_code, "stderr": _tail(status.stderr)}
    if status.exit_code == EXIT_NO_AGENT:
        raise AgentNotRunning(domain=label, command="accelmig-agent status", details=details,
                              reason=f"exit status 3, no accelmig agent runs in the guest: {_tail(status.stderr, 500)}")
    try:
        answer = json.loads(status.stdout)
    except ValueError:
        answer = None
    if status.exit_code != EXIT_OK or not isinstance(answer, dict):
        raise GuestCommandFailed(domain=label, command="accelmig-agent status", details=details,
                                 reason=f"exit status {status.exit_code}: {_tail(status.stderr, 500) or 'no stderr'}")
    return answer


def agent_prove(domain, request: dict, *, command=DEFAULT_COMMAND, timeout: float = 15.0,
                socket: str | None = None) -> dict:
    """``accelmig-agent prove --stdin`` through guest-exec: the guest's
    drivers' binding proofs for this host (``accelmig.wire.attestation``:
    ``request`` is ``{host, challenges, sids?, after?}``), as
    ``{proofs, refused, next}``.  Only the guest this domain runs holds the
    sessions' secrets: a host gets proofs of its own guests' sessions only.
    Blocking."""
    label = _domain_label(domain)
    argv = (*command, "prove", "--stdin", *(("--socket", socket) if socket else ()))
    _pid, status = guest_exec(domain, argv, input_data=json.dumps(request, separators=(",", ":")).encode(),
                              timeout=timeout, label=label)
    answer = _agent_answer(status, domain=label, command="accelmig-agent prove --stdin", ok_codes=(EXIT_OK,))
    if not isinstance(answer.get("proofs"), dict) or not isinstance(answer.get("refused", {}), dict):
        raise GuestCommandFailed(domain=label, command="accelmig-agent prove --stdin",
                                 reason=f"an answer without proofs: {json.dumps(answer)[:200]}",
                                 details={"domain": label, "exit_code": status.exit_code})
    return answer


# ---------------------------------------------------------------- the domain XML

def has_guest_agent(domain_xml_text: str) -> bool:
    """Whether a domain XML has qemu-guest-agent's channel."""
    return DomainXML.parse(domain_xml_text).has_guest_agent()


def guest_agent_connected(domain_xml_text: str) -> bool | None:
    """qemu-ga's channel state in a *live* domain XML: True when the guest
    end is open (``state='connected'``), False when not, None when the
    domain has no such channel or libvirt does not say.  Reading it does not
    taint the domain (unlike any agent command)."""
    channel = DomainXML.parse(domain_xml_text).guest_agent_channel()
    return None if channel is None else channel.connected
