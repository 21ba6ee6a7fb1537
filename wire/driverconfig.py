"""The drivers' configuration file in a guest (``/etc/accelmig/driver.toml``,
or ``$ACCELMIG_DRIVER_CONFIG``): where the pool is and how to reach it,
for the OpenCL driver (``icd/src/config.c``, which reads the same keys)
and the Python driver (``connect()``, after the guest agent and the
environment).  The environment wins over the file, the guest agent's
``where`` over both for the endpoint.

A TOML subset, so that a guest needs no TOML library (Python 3.9 has
none; the C driver neither): one ``key = value`` per line, values
``"strings"`` (with ``\\"``, ``\\\\``, ``\\n``, ``\\t``), ``true``/``false`` or
numbers, ``#`` comments, the keys at the top or in a ``[driver]`` table
(other tables are left to other readers).  A key this code does not know
is a warning, not an error (a newer file for an older driver).

Standard library only (the guest side imports it; Python 3.9+).
"""

from __future__ import annotations

import dataclasses
import logging
import os

from accelmig.wire.errors import ConfigInvalid

LOG = logging.getLogger(__name__)

DEFAULT_PATH = "/etc/accelmig/driver.toml"
PATH_ENV = "ACCELMIG_DRIVER_CONFIG"
#: the file is read whole, at most this big
MAX_BYTES = 64 * 1024


@dataclasses.dataclass
class DriverConfig:
    """The keys of driver.toml (every one optional)."""

    endpoint: str | None = dataclasses.field(default=None, metadata={
        "doc": "The pool's data-plane address, `HOST:PORT` (`[IPv6]:PORT`). Used when no guest agent "
               "knows one and `ACCELMIG_ENDPOINT` is unset.",
        "example": "10.88.0.1:7070"})
    token: str | None = dataclasses.field(default=None, metadata={
        "doc": "The tenant token. Prefer `token_file` (a file only the application's user reads); "
               "`ACCELMIG_TOKEN` wins over both.",
        "example": "a-long-random-token"})
    token_file: str | None = dataclasses.field(default=None, metadata={
        "doc": "A file holding the tenant token (one line; a trailing newline is dropped).",
        "example": "/etc/accelmig/token"})
    cafile: str | None = dataclasses.field(default=None, metadata={
        "doc": "The CA that signed the pool's certificate (PEM). Unset: the system's trust store. "
               "`ACCELMIG_CAFILE` wins over it.",
        "example": "/etc/accelmig/pool-ca.crt"})
    insecure: bool | None = dataclasses.field(default=None, metadata={
        "doc": "Plain TCP to the pool (the pool must say `insecure` too): anyone on the path reads the "
               "token, the session secret and the data. `ACCELMIG_INSECURE` wins over it.",
        "default": "false", "example": False})
    timeout: float = dataclasses.field(default=60.0, metadata={
        "doc": "The OpenCL driver's: seconds a session may stay without a connection to the pool before "
               "its commands fail (their events with CL_OUT_OF_RESOURCES). `ACCELMIG_TIMEOUT` wins over it. "
               "(The Python driver takes `timeout=` from its caller.)"})
    connect_timeout: float = dataclasses.field(default=10.0, metadata={
        "doc": "Seconds one connection attempt (TCP and TLS handshake) may take."})
    source: str | None = dataclasses.field(default=None, metadata={"toml": False})


KEYS = tuple(f.name for f in dataclasses.fields(DriverConfig) if f.metadata.get("toml", True))
_KINDS = {f.name: f.type for f in dataclasses.fields(DriverConfig)}


def _unquote(raw: str, where: str) -> str:
    out, i = [], 1
    if len(raw) < 2 or not raw.startswith('"') or not raw.endswith('"'):
        raise ConfigInvalid(source=where, reason="a string value goes in double quotes")
    escapes = {"n": "\n", "t": "\t", '"': '"', "\\": "\\"}
    while i < len(raw) - 1:
        char = raw[i]
        if char == '"':
            raise ConfigInvalid(source=where, reason="a quote inside a string must be escaped (\\\")")
        if char == "\\":
            if i + 2 >= len(raw) or raw[i + 1] not in escapes:
                raise ConfigInvalid(source=where, reason="an unknown escape in a string")
            out.append(escapes[raw[i + 1]])
            i += 2
            continue
        if ord(char) < 0x20 and char not in "\t\n":
            raise ConfigInvalid(source=where, reason="a control character in a string")
        out.append(char)
        i += 1
    return "".join(out)


def _strip_comment(raw: str) -> str:
    if raw.startswith('"'):
        i = 1
        while i < len(raw):
            if raw[i] == "\\":
                i += 2
                continue
            if raw[i] == '"':
                return raw[:i + 1]
            i += 1
        return raw
    return raw.split("#", 1)[0].strip()


def parse(text: str, source: str = "driver.toml") -> DriverConfig:
    """The file's text as a DriverConfig; ConfigInvalid naming the line."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise ConfigInvalid(source=source, reason=f"over {MAX_BYTES} bytes")
    config = DriverConfig(source=source)
    in_driver = True
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            in_driver = line == "[driver]"
            continue
        key, sep, raw = line.partition("=")
        where = f"{source} line {number}"
        if not sep:
            raise ConfigInvalid(source=where, reason="not key = value")
        key, raw = key.strip(), _strip_comment(raw.strip())
        if not in_driver:
            continue
        if key not in KEYS:
            LOG.warning("%s: unknown key %s (ignored)", where, key[:40])
            continue
        kind = _KINDS[key]
        if "str" in str(kind):
            setattr(config, key, _unquote(raw, where))
        elif "bool" in str(kind):
            if raw not in ("true", "false"):
                raise ConfigInvalid(source=where, reason=f"{key} is true or false")
            setattr(config, key, raw == "true")
        else:
            try:
                seconds = float(raw)
            except ValueError:
                seconds = -1.0
            if not 0 < seconds <= 86400:
                raise ConfigInvalid(source=where, reason=f"{key} is a number of seconds (0 to 86400)")
            setattr(config, key, seconds)
    return config


def load(path: str | None = None) -> DriverConfig:
    """The file at ``path`` (else ``$ACCELMIG_DRIVER_CONFIG``, else the
    default path); an absent file is an empty configuration."""
    path = path or os.environ.get(PATH_ENV) or DEFAULT_PATH
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return DriverConfig()
    except OSError as exc:
        raise ConfigInvalid(source=path, reason=f"cannot read it: {exc.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigInvalid(source=path, reason="not UTF-8") from None
    return parse(text, path)


def token_of(config: DriverConfig) -> str | None:
    """The token the file gives (``token``, else ``token_file``'s first line)."""
    if config.token:
        return config.token
    if not config.token_file:
        return None
    try:
        with open(config.token_file, "r", encoding="utf-8") as handle:
            return handle.read(4097).rstrip("\r\n") or None
    except OSError as exc:
        raise ConfigInvalid(source=config.source or DEFAULT_PATH,
                            reason=f"token_file {config.token_file} cannot be read ({exc.strerror})") from None
