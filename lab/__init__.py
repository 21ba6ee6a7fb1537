"""accelmig's local lab (the ``accelmig-lab`` distribution): a test rig, not
part of the host plugin.  A pool node and two libvirt hypervisor hosts on one
machine, each in its own network namespace (and, for the libvirt daemons,
its own mount and UTS namespace), plus a RAM-only guest image to boot in it.

It is the foundation of ``accelmig lab …`` (also ``accelmig-lab …``) and of
the end-to-end test tier: real libvirt daemons, real QEMU guests (TCG where
KVM cannot boot a stock kernel), real live migrations — only the "hosts"
share one kernel.

Modules:

- :mod:`.image` builds and caches the guest image (kernel + initramfs);
- :mod:`.netns` is the network-namespace toolkit (the tests use it too);
- :mod:`.topology` builds the lab's network on it (namespaces, veths, bridges);
- :mod:`.libvirtd` runs one libvirt daemon per host in its own namespaces;
- :mod:`.rig` ties them together behind ``Lab.up()`` / ``Lab.down()`` with a
  crash-safe state file;
- :mod:`.accel` adds accelmig itself: a pool, hostd and the hook per host, a
  demo guest;
- :mod:`.cli` is ``accelmig lab up|down|env|boot|migrate|demo|image|boot-test``.
"""
