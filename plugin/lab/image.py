"""The lab's guest image: a RAM-only Linux guest (kernel + initramfs, no disk).

Why this shape (measured, see LAB-NOTES):

- **No disk** means no storage handling at all in a live migration: the
  whole guest is RAM, which QEMU moves anyway.
- **The host's own Python** (``/usr/bin/python3.11``, its stdlib and only the
  shared libraries ``ldd`` names) instead of a distribution in the guest:
  the guest side of accelmig (``accelmig.agent``, ``accelmig.wire``) is
  standard-library only, so the interpreter the host already has is all it
  needs, and the image builds in seconds from files already on disk.
- **Uncompressed initramfs** and an **uncompressed ``vmlinux``** (extracted
  from Debian's bzImage): under TCG the guest's own decompressors cost
  seconds; QEMU boots an ELF ``vmlinux`` directly through its PVH note.
- **busybox-static** provides ``/init``'s shell, ``insmod``, ``ip`` and an
  init that reaps orphans.  There is no udev: ``/init`` names the
  virtio-serial ports (``/dev/virtio-ports/<name>``) itself.

The guest runs every executable in ``/etc/accelmig/init.d/`` in name order
(``50-agent`` starts ``python3 -m accelmig.agent run --port
/dev/virtio-ports/org.accelmig.agent.0`` when the image's ``accelmig.agent``
has a ``__main__``, or ``--port none`` with ``accelmig.agent_port=none``
for a VM that has only qemu-guest-agent; ``60-app`` an optional demo
application).  Images built ``with_qemu_ga`` also carry Debian's
``qemu-ga`` (unpacked from the ``qemu-guest-agent`` package with
``apt-get download``, like the kernel: the host never installs it), which
``45-qemu-ga`` starts on ``org.qemu.guest_agent.0`` when the domain has
that port.  Services read
their settings from ``/etc/accelmig/guest.conf`` (baked in) overridden by
``accelmig.*`` words on the kernel command line (see :func:`guest_cmdline`).

Images are cached under ``/var/cache/accelmig-lab/images/<hash>``, the hash
covering every input (kernel package, interpreter, stdlib listing, busybox,
the agent/wire sources, the generated scripts, extra files), and built
atomically (a temporary directory renamed into place), so a cache entry is
either complete or absent.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import logging
import lzma
import os
import re
import shlex
import shutil
import stat
import struct
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

from accelmig.plugin.domain import AGENT_CHANNEL_NAME, QEMU_GA_CHANNEL_NAME

LOG = logging.getLogger("accelmig.lab.image")

#: Bump when the image layout changes in a way the input hash cannot see.
BUILDER_VERSION = 1

DEFAULT_CACHE = Path(os.environ.get("ACCELMIG_LAB_CACHE", "/var/cache/accelmig-lab"))

#: Kernel modules the guest loads, in this order (dependencies first; the
#: order is re-checked against each module's own ``depends=``).
DEFAULT_MODULES = (
    "virtio", "virtio_ring", "virtio_pci_modern_dev", "virtio_pci_legacy_dev",
    "virtio_pci", "virtio_console", "failover", "net_failover", "virtio_net",
)

#: Where the guest's Python finds accelmig (Debian's python3.11 has it on
#: ``sys.path`` through site.py: no PYTHONPATH needed).
GUEST_SITE = "/usr/lib/python3/dist-packages"

#: stdlib parts a headless guest never imports (saves ~35 MB of initramfs).
STDLIB_EXCLUDE_DIRS = frozenset({
    "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3",
    "pydoc_data", "distutils", "site-packages", "dist-packages", "venv",
    "sqlite3", "curses", "dbm", "__phello__",
})
# sitecustomize.py: Debian's apport hook, a link out of the stdlib.
STDLIB_EXCLUDE_FILES = frozenset({"turtle.py", "antigravity.py", "this.py", "sitecustomize.py"})
#: Extension modules left out (tests, terminals, databases, audio), and so
#: the libraries only they need.
DYNLOAD_EXCLUDE = re.compile(
    r"^(_test|_xx|xxlimited|_ctypes_test|_curses|_dbm|_gdbm|nis|_sqlite3|readline|"
    r"ossaudiodev|audioop|_tkinter)")

XZ_MAGIC = b"\xfd7zXZ\x00"
XEN_ELFNOTE_PHYS32_ENTRY = 18   # the PVH entry point QEMU boots an ELF kernel through


class ImageError(RuntimeError):
    """The guest image cannot be built (a missing input, a bad kernel)."""


# ---------------------------------------------------------------- ELF helpers

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


# ---------------------------------------------------------------- the kernel

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


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, check=True, capture_output=True, text=True, **kwargs)
    except FileNotFoundError as exc:
        raise ImageError(f"{cmd[0]} is not installed") from exc
    except subprocess.CalledProcessError as exc:
        raise ImageError(f"{' '.join(map(str, cmd))} failed: {exc.stderr.strip()}") from exc


APT_LISTS = Path("/var/lib/apt/lists")


def default_kernel_package(cache: Path | None = None) -> str:
    """The kernel package Debian's ``linux-image-amd64`` currently points at
    (so the lab follows the distribution's kernel without a pinned name).

    ``apt-cache`` takes ~1 s here, and its answer can only change when apt's
    package lists do: the answer is remembered in ``cache`` together with
    the lists directory's mtime (``apt-get update`` renames files into it).
    """
    memo = Path(cache) / "default-kernel.json" if cache else None
    try:
        lists_mtime = APT_LISTS.stat().st_mtime_ns
    except OSError:
        lists_mtime = None
    if memo and lists_mtime is not None:
        try:
            saved = json.loads(memo.read_text())
            if saved.get("apt_lists_mtime_ns") == lists_mtime:
                return saved["package"]
        except (OSError, ValueError, KeyError):
            pass
    out = _run(["apt-cache", "depends", "linux-image-amd64"]).stdout
    for line in out.splitlines():
        match = re.match(r"\s*Depends:\s*(linux-image-\S+)", line)
        if match:
            if memo and lists_mtime is not None:
                memo.write_text(json.dumps({"package": match.group(1), "apt_lists_mtime_ns": lists_mtime}))
            return match.group(1)
    raise ImageError("apt-cache knows no linux-image-amd64 dependency (run apt-get update?)")


def _cached_kernels(root: Path) -> list[Path]:
    return sorted((p for p in root.glob("linux-image-*") if (p / "kernel.json").is_file()),
                  key=lambda p: p.stat().st_mtime)


def _load_kernel(path: Path) -> Kernel:
    info = json.loads((path / "kernel.json").read_text())
    return Kernel(package=info["package"], version=info["version"], release=info["release"], dir=path)


def prepare_kernel(cache: Path = DEFAULT_CACHE, *, package: str | None = None,
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
            _run(["apt-get", "download", package], cwd=tmp)
            deb = next(Path(tmp).glob("*.deb"))
            LOG.info("downloaded %s (%.1f MB) in %.1f s", deb.name,
                     deb.stat().st_size / 1e6, time.monotonic() - t0)
        return _unpack_kernel(Path(deb), root, modules)


def _unpack_kernel(deb: Path, root: Path, modules) -> Kernel:
    t0 = time.monotonic()
    fields = _run(["dpkg-deb", "-f", str(deb), "Package", "Version"]).stdout
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


# ---------------------------------------------------------------- qemu-guest-agent

QEMU_GA_PACKAGE = "qemu-guest-agent"


def _cached_qemu_gas(root: Path) -> list[Path]:
    return sorted((p for p in root.glob("*") if (p / "qemu-ga").is_file()), key=lambda p: p.stat().st_mtime)


def prepare_qemu_ga(cache: Path = DEFAULT_CACHE, *, deb: str | os.PathLike | None = None) -> Path:
    """``/usr/sbin/qemu-ga`` of Debian's qemu-guest-agent package, unpacked
    once under ``<cache>/qemu-ga/<version>/`` (``apt-get download``, never
    installed); returns the binary's path.

    ``deb`` uses a ``.deb`` already on disk.  Which version apt offers is
    remembered together with the apt lists' mtime (as for the kernel);
    without apt (or offline) the newest cached binary is used.
    """
    root = Path(cache) / "qemu-ga"
    root.mkdir(parents=True, exist_ok=True)
    memo = root / "current.json"
    with tempfile.TemporaryDirectory(dir=root, prefix=".dl-") as tmp:
        if deb is None:
            try:
                lists_mtime = APT_LISTS.stat().st_mtime_ns
            except OSError:
                lists_mtime = None
            try:
                saved = json.loads(memo.read_text())
                if saved.get("apt_lists_mtime_ns") == lists_mtime and (Path(saved["dir"]) / "qemu-ga").is_file():
                    return Path(saved["dir"]) / "qemu-ga"
            except (OSError, ValueError, KeyError):
                pass
            try:
                _run(["apt-get", "download", QEMU_GA_PACKAGE], cwd=tmp)
            except ImageError as exc:
                cached = _cached_qemu_gas(root)
                if not cached:
                    raise ImageError(f"cannot get qemu-ga for the guest image: {exc}") from None
                LOG.warning("cannot download %s (%s): using the cached %s", QEMU_GA_PACKAGE, exc, cached[-1].name)
                return cached[-1] / "qemu-ga"
            deb = next(Path(tmp).glob("*.deb"))
        else:
            lists_mtime = None
        version = _run(["dpkg-deb", "-f", str(deb), "Version"]).stdout.strip()
        final = root / re.sub(r"[^A-Za-z0-9.+~-]", "_", version)
        if not (final / "qemu-ga").is_file():
            unpacked = Path(tmp) / "x"
            _run(["dpkg-deb", "-x", str(deb), str(unpacked)])
            binary = unpacked / "usr" / "sbin" / "qemu-ga"
            if not binary.is_file():
                raise ImageError(f"{deb} holds no usr/sbin/qemu-ga")
            staged = Path(tmp) / "final"
            staged.mkdir()
            shutil.copy2(binary, staged / "qemu-ga")
            shutil.rmtree(final, ignore_errors=True)
            os.rename(staged, final)
            LOG.info("unpacked %s %s into %s", QEMU_GA_PACKAGE, version, final)
        if lists_mtime is not None:
            memo.write_text(json.dumps({"dir": str(final), "apt_lists_mtime_ns": lists_mtime}))
        return final / "qemu-ga"


# ---------------------------------------------------------------- the image

@dataclasses.dataclass(frozen=True)
class ExtraFile:
    """A file added to the image (a test responder, a demo, a config)."""

    path: str                 # absolute path inside the guest
    data: bytes
    mode: int = 0o644

    def __post_init__(self):
        if not self.path.startswith("/") or ".." in Path(self.path).parts or self.path == "/":
            raise ImageError(f"extra file path {self.path!r} must be absolute and stay inside the image")
        if isinstance(self.data, str):
            object.__setattr__(self, "data", self.data.encode())

    @classmethod
    def executable(cls, path: str, text: str) -> "ExtraFile":
        return cls(path, text.encode(), 0o755)

    @classmethod
    def from_host(cls, host_path, guest_path: str, mode: int | None = None) -> "ExtraFile":
        host_path = Path(host_path)
        return cls(guest_path, host_path.read_bytes(),
                   stat.S_IMODE(host_path.stat().st_mode) if mode is None else mode)


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    """Everything an image is built from (all of it goes into the cache key)."""

    python: str = "/usr/bin/python3.11"
    busybox: str = "/bin/busybox"
    agent_src: str | None = None      # default: where accelmig.agent is imported from
    wire_src: str | None = None       # default: where accelmig.wire is imported from
    modules: tuple[str, ...] = DEFAULT_MODULES
    extra_files: tuple[ExtraFile, ...] = ()
    app_command: str | None = None    # the demo application 60-app runs, if any
    hostname: str = "accelmig-guest"
    kernel_package: str | None = None
    kernel_deb: str | None = None
    #: add qemu-guest-agent (``/usr/sbin/qemu-ga``, started by 45-qemu-ga
    #: when the domain has its channel): the guest of a VM without
    #: accelmig's channel, rehomed through ``guest-exec``
    with_qemu_ga: bool = False
    qemu_ga_deb: str | None = None    # a qemu-guest-agent .deb on disk (default: apt-get download)


@dataclasses.dataclass(frozen=True)
class GuestImage:
    """A built image: what a domain's ``<os>`` needs."""

    key: str
    dir: Path
    kernel: Path
    initrd: Path
    kernel_release: str
    size: int                          # initramfs bytes
    build_seconds: float | None        # None: it came from the cache

    def cmdline(self, **kwargs) -> str:
        return guest_cmdline(**kwargs)


def guest_cmdline(*, net: str | None = None, agent: bool | None = None, app: bool | None = None,
                  hostname: str | None = None, quiet: bool = True, extra: str = "",
                  agent_port: str | None = None, qemu_ga: bool | None = None,
                  qemu_ga_block: str | None = None) -> str:
    """The kernel command line for a lab guest.

    ``net="10.89.1.10/24,10.89.1.1"`` configures the fabric NIC (eth0) with
    an address and a default gateway; ``agent=False``/``app=False`` keep the
    guest agent / demo app from starting (a test that talks on the agent's
    own port, say).  ``console=ttyS0``: the domain's serial console is a
    file, which is the boot log a failing test prints.

    ``agent_port="none"`` runs the agent without a host channel (a VM with
    only qemu-guest-agent); ``qemu_ga=False`` keeps qemu-ga from starting;
    ``qemu_ga_block="guest-exec,..."`` disables those commands in qemu-ga
    (``--block-rpcs``, as distributions' policies do).
    """
    # tsc=reliable no_timer_check: the emulated TSC is stable, and skipping
    # the clocksource checks saves ~0.5 s of boot under TCG (measured).
    words = ["console=ttyS0", "panic=-1", "tsc=reliable", "no_timer_check"]
    if quiet:
        words.append("quiet")
    if net:
        if not re.fullmatch(r"[0-9.]+/\d+(,[0-9.]+)?", net):
            raise ValueError(f"net {net!r} is not ADDRESS/PREFIX[,GATEWAY]")
        words.append(f"accelmig.net={net}")
    if agent is not None:
        words.append(f"accelmig.agent={'on' if agent else 'off'}")
    if app is not None:
        words.append(f"accelmig.app={'on' if app else 'off'}")
    if hostname:
        words.append(f"accelmig.hostname={hostname}")
    if agent_port is not None:
        if not re.fullmatch(r"none|[A-Za-z0-9._-]+", agent_port):
            raise ValueError(f"agent_port {agent_port!r} is not 'none' or a virtio port name")
        words.append(f"accelmig.agent_port={agent_port}")
    if qemu_ga is not None:
        words.append(f"accelmig.qemu_ga={'on' if qemu_ga else 'off'}")
    if qemu_ga_block:
        if not re.fullmatch(r"[a-z0-9-]+(,[a-z0-9-]+)*", qemu_ga_block):
            raise ValueError(f"qemu_ga_block {qemu_ga_block!r} is not a comma-separated list of commands")
        words.append(f"accelmig.qemu_ga_block={qemu_ga_block}")
    if extra:
        words.append(extra)
    return " ".join(words)


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImageError(f"cannot find the {name} package to copy into the image")
    return Path(list(spec.submodule_search_locations)[0])


def _source_files(root: Path):
    """Files of a source package, without bytecode caches."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
        for name in sorted(filenames):
            if not name.endswith((".pyc", ".pyo")):
                yield Path(dirpath) / name


def _stdlib_dir(python: str) -> Path:
    out = _run([python, "-S", "-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"]).stdout
    return Path(out.strip())


def _stdlib_files(stdlib: Path):
    """(path, is_pyc) of the stdlib files the guest gets."""
    for dirpath, dirnames, filenames in os.walk(stdlib):
        rel = Path(dirpath).relative_to(stdlib)
        if rel == Path("."):
            dirnames[:] = [d for d in dirnames
                           if d not in STDLIB_EXCLUDE_DIRS and not d.startswith("config-")]
        else:
            dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDE_DIRS]
        dirnames.sort()
        in_cache = rel.name == "__pycache__"
        for name in sorted(filenames):
            if rel == Path(".") and name in STDLIB_EXCLUDE_FILES:
                continue
            if rel.name == "lib-dynload" and DYNLOAD_EXCLUDE.match(name):
                continue
            if in_cache:
                # only the plain (non-optimised) bytecode of this interpreter
                if ".opt-" in name or not name.endswith(".pyc"):
                    continue
                yield Path(dirpath) / name
            elif name.endswith((".py", ".so")) or rel.name == "lib-dynload":
                yield Path(dirpath) / name


def _ldd(paths, required=()) -> list[str]:
    """The shared libraries (as ldd names them, loader included) of ``paths``.
    A library of one of the ``required`` binaries that this host lacks is an
    error (the guest would fail to start it)."""
    libs: set[str] = set()
    paths = [str(p) for p in paths]
    required = {str(p) for p in required}
    out = _run(["ldd", *paths]).stdout
    current = paths[0] if len(paths) == 1 else None
    for line in out.splitlines():
        if not line.startswith(("\t", " ")) and line.endswith(":"):
            current = line[:-1]        # ldd of several files: "path:" heads each one's list
            continue
        line = line.strip()
        if line.endswith("=> not found") and current in required:
            raise ImageError(f"{current} needs {line.split()[0]}, which is not installed on this host")
        match = re.match(r"\S+ => (/\S+) \(0x", line) or re.match(r"(/\S+) \(0x", line)
        if match:
            libs.add(match.group(1))
    # glibc dlopen()s libgcc_s when a thread exits (pthread_exit unwinds);
    # ldd cannot see that, and without it every Python thread's exit aborts.
    for lib in libs.copy():
        if os.path.basename(lib).startswith("libc.so"):
            gcc_s = os.path.join(os.path.dirname(lib), "libgcc_s.so.1")
            if os.path.exists(gcc_s):
                libs.add(gcc_s)
    return sorted(libs)


# ---- generated guest files

LIB_SH = r"""# /etc/accelmig/lib.sh: helpers for /init, rc and the init.d scripts.
export PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin
export HOME=/root PYTHONUNBUFFERED=1 LANG=C.UTF-8
ACCELMIG_SITE=@SITE@
log() { echo "accelmig-guest[${0##*/}]: $*" >/dev/console; }
uptime_s() { cut -d' ' -f1 /proc/uptime; }

# Settings: guest.conf (baked into the image), then accelmig.* words of the
# kernel command line (accelmig.net=... -> ACCELMIG_NET=...).
load_settings() {
    [ -f /etc/accelmig/guest.conf ] && . /etc/accelmig/guest.conf
    [ -f /run/accelmig/settings ] && . /run/accelmig/settings
}
parse_cmdline() {
    mkdir -p /run/accelmig
    : > /run/accelmig/settings
    for word in $(cat /proc/cmdline); do
        case "$word" in
            accelmig.*=*)
                key=${word%%=*}; value=${word#*=}
                key=$(echo "$key" | tr 'a-z.-' 'A-Z__')
                case "$value" in *"'"*) log "ignoring $key: quote in value"; continue;; esac
                echo "$key='$value'" >> /run/accelmig/settings;;
        esac
    done
}

