"""How the image builder fails: :class:`ImageError`, also when a host tool
it runs (apt-get, dpkg-deb, ldd, busybox, the interpreter) is missing or fails."""

from __future__ import annotations

import subprocess


class ImageError(RuntimeError):
    """The guest image cannot be built (a missing input, a bad kernel)."""


def run(cmd, **kwargs) -> subprocess.CompletedProcess:
    """``cmd`` to completion, its output captured; any failure an :class:`ImageError`."""
    try:
        return subprocess.run(cmd, check=True, capture_output=True, text=True, **kwargs)
    except FileNotFoundError as exc:
        raise ImageError(f"{cmd[0]} is not installed") from exc
    except subprocess.CalledProcessError as exc:
        raise ImageError(f"{' '.join(map(str, cmd))} failed: {exc.stderr.strip()}") from exc
