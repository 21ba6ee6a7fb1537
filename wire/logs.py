"""Structured logs on stderr, the same on every side.

``setup("accelmig-pool", fmt="json")`` gives one JSON object per line
(``ts``, ``level``, ``logger``, ``msg`` and any ``extra=`` fields, such as
``domain``, ``migration`` or ``sid``); ``fmt="text"`` gives plain lines for a
terminal.  Standard library only.
"""

from __future__ import annotations

import json
import logging
import sys
import time

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


def setup(program: str, fmt: str = "json", level: str | int = "INFO", stream=None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(program) if fmt == "json" else TextFormatter(program))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
