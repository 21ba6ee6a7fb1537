"""The guest agent authorises every local call by who makes it (issue 14,
item 5): a real ``accelmig-agent run`` process; the other user is a real
process running as ``nobody``, its identity told by the kernel
(SO_PEERCRED).

- only root may rehome the guest (``rehome_local`` re-addresses the NIC,
  moves the default route and hands out tickets);
- a session registered by one process cannot be registered by another, so
  its tickets never go elsewhere;
- a user's ``status`` shows only that user's sessions;
- only root may have the drivers prove their sessions (``prove_local``:
  what qemu-guest-agent's guest-exec relays for the host).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile

import pytest

from accelmig.wire import channel as wire_channel
from accelmig.wire.channel import LineClient
from accelmig.wire.errors import Forbidden
from tests.support.processes import LoggedProcess

pytestmark = pytest.mark.root

NOBODY = "nobody"

# What the unprivileged process does: each call's outcome, as JSON on stdout.
AS_NOBODY = r"""
import json, sys
from accelmig.wire.channel import LineClient
from accelmig.wire.errors import AccelmigError
out = {}
with LineClient(sys.argv[1], timeout=10, what="the agent") as agent:
    def attempt(name, kind, **fields):
        try:
            out[name] = {"ok": True, "result": agent.call(kind, **fields)}
        except AccelmigError as exc:
            out[name] = {"ok": False, "code": exc.code.value, "message": exc.message}
    attempt("status_before", "status")
    attempt("take_roots_session", "register", sid="s-root-1", endpoint="10.9.9.9:7070")
    attempt("rehome", "rehome_local", document={"migration_id": "m-evil", "identity": {},
                                                "tickets": {}})
    attempt("prove", "prove_local", request={"host": "hostA", "challenges": {"abcd1234": "ab" * 16}})
    attempt("register_own", "register", sid="s-nobody-1", endpoint="10.0.0.1:7070")
    attempt("status_after", "status")
print(json.dumps(out))
"""


@pytest.fixture
def shared_dir():
    """A directory ``nobody`` can reach (pytest's own are root's only)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: runs a process as another user")
    try:
        pwd.getpwnam(NOBODY)
    except KeyError:
        pytest.skip(f"SKIPPED LOUDLY: no user {NOBODY!r} on this machine")
    path = tempfile.mkdtemp(prefix="accelmig-peercred-")
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_the_agent_authorises_each_call_by_the_callers_uid(shared_dir):
    socket_path = os.path.join(shared_dir, "agent.sock")
    proc = LoggedProcess(["accelmig-agent", "run", "--port", os.path.join(shared_dir, "channel.sock"),
                          "--socket", socket_path, "--state-dir", os.path.join(shared_dir, "state"),
                          "--log-format", "json"])
    try:
        proc.wait_log(lambda e: e["msg"].startswith("agent "))
        with LineClient(socket_path, timeout=10, what="the agent") as root_app:
            assert root_app.call("register", sid="s-root-1", endpoint="10.0.0.5:7070") == \
                {"registered": "s-root-1"}
            # The real interpreter and a copy of accelmig.wire (standard library
            # only) where nobody can read them: the checkout and its virtualenv
            # may sit in a directory only root may enter.
            site = os.path.join(shared_dir, "site", "accelmig")
            shutil.copytree(os.path.dirname(wire_channel.__file__), os.path.join(site, "wire"),
                            ignore=shutil.ignore_patterns("__pycache__"))
            child = subprocess.run([os.path.realpath(sys.executable), "-S", "-c", AS_NOBODY, socket_path],
                                   user=NOBODY, capture_output=True, text=True, timeout=60,
                                   env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1",
                                        "PYTHONPATH": os.path.dirname(site)}, cwd=shared_dir)
            assert child.returncode == 0, child.stderr
            seen = json.loads(child.stdout)

            # another user's session is not even visible to it
            assert seen["status_before"]["ok"]
            assert seen["status_before"]["result"]["sessions"] == []
            assert "dropped" not in seen["status_before"]["result"]
            # nor can it take it over (its tickets would follow)
            assert seen["take_roots_session"]["code"] == "FORBIDDEN"
            assert "registered by pid" in seen["take_roots_session"]["message"]
            # nor rehome the guest
            assert seen["rehome"]["code"] == "FORBIDDEN"
            assert "root only" in seen["rehome"]["message"]
            # nor have the guest's drivers prove their sessions for a host
            assert seen["prove"]["code"] == "FORBIDDEN" and "root only" in seen["prove"]["message"]
            # its own session it may register, and see, with the kernel's uid
            assert seen["register_own"] == {"ok": True, "result": {"registered": "s-nobody-1"}}
            mine = seen["status_after"]["result"]["sessions"]
            assert [s["sid"] for s in mine] == ["s-nobody-1"]
            assert mine[0]["uid"] == pwd.getpwnam(NOBODY).pw_uid

            # root sees everything; its session is still its own
            everything = root_app.call("status")
            by_sid = {s["sid"]: s for s in everything["sessions"]}
            assert by_sid["s-root-1"]["uid"] == 0 and by_sid["s-root-1"]["endpoint"] == "10.0.0.5:7070"
            assert by_sid["s-root-1"]["pid"] == os.getpid()
            assert "s-nobody-1" not in by_sid       # its process is gone: dropped with it
            # a root caller is not refused rehome for who it is (the document is what is wrong)
            with pytest.raises(Exception) as refused:
                root_app.call("rehome_local", document={})
            assert not isinstance(refused.value, Forbidden)
    finally:
        proc.stop()


def test_the_same_process_may_register_its_session_again_on_a_new_connection(shared_dir):
    socket_path = os.path.join(shared_dir, "agent.sock")
    proc = LoggedProcess(["accelmig-agent", "run", "--port", os.path.join(shared_dir, "channel.sock"),
                          "--socket", socket_path, "--state-dir", os.path.join(shared_dir, "state"),
                          "--log-format", "json"])
    try:
        proc.wait_log(lambda e: e["msg"].startswith("agent "))
        with LineClient(socket_path, timeout=10, what="the agent") as first, \
                LineClient(socket_path, timeout=10, what="the agent") as second:
            assert first.call("register", sid="s-1", endpoint="10.0.0.5:7070")
            assert second.call("register", sid="s-1", endpoint="10.0.0.5:7070") == {"registered": "s-1"}
            assert [s["sid"] for s in second.call("status")["sessions"]] == ["s-1"]
    finally:
        proc.stop()
