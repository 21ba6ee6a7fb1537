"""Device backends: ``open_backend("auto" | "opencl:N" | ID)`` (one device,
what a tenant's device process opens), and ``devices_for(config)``: every
device a pool configuration serves, each with its own backend (each tenant
in a device process of its own per device unless ``device_isolation =
"none"``)."""

from __future__ import annotations

import logging

from accelmig.pool.devices.base import (BufferArg, BuildResult, DeviceBackend, DeviceContext,
                                        LocalArg, ScalarArg)
from accelmig.wire.errors import ConfigInvalid, Unavailable

LOG = logging.getLogger("accelmig.pool.devices")

__all__ = ["BufferArg", "BuildResult", "DeviceBackend", "DeviceContext", "LocalArg",
           "ScalarArg", "devices_for", "open_backend", "list_devices"]


def list_devices() -> list[dict]:
    """Every device the pool could serve, as ``{"spec", "name", ...}``."""
    from accelmig.pool.devices import opencl
    return opencl.list_devices()


def devices_for(config):
    """The ``DeviceSet`` a ``PoolConfig`` serves (``inventory.select``)."""
    from accelmig.pool.devices import opencl
    from accelmig.pool.devices.inventory import DeviceSet, PoolDevice, select
    chosen = select(opencl.list_devices(), config)
    made: list = []
    refused = None
    if config.device_isolation == "none":
        # Builds in the pool's own process: nothing confines what they read.
        if config.allow_unconfined_builds:
            LOG.warning("device_isolation = none with allow_unconfined_builds: builds run in the pool's "
                        "process and can read every file it can (one trusted tenant only)")
        else:
            refused = ("device_isolation = none runs them in the pool's own process, where nothing keeps "
                       "a build from reading the node's files (allow_unconfined_builds: one trusted tenant)")
            LOG.error("device_isolation = none: program builds are REFUSED (they would run unconfined in "
                      "the pool's process); set allow_unconfined_builds = true for one trusted tenant, or "
                      "use device_isolation = process")
    try:
        for dev in chosen:
            info = {k: v for k, v in dev.items() if k != "index"}
            info["backend"] = "opencl"
            if config.device_isolation == "none":
                backend = opencl.OpenCLBackend(dev["index"], builds_refused=refused)
            else:
                from accelmig.pool.devices.isolated import IsolatedBackend
                # The device process finds its device by the stable id, not
                # by an index that another process's runtime might order otherwise.
                backend = IsolatedBackend(dev["id"], info, time_limit=config.device_time_limit,
                                          max_builds=config.max_concurrent_builds,
                                          allow_unconfined_builds=config.allow_unconfined_builds)
            made.append(PoolDevice(info, backend))
    except BaseException:
        for device in made:
            device.backend.close()
        raise
    return DeviceSet(made)


def open_backend(spec: str = "auto") -> DeviceBackend:
    from accelmig.wire.devices import ID_PATTERN
    if ID_PATTERN.match(spec):
        from accelmig.pool.devices import opencl
        return opencl.OpenCLBackend(opencl.index_of(spec))
    kind, _, index = spec.partition(":")
    if kind == "auto":
        from accelmig.pool.devices import opencl
        devices = opencl.list_devices()
        if not devices:
            raise Unavailable(what="an accelerator",
                              reason="no OpenCL device found (is pocl-opencl-icd or a vendor ICD "
                                     "installed under /etc/OpenCL/vendors?)")
        return opencl.OpenCLBackend(devices[0]["index"])
    if kind == "opencl":
        from accelmig.pool.devices import opencl
        try:
            number = int(index or 0)
        except ValueError:
            raise ConfigInvalid(source="--device", reason=f"{spec!r}: N in opencl:N is a number") from None
        return opencl.OpenCLBackend(number)
    raise ConfigInvalid(source="--device", reason=f"unknown device {spec!r} (auto, opencl:N or a device id)")
