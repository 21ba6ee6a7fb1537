"""The guest's kernel: a Debian kernel package, downloaded once (never
installed) and unpacked into the cache as an **uncompressed** ``vmlinux``
plus the few modules the guest loads, and their load order.

Under TCG the guest's own decompressor costs seconds: Debian's bzImage
carries its kernel as one XZ stream, which Python's lzma unpacks here once;
QEMU boots the resulting ELF directly through its PVH entry note (docs/lab-notes.md:
boot-to-agent 8.4–9.4 s -> 4.2–4.9 s).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import lzma
import os
import re
import shutil
import struct
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

from . import apt
from .errors import ImageError, run

LOG = logging.getLogger("accelmig.lab.image")

#: Kernel modules the guest loads, in this order (dependencies first; the
#: order is re-checked against each module's own ``depends=``).
DEFAULT_MODULES = (
    "virtio", "virtio_ring", "virtio_pci_modern_dev", "virtio_pci_legacy_dev",
    "virtio_pci", "virtio_console", "failover", "net_failover", "virtio_net",
)

XZ_MAGIC = b"\xfd7zXZ\x00"
XEN_ELFNOTE_PHYS32_ENTRY = 18   # the PVH entry point QEMU boots an ELF kernel through


# ---------------------------------------------------------------- ELF

def _elf_sections(data: bytes) -> dict[str, tuple[int, int]]:
    """Section name -> (offset, size) of a 64-bit little-endian ELF file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ImageError("not a 64-bit little-endian ELF file")
    e_shoff = struct.unpack_from("<Q", data, 0x28)[0]
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = []
    for i in range(e_shnum):
        name, _type, _flags, _addr, offset, size = struct.unpack_from(
            "<IIQQQQ", data, e_shoff + i * e_shentsize)
        headers.append((name, offset, size))
    strtab_off, strtab_size = headers[e_shstrndx][1], headers[e_shstrndx][2]
    strtab = data[strtab_off:strtab_off + strtab_size]
    out = {}
    for name, offset, size in headers:
        end = strtab.find(b"\0", name)
        out[strtab[name:end].decode()] = (offset, size)
    return out


def elf_notes(data: bytes) -> list[tuple[bytes, int]]:
    """(owner, type) of every note in the PT_NOTE segments of an ELF file."""
    if data[:4] != b"\x7fELF":
        raise ImageError("not an ELF file")
    e_phoff = struct.unpack_from("<Q", data, 0x20)[0]
    e_phentsize, e_phnum = struct.unpack_from("<HH", data, 0x36)
    notes = []
    for i in range(e_phnum):
        p_type, _flags, p_offset, _vaddr, _paddr, p_filesz = struct.unpack_from(
            "<IIQQQQ", data, e_phoff + i * e_phentsize)
        if p_type != 4:     # PT_NOTE
            continue
        off, end = p_offset, p_offset + p_filesz
        while off + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", data, off)
            notes.append((data[off + 12:off + 12 + namesz].rstrip(b"\0"), ntype))
            off += 12 + ((namesz + 3) & ~3) + ((descsz + 3) & ~3)
    return notes


def module_info(path: Path) -> dict[str, str]:
    """The ``.modinfo`` section of a kernel module (what ``modinfo`` prints):
    read directly, because kmod's tools are not needed anywhere else here."""
    data = path.read_bytes()
    offset, size = _elf_sections(data)[".modinfo"]
    info: dict[str, str] = {}
    for entry in data[offset:offset + size].split(b"\0"):
        if b"=" in entry:
            key, _, value = entry.decode(errors="replace").partition("=")
            info.setdefault(key, value)
    return info


def extract_vmlinux(bzimage: bytes) -> bytes:
    """The uncompressed kernel ELF inside a Debian x86 bzImage.

    Debian builds with CONFIG_KERNEL_XZ: the payload is one XZ stream (x86
    BCJ + LZMA2) somewhere after the real-mode setup code.  Python's lzma
    decompresses it and stops at the stream's end (what follows is the
    decompressor's size trailer).  We insist on an ELF with the PVH entry
    note, since that is what lets QEMU boot it with ``-kernel``.
    """
    start = 0
    while True:
        start = bzimage.find(XZ_MAGIC, start)
        if start < 0:
            raise ImageError("no XZ payload in the bzImage (is the kernel built with CONFIG_KERNEL_XZ?)")
        try:
            decompressor = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
            out = decompressor.decompress(bzimage[start:])
        except lzma.LZMAError:
            start += 1      # a stray magic: look for the next one
            continue
        if decompressor.eof and out[:4] == b"\x7fELF":
            break
        start += 1
    notes = elf_notes(out)
    if (b"Xen", XEN_ELFNOTE_PHYS32_ENTRY) not in notes:
        raise ImageError("the kernel ELF has no PVH entry note (XEN_ELFNOTE_PHYS32_ENTRY): "
                         "QEMU cannot boot it as an uncompressed vmlinux")
    return out


# ---------------------------------------------------------------- the package

@dataclasses.dataclass(frozen=True)
class Kernel:
    """A Debian kernel unpacked for the lab: ``vmlinux`` plus its modules."""

    package: str          # linux-image-6.1.0-57-amd64
    version: str          # 6.1.192-3 (the package version)
    release: str          # 6.1.0-57-amd64 (uname -r)
    dir: Path

    @property
    def vmlinux(self) -> Path:
        return self.dir / "vmlinux"

    def module(self, name: str) -> Path:
        return self.dir / "modules" / f"{name}.ko"


