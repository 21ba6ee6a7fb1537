"""A guest built, started and live-migrated by OpenStack Nova's own libvirt
driver code, in the lab: the domain XML comes from Nova's config classes
(``nova.virt.libvirt.config``) filled in the way ``LibvirtDriver`` fills
them, the migration flags are the ones Nova's driver computes from its
default ``nova.conf``, and the migration is Nova's own
``nova.virt.libvirt.guest.Guest.migrate()`` call.

Such a domain has nothing of accelmig in it: no accelmig metadata, no
``org.accelmig.agent.0`` channel — only qemu-guest-agent's channel (the
image property ``hw_qemu_guest_agent=yes``), Nova's metadata, its SMBIOS
system UUID (= the instance UUID) and one NIC on the lab's tenant network
(``ten0``: one subnet on both hosts, as a Neutron tenant network; see
:mod:`accelmig.lab.topology`).  The guest image runs qemu-ga and the
accelmig agent with ``--port none`` (:func:`nova_image_spec`,
:func:`nova_guest_cmdline`).

Nova is needed only here (``pip install nova``, or the ``nova-test`` extra
of accelmig, which ``./dev.sh setup`` installs); it is imported lazily, so
the rest of the lab works without it.  What we take from Nova and what we
skip is said at each step; the reference is Nova 34's
``nova/virt/libvirt/driver.py`` (``LibvirtDriver._get_guest_config``).

    xml = nova_domain_xml("instance-0000000a", instance_uuid, image, lab, tenant_index=10)
    dom = nova_define_and_start(lab, "hostA", xml)
    nova_migrate(lab, "instance-0000000a", "hostA", "hostB")
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import threading
import time
import types
import uuid as uuidlib

from .image import GuestImage, ImageSpec
from .topology import TENANT_BRIDGE, TENANT_GATEWAY, TENANT_SUBNET, tenant_address as _tenant_address

#: What to install when Nova is missing.
NOVA_HINT = "pip install nova (or accelmig's extra: pip install -e '.[nova-test]', which ./dev.sh setup does)"

#: qemu-guest-agent's channel name, as Nova's ``_add_qga_device`` sets it.
QGA_CHANNEL = "org.qemu.guest_agent.0"

#: Nova's default live-migration flags (``_prepare_migration_flags`` with
#: every ``[libvirt] live_migration_*`` option at its default): LIVE |
#: PEER2PEER | UNDEFINE_SOURCE | PERSIST_DEST (1 | 2 | 16 | 8), and POSTCOPY
#: (0x8000) added by ``live_migration_permit_post_copy = True``.  Written out
#: so that a test can check :func:`nova_live_migration_flags` against them.
NOVA_DEFAULT_LIVE_MIGRATION_FLAGS = 1 | 2 | 8 | 16
VIR_MIGRATE_POSTCOPY = 1 << 15

_LOCK = threading.Lock()


class NovaMissing(RuntimeError):
    """Nova's code is not importable here."""


def _nova():
    """Nova's modules, imported on first use (2 s); a clear error without them."""
    try:
        import nova.conf
        from nova import objects
        from nova.network import model as netmodel
        from nova.virt import driver as virt_driver
        from nova.virt.libvirt import config as vconfig
        from nova.virt.libvirt import driver as libvirt_driver
        from nova.virt.libvirt import guest as libvirt_guest
        from nova.virt.libvirt import migration as libvirt_migration
        from nova.virt.libvirt import vif as libvirt_vif
    except ImportError as exc:
        raise NovaMissing(f"OpenStack Nova's libvirt driver is not importable ({exc}): {NOVA_HINT}") from exc
    with _LOCK:
        objects.register_all()              # what nova-compute does at start (idempotent: imports)
        if getattr(nova.conf.CONF, "_args", None) is None:
            # nova-compute parses its command line and nova.conf first
            # (nova.config.parse_args); here: no arguments, no file, every
            # option at its default.  Nova reads its version strings (for
            # the metadata and the SMBIOS sysinfo) only from a parsed CONF.
            nova.conf.CONF(args=[], project="nova", default_config_files=[], default_config_dirs=[])
    return types.SimpleNamespace(conf=nova.conf.CONF, objects=objects, netmodel=netmodel, virt_driver=virt_driver,
                                 vconfig=vconfig, driver=libvirt_driver, guest=libvirt_guest,
                                 migration=libvirt_migration, vif=libvirt_vif)


