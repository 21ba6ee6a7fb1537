"""Debian packages the image takes from apt: downloaded with ``apt-get
download`` and unpacked, never installed (the kernel package would pull
systemd).

What apt offers can only change when its package lists do (``apt-get
update`` renames files into the lists directory): an answer is remembered
together with that directory's mtime, so the next build asks apt nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import run

APT_LISTS = Path("/var/lib/apt/lists")


def lists_mtime() -> int | None:
    try:
        return APT_LISTS.stat().st_mtime_ns
    except OSError:
        return None


def recall(memo: Path) -> dict | None:
    """What :func:`remember` stored in ``memo``, while apt's lists are unchanged since."""
    mtime = lists_mtime()
    if mtime is None:
        return None
    try:
        saved = json.loads(memo.read_text())
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) and saved.get("apt_lists_mtime_ns") == mtime else None


def remember(memo: Path, **values) -> None:
    mtime = lists_mtime()
    if mtime is not None:
        memo.write_text(json.dumps({**values, "apt_lists_mtime_ns": mtime}))


def download(package: str, into: Path) -> Path:
    """``apt-get download package`` into the directory ``into``; the ``.deb``'s path."""
    run(["apt-get", "download", package], cwd=into)
    return next(Path(into).glob("*.deb"))