# udev's job, done by hand: /dev/virtio-ports/<name> -> ../vportNpM.
link_ports() {
    mkdir -p /dev/virtio-ports
    for port in /sys/class/virtio-ports/*; do
        [ -r "$port/name" ] || continue
        name=$(cat "$port/name")
        [ -n "$name" ] && ln -sfn "../${port##*/}" "/dev/virtio-ports/$name"
    done
}
# wait_port NAME SECONDS: the host announces port names asynchronously.
wait_port() {
    tries=$(( ${2:-10} * 20 ))
    while [ ! -e "/dev/virtio-ports/$1" ]; do
        link_ports
        [ -e "/dev/virtio-ports/$1" ] && break
        tries=$((tries - 1))
        [ "$tries" -le 0 ] && return 1
        usleep 50000
    done
    return 0
}
"""

INIT_SH = r"""#!/bin/sh
# /init of an accelmig lab guest (generated by accelmig.plugin.lab.image).
# PID 1 from the initramfs, no udev: mount the pseudo filesystems, load the
# virtio modules, name the virtio-serial ports, configure the network from
# the kernel command line, then hand over to busybox init, which runs
# /etc/accelmig/rc (every executable in /etc/accelmig/init.d, in order) and
# reaps orphans for the rest of the guest's life.
. /etc/accelmig/lib.sh
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/pts /dev/shm /run /tmp
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=0755 tmpfs /run
mount -t tmpfs tmpfs /dev/shm
log "kernel $(uname -r) up $(uptime_s) s"
while read -r module; do
    insmod "/lib/modules/$module.ko" || log "insmod $module failed"
