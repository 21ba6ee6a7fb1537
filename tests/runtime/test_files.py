"""accelmig.runtime.files: the one atomic write (a reader or a failure sees
the old file or the new one, never half, and no temporary is left) and the
one TOML loader (every way a file is wrong is one ConfigInvalid naming it)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from accelmig.runtime import files
from accelmig.runtime.files import atomic_write, load_toml, parse_toml
from accelmig.wire.errors import ConfigInvalid


def test_it_writes_text_or_bytes_with_the_mode_asked(tmp_path):
    path = tmp_path / "f.json"
    atomic_write(path, "ünïcode\n")
    assert path.read_text(encoding="utf-8") == "ünïcode\n" and (path.stat().st_mode & 0o7777) == 0o644
    atomic_write(str(path), b"\x00\x01", 0o600, durable=False)
    assert path.read_bytes() == b"\x00\x01" and (path.stat().st_mode & 0o7777) == 0o600
    assert os.listdir(tmp_path) == ["f.json"]


def test_a_write_the_disk_refuses_leaves_the_old_file_and_no_temporary(tmp_path):
    """A real failure in the middle of the write: the child may write files of
    at most 4 KiB (RLIMIT_FSIZE), so the kernel refuses the 64 KiB one."""
    path = tmp_path / "state.json"
    path.write_text("the old one\n")
    os.chmod(path, 0o640)
    code = textwrap.dedent("""
        import resource, signal, sys
        from accelmig.runtime.files import atomic_write
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # EFBIG instead of a core dump
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            atomic_write(sys.argv[1], b"n" * 65536)
        except OSError as exc:
            print(exc.errno)
    """)
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(__import__("errno").EFBIG)
    assert path.read_text() == "the old one\n" and (path.stat().st_mode & 0o7777) == 0o640
    assert os.listdir(tmp_path) == ["state.json"]


def test_an_interrupt_before_the_rename_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    """^C (any BaseException) between the write and the rename."""
    path = tmp_path / "state.json"
    path.write_text("old")

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, "new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["state.json"]


def test_a_missing_directory_is_the_callers_error_and_leaves_nothing(tmp_path):
    with pytest.raises(FileNotFoundError):
        atomic_write(tmp_path / "no" / "f", "x")
    assert os.listdir(tmp_path) == []


def test_a_reader_sees_the_old_file_or_the_new_one_never_half(tmp_path):
    path = tmp_path / "f"
    versions = [bytes([65 + i]) * (256 * 1024) for i in range(4)]
    atomic_write(path, versions[0], durable=False)
    done, seen = threading.Event(), set()

    def read():
        while not done.is_set():
            with open(path, "rb") as handle:
                seen.add(handle.read())

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for n in range(60):
            atomic_write(path, versions[n % 4], durable=n % 2 == 0)
    finally:
        done.set()
        reader.join(30)
    assert seen and seen <= set(versions)
    assert os.listdir(tmp_path) == ["f"]


# ---------------------------------------------------------------- TOML

def test_a_toml_file_is_read(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[pool]\nlisten = "127.0.0.1:7070"\n')
    assert load_toml(path) == {"pool": {"listen": "127.0.0.1:7070"}}
    assert parse_toml("a = 1") == {"a": 1}


@pytest.mark.parametrize("make,what,reason", [
    (lambda p: None, "file", "file not found"),
    (lambda p: None, "inventory file", "inventory file not found"),
    (lambda p: p.write_text("[pool\n"), "file", "not valid TOML: "),
    (lambda p: p.write_bytes(b'a = "\xff\xfe"\n'), "file", "not valid TOML: not UTF-8"),
    (lambda p: p.mkdir(), "file", "cannot read it: Is a directory"),
], ids=["absent", "absent-named", "not-toml", "not-utf8", "a-directory"])
def test_every_way_a_file_is_wrong_is_one_config_invalid_naming_it(tmp_path, make, what, reason):
    path = tmp_path / "c.toml"
    make(path)
    with pytest.raises(ConfigInvalid) as raised:
        load_toml(path, what)
    assert raised.value.message.startswith(f"invalid configuration in {path}: {reason}")


def test_text_that_is_not_toml_names_its_source():
    with pytest.raises(ConfigInvalid, match=r"invalid configuration in inline: not valid TOML: "):
        parse_toml("x = ", "inline")
