"""runtime.logs: level names as every CLI takes them, and journald priorities
(sd-daemon's ``<N>`` prefix) on a stream that is the journal — a real file
whose device and inode ``JOURNAL_STREAM`` names, as systemd sets it."""

from __future__ import annotations

import json
import logging
import os

import pytest

from accelmig.runtime import logs


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def test_level_names():
    assert logs.level_number("debug") == logging.DEBUG and logs.level_number("WARNING") == 30
    assert logs.level_number(15) == 15
    for bad in ("LOUD", "", None, True):
        with pytest.raises(ValueError, match="is not one of DEBUG, INFO, WARNING, ERROR"):
            logs.level_number(bad)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_priorities_on_the_journal(tmp_path, monkeypatch, restore_logging, fmt):
    path = tmp_path / "journal"
    with open(path, "w") as stream:
        info = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{info.st_dev}:{info.st_ino}")
        logs.setup("test", fmt, "debug", stream=stream)
        log = logging.getLogger("accelmig.test")
        log.debug("d")
        log.info("i")
        log.warning("w")
        log.error("e")
        log.critical("c")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("x")
    lines = path.read_text().splitlines()
    assert [line[:3] for line in lines[:5]] == ["<7>", "<6>", "<4>", "<3>", "<2>"]
    if fmt == "json":
        assert json.loads(lines[1][3:])["msg"] == "i" and len(lines) == 6
    else:
        # a traceback's every line is its own journal entry, each at the error's priority
        assert len(lines) > 6 and all(line.startswith("<3>") for line in lines[5:])


def test_no_prefix_elsewhere(tmp_path, monkeypatch, restore_logging):
    """An inherited JOURNAL_STREAM names the journal, not this redirected file."""
    path = tmp_path / "redirected"
    with open(path, "w") as stream:
        monkeypatch.setenv("JOURNAL_STREAM", f"{os.fstat(stream.fileno()).st_dev}:1")
        logs.setup("test", "text", "INFO", stream=stream)
        logging.getLogger("accelmig.test").warning("plain")
    text = path.read_text()
    assert text[:1].isdigit() and text.split(" ", 4)[2:] == ["test", "WARNING", "accelmig.test: plain\n"]