done < /etc/accelmig/modules
parse_cmdline
load_settings
hostname "${ACCELMIG_HOSTNAME:-@HOSTNAME@}"
ip link set lo up
# Ports appear when the host's QEMU announces them: give them a moment.
tries=40
while [ "$tries" -gt 0 ]; do
    link_ports
    n=$(ls /sys/class/virtio-ports 2>/dev/null | wc -l)
    named=$(ls /dev/virtio-ports 2>/dev/null | wc -l)
    [ "$n" -gt 0 ] && [ "$n" -eq "$named" ] && break
    tries=$((tries - 1)); usleep 25000
done
log "virtio ports: $(ls /dev/virtio-ports 2>/dev/null | tr '\n' ' ')"
if [ -n "$ACCELMIG_NET" ]; then
    dev=${ACCELMIG_NET_DEV:-eth0}
    addr=${ACCELMIG_NET%%,*}
    ip link set "$dev" up && ip addr add "$addr" dev "$dev" || log "cannot configure $dev"
    case "$ACCELMIG_NET" in
        *,*) ip route add default via "${ACCELMIG_NET#*,}" dev "$dev" || log "no default route";;
    esac
    log "network: $dev $addr gateway ${ACCELMIG_NET#*,}"
fi
log "modules loaded, up $(uptime_s) s"
exec /sbin/init
"""

INITTAB = """\
# busybox init: /etc/accelmig/rc once, then reap orphans until poweroff.
::sysinit:/etc/accelmig/rc
::ctrlaltdel:/sbin/reboot
::shutdown:/bin/umount -a -r
"""

RC_SH = r"""#!/bin/sh
# Run every executable in /etc/accelmig/init.d in name order.  Each runs in
# the foreground: a long-running service starts itself in the background.
. /etc/accelmig/lib.sh
load_settings
for script in /etc/accelmig/init.d/*; do
    [ -x "$script" ] || continue
    "$script" </dev/null >/dev/console 2>&1 || log "${script##*/} failed (exit $?)"
