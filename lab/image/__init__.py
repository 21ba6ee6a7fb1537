"""The lab's guest image: a RAM-only Linux guest (kernel + initramfs, no disk).

Why this shape (measured, see docs/lab-notes.md):

- **No disk** means no storage handling at all in a live migration: the
  whole guest is RAM, which QEMU moves anyway.
- **The host's own Python** (``/usr/bin/python3.11``, its stdlib and only the
  shared libraries ``ldd`` names) instead of a distribution in the guest:
  the guest side of accelmig (``accelmig.agent``, ``accelmig.wire``,
  ``accelmig.runtime``) is standard-library only, so the interpreter the
  host already has is all it needs, and the image builds in seconds from
  files already on disk.
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
that port.  Services read their settings from ``/etc/accelmig/guest.conf``
(baked in) overridden by ``accelmig.*`` words on the kernel command line
(see :func:`guest_cmdline`).

Images are cached under ``/var/cache/accelmig-lab/images/<hash>``, the hash
covering every input (kernel package, interpreter, stdlib listing, busybox,
the agent/wire/runtime sources, the guest's own files, extra files), and built
atomically (a temporary directory renamed into place), so a cache entry is
either complete or absent.

The parts:

- :mod:`.kernel`: the Debian kernel package, its uncompressed ``vmlinux``,
  its modules and their load order;
- :mod:`.qemu_ga`: Debian's qemu-guest-agent, for images built ``with_qemu_ga``;
- :mod:`.guest_python`: what of the host's Python goes into the guest;
- ``guest/``: the guest's own files (``/init``, inittab, ``/etc/accelmig/…``),
  package data at the paths they take in the guest;
- :mod:`.cpio`: the initramfs writer;
- :mod:`.build`: spec, plan, key, the build, :class:`GuestImage`, the kernel
  command line;
- :mod:`.cache`: where images live, complete or absent, and pruning;
- :mod:`.apt` and :mod:`.errors`: packages downloaded (never installed), and
  how a build fails.
"""

from .build import ExtraFile, GuestImage, ImageSpec, build_image, guest_cmdline
from .cache import DEFAULT_CACHE
from .errors import ImageError

__all__ = ["DEFAULT_CACHE", "ExtraFile", "GuestImage", "ImageError", "ImageSpec", "build_image", "guest_cmdline"]