def default_kernel_package(root: Path) -> str:
    """The kernel package Debian's ``linux-image-amd64`` currently points at
    (so the lab follows the distribution's kernel without a pinned name).
    ``apt-cache`` takes ~1 s here: its answer is remembered under ``root``."""
    memo = Path(root) / "default-kernel.json"
    saved = apt.recall(memo)
    if saved and "package" in saved:
        return saved["package"]
    out = run(["apt-cache", "depends", "linux-image-amd64"]).stdout
    for line in out.splitlines():
        match = re.match(r"\s*Depends:\s*(linux-image-\S+)", line)
        if match:
            apt.remember(memo, package=match.group(1))
            return match.group(1)
    raise ImageError("apt-cache knows no linux-image-amd64 dependency (run apt-get update?)")


def _cached_kernels(root: Path) -> list[Path]:
    return sorted((p for p in root.glob("linux-image-*") if (p / "kernel.json").is_file()),
                  key=lambda p: p.stat().st_mtime)


def _load_kernel(path: Path) -> Kernel:
    info = json.loads((path / "kernel.json").read_text())
    return Kernel(package=info["package"], version=info["version"], release=info["release"], dir=path)


def prepare_kernel(cache: Path, *, package: str | None = None,
                   deb: str | os.PathLike | None = None,
                   modules=DEFAULT_MODULES) -> Kernel:
    """Download (``apt-get download``, never install: the package pulls
    systemd) and unpack a Debian kernel, once; later calls reuse the cache.

    ``deb`` uses a ``.deb`` already on disk; otherwise ``package`` (default:
    what ``linux-image-amd64`` depends on).  Without apt (or offline) the
    newest kernel already in the cache is used.
    """
    root = Path(cache) / "kernels"
    root.mkdir(parents=True, exist_ok=True)
    if deb is None:
        try:
            package = package or default_kernel_package(root)
        except ImageError as exc:
            cached = _cached_kernels(root)
            if not cached:
                raise
            LOG.warning("cannot ask apt for the kernel (%s): using the cached %s", exc, cached[-1].name)
            return _load_kernel(cached[-1])
        for path in reversed(_cached_kernels(root)):
            if _load_kernel(path).package == package:
                return _load_kernel(path)
    with tempfile.TemporaryDirectory(dir=root, prefix=".dl-") as tmp:
        if deb is None:
            t0 = time.monotonic()
            LOG.info("downloading %s (apt-get download)", package)
            deb = apt.download(package, Path(tmp))
            LOG.info("downloaded %s (%.1f MB) in %.1f s", deb.name,
                     deb.stat().st_size / 1e6, time.monotonic() - t0)
        return _unpack_kernel(Path(deb), root, modules)


def _unpack_kernel(deb: Path, root: Path, modules) -> Kernel:
    t0 = time.monotonic()
    fields = run(["dpkg-deb", "-f", str(deb), "Package", "Version"]).stdout
    meta = dict(line.split(": ", 1) for line in fields.strip().splitlines())
    package, version = meta["Package"], meta["Version"]
    final = root / f"{package}_{version}"
    if (final / "kernel.json").is_file():
        return _load_kernel(final)
    wanted = {m.replace("-", "_") for m in modules} | {"virtio_rng"}
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{package}-"))
    try:
        (tmp / "modules").mkdir()
        bzimage = release = None
        # Stream the data tarball: only the bzImage and a few modules are kept.
        with subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE) as proc:
            with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
                for member in tar:
                    name = member.name.lstrip("./")
                    if re.fullmatch(r"boot/vmlinuz-.+", name) and member.isfile():
                        release = name.split("vmlinuz-", 1)[1]
                        bzimage = tar.extractfile(member).read()
                    elif name.endswith(".ko") and member.isfile():
                        mod = Path(name).stem.replace("-", "_")
                        if mod in wanted:
                            (tmp / "modules" / f"{mod}.ko").write_bytes(tar.extractfile(member).read())
        if proc.returncode:
            raise ImageError(f"dpkg-deb --fsys-tarfile {deb} failed")
        if bzimage is None:
            raise ImageError(f"{deb} holds no boot/vmlinuz-*")
        (tmp / "vmlinux").write_bytes(extract_vmlinux(bzimage))
        (tmp / "kernel.json").write_text(json.dumps(
            {"package": package, "version": version, "release": release, "deb": deb.name}, indent=1))
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    LOG.info("unpacked %s %s (vmlinux %.1f MB) in %.1f s", package, version,
             (final / "vmlinux").stat().st_size / 1e6, time.monotonic() - t0)
    return _load_kernel(final)


def module_load_order(kernel: Kernel, modules=DEFAULT_MODULES) -> list[str]:
    """``modules`` plus whatever they depend on, dependencies first."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str):
        name = name.replace("-", "_")
        if name in order:
            return
        if name in visiting:
            raise ImageError(f"module dependency cycle at {name}")
        path = kernel.module(name)
        if not path.is_file():
            raise ImageError(f"kernel {kernel.release} has no module {name} in {kernel.dir}/modules "
                             "(add it to the modules the kernel cache keeps)")
        visiting.add(name)
        for dep in filter(None, module_info(path).get("depends", "").split(",")):
            visit(dep)
        visiting.discard(name)
        order.append(name)

    for module in modules:
        visit(module)
    return order
