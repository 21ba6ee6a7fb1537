"""The image build: what an image is built from (:class:`ImageSpec`), the
plan that resolves it (kernel, modules, the guest's Python, qemu-ga), the
key that names it in the cache, the build itself, and what a domain needs
of the result (:class:`GuestImage`, :func:`guest_cmdline`).

The guest's own files — ``/init``, busybox init's inittab, the services in
``/etc/accelmig/init.d`` — are package data under ``guest/``, at the paths
they take in the guest; ``@NAME@`` words in them are filled in here.  Their
text is part of the image key, like every other input.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import json
import logging
import os
import re
import shlex
import shutil
import stat
import time
from pathlib import Path

from accelmig.plugin.domain import AGENT_CHANNEL_NAME, QEMU_GA_CHANNEL_NAME

from .cache import DEFAULT_CACHE, IMAGE_META, complete_entry, locked, mark_used, new_entry, prune_images
from .cpio import CpioWriter
from .errors import ImageError, run
from .guest_python import (DYNLOAD_EXCLUDE, GUEST_SITE, STDLIB_EXCLUDE_DIRS, ldd, package_dir, source_files,
                           stdlib_dir, stdlib_files)
from .kernel import DEFAULT_MODULES, Kernel, module_load_order, prepare_kernel
from .qemu_ga import prepare_qemu_ga

LOG = logging.getLogger("accelmig.lab.image")

#: Bump when the image layout changes in a way the input hash cannot see.
BUILDER_VERSION = 1


# ---------------------------------------------------------------- what an image is built from

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
    runtime_src: str | None = None    # default: where accelmig.runtime is imported from
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



# ---------------------------------------------------------------- the guest's own files

#: ``guest/`` of this package: the guest's files at the paths they take there.
GUEST_TREE = importlib.resources.files(__package__) / "guest"

#: Only images built ``with_qemu_ga`` start qemu-guest-agent.
QEMU_GA_SERVICE = "etc/accelmig/init.d/45-qemu-ga"


def _walk(node, prefix: str = ""):
    """(relative path, resource) of every file under ``node``, in name order."""
    for child in sorted(node.iterdir(), key=lambda c: c.name):
        if child.is_dir():
            yield from _walk(child, f"{prefix}{child.name}/")
        else:
            yield f"{prefix}{child.name}", child


def _guest_mode(rel: str) -> int:
    """/init, rc and the services run; the rest (lib.sh, inittab, …) is read."""
    executable = rel in ("init", "etc/accelmig/rc") or rel.startswith("etc/accelmig/init.d/")
    return 0o755 if executable else 0o644


def guest_files(spec: "ImageSpec", modules: list[str], tree=GUEST_TREE) -> list[ExtraFile]:
    """The guest's own files for ``spec``: those of ``tree`` (package data by
    default) with their ``@NAME@`` words filled in, plus the settings
    (``guest.conf``) and the module load order, which depend on the spec."""
    words = {"@SITE@": GUEST_SITE, "@HOSTNAME@": spec.hostname,
             "@AGENT_PORT@": AGENT_CHANNEL_NAME, "@QEMU_GA_PORT@": QEMU_GA_CHANNEL_NAME}
    files = []
    for rel, resource in _walk(tree):
        if rel == QEMU_GA_SERVICE and not spec.with_qemu_ga:
            continue
        text = resource.read_text()
        for word, value in words.items():
            text = text.replace(word, value)
        files.append(ExtraFile("/" + rel, text.encode(), _guest_mode(rel)))
    guest_conf = ["# accelmig lab guest settings (the kernel command line overrides them)",
                  f"ACCELMIG_HOSTNAME={shlex.quote(spec.hostname)}"]
    if spec.app_command:
        guest_conf.append(f"ACCELMIG_APP_COMMAND={shlex.quote(spec.app_command)}")
    files.append(ExtraFile("/etc/accelmig/guest.conf", ("\n".join(guest_conf) + "\n").encode()))
    files.append(ExtraFile("/etc/accelmig/modules", ("\n".join(modules) + "\n").encode()))
    return files


# ---------------------------------------------------------------- the key

def _hash_file(h, path: Path):
    h.update(str(path).encode() + b"\0")
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)


def image_key(spec: ImageSpec, kernel: Kernel, generated: list[ExtraFile],
              stdlib: Path, agent_src: Path, wire_src: Path, qemu_ga: Path | None = None,
              runtime_src: Path | None = None) -> str:
    """A hash of every input: change any of them and the image is rebuilt
    (``runtime_src``: where accelmig.runtime is imported from, by default)."""
    if runtime_src is None:
        runtime_src = package_dir("accelmig.runtime")
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
    # every package upgrade.  Sources only: root running Python keeps adding
    # bytecode to the host's __pycache__ directories, which must not change the key.
    for path in stdlib_files(stdlib):
        if path.parent.name == "__pycache__":
            continue
        st = path.stat()
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    for root in (agent_src, wire_src, runtime_src):
        for path in source_files(root):
            h.update(str(path.relative_to(root.parent)).encode())
            _hash_file(h, path)
    for extra in [*generated, *spec.extra_files]:
        h.update(f"{extra.path}\0{extra.mode:o}\0".encode() + hashlib.sha256(extra.data).digest())
    return h.hexdigest()[:20]


# ---------------------------------------------------------------- the plan and the build

@dataclasses.dataclass(frozen=True)
class _Plan:
    """Every input of one build, resolved (the kernel unpacked, qemu-ga too)."""

    spec: ImageSpec
    kernel: Kernel
    modules: list
    agent_src: Path
    wire_src: Path
    runtime_src: Path
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
    agent_src = Path(spec.agent_src) if spec.agent_src else package_dir("accelmig.agent")
    wire_src = Path(spec.wire_src) if spec.wire_src else package_dir("accelmig.wire")
    runtime_src = Path(spec.runtime_src) if spec.runtime_src else package_dir("accelmig.runtime")
    stdlib = stdlib_dir(spec.python)
    generated = guest_files(spec, modules)
    qemu_ga = prepare_qemu_ga(cache, deb=spec.qemu_ga_deb) if spec.with_qemu_ga else None
    key = image_key(spec, kernel, generated, stdlib, agent_src, wire_src, qemu_ga, runtime_src)
    return _Plan(spec, kernel, modules, agent_src, wire_src, runtime_src, stdlib, generated, key, qemu_ga)


def build_image(spec: ImageSpec = ImageSpec(), cache: Path = DEFAULT_CACHE, *,
                force: bool = False, keep: int = 8) -> GuestImage:
    """Build (or fetch from the cache) the guest image described by ``spec``.

    ``keep``: how many images the cache holds at most (least recently used
    ones go after a build)."""
    t0 = time.monotonic()
    cache = Path(cache)
    plan = _plan(spec, cache)
    key = plan.key
    with locked(cache):
        found = complete_entry(cache, key)
        if found is not None and not force:
            mark_used(found)
            image = _load_image(found, None)
            LOG.info("guest image %s from the cache (%.2f s)", key, time.monotonic() - t0)
            return image
        LOG.info("building guest image %s (kernel %s, %s)", key, plan.kernel.release, spec.python)
        t_build = time.monotonic()
        with new_entry(cache, key) as tmp:
            _build(plan, tmp)
            seconds = time.monotonic() - t_build
            meta = json.loads((tmp / IMAGE_META).read_text())
            meta["build_seconds"] = round(seconds, 3)
            (tmp / IMAGE_META).write_text(json.dumps(meta, indent=1))
        prune_images(cache, keep)
    image = _load_image(complete_entry(cache, key), seconds)
    LOG.info("guest image %s built in %.2f s (initramfs %.1f MB; %.2f s with the input checks)",
             key, seconds, image.size / 1e6, time.monotonic() - t0)
    return image


def _load_image(path: Path, build_seconds: float | None) -> GuestImage:
    meta = json.loads((path / IMAGE_META).read_text())
    return GuestImage(key=meta["key"], dir=path, kernel=path / "vmlinux", initrd=path / "initramfs.cpio",
                      kernel_release=meta["kernel_release"], size=meta["initramfs_bytes"],
                      build_seconds=build_seconds)


def _build(plan: _Plan, out: Path):
    spec, kernel, modules, stdlib, qemu_ga = plan.spec, plan.kernel, plan.modules, plan.stdlib, plan.qemu_ga
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
    for path in stdlib_files(stdlib):
        dest = guest_stdlib / path.relative_to(stdlib)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
        if dest.parent.name == "lib-dynload" and dest.suffix == ".so":
            dynload.append(path)
    site = stage / GUEST_SITE.lstrip("/") / "accelmig"
    for src, name in ((plan.agent_src, "agent"), (plan.wire_src, "wire"), (plan.runtime_src, "runtime")):
        for path in source_files(src):
            dest = site / name / path.relative_to(src)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
    progress("copied stdlib + accelmig.agent/wire/runtime")
    run([spec.python, "-m", "compileall", "-q", "-j", "0", "-s", str(stage), "-p", "/",
          str(guest_stdlib), str(site.parent)])
    progress("precompiled")
    libs = ldd([spec.python, *dynload, *([qemu_ga] if qemu_ga else [])],
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
        applets = run([spec.busybox, "--list-full"]).stdout.split()
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
        extras = {e.path: e for e in [*plan.generated, *spec.extra_files]}   # extra files may replace generated ones
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
    (out / IMAGE_META).write_text(json.dumps({
        "key": plan.key,
        "kernel_package": kernel.package, "kernel_version": kernel.version,
        "kernel_release": kernel.release, "modules": modules, "python": spec.python,
        "initramfs_bytes": size, "extra_files": sorted(e.path for e in spec.extra_files),
        "app_command": spec.app_command, "qemu_ga": qemu_ga is not None,
    }, indent=1))
    progress("done")