def _bare_driver(n):
    """A ``LibvirtDriver`` without its ``__init__`` (no connection, no host):
    enough to call the methods that read only ``CONF`` and their arguments
    (``_get_guest_config_meta``, ``_get_guest_config_sysinfo``,
    ``_add_qga_device``, ``_create_pty_device``, ``_parse_migration_flags``).
    A method that needs more fails loudly with an AttributeError."""
    if n.driver.libvirt is None:                      # what LibvirtDriver.__init__ does
        import libvirt
        n.driver.libvirt = libvirt
    return object.__new__(n.driver.LibvirtDriver)


# ---------------------------------------------------------------- the guest image

def nova_image_spec(*, extra_files=(), **spec) -> ImageSpec:
    """The :class:`ImageSpec` of a guest for a Nova-built domain: the lab
    image with qemu-guest-agent (started on ``org.qemu.guest_agent.0``);
    ``extra_files`` and other ``ImageSpec`` fields as given.  Build it with
    ``accelmig.lab.image.build_image(nova_image_spec(...), cache=lab.cache)``."""
    return ImageSpec(with_qemu_ga=True, extra_files=tuple(extra_files), **spec)


def nova_guest_cmdline(lab, image: GuestImage, tenant_address: str, **options) -> str:
    """The guest kernel's command line (Nova: the image property
    ``os_command_line``): the tenant address and gateway
    (``accelmig.net=10.90.0.N/24,10.90.0.1``), the accelmig agent without a
    host channel (``accelmig.agent_port=none``: only qemu-ga's channel
    exists), and how the guest reaches the lab's pool
    (:meth:`Lab.guest_tls_word`).  ``options`` go to
    :meth:`GuestImage.cmdline` (``extra=``, ``agent=``, ``app=``, ...)."""
    iface = ipaddress.ip_interface(tenant_address)
    if iface.network != ipaddress.ip_network(TENANT_SUBNET):
        raise ValueError(f"tenant address {tenant_address} is not in the tenant subnet {TENANT_SUBNET}")
    options.setdefault("agent_port", "none")
    cmdline = image.cmdline(net=f"{iface.with_prefixlen},{TENANT_GATEWAY}", **options)
    word = lab.guest_tls_word()
    if word and word.split("=")[0] + "=" not in cmdline:
        cmdline = f"{cmdline} {word}"
    return cmdline


# ---------------------------------------------------------------- the domain XML

def neutron_mac(seed: str) -> str:
    """A stable MAC under Neutron's default ``base_mac`` (fa:16:3e)."""
    digest = hashlib.sha256(seed.encode()).digest()
    return "fa:16:3e:%02x:%02x:%02x" % (digest[0], digest[1], digest[2])


