"""The qemu-guest-agent fallback (accelmig.plugin.qga), without a VM: the
messages it builds, the answers it decodes, the libvirt errors it maps (the
texts are the ones libvirt 9.0 / QEMU 7.2 really produced, see
tests/e2e/test_qga.py), and one ``deliver_rehome`` against a real agent
daemon, with ``libvirt_qemu.qemuAgentCommand`` — the one function replaced
here — standing in for qemu-ga by running the command locally."""

from __future__ import annotations

import base64
import json
import logging
import subprocess
import sys
import tempfile
import time
import uuid

import libvirt
import pytest

from accelmig.lab.guest import agent_status
from accelmig.plugin import qga
from accelmig.plugin.domain.model import DomainXML
from accelmig.plugin.domain.render import render
from accelmig.wire.errors import AccelmigError, ErrorCode
from tests.support.wait import wait_for

DOMAIN = "vm1"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


# ---------------------------------------------------------------- messages

def test_exec_request_carries_path_args_input_and_capture():
    message = json.loads(qga.exec_request(qga.DEFAULT_COMMAND, qga.REHOME_ARGS, b'{"a": 1}'))
    assert message == {"execute": "guest-exec", "arguments": {
        "path": "/usr/bin/python3", "arg": ["-m", "accelmig.agent", "rehome", "--stdin"],
        "capture-output": True, "input-data": b64('{"a": 1}')}}
    bare = json.loads(qga.exec_request(["/bin/true"]))["arguments"]
    assert bare == {"path": "/bin/true", "arg": [], "capture-output": True}   # no input-data key
    with pytest.raises(ValueError, match="path"):
        qga.exec_request(())


def test_status_request():
    assert json.loads(qga.status_request(141)) == {"execute": "guest-exec-status", "arguments": {"pid": 141}}


def test_decode_status_running_exited_and_killed():
    assert qga.decode_status({"exited": False}) == qga.ExecStatus(exited=False)
    done = qga.decode_status({"exitcode": 0, "out-data": "aGkK", "out-truncated": False, "exited": True})
    assert (done.exited, done.exit_code, done.stdout, done.stderr) == (True, 0, "hi\n", "")
    killed = qga.decode_status({"exited": True, "signal": 9})
    assert killed.signal == 9 and killed.exit_code is None
    with pytest.raises(qga.QgaError, match="out-data is not base64"):
        qga.decode_status({"exited": True, "exitcode": 0, "out-data": "%%%"})
    with pytest.raises(qga.QgaError, match="unexpected answer"):
        qga.decode_status({"pid": 3})


def test_parse_reply_returns_the_value_or_maps_qemu_ga_errors():
    assert qga.parse_reply('{"return": {"pid": 7}}', domain=DOMAIN, command="guest-exec") == {"pid": 7}
    # qemu-ga 7.2's own answer for a command blocked with --block-rpcs (measured)
    raw = '{"error": {"class": "CommandNotFound", "desc": "Command guest-exec has been disabled"}}'
    with pytest.raises(qga.GuestExecDisabled) as info:
        qga.parse_reply(raw, domain=DOMAIN, command="guest-exec")
    assert info.value.details["agent_class"] == "CommandNotFound"
    with pytest.raises(qga.QgaError, match="not JSON"):
        qga.parse_reply("garbage", domain=DOMAIN, command="guest-ping")


def outcome(ok=True, sid="s-1"):
    return {"migration_id": "m1", "ok": ok, "host_id": "hostA", "network": [],
            "sessions": {sid: {"ok": ok, "epoch": 2} if ok else {"ok": False, "error": {"code": "WRONG_HOST"}}}}


def test_rehome_outcome_exit_0_and_1_return_the_outcome():
    good = qga.rehome_outcome(qga.ExecStatus(True, 0, stdout=json.dumps(outcome())), domain=DOMAIN)
    assert good["sessions"]["s-1"]["ok"]
    # exit 1: not every session resumed; the per-session results are returned
    partial = qga.rehome_outcome(qga.ExecStatus(True, 1, stdout=json.dumps(outcome(False))), domain=DOMAIN)
    assert partial["ok"] is False and partial["sessions"]["s-1"]["error"]["code"] == "WRONG_HOST"


@pytest.mark.parametrize("status, cls, code, text", [
    (qga.ExecStatus(True, 2, stderr="accelmig-agent: bad rehome document: BAD_REQUEST: ...migration_id...\n"),
     qga.RehomeDocumentRefused, ErrorCode.BAD_REQUEST, "refused the document: accelmig-agent: bad rehome"),
    (qga.ExecStatus(True, 3, stderr="accelmig-agent: no agent answers at /run/accelmig/agent.sock\n"),
     qga.AgentNotRunning, ErrorCode.UNAVAILABLE, "no accelmig agent runs in the guest"),
    (qga.ExecStatus(True, 1, stderr="/usr/bin/python3: No module named accelmig.agent\n"),
     qga.GuestCommandFailed, ErrorCode.INTERNAL, "without an outcome on stdout: /usr/bin/python3: No module"),
    (qga.ExecStatus(True, 1, stdout='{"ok": false, "error": {"code": "TIMEOUT", "message": "rehome m1 (still running)"}}'),
     qga.GuestCommandFailed, ErrorCode.INTERNAL, "the agent answered TIMEOUT: rehome m1"),
    (qga.ExecStatus(True, None, signal=9), qga.GuestCommandFailed, ErrorCode.INTERNAL, "killed by signal 9"),
    (qga.ExecStatus(True, 0, stdout="{", stdout_truncated=True), qga.GuestCommandFailed, ErrorCode.INTERNAL,
     "truncated"),
    (qga.ExecStatus(True, 127, stderr="sh: not found"), qga.GuestCommandFailed, ErrorCode.INTERNAL,
     "exit status 127: sh: not found"),
])
def test_rehome_outcome_failures_are_clear(status, cls, code, text):
    with pytest.raises(cls) as info:
        qga.rehome_outcome(status, domain=DOMAIN)
    exc = info.value
    assert type(exc) is cls and exc.code is code and isinstance(exc, AccelmigError)
    assert text in str(exc) and "domain vm1" in str(exc)
    assert exc.exit_code == status.exit_code and exc.stderr == status.stderr.strip()


def libvirt_error(code: int, message: str) -> libvirt.libvirtError:
    """A libvirtError as libvirt raises it (its ``err`` tuple filled in)."""
    exc = libvirt.libvirtError(message)
    exc.err = (code, libvirt.VIR_FROM_QEMU, message, 2, None, None, None, -1, -1)
    return exc


@pytest.mark.parametrize("code, message, cls, retriable", [
    (libvirt.VIR_ERR_AGENT_UNRESPONSIVE, "Guest agent is not responding: QEMU guest agent is not connected",
     qga.QgaUnavailable, True),
    (libvirt.VIR_ERR_AGENT_UNSYNCED, "Guest agent is not responding: guest agent replied with wrong id",
     qga.QgaUnavailable, True),
    (libvirt.VIR_ERR_ARGUMENT_UNSUPPORTED, "argument unsupported: QEMU guest agent is not configured",
     qga.QgaNotConfigured, False),
    (libvirt.VIR_ERR_INTERNAL_ERROR, "internal error: unable to execute QEMU agent command 'guest-exec': "
                                     "Command guest-exec has been disabled", qga.GuestExecDisabled, False),
    (libvirt.VIR_ERR_INTERNAL_ERROR, "internal error: unable to execute QEMU agent command 'guest-exec': "
                                     "Command guest-exec has been disabled: the agent is in frozen state",
     qga.QgaUnavailable, True),
    (libvirt.VIR_ERR_INTERNAL_ERROR, "internal error: unable to execute QEMU agent command 'guest-exec': "
                                     "The command guest-exec has not been found", qga.GuestExecDisabled, False),
    (libvirt.VIR_ERR_INTERNAL_ERROR, "internal error: unable to execute QEMU agent command 'guest-exec': Guest "
                                     "agent command failed, error was 'Failed to execute child process "
                                     "\u201c/nonexistent\u201d (No such file or directory)'",
     qga.GuestCommandFailed, False),
    (libvirt.VIR_ERR_INTERNAL_ERROR, "internal error: unable to execute QEMU agent command 'guest-exec-status': "
                                     "Invalid parameter 'pid'", qga.QgaError, False),
    (libvirt.VIR_ERR_OPERATION_INVALID, "Requested operation is not valid: domain is not running",
     qga.QgaError, False),
])
def test_libvirt_errors_map_to_clear_accelmig_errors(code, message, cls, retriable):
    exc = qga.classify_libvirt_error(libvirt_error(code, message), domain=DOMAIN, command="guest-exec")
    assert type(exc) is cls
    assert exc.retriable is retriable
    assert exc.details["libvirt_code"] == code
    assert "vm1" in str(exc)


