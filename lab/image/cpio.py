"""The initramfs archive: a minimal newc cpio writer (what the kernel's
initramfs unpacker reads), written uncompressed because under TCG the
guest's own decompressor costs more than the bigger archive (docs/lab-notes.md)."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from .errors import ImageError


class CpioWriter:
    """A minimal newc cpio writer (what the kernel's initramfs unpacker
    reads): deterministic, root-owned, and able to add device nodes
    without mknod."""

    def __init__(self, fileobj):
        self.f = fileobj
        self.ino = 1000
        self.names: set[str] = set()

    def _entry(self, name: str, mode: int, data: bytes = b"", *, mtime: int = 0,
               size: int | None = None, rdev: tuple[int, int] = (0, 0), nlink: int = 1):
        name = name.lstrip("/") or "."
        if name in self.names:
            raise ImageError(f"duplicate initramfs entry {name}")
        self.names.add(name)
        self.ino += 1
        encoded = name.encode() + b"\0"
        size = len(data) if size is None else size
        header = "070701" + "".join(f"{v:08x}" for v in (
            self.ino, mode, 0, 0, nlink, int(mtime), size, 0, 0, rdev[0], rdev[1], len(encoded), 0))
        self.f.write(header.encode() + encoded)
        self._pad(110 + len(encoded))
        if data:
            self.f.write(data)
            self._pad(len(data))

    def _pad(self, n: int):
        if n % 4:
            self.f.write(b"\0" * (4 - n % 4))

    def directory(self, name: str, mode: int = 0o755, mtime: int = 0):
        self._entry(name, stat.S_IFDIR | mode, mtime=mtime, nlink=2)

    def symlink(self, name: str, target: str, mtime: int = 0):
        self._entry(name, stat.S_IFLNK | 0o777, target.encode(), mtime=mtime)

    def chardev(self, name: str, major: int, minor: int, mode: int = 0o600):
        self._entry(name, stat.S_IFCHR | mode, rdev=(major, minor))

    def file(self, name: str, source: Path | None = None, data: bytes | None = None,
             mode: int | None = None, mtime: int | None = None):
        if source is not None:
            st = source.stat()
            size = st.st_size
            perm = stat.S_IMODE(st.st_mode) if mode is None else mode
            self._entry(name, stat.S_IFREG | perm, mtime=st.st_mtime if mtime is None else mtime, size=size)
            with open(source, "rb") as f:
                shutil.copyfileobj(f, self.f, 1 << 20)
            self._pad(size)
        else:
            self._entry(name, stat.S_IFREG | (0o644 if mode is None else mode), data or b"",
                        mtime=mtime or 0)

    def tree(self, root: Path, prefix: str = ""):
        """Add a staged directory tree (dirs, files, symlinks) under ``prefix``."""
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            rel = Path(dirpath).relative_to(root)
            base = f"{prefix}/{rel}" if str(rel) != "." else prefix
            if base and base.strip("/") not in self.names:
                self.directory(base, mtime=int(os.lstat(dirpath).st_mtime))
            for name in sorted(filenames) + sorted(d for d in dirnames if os.path.islink(os.path.join(dirpath, d))):
                path = Path(dirpath) / name
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode):
                    self.symlink(f"{base}/{name}", os.readlink(path), int(st.st_mtime))
                elif stat.S_ISREG(st.st_mode):
                    self.file(f"{base}/{name}", path)

    def close(self):
        self._entry("TRAILER!!!", 0, nlink=1)
        self._pad(self.f.tell())  # the kernel wants the archive 4-aligned (512 is customary)