def nova_domain_xml(name: str, instance_uuid: str, image: GuestImage, lab, *, memory_mib: int = 256,
                    vcpus: int = 1, mac: str | None = None, tenant_address: str | None = None,
                    tenant_index: int = 10, console_log: str | None = None, cmdline: str | None = None,
                    cmdline_options: dict | None = None, port_id: str | None = None, mtu: int | None = None,
                    flavor_name: str = "m1.accel", flavor_id: str = "accel-1", extra_specs: dict | None = None,
                    image_id: str | None = None, display_name: str | None = None,
                    project: tuple[str, str] = ("6f70656e737461636b2d6c6162000001", "accel-lab"),
                    user: tuple[str, str] = ("75736572000000000000000000000001", "alice")) -> str:
    """The domain XML Nova's libvirt driver writes for an instance booted
    from an AKI/ARI-style image (kernel + ramdisk, ``os_command_line``,
    ``hw_qemu_guest_agent=yes``) on a flavor of ``memory_mib``/``vcpus``,
    with one port on the tenant network — built with Nova's own classes.

    - ``name``: the libvirt domain name (Nova's ``instance.name``,
      ``instance-%08x``); ``instance_uuid``: the domain's ``<uuid>`` and the
      guest's SMBIOS system UUID (``/sys/class/dmi/id/product_uuid``).
    - ``tenant_address``: the port's fixed IP, CIDR (default:
      ``tenant_address(tenant_index)``, e.g. 10.90.0.10/24); ``mac``: the
      port's MAC (default: stable, Neutron's fa:16:3e prefix).
    - ``console_log``: the serial console's log (default: the lab's
      ``/var/log/libvirt/qemu/<name>-console.log``, read by
      ``Lab.console_log(host, name)``).
    - ``cmdline``: the guest kernel's command line (default:
      :func:`nova_guest_cmdline` with ``cmdline_options``).
    """
    n = _nova()
    vconfig = n.vconfig
    drv = _bare_driver(n)
    virt_type = lab.virt_type                       # [libvirt] virt_type: "qemu" (TCG) here, or "kvm"
    instance_uuid = str(uuidlib.UUID(instance_uuid))
    address = ipaddress.ip_interface(tenant_address or _tenant_address(tenant_index))
    port_id = port_id or str(uuidlib.uuid5(uuidlib.UUID(instance_uuid), "port-0"))
    mac = mac or neutron_mac(f"{instance_uuid}/{port_id}")
    console_log = console_log or f"/var/log/libvirt/qemu/{name}-console.log"
    if cmdline is None:
        cmdline = nova_guest_cmdline(lab, image, address.with_prefixlen, **(cmdline_options or {}))
    image_id = image_id or str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"accelmig-lab-image:{image.key}"))
    extra_specs = dict(extra_specs or {})

    # What the driver reads of the instance, its image and its flavor.
    image_meta = n.objects.ImageMeta.from_dict({
        "id": image_id, "name": f"accelmig-lab-{image.key}", "container_format": "aki", "disk_format": "aki",
        "min_disk": 0, "min_ram": 0,
        "properties": {"hw_qemu_guest_agent": "yes", "os_command_line": cmdline}})
    flavor = n.objects.Flavor(name=flavor_name, flavorid=flavor_id, memory_mb=memory_mib, vcpus=vcpus, root_gb=0,
                              ephemeral_gb=0, swap=0, extra_specs=extra_specs)
    instance = types.SimpleNamespace(uuid=instance_uuid, name=name, flavor=flavor)
    subnet = n.netmodel.Subnet(cidr=TENANT_SUBNET, gateway=n.netmodel.IP(address=TENANT_GATEWAY, type="gateway"),
                               ips=[n.netmodel.FixedIP(address=str(address.ip))])
    network = n.netmodel.Network(id=str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, "accelmig-lab-tenant-net")),
                                 bridge=TENANT_BRIDGE, label="tenant", subnets=[subnet],
                                 **({"meta": {"mtu": mtu}} if mtu else {}))
    vif = n.netmodel.VIF(id=port_id, address=mac, network=network, type=n.netmodel.VIF_TYPE_BRIDGE,
                         vnic_type=n.netmodel.VNIC_TYPE_NORMAL, devname=("tap" + port_id)[:n.netmodel.NIC_NAME_LEN])
    network_info = n.netmodel.NetworkInfo([vif])

    # _get_guest_config: the basics
    guest = vconfig.LibvirtConfigGuest()
    guest.virt_type = virt_type
    guest.name = name
    guest.uuid = instance_uuid
    guest.memory = memory_mib * 1024                # KiB, as Nova writes it
    guest.vcpus = vcpus

    # _get_guest_config_meta(get_instance_driver_metadata(instance, network_info)):
    # Nova's own method, on Nova's own metadata dataclasses.
    dmeta = n.virt_driver.InstanceDriverMetadata(
        root_type="image", root_id=image_id,
        instance_meta=n.virt_driver.NovaInstanceMeta(display_name or name, instance_uuid),
        owner=n.virt_driver.OwnerMeta(userid=user[0], username=user[1], projectid=project[0],
                                      projectname=project[1]),
        image=n.virt_driver.ImageMeta(id=image_id, name=image_meta.name, container_format="aki",
                                      disk_format="aki", min_disk=0, min_ram=0,
                                      properties={"hw_qemu_guest_agent": "yes", "os_command_line": cmdline}),
        flavor=n.virt_driver.FlavorMeta(name=flavor_name, flavorid=flavor_id, memory_mb=memory_mib,
                                        vcpus=vcpus, root_gb=0, ephemeral_gb=0, extra_specs=extra_specs,
                                        swap=0),
        network_info=network_info)
    guest.metadata.append(drv._get_guest_config_meta(dmeta))

    # _get_guest_cpu_config: nothing for virt_type qemu with [libvirt]
    # cpu_mode unset (no <cpu>; -cpu host/max would not run here anyway).
    # Skipped: NUMA, cputune, memory backing, perf events, idmaps (all
    # empty for a plain flavor).

    # _configure_guest_by_virt_type (x86, qemu/kvm): the SMBIOS sysinfo
    # (Nova's own _get_guest_config_sysinfo: system uuid = serial = the
    # instance uuid) in <os><smbios mode='sysinfo'/>, arch, machine 'pc'
    # (libvirt_utils.get_default_machine_type for x86_64).
    guest.os_type = "hvm"
    guest.os_arch = "x86_64"
    guest.os_mach_type = "pc"
    guest.sysinfo = drv._get_guest_config_sysinfo(instance)
    guest.os_smbios = vconfig.LibvirtConfigGuestSMBIOS()

    # _conf_non_lxc -> _set_guest_for_inst_kernel: direct kernel boot; the
    # image's os_command_line replaces Nova's "root=... console=..." words.
    # Skipped: Nova copies kernel and ramdisk into the instance directory
    # (<instances_path>/<uuid>/kernel, /ramdisk); the lab boots the cached
    # image's files in place (both hosts see the same paths, which is what
    # Nova's shared or copied instance directory gives a live migration).
    guest.os_kernel = str(image.kernel)
    guest.os_initrd = str(image.initrd)
    guest.os_cmdline = image_meta.properties.os_command_line

    # _set_features / _set_clock: ACPI and APIC (qemu/kvm); UTC (kvm alone adds timers).
    guest.add_feature(vconfig.LibvirtConfigGuestFeatureACPI())
    guest.add_feature(vconfig.LibvirtConfigGuestFeatureAPIC())
    clock = vconfig.LibvirtConfigGuestClock()
    clock.offset = "utc"
    if virt_type == "kvm":
        for timer_name, policy in (("pit", "delay"), ("rtc", "catchup")):
            timer = vconfig.LibvirtConfigGuestTimer()
            timer.name, timer.tickpolicy = timer_name, policy
            clock.add_timer(timer)
        hpet = vconfig.LibvirtConfigGuestTimer()
        hpet.name, hpet.present = "hpet", False
        clock.add_timer(hpet)
    guest.set_clock(clock)

    # No disks (a RAM-only guest: the image is the kernel + initramfs).

    # The port: LibvirtGenericVIFDriver.get_base_config (Nova's own: MAC,
    # model virtio, driver 'qemu' under TCG), then what _set_config_VIFBridge
    # sets (type bridge, source = the network's bridge, target = the tap).
    # Nova 34 no longer converts a 'bridge' VIF (Linux bridge support is gone
    # from os_vif_util: real deployments plug into OVS), so the last step
    # is written out here; the lab's tenant network is a Linux bridge.
    nic = n.vif.LibvirtGenericVIFDriver().get_base_config(instance, mac, image_meta, flavor, virt_type,
                                                          n.netmodel.VNIC_TYPE_NORMAL)
    n.vif.LibvirtGenericVIFDriver._set_config_VIFBridge(
        None, instance, types.SimpleNamespace(bridge_name=TENANT_BRIDGE, vif_name=vif["devname"]), nic)
    if mtu:
        nic.mtu = mtu                               # designer.set_vif_mtu_config
    guest.add_device(nic)

    # _create_consoles -> _create_consoles_qemu_kvm with [serial_console]
    # enabled = false (the default): a pty serial port whose output QEMU
    # also writes to a log file (Nova: <instance dir>/console.log).
    drv._create_pty_device(guest, vconfig.LibvirtConfigGuestSerial, log_path=console_log)

    # Skipped: graphics (VNC), video and input devices ([vnc] enabled =
    # false), sound, vTPM, PCI devices, watchdog.
    # _set_qemu_guest_agent with hw_qemu_guest_agent=yes: Nova's own
    # _add_qga_device (a unix channel, named org.qemu.guest_agent.0, with
    # Nova's fixed path /var/lib/libvirt/qemu/org.qemu.guest_agent.0.<name>.sock:
    # each lab host has its own /var/lib/libvirt).
    if image_meta.properties.get("hw_qemu_guest_agent", False):
        drv._add_qga_device(guest, instance)
    # _add_rng_device: virtio-rng from /dev/urandom ([libvirt] rng_dev_path).
    rng = vconfig.LibvirtConfigGuestRng()
    rng.backend = n.conf.libvirt.rng_dev_path
    guest.add_device(rng)
    # _guest_add_usb_root_controller: model 'none' (no USB device needed).
    usb = vconfig.LibvirtConfigGuestUSBHostController()
    usb.index, usb.model = 0, "none"
    guest.add_device(usb)
    # _guest_add_memory_balloon: virtio, stats every
    # [libvirt] mem_stats_period_seconds (10).
    balloon = vconfig.LibvirtConfigMemoryBalloon()
    balloon.model = "virtio"
    balloon.period = n.conf.libvirt.mem_stats_period_seconds
    guest.add_device(balloon)
    return guest.to_xml()


# ---------------------------------------------------------------- define, start, migrate

def nova_define_and_start(lab, host: str, xml: str):
    """What Nova's spawn does with the XML: define the domain persistently
    (``Host.write_instance_config``: ``defineXML``), then start it
    (``Guest.launch``: ``createWithFlags``).  Returns the ``virDomain``."""
    n = _nova()
    dom = lab.connect(host).defineXML(xml)
    n.guest.Guest(dom).launch()
    return dom


def nova_live_migration_flags(postcopy: bool = False) -> int:
    """The flags Nova's driver migrates with by default: computed by Nova's
    own ``LibvirtDriver._parse_migration_flags`` (``_prepare_migration_flags``,
    then ``_handle_live_migration_tunnelled``/``_native_tls``/``_post_copy``/
    ``_auto_converge``/``_parallel``) from nova.conf's defaults — LIVE |
    PEER2PEER | UNDEFINE_SOURCE | PERSIST_DEST — with
    ``[libvirt] live_migration_permit_post_copy = postcopy`` (adds
    VIR_MIGRATE_POSTCOPY).  Nova's monitor switching a running migration to
    post-copy is not part of this (see :func:`nova_migrate`)."""
    n = _nova()
    drv = _bare_driver(n)
    with _LOCK:
        n.conf.set_override("live_migration_permit_post_copy", bool(postcopy), group="libvirt")
        try:
            drv._parse_migration_flags()
        finally:
            n.conf.clear_override("live_migration_permit_post_copy", group="libvirt")
    return drv._live_migration_flags