def test_disabled_and_not_connected_messages_tell_what_to_do():
    disabled = qga.classify_libvirt_error(libvirt_error(
        libvirt.VIR_ERR_INTERNAL_ERROR, "internal error: unable to execute QEMU agent command 'guest-exec': "
                                        "Command guest-exec has been disabled"), domain=DOMAIN, command="guest-exec")
    assert "refuses guest-exec (Command guest-exec has been disabled)" in str(disabled)
    assert "--block-rpcs" in str(disabled) and "org.accelmig.agent.0" in str(disabled)
    missing = qga.classify_libvirt_error(libvirt_error(
        libvirt.VIR_ERR_AGENT_UNRESPONSIVE, "Guest agent is not responding: QEMU guest agent is not connected"),
        domain=DOMAIN, command="guest-ping")
    assert "not connected" in str(missing) and "is qemu-ga running in the guest?" in str(missing)


# ---------------------------------------------------------------- domain XML

def test_has_guest_agent_and_a_domain_with_only_qemu_ga():
    """What hostd reads of a domain to choose the guest-exec path (the model's
    ``has_guest_agent``) and the channel state doctor reports."""
    only_qga = render("accelerator-domain.xml.j2", name="nova1", kernel="/k", agent_channel=False,
                      qemu_guest_agent=True)
    assert DomainXML.parse(only_qga).has_guest_agent()
    assert "org.accelmig.agent.0" not in only_qga
    default = render("accelerator-domain.xml.j2", name="vm1", kernel="/k")
    assert not DomainXML.parse(default).has_guest_agent() and "org.accelmig.agent.0" in default
    live = only_qga.replace("name='org.qemu.guest_agent.0'", "name='org.qemu.guest_agent.0' state='connected'")
    assert DomainXML.parse(live).guest_agent_channel().connected is True
    assert DomainXML.parse(live.replace("'connected'", "'disconnected'")).guest_agent_channel().connected is False
    assert DomainXML.parse(only_qga).guest_agent_channel().connected is None   # config XML: libvirt says nothing
    assert DomainXML.parse(default).guest_agent_channel() is None


# ---------------------------------------------------------------- deliver_rehome, end to end without a VM

class FakeDomain:
    """Just what the module asks a virDomain: its name and UUID."""

    def __init__(self, name):
        self._name, self._uuid = name, str(uuid.uuid4())

    def name(self):
        return self._name

    def UUIDString(self):
        return self._uuid


def _drained(file) -> bytes:
    file.seek(0)
    try:
        return file.read()
    finally:
        file.close()


