"""The image cache: one directory per image key under ``<cache>/images``,
complete or absent (built in a temporary directory renamed into place),
the least recently used pruned.  The kernels and qemu-ga images are built
from live beside it (``<cache>/kernels``, ``<cache>/qemu-ga``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from pathlib import Path

DEFAULT_CACHE = Path(os.environ.get("ACCELMIG_LAB_CACHE", "/var/cache/accelmig-lab"))

#: The file that marks an image complete; its mtime says when it was last used.
IMAGE_META = "image.json"


def images_dir(cache: Path) -> Path:
    path = Path(cache) / "images"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def locked(cache: Path):
    """Hold the cache's lock: two labs building the same image at once, one
    builds and the other waits, then finds it built."""
    with open(images_dir(cache) / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def complete_entry(cache: Path, key: str) -> Path | None:
    path = images_dir(cache) / key
    return path if (path / IMAGE_META).is_file() else None


def mark_used(entry: Path) -> None:
    os.utime(entry / IMAGE_META)       # what prune_images goes by


@contextlib.contextmanager
def new_entry(cache: Path, key: str):
    """A temporary directory that becomes the entry ``key`` (replacing any
    old one) when the body succeeds, and is removed when it fails."""
    images = images_dir(cache)
    tmp = Path(tempfile.mkdtemp(dir=images, prefix=f".build-{key}-"))
    try:
        yield tmp
        final = images / key
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def prune_images(cache: Path, keep: int = 8) -> list[Path]:
    """Remove all but the ``keep`` most recently used images (and stale
    temporary build directories); returns what was removed.  Call with the
    cache lock held, or when no build runs."""
    images = images_dir(cache)
    removed = []
    entries = sorted((p for p in images.iterdir() if (p / IMAGE_META).is_file()),
                     key=lambda p: (p / IMAGE_META).stat().st_mtime, reverse=True)
    for path in entries[keep:]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    for tmp in images.glob(".build-*"):
        if time.time() - tmp.stat().st_mtime > 3600:
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed
