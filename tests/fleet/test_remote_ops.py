"""What the fleet runs on a node before accelmig is there
(fleet/remote_ops.py), run here the way the fleet runs it:
``python3 -c SOURCE OP ARGS``, standard library only."""

from __future__ import annotations

import grp
import json
import os
import pwd
import stat
import subprocess
import sys

import pytest

from accelmig.fleet.remote import OPS_SOURCE

USER = pwd.getpwuid(os.geteuid()).pw_name
GROUP = grp.getgrgid(os.getegid()).gr_name


def op(*args: str, stdin: bytes = b"") -> dict:
    done = subprocess.run([sys.executable, "-I", "-c", OPS_SOURCE, *args], input=stdin, capture_output=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_put_writes_atomically_with_its_mode_and_then_leaves_the_same_bytes_alone(tmp_path):
    path = str(tmp_path / "etc" / "secret")
    assert op("put", path, "0600", USER, GROUP, "--check", stdin=b"s3cret\n")["action"] == "created"
    assert not os.path.exists(path)                              # --check writes nothing
    assert op("put", path, "0600", USER, GROUP, stdin=b"s3cret\n")["action"] == "created"
    assert open(path, "rb").read() == b"s3cret\n" and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    inode = os.stat(path).st_ino
    assert op("put", path, "0600", USER, GROUP, stdin=b"s3cret\n")["action"] == "unchanged"
    assert os.stat(path).st_ino == inode                         # not even rewritten
    os.chmod(path, 0o644)
    assert op("put", path, "0600", USER, GROUP, stdin=b"s3cret\n")["action"] == "mode or owner fixed"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    os.link(path, tmp_path / "held")                             # the old file, still referenced
    assert op("put", path, "0600", USER, GROUP, stdin=b"other\n")["action"] == "updated"
    assert open(path, "rb").read() == b"other\n"
    assert open(tmp_path / "held", "rb").read() == b"s3cret\n"  # a rename, never a write in place
    assert sorted(os.listdir(tmp_path / "etc")) == ["secret"]    # no temporary file left


def test_probe_describes_the_interpreter_and_each_path(tmp_path):
    (tmp_path / "file").write_bytes(b"abc")
    os.symlink("file", tmp_path / "link")
    answer = op("probe", str(tmp_path / "file"), str(tmp_path / "link"), str(tmp_path / "none"),
                "--pid-files", str(tmp_path / "no.pid"))
    assert answer["python"][:2] == list(sys.version_info[:2]) and answer["venv"] is True
    assert answer["libvirt"] is None                             # no daemon behind that pid file
    paths = answer["paths"]
    assert paths[str(tmp_path / "file")]["sha256"] == \
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert paths[str(tmp_path / "link")]["link"] == "file"
    assert paths[str(tmp_path / "none")] is None


def test_link_swaps_atomically_and_prune_keeps_what_it_is_told(tmp_path):
    for name in ("v1", "v2", "v3"):
        (tmp_path / "venvs" / name).mkdir(parents=True)
    link = str(tmp_path / "venv")
    assert op("link", "venvs/v1", link)["action"] == "updated"
    assert op("link", "venvs/v1", link)["action"] == "unchanged"
    assert op("link", "venvs/v2", link)["action"] == "updated" and os.readlink(link) == "venvs/v2"
    assert op("prune", str(tmp_path / "venvs"), "v2", "v3")["removed"] == ["v1"]
    assert sorted(os.listdir(tmp_path / "venvs")) == ["v2", "v3"]
    assert sorted(os.listdir(tmp_path)) == ["venv", "venvs"]     # no temporary link left


def test_read_answers_null_for_a_missing_file(tmp_path):
    assert op("read", str(tmp_path / "none"))["text"] is None
    (tmp_path / "f").write_text("x")
    assert op("read", str(tmp_path / "f"))["text"] == "x"


def test_it_runs_on_an_old_python_to_say_it_is_too_old(tmp_path):
    from tests.support.oldpython import SKIP_REASON, oldest_python
    exe = oldest_python()
    if exe is None:
        pytest.skip(SKIP_REASON)
    done = subprocess.run([exe, "-I", "-c", OPS_SOURCE, "probe", str(tmp_path)], capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["python"][:2] == [3, 9]