def nova_destination_xml(dom) -> str:
    """The destination XML Nova passes to ``Guest.migrate``: Nova's own
    ``migration.get_updated_guest_xml`` on the domain's migratable XML
    (``XMLDesc(VIR_DOMAIN_XML_MIGRATABLE)``; Nova does not ask for
    ``VIR_DOMAIN_XML_SECURE``: the lab's domains hold no secrets either way),
    with migrate data saying what the lab's destination is like: no serial
    TCP ports, no graphics, no volumes, no perf events, no file-backed
    memory.  Skipped (nothing to update for a lab guest): the VIF update
    (``get_vif_config``: Nova passes it when Neutron gives the port a new
    binding on the destination; here ``ten0`` is the same on both hosts),
    NUMA/cpuset, mdev, PCI and vTPM updates."""
    n = _nova()
    migrate_data = n.objects.LibvirtLiveMigrateData(
        serial_listen_addr=None, serial_listen_ports=[], bdms=[], supported_perf_events=[],
        dst_wants_file_backed_memory=False, block_migration=False, is_shared_instance_path=True,
        is_shared_block_storage=True)
    flavor = n.objects.Flavor(extra_specs={})
    instance = types.SimpleNamespace(flavor=flavor, uuid=dom.UUIDString(), name=dom.name())

    def no_volumes(*_args, **_kwargs):              # only called for a disk with a serial (a volume)
        raise AssertionError("a lab guest has no volumes")

    return n.migration.get_updated_guest_xml(instance, n.guest.Guest(dom), migrate_data, no_volumes)


def nova_migrate(lab, name: str, src: str, dst: str, *, flags: int | None = None, postcopy: bool = False,
                 destination_xml: str | None = None) -> dict:
    """Live-migrate domain ``name`` from ``src`` to ``dst`` with Nova's own
    call (``LibvirtDriver._live_migration_operation``)::

        guest.migrate(self._live_migration_uri(dest), migrate_uri=migrate_uri,
                      flags=migration_flags, migrate_disks=device_names,
                      destination_xml=new_xml_str,
                      bandwidth=CONF.libvirt.live_migration_bandwidth,
                      parallel=CONF.libvirt.live_migration_parallel_connections)

    with the lab's URIs (``Lab.migration_uris``: ``qemu+tcp://<dst's host
    link address>:<port>/system``, what ``_live_migration_uri`` builds, and
    ``tcp://<that address>``, what ``_migrate_uri`` builds when
    ``live_migration_inbound_addr`` is set), ``flags`` (default:
    :func:`nova_live_migration_flags`), :func:`nova_destination_xml` and no
    disks.  Skipped: Nova runs this in a thread next to its monitor
    (``_live_migration_monitor``: the max-downtime steps, the completion
    timeout, the switch to post-copy) and its pre/post steps (port
    bindings, ``post_live_migration_at_destination``); a lab guest's
    migration takes ~1 s, within the monitor's first step.

    Returns ``{"wall", "downtime_ms", "stats", "flags"}`` (the destination's
    completed-job stats)."""
    n = _nova()
    import libvirt
    dest_uri, migrate_uri = lab.migration_uris(dst)
    dom = lab.connect(src).lookupByName(name)
    if flags is None:
        flags = nova_live_migration_flags(postcopy)
    if destination_xml is None:
        destination_xml = nova_destination_xml(dom)
    guest = n.guest.Guest(dom)
    t0 = time.monotonic()
    guest.migrate(dest_uri, migrate_uri=migrate_uri, flags=flags, migrate_disks=[],
                  destination_xml=destination_xml, bandwidth=n.conf.libvirt.live_migration_bandwidth,
                  parallel=n.conf.libvirt.live_migration_parallel_connections)
    wall = time.monotonic() - t0
    stats = {}
    with contextlib.suppress(libvirt.libvirtError):
        stats = lab.connect(dst).lookupByName(name).jobStats(libvirt.VIR_DOMAIN_JOB_STATS_COMPLETED)
    return {"wall": wall, "downtime_ms": stats.get("downtime"), "stats": stats, "flags": flags}


__all__ = ["NOVA_DEFAULT_LIVE_MIGRATION_FLAGS", "NOVA_HINT", "NovaMissing", "QGA_CHANNEL", "VIR_MIGRATE_POSTCOPY",
           "neutron_mac", "nova_define_and_start", "nova_destination_xml", "nova_domain_xml",
           "nova_guest_cmdline", "nova_image_spec", "nova_live_migration_flags", "nova_migrate"]