class LocalGuestAgent:
    """qemu-ga's guest-exec / guest-exec-status, done on this machine with
    subprocess (stdin from input-data, captured output base64): the stand-in
    for ``libvirt_qemu.qemuAgentCommand``."""

    def __init__(self):
        self.procs: dict[int, subprocess.Popen] = {}
        self.outputs: dict[int, tuple] = {}
        self.calls: list[str] = []

    def __call__(self, domain, message, timeout, flags):
        request = json.loads(message)
        self.calls.append(request["execute"])
        args = request.get("arguments", {})
        if request["execute"] == "guest-exec":
            # output into files, drained as qemu-ga drains its pipes (a pipe left
            # unread would block a child whose answer is over 64 KiB)
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            proc = subprocess.Popen([args["path"], *args.get("arg", [])], stdin=subprocess.PIPE,
                                    stdout=out, stderr=err)
            self.outputs[proc.pid] = (out, err)
            try:
                proc.stdin.write(base64.b64decode(args.get("input-data", "")))
                proc.stdin.close()
            except BrokenPipeError:      # a command that does not read its stdin
                pass
            self.procs[proc.pid] = proc
            return json.dumps({"return": {"pid": proc.pid}})
        if request["execute"] == "guest-exec-status":
            proc = self.procs[args["pid"]]
            if proc.poll() is None:
                return json.dumps({"return": {"exited": False}})
            del self.procs[args["pid"]]
            out, err = (_drained(f) for f in self.outputs.pop(args["pid"]))
            ret = {"exited": True, "exitcode": proc.returncode}
            if out:
                ret["out-data"] = base64.b64encode(out).decode()
            if err:
                ret["err-data"] = base64.b64encode(err).decode()
            return json.dumps({"return": ret})
        raise AssertionError(f"unexpected command {request}")

    def close(self):
        for proc in self.procs.values():
            proc.kill()
            proc.wait()
        for files in self.outputs.values():
            for file in files:
                file.close()


