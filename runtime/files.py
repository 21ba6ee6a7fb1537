"""Files every side writes and reads: the one atomic write and the one
TOML loader.

``atomic_write`` leaves a reader (or a crash) one of two files, the old or
the new, never half of one: the bytes go to a temporary file beside the
target (same directory, so the same filesystem), get their mode, are synced,
and are renamed over the target (``rename(2)`` is atomic).  ``durable``
also syncs the directory, so that the rename itself survives a power loss;
``durable=False`` skips both syncs, for files whose loss costs only a
rebuild (a bench report, a cache a daemon rewrites).  A failure at any step
removes the temporary file and leaves the old one as it was.

``load_toml``/``parse_toml`` turn every way a configuration file can be
wrong (absent, unreadable, not TOML) into one ``ConfigInvalid`` that names
the file.  ``tomllib`` is Python 3.11's: it is imported inside, so that the
guest side (3.9, which reads no TOML with them) can import this module.

Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from typing import Union

from accelmig.wire.errors import ConfigInvalid

PathLike = Union[str, "os.PathLike[str]"]


def atomic_write(path: PathLike, data: Union[str, bytes], mode: int = 0o644, *,
                 durable: bool = True) -> None:
    """Replace ``path`` with ``data`` (text is UTF-8) and ``mode``, atomically."""
    path = os.fspath(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            if durable:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        _sync_directory(directory)


def _sync_directory(directory: str) -> None:
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    except OSError as exc:      # some filesystems cannot sync a directory
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(dir_fd)


def load_toml(path: PathLike, what: str = "file") -> dict:
    """The TOML file at ``path`` as a dict; ``ConfigInvalid`` naming the file
    when it is absent (``"<what> not found"``), unreadable or not TOML."""
    import tomllib      # 3.11: host sides only (see the module's docstring)

    path = os.fspath(path)
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigInvalid(source=path, reason=f"{what} not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigInvalid(source=path, reason=f"not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigInvalid(source=path, reason=f"not valid TOML: not UTF-8 ({exc.reason})") from None
    except OSError as exc:
        raise ConfigInvalid(source=path, reason=f"cannot read it: {exc.strerror or exc}") from None


def parse_toml(text: str, source: str = "<string>") -> dict:
    """``text`` as TOML; ``ConfigInvalid`` naming ``source`` when it is not."""
    import tomllib

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigInvalid(source=source, reason=f"not valid TOML: {exc}") from None
