"""qemu-guest-agent for images built ``with_qemu_ga``: ``/usr/sbin/qemu-ga``
of Debian's package, unpacked once into the cache (the host never installs
it).  It is what a VM without accelmig's channel (one built the way Nova
builds them) is rehomed through, with ``guest-exec``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from . import apt
from .errors import ImageError, run

LOG = logging.getLogger("accelmig.lab.image")

QEMU_GA_PACKAGE = "qemu-guest-agent"


def _cached_qemu_gas(root: Path) -> list[Path]:
    return sorted((p for p in root.glob("*") if (p / "qemu-ga").is_file()), key=lambda p: p.stat().st_mtime)


def prepare_qemu_ga(cache: Path, *, deb: str | os.PathLike | None = None) -> Path:
    """``/usr/sbin/qemu-ga`` of Debian's qemu-guest-agent package, unpacked
    once under ``<cache>/qemu-ga/<version>/``; returns the binary's path.

    ``deb`` uses a ``.deb`` already on disk.  Which version apt offers is
    remembered while apt's lists are unchanged (as for the kernel); without
    apt (or offline) the newest cached binary is used.
    """
    root = Path(cache) / "qemu-ga"
    root.mkdir(parents=True, exist_ok=True)
    memo = root / "current.json"
    from_apt = deb is None          # a .deb given by hand says nothing about what apt offers
    with tempfile.TemporaryDirectory(dir=root, prefix=".dl-") as tmp:
        if from_apt:
            saved = apt.recall(memo)
            if saved and "dir" in saved and (Path(saved["dir"]) / "qemu-ga").is_file():
                return Path(saved["dir"]) / "qemu-ga"
            try:
                deb = apt.download(QEMU_GA_PACKAGE, Path(tmp))
            except ImageError as exc:
                cached = _cached_qemu_gas(root)
                if not cached:
                    raise ImageError(f"cannot get qemu-ga for the guest image: {exc}") from None
                LOG.warning("cannot download %s (%s): using the cached %s", QEMU_GA_PACKAGE, exc, cached[-1].name)
                return cached[-1] / "qemu-ga"
        version = run(["dpkg-deb", "-f", str(deb), "Version"]).stdout.strip()
        final = root / re.sub(r"[^A-Za-z0-9.+~-]", "_", version)
        if not (final / "qemu-ga").is_file():
            unpacked = Path(tmp) / "x"
            run(["dpkg-deb", "-x", str(deb), str(unpacked)])
            binary = unpacked / "usr" / "sbin" / "qemu-ga"
            if not binary.is_file():
                raise ImageError(f"{deb} holds no usr/sbin/qemu-ga")
            staged = Path(tmp) / "final"
            staged.mkdir()
            shutil.copy2(binary, staged / "qemu-ga")
            shutil.rmtree(final, ignore_errors=True)
            os.rename(staged, final)
            LOG.info("unpacked %s %s into %s", QEMU_GA_PACKAGE, version, final)
        if from_apt:
            apt.remember(memo, dir=str(final))
        return final / "qemu-ga"
