"""Structured logs on stderr, the same on every side.

``setup("accelmig-pool", fmt="json")`` gives one JSON object per line
(``ts``, ``level``, ``logger``, ``msg`` and any ``extra=`` fields, such as
``domain``, ``migration`` or ``sid``); ``fmt="text"`` gives plain lines for a
terminal.  When stderr is the journal (a systemd unit's default), every line
starts with its sd-daemon priority prefix (``<3>`` error ... ``<7>`` debug),
so journald keeps each line's level.  Standard library only.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from accelmig.wire.values import is_int

_STANDARD = set(vars(logging.LogRecord("x", 0, "x", 0, "x", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, program: str):
        super().__init__()
        self.program = program

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                  + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "prog": self.program,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    def __init__(self, program: str):
        super().__init__(f"%(asctime)s {program} %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extras = {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}
        if extras:
            text += " " + " ".join(f"{k}={v}" for k, v in sorted(extras.items()))
        return text


#: the levels a ``--log-level`` takes, and their journald priorities (sd-daemon(3))
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_PRIORITIES = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
               logging.CRITICAL: 2}


def level_number(level: str | int) -> int:
    """``"info"``/``"INFO"``/``20`` -> 20; anything else is a ValueError that says what to use."""
    if is_int(level):
        return level
    if isinstance(level, str) and level.upper() in LEVELS:
        return getattr(logging, level.upper())
    raise ValueError(f"log level {level!r} is not one of {', '.join(LEVELS)}")


def priority(levelno: int) -> int:
    """The journald priority of a logging level (a custom level takes the next one below)."""
    for number in sorted(_PRIORITIES, reverse=True):
        if levelno >= number:
            return _PRIORITIES[number]
    return 7


def is_journal(stream) -> bool:
    """Whether ``stream`` is the journal: systemd sets ``JOURNAL_STREAM=DEV:INODE``
    for the stdout/stderr it connects to journald; a redirected stream is not it."""
    expected = os.environ.get("JOURNAL_STREAM", "")
    try:
        info = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):      # no file descriptor (a test's buffer)
        return False
    return bool(expected) and expected == f"{info.st_dev}:{info.st_ino}"


class JournalPrefix(logging.Formatter):
    """Another formatter's line behind the ``<N>`` priority prefix journald reads."""

    def __init__(self, inner: logging.Formatter):
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        text = self.inner.format(record)
        prefix = f"<{priority(record.levelno)}>"
        # each line of a multi-line message (a traceback) is its own journal entry
        return "\n".join(prefix + line for line in text.split("\n"))


def setup(program: str, fmt: str = "json", level: str | int = "INFO", stream=None) -> None:
    number = level_number(level)
    stream = stream or sys.stderr
    handler = logging.StreamHandler(stream)
    formatter = JsonFormatter(program) if fmt == "json" else TextFormatter(program)
    handler.setFormatter(JournalPrefix(formatter) if is_journal(stream) else formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(number)