done
log "init.d done, up $(uptime_s) s"
"""

AGENT_SH = r"""#!/bin/sh
# The accelmig guest agent on its virtio-serial port, restarted if it exits.
# Not started when accelmig.agent=off, or when this image's accelmig.agent
# has no __main__ (an image built before the agent existed).
# accelmig.agent_port=none: no host channel (a VM with only qemu-guest-agent,
# rehomed through guest-exec of 'accelmig-agent rehome --stdin').
. /etc/accelmig/lib.sh
load_settings
case "${ACCELMIG_AGENT:-auto}" in off|0|no) log "agent disabled (accelmig.agent=off)"; exit 0;; esac
if [ ! -f "$ACCELMIG_SITE/accelmig/agent/__main__.py" ]; then
    log "no accelmig/agent/__main__.py in this image: agent not started"
    exit 0
fi
port_name=${ACCELMIG_AGENT_PORT:-@PORT@}
(
    if [ "$port_name" = none ]; then
        port=none
    else
        wait_port "$port_name" 30 || { log "no virtio port $port_name: agent not started"; exit 1; }
        port=/dev/virtio-ports/$port_name
    fi
    while :; do
        python3 -m accelmig.agent run --port "$port"
        log "agent exited (status $?): restarting in 1 s"
        sleep 1
    done
) </dev/null >/dev/console 2>&1 &
"""

QEMU_GA_SH = r"""#!/bin/sh
# qemu-guest-agent on its virtio-serial port (images built with_qemu_ga),
# when the domain has that port; restarted if it exits.  accelmig.qemu_ga=off
# keeps it from starting; accelmig.qemu_ga_block=cmd,... disables commands
# (qemu-ga --block-rpcs), as some distributions do by policy for guest-exec.
. /etc/accelmig/lib.sh
load_settings
case "${ACCELMIG_QEMU_GA:-on}" in off|0|no) log "qemu-ga disabled (accelmig.qemu_ga=off)"; exit 0;; esac
(
    wait_port @PORT@ 5 || { log "no virtio port @PORT@: qemu-ga not started"; exit 0; }
    set -- -m virtio-serial -p /dev/virtio-ports/@PORT@ -t /run -f /run/qemu-ga.pid
    [ -n "$ACCELMIG_QEMU_GA_BLOCK" ] && set -- "$@" --block-rpcs "$ACCELMIG_QEMU_GA_BLOCK"
    log "qemu-ga $*"
    while :; do
        /usr/sbin/qemu-ga "$@"
        log "qemu-ga exited (status $?): restarting in 1 s"
        sleep 1
    done
) </dev/null >/dev/console 2>&1 &
"""

APP_SH = r"""#!/bin/sh
# The demo application, if the image has one (guest.conf ACCELMIG_APP_COMMAND)
# and the kernel command line does not say accelmig.app=off.
. /etc/accelmig/lib.sh
load_settings
[ -n "$ACCELMIG_APP_COMMAND" ] || exit 0
case "${ACCELMIG_APP:-on}" in off|0|no) log "app disabled (accelmig.app=off)"; exit 0;; esac
(
    log "app: $ACCELMIG_APP_COMMAND"
    sh -c "$ACCELMIG_APP_COMMAND"
    log "app exited (status $?)"
) </dev/null >/dev/console 2>&1 &
"""


def _generated_files(spec: ImageSpec, modules: list[str]) -> list[ExtraFile]:
    guest_conf = ["# accelmig lab guest settings (the kernel command line overrides them)",
                  f"ACCELMIG_HOSTNAME={shlex.quote(spec.hostname)}"]
    if spec.app_command:
        guest_conf.append(f"ACCELMIG_APP_COMMAND={shlex.quote(spec.app_command)}")
    qemu_ga = [ExtraFile("/etc/accelmig/init.d/45-qemu-ga",
                         QEMU_GA_SH.replace("@PORT@", QEMU_GA_CHANNEL_NAME).encode(), 0o755)
               ] if spec.with_qemu_ga else []
    return [
        *qemu_ga,
        ExtraFile("/init", INIT_SH.replace("@HOSTNAME@", spec.hostname).encode(), 0o755),
        ExtraFile("/etc/inittab", INITTAB.encode()),
        ExtraFile("/etc/accelmig/lib.sh", LIB_SH.replace("@SITE@", GUEST_SITE).encode()),
        ExtraFile("/etc/accelmig/rc", RC_SH.encode(), 0o755),
        ExtraFile("/etc/accelmig/guest.conf", ("\n".join(guest_conf) + "\n").encode()),
        ExtraFile("/etc/accelmig/modules", ("\n".join(modules) + "\n").encode()),
        ExtraFile("/etc/accelmig/init.d/50-agent", AGENT_SH.replace("@PORT@", AGENT_CHANNEL_NAME).encode(), 0o755),
        ExtraFile("/etc/accelmig/init.d/60-app", APP_SH.encode(), 0o755),
        ExtraFile("/etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n"),
        ExtraFile("/etc/group", b"root:x:0:\n"),
        ExtraFile("/etc/hosts", b"127.0.0.1\tlocalhost\n"),
    ]


# ---- cache key

def _hash_file(h, path: Path):
    h.update(str(path).encode() + b"\0")
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)


def image_key(spec: ImageSpec, kernel: Kernel, generated: list[ExtraFile],
              stdlib: Path, agent_src: Path, wire_src: Path, qemu_ga: Path | None = None) -> str:
    """A hash of every input: change any of them and the image is rebuilt."""
    h = hashlib.sha256()
    h.update(json.dumps({
        "builder": BUILDER_VERSION, "kernel": [kernel.package, kernel.version],
        "modules": list(spec.modules), "stdlib_exclude": sorted(STDLIB_EXCLUDE_DIRS),
        "dynload_exclude": DYNLOAD_EXCLUDE.pattern, "site": GUEST_SITE,
    }, sort_keys=True).encode())
    _hash_file(h, Path(spec.python).resolve())
    _hash_file(h, Path(spec.busybox).resolve())
    if qemu_ga is not None:
        _hash_file(h, qemu_ga)
    # The stdlib by listing (path, size, mtime): cheap, and it changes with
    # every package upgrade.
    # (sources only: root running Python keeps adding bytecode to the host's
    # __pycache__ directories, which must not change the key)
    for path in _stdlib_files(stdlib):
        if path.parent.name == "__pycache__":
            continue
        st = path.stat()
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    for root in (agent_src, wire_src):
        for path in _source_files(root):
            h.update(str(path.relative_to(root.parent)).encode())
            _hash_file(h, path)
    for extra in [*generated, *spec.extra_files]:
        h.update(f"{extra.path}\0{extra.mode:o}\0".encode() + hashlib.sha256(extra.data).digest())
    return h.hexdigest()[:20]


# ---- cpio (newc) writer

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


# ---- the builder

@dataclasses.dataclass(frozen=True)
class _Plan:
    kernel: Kernel
    modules: list
    agent_src: Path
    wire_src: Path
    stdlib: Path
    generated: list
    key: str
    qemu_ga: Path | None = None      # the qemu-ga binary (images built with_qemu_ga)


def _plan(spec: ImageSpec, cache: Path) -> _Plan:
    for tool in (spec.python, spec.busybox):
        if not os.access(tool, os.X_OK):
            raise ImageError(f"{tool} is missing (apt-get install busybox-static python3.11)")
    kernel = prepare_kernel(cache, package=spec.kernel_package, deb=spec.kernel_deb, modules=spec.modules)
    modules = module_load_order(kernel, spec.modules)
    agent_src = Path(spec.agent_src) if spec.agent_src else _package_dir("accelmig.agent")
    wire_src = Path(spec.wire_src) if spec.wire_src else _package_dir("accelmig.wire")
    stdlib = _stdlib_dir(spec.python)
    generated = _generated_files(spec, modules)
    qemu_ga = prepare_qemu_ga(cache, deb=spec.qemu_ga_deb) if spec.with_qemu_ga else None
    key = image_key(spec, kernel, generated, stdlib, agent_src, wire_src, qemu_ga)
    return _Plan(kernel, modules, agent_src, wire_src, stdlib, generated, key, qemu_ga)


def image_key_for(spec: ImageSpec = ImageSpec(), cache: Path = DEFAULT_CACHE) -> str:
    """The cache key ``build_image(spec)`` would use, without building."""
    return _plan(spec, Path(cache)).key


def build_image(spec: ImageSpec = ImageSpec(), cache: Path = DEFAULT_CACHE, *,
                force: bool = False, keep: int = 8) -> GuestImage:
    """Build (or fetch from the cache) the guest image described by ``spec``.

    ``keep``: how many images the cache holds at most (least recently used
    ones go after a build)."""
    t0 = time.monotonic()
    cache = Path(cache)
    plan = _plan(spec, cache)
    key = plan.key
    images = cache / "images"
    final = images / key
    images.mkdir(parents=True, exist_ok=True)
    with open(images / ".lock", "w") as lock:
        # Two labs building the same image at once: one builds, one waits.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "image.json").is_file() and not force:
            os.utime(final / "image.json")       # recently used (see prune_images)
            image = _load_image(final, None)
            LOG.info("guest image %s from the cache (%.2f s)", key, time.monotonic() - t0)
            return image
        if final.exists():
            shutil.rmtree(final)
        LOG.info("building guest image %s (kernel %s, %s)", key, plan.kernel.release, spec.python)
        t_build = time.monotonic()
        tmp = Path(tempfile.mkdtemp(dir=images, prefix=f".build-{key}-"))
        try:
            _build(key, spec, plan.kernel, plan.modules, plan.generated, plan.stdlib,
                   plan.agent_src, plan.wire_src, tmp, plan.qemu_ga)
            seconds = time.monotonic() - t_build
            meta = json.loads((tmp / "image.json").read_text())
            meta["build_seconds"] = round(seconds, 3)
            (tmp / "image.json").write_text(json.dumps(meta, indent=1))
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        prune_images(cache, keep)
    image = _load_image(final, seconds)
    LOG.info("guest image %s built in %.2f s (initramfs %.1f MB; %.2f s with the input checks)",
             key, seconds, image.size / 1e6, time.monotonic() - t0)
    return image


def prune_images(cache: Path = DEFAULT_CACHE, keep: int = 8) -> list[Path]:
    """Remove all but the ``keep`` most recently used images (and stale
    temporary build directories); returns what was removed.  Call with the
    cache lock held, or when no build runs."""
    images = Path(cache) / "images"
    removed = []
    entries = sorted((p for p in images.iterdir() if (p / "image.json").is_file()),
                     key=lambda p: (p / "image.json").stat().st_mtime, reverse=True)
    for path in entries[keep:]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    for tmp in images.glob(".build-*"):
        if time.time() - tmp.stat().st_mtime > 3600:
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def _load_image(path: Path, build_seconds: float | None) -> GuestImage:
    meta = json.loads((path / "image.json").read_text())
    return GuestImage(key=meta["key"], dir=path, kernel=path / "vmlinux", initrd=path / "initramfs.cpio",
                      kernel_release=meta["kernel_release"], size=meta["initramfs_bytes"],
                      build_seconds=build_seconds)


def _build(key: str, spec: ImageSpec, kernel: Kernel, modules: list[str], generated: list[ExtraFile],
           stdlib: Path, agent_src: Path, wire_src: Path, out: Path, qemu_ga: Path | None = None):
    step = time.monotonic()

    def progress(what: str):
        nonlocal step
        now = time.monotonic()
        LOG.info("  %-44s %.2f s", what, now - step)
        step = now

    stage = out / "stage"
    # 1. Python: the stdlib (with the host's own bytecode where it is valid),
    #    then accelmig's guest-side packages; compileall fills the gaps.
    guest_stdlib = stage / str(stdlib).lstrip("/")
    dynload: list[Path] = []
    for path in _stdlib_files(stdlib):
        dest = guest_stdlib / path.relative_to(stdlib)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
        if dest.parent.name == "lib-dynload" and dest.suffix == ".so":
            dynload.append(path)
    site = stage / GUEST_SITE.lstrip("/") / "accelmig"
    for src, name in ((agent_src, "agent"), (wire_src, "wire")):
        for path in _source_files(src):
            dest = site / name / path.relative_to(src)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
    progress("copied stdlib + accelmig.agent/wire")
    _run([spec.python, "-m", "compileall", "-q", "-j", "0", "-s", str(stage), "-p", "/",
          str(guest_stdlib), str(site.parent)])
    progress("precompiled")
    libs = _ldd([spec.python, *dynload, *([qemu_ga] if qemu_ga else [])],
                required=[qemu_ga] if qemu_ga else [])
    progress(f"ldd: {len(libs)} shared libraries")

    # 2. The archive.
    initrd = out / "initramfs.cpio"
    with open(initrd, "wb") as f:
        cpio = CpioWriter(f)
        for d in ("bin", "sbin", "usr", "usr/bin", "usr/sbin", "usr/local", "usr/local/bin",
                  "usr/lib", "lib", "lib64", "lib/x86_64-linux-gnu", "lib/modules", "etc",
                  "etc/accelmig", "etc/accelmig/init.d", "proc", "sys", "dev", "run", "tmp",
                  "root", "var", "var/log"):
            cpio.directory(d, 0o1777 if d == "tmp" else 0o755)
        cpio.chardev("dev/console", 5, 1)
        cpio.chardev("dev/null", 1, 3, 0o666)
        cpio.file("bin/busybox", Path(spec.busybox).resolve(), mode=0o755)
        applets = _run([spec.busybox, "--list-full"]).stdout.split()
        for applet in sorted(set(applets)):
            parent = str(Path(applet).parent)
            if parent not in cpio.names:
                cpio.directory(parent)
            if applet != "bin/busybox":
                cpio.symlink(applet, "/bin/busybox")
        python_name = Path(spec.python).name
        cpio.file(f"usr/bin/{python_name}", Path(spec.python).resolve(), mode=0o755)
        cpio.symlink("usr/bin/python3", python_name)
        if qemu_ga is not None:
            cpio.file("usr/sbin/qemu-ga", qemu_ga, mode=0o755)
        for lib in libs:
            parent = str(Path(lib).parent).lstrip("/")
            if parent not in cpio.names:
                cpio.directory(parent)
            cpio.file(lib, Path(lib).resolve(), mode=0o755)
        for module in modules:
            cpio.file(f"lib/modules/{module}.ko", kernel.module(module))
        # the staged Python tree (stdlib + site) on top of usr/lib
        for top in sorted((stage / "usr" / "lib").iterdir()):
            cpio.tree(top, "usr/lib/" + top.name)
        extras = {e.path: e for e in [*generated, *spec.extra_files]}   # extra files may replace generated ones
        for extra in extras.values():
            parent = str(Path(extra.path).parent).lstrip("/")
            parts = Path(parent).parts
            for i in range(1, len(parts) + 1):
                if "/".join(parts[:i]) not in cpio.names:
                    cpio.directory("/".join(parts[:i]))
            cpio.file(extra.path, data=extra.data, mode=extra.mode)
        cpio.close()
    size = initrd.stat().st_size
    progress(f"initramfs written ({size / 1e6:.1f} MB, {len(cpio.names)} entries)")
    shutil.rmtree(stage)
    try:
        os.link(kernel.vmlinux, out / "vmlinux")
    except OSError:
        shutil.copy2(kernel.vmlinux, out / "vmlinux")
    (out / "image.json").write_text(json.dumps({
        "key": key,
        "kernel_package": kernel.package, "kernel_version": kernel.version,
        "kernel_release": kernel.release, "modules": modules, "python": spec.python,
        "initramfs_bytes": size, "extra_files": sorted(e.path for e in spec.extra_files),
        "app_command": spec.app_command, "qemu_ga": qemu_ga is not None,
    }, indent=1))
    progress("done")
