"""Device backends: ``open_backend("auto" | "opencl:N")``, and
``backend_for(config)``: the one a pool configuration asks for (each
tenant in a device process of its own unless ``device_isolation = "none"``)."""

from __future__ import annotations

from accelmig.pool.devices.base import (BufferArg, BuildResult, DeviceBackend, DeviceContext,
                                        LocalArg, ScalarArg)
from accelmig.wire.errors import ConfigInvalid, Unavailable

__all__ = ["BufferArg", "BuildResult", "DeviceBackend", "DeviceContext", "LocalArg",
           "ScalarArg", "backend_for", "open_backend", "list_devices"]


def list_devices() -> list[dict]:
    """Every device the pool could serve, as ``{"spec", "name", ...}``."""
    from accelmig.pool.devices import opencl
    return opencl.list_devices()


def backend_for(config) -> DeviceBackend:
    """The backend of a ``PoolConfig``."""
    if config.device_isolation == "none":
        return open_backend(config.device)
    from accelmig.pool.devices import opencl
    from accelmig.pool.devices.isolated import IsolatedBackend
    index = _device_index(config.device)
    devices = opencl.list_devices()
    if not 0 <= index < len(devices):
        raise Unavailable(what=f"OpenCL device {index}", reason=f"{len(devices)} OpenCL device(s) present"
                          if devices else "no OpenCL device found (is pocl-opencl-icd or a vendor ICD "
                                          "installed under /etc/OpenCL/vendors?)")
    info = {k: v for k, v in devices[index].items() if k != "index"}
    info["backend"] = "opencl"
    return IsolatedBackend(f"opencl:{index}", info, time_limit=config.device_time_limit,
                           max_builds=config.max_concurrent_builds)


def _device_index(spec: str) -> int:
    kind, _, index = spec.partition(":")
    if kind == "auto":
        return 0
    if kind != "opencl":
        raise ConfigInvalid(source="--device", reason=f"unknown device {spec!r} (auto or opencl:N)")
    try:
        return int(index or 0)
    except ValueError:
        raise ConfigInvalid(source="--device", reason=f"{spec!r}: N in opencl:N is a number") from None


def open_backend(spec: str = "auto") -> DeviceBackend:
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
    raise ConfigInvalid(source="--device", reason=f"unknown device {spec!r} (auto or opencl:N)")
