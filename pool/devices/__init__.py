"""Device backends: ``open_backend("auto" | "opencl:N")``."""

from __future__ import annotations

from accelmig.pool.devices.base import (BufferArg, BuildResult, DeviceBackend, DeviceContext,
                                        LocalArg, ScalarArg)
from accelmig.wire.errors import ConfigInvalid, Unavailable

__all__ = ["BufferArg", "BuildResult", "DeviceBackend", "DeviceContext", "LocalArg",
           "ScalarArg", "open_backend", "list_devices"]


def list_devices() -> list[dict]:
    """Every device the pool could serve, as ``{"spec", "name", ...}``."""
    from accelmig.pool.devices import opencl
    return opencl.list_devices()


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
