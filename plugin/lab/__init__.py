"""The local lab rig: a pool node and two libvirt hypervisor hosts on one
machine, each in its own network namespace (and, for the libvirt daemons,
its own mount and UTS namespace), plus a RAM-only guest image to boot in it.

It is the foundation of ``accelmig lab up|down`` and of the end-to-end test
tier: real libvirt daemons, real QEMU guests (TCG where KVM cannot boot a
stock kernel), real live migrations — only the "hosts" share one kernel.

Modules:

- :mod:`.image` builds and caches the guest image (kernel + initramfs);
- :mod:`.netns` builds the network topology (namespaces, veths, bridges);
- :mod:`.libvirtd` runs one libvirt daemon per host in its own namespaces;
- :mod:`.rig` ties them together behind ``Lab.up()`` / ``Lab.down()`` with a
  crash-safe state file;
- ``python -m accelmig.plugin.lab up|down|env|boot-test`` drives it by hand.
"""