@pytest.fixture
def local_agent(tmp_path):
    """A real guest agent daemon with no channel (``run --port none``), as in
    a Nova-built guest, on a socket in tmp_path."""
    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen([sys.executable, "-m", "accelmig.agent", "run", "--port", "none",
                             "--socket", str(sock), "--state-dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def socket_there():
            assert proc.poll() is None, proc.stderr.read().decode()      # the agent died
            return sock.exists()
        wait_for(socket_there, 20, f"the agent to create its socket {sock}")
        yield str(sock)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def fake_qga(monkeypatch):
    agent = LocalGuestAgent()
    monkeypatch.setattr(qga.libvirt_qemu, "qemuAgentCommand", agent)
    yield agent
    agent.close()


DOC = {"migration_id": "m-unit-1", "identity": {"host_id": "hostA", "pool_endpoint": "10.88.0.1:7070"},
       "tickets": {}}


def test_deliver_rehome_runs_the_agent_command_and_returns_its_outcome(local_agent, fake_qga, caplog):
    dom = FakeDomain("nova-1")
    command = (sys.executable, "-m", "accelmig.agent")
    with caplog.at_level(logging.INFO, logger="accelmig.plugin.qga"):
        result = qga.deliver_rehome(dom, DOC, command=command, socket=local_agent, timeout=30)
        # the same migration id again: the agent answers with the first outcome
        again = qga.deliver_rehome(dom, DOC, command=command, socket=local_agent, timeout=30)
    assert result["ok"] and result["migration_id"] == "m-unit-1" and result["sessions"] == {}
    assert result["host_id"] == "hostA"
    assert result["delivery"]["via"] == "guest-exec" and result["delivery"]["exit_code"] == 0
    assert again["seconds"] == result["seconds"]
    assert fake_qga.calls[0] == "guest-exec" and set(fake_qga.calls[1:]) <= {"guest-exec", "guest-exec-status"}
    # the taint is said once per domain, loudly
    taints = [r for r in caplog.records if "TAINTED (custom-ga-command)" in r.getMessage()]
    assert len(taints) == 1 and taints[0].levelno == logging.WARNING
    status = agent_status(dom, command=command, socket=local_agent)         # (the lab's reader)
    assert status["channel"] and status["sessions"] == []
    assert status["rehomes"][0]["migration_id"] == "m-unit-1"


def test_deliver_rehome_of_a_broken_document_and_without_an_agent(local_agent, fake_qga, tmp_path):
    dom = FakeDomain("nova-2")
    command = (sys.executable, "-m", "accelmig.agent")
    with pytest.raises(qga.RehomeDocumentRefused) as info:
        qga.deliver_rehome(dom, {"identity": {}}, command=command, socket=local_agent)
    assert info.value.exit_code == 2
    assert "bad rehome document" in info.value.stderr and "migration_id" in info.value.stderr
    with pytest.raises(qga.AgentNotRunning) as info:
        qga.deliver_rehome(dom, DOC, command=command, socket=str(tmp_path / "nobody.sock"))
    assert info.value.exit_code == 3 and "no agent answers" in info.value.stderr


def test_deliver_rehome_times_out_with_the_guest_pid(fake_qga):
    dom = FakeDomain("nova-3")
    t0 = time.monotonic()
    with pytest.raises(qga.GuestExecTimeout) as info:
        # (sh -c: "rehome --stdin" become its positional parameters)
        qga.deliver_rehome(dom, DOC, command=("/bin/sh", "-c", "sleep 5", "sh"), timeout=0.5)
    assert time.monotonic() - t0 < 2
    assert info.value.retriable and info.value.details["pid"] in fake_qga.procs
    assert "did not finish within 0.5 s" in str(info.value)


def test_a_rehome_too_big_for_one_guest_exec_goes_in_staged_pieces(local_agent, fake_qga, monkeypatch):
    """qemu-ga stalls on guest-exec commands of a few hundred KB: a rehome of
    1,000 sessions' tickets (~340 KB) is staged in pieces, each guest-exec's
    stdin within GUEST_EXEC_STDIN_MAX, and the rehome that follows counts them all."""
    sizes = []
    real = fake_qga.__call__

    def measured(domain, message, timeout, flags):
        request = json.loads(message)
        if request["execute"] == "guest-exec":
            sizes.append((request["arguments"]["arg"], len(base64.b64decode(
                request["arguments"].get("input-data", "")))))
        return real(domain, message, timeout, flags)
    monkeypatch.setattr(qga.libvirt_qemu, "qemuAgentCommand", measured)
    strangers = {f"s-{uuid.uuid4().hex}": "t" * 300 for _ in range(1000)}
    document = dict(DOC, migration_id="m-big-1", tickets=strangers)
    assert len(json.dumps(document)) > 300_000
    command = (sys.executable, "-m", "accelmig.agent")
    result = qga.deliver_rehome(FakeDomain("nova-big"), document, command=command, socket=local_agent,
                                timeout=60)
    pieces = [n for args, n in sizes if "--piece" in args]
    assert len(pieces) == result["delivery"]["pieces"] >= 2
    assert max(n for _, n in sizes) <= qga.GUEST_EXEC_STDIN_MAX
    assert [("--piece" in args) for args, _ in sizes] == [True] * len(pieces) + [False]
    # every ticket arrived: 1,000 sessions, none of them this guest's
    assert result["session_count"] == 1000 and result["resumed_count"] == 0 and result["ok"] is False
    assert all(o["error"]["code"] == "NO_SUCH_OBJECT" for o in result["sessions"].values())


def test_a_piece_that_cannot_be_staged_stops_the_delivery_clearly(fake_qga, tmp_path):
    strangers = {f"s-{i:06d}-{'x' * 20}": "t" * 300 for i in range(1000)}
    document = dict(DOC, migration_id="m-big-2", tickets=strangers)
    command = (sys.executable, "-m", "accelmig.agent")
    with pytest.raises(qga.AgentNotRunning) as info:
        qga.deliver_rehome(FakeDomain("nova-big2"), document, command=command,
                           socket=str(tmp_path / "nobody.sock"), timeout=30)
    assert info.value.exit_code == 3 and "--piece" in str(info.value)
    assert fake_qga.calls.count("guest-exec") == 1         # nothing more was sent after the first piece
