"""The hypervisor-host side: the libvirt hook, ``accelmig hostd`` and the operator CLI."""
