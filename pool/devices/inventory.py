"""The devices one pool node serves, their accounting, and placement.

``PoolDevice`` is one device: its stable id (``wire.devices``), what it is,
its backend (its own contexts, hence its own queues), and what is in use on
it (bytes allocated, live sessions).  ``DeviceSet`` is the node's devices.
``Placer`` answers one question: which device fits this selector, least
loaded.  It reads only ``PoolDevice.view()``-shaped facts, so a node-level
placer (many nodes) can rank the devices of other nodes with the same class.

Accounting is per device, counted in the pool (never in a device process,
which may die): a session adds itself at open and removes itself at
release; its bytes come and go with its allocations.
"""

from __future__ import annotations

import logging
import threading

from accelmig.pool.devices.base import DeviceBackend
from accelmig.wire.devices import DEVICE_TYPES, DeviceSelector, assign_ids
from accelmig.wire.errors import ConfigInvalid, NoSuchDevice, Unavailable

LOG = logging.getLogger("accelmig.pool.devices")

#: Most devices one node serves (a bound on what ``list_devices`` answers).
MAX_DEVICES = 64


class PoolDevice:
    """One device of the node and what is in use on it."""

    def __init__(self, info: dict, backend: DeviceBackend):
        self.id: str = info["id"]
        self.type: str = info["type"]
        self.info = dict(info)
        self.backend = backend
        self.bytes_in_use = 0
        self.sessions = 0
        self._lock = threading.Lock()     # bytes move on session worker threads
        # every CL_DEVICE_* value (wire.opencl), read at the first list_devices (pool.clcommands)
        self.cl_params: dict | None = None

    def session_opened(self) -> None:
        with self._lock:
            self.sessions += 1

    def session_released(self) -> None:
        with self._lock:
            self.sessions = max(0, self.sessions - 1)

    def charge(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_in_use += nbytes

    def refund(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_in_use = max(0, self.bytes_in_use - nbytes)

    def view(self) -> dict:
        """What the placer ranks and ``accelmig-pool devices`` shows."""
        info = self.info
        return {"id": self.id, "type": self.type, "name": info.get("name", ""),
                "vendor": info.get("vendor", ""), "platform": info.get("platform", ""),
                "spec": info.get("spec", ""), "global_mem_size": int(info.get("global_mem_size", 0)),
                "max_mem_alloc_size": int(info.get("max_mem_alloc_size", 0)),
                "bytes_in_use": self.bytes_in_use, "sessions": self.sessions}


class Placer:
    """Which device fits a selector, least loaded first.

    Load is, in order: fewer live sessions, then a smaller share of the
    device's memory in use, then the id (so a tie always goes the same way).
    ``min_memory`` asks for a device that large, not for free bytes: the
    tenant's quota decides what it may allocate."""

    @staticmethod
    def load(view: dict) -> tuple:
        size = max(1, int(view.get("global_mem_size") or 0))
        return (int(view.get("sessions", 0)), int(view.get("bytes_in_use", 0)) / size, str(view["id"]))

    def choose(self, views: list, selector: DeviceSelector | None) -> dict:
        """The view of the device to place on; ``NoSuchDevice`` naming what
        exists when none fits."""
        fitting = [v for v in views if selector is None or selector.matches(v)]
        if not fitting:
            raise NoSuchDevice(selector=str(selector) if selector is not None else "any device",
                               available=describe_briefly(views))
        return min(fitting, key=self.load)


def describe_briefly(views: list) -> str:
    """``"cpu-1a2b3c4d-0 (cpu, pthread-..., 5 GiB); ..."``: what an error names."""
    if not views:
        return "no device"
    # (.get: the views of other nodes come from etcd, each field checked but optional)
    return "; ".join(f"{v.get('id', '?')} ({v.get('type', '?')}, {v.get('name', '?')}, vendor "
                     f"{v.get('vendor', '?')}, {int(v.get('global_mem_size', 0)) >> 20} MiB)" for v in views)


class DeviceSet:
    """The devices this node serves, in the runtime's order."""

    def __init__(self, devices: list[PoolDevice]):
        ids = [d.id for d in devices]
        if len(set(ids)) != len(ids):
            raise ConfigInvalid(source="devices", reason=f"a device is named twice: {ids}")
        self.devices = list(devices)
        self._by_id = {d.id: d for d in self.devices}
        self.placer = Placer()

    @classmethod
    def of_backend(cls, backend: DeviceBackend) -> "DeviceSet":
        """One backend made elsewhere (a test's model, a bench's): one device,
        described by what its ``info()`` says, if anything."""
        info = dict(backend.info()) if hasattr(backend, "info") else {}
        if "id" not in info:
            described = {"type": info.get("type") if info.get("type") in DEVICE_TYPES else "custom",
                         "platform": str(info.get("platform", "")), "vendor": str(info.get("vendor", "")),
                         "name": str(info.get("name") or getattr(backend, "spec", "device"))}
            info.update(described, id=assign_ids([described])[0])
        return cls([PoolDevice(info, backend)])

    def __iter__(self):
        return iter(self.devices)

    def __len__(self) -> int:
        return len(self.devices)

    def get(self, device_id: str) -> PoolDevice | None:
        return self._by_id.get(device_id)

    def describe(self) -> list[dict]:
        return [d.view() for d in self.devices]

    def place(self, selector: DeviceSelector | None) -> PoolDevice:
        return self._by_id[self.placer.choose(self.describe(), selector)["id"]]

    def close(self) -> None:
        for device in self.devices:
            device.backend.close()


def select(found: list[dict], config) -> list[dict]:
    """The devices a configuration serves, from every device found (each
    with ``id`` and ``spec``): its ``devices``, ``all`` or a comma-separated
    list of ids or ``opencl:N``."""
    if not found:
        raise Unavailable(what="an accelerator", reason="no OpenCL device found (is pocl-opencl-icd "
                                                        "or a vendor ICD installed under /etc/OpenCL/vendors?)")
    if config.devices.strip() == "all":
        return found[:MAX_DEVICES]
    wanted = [w.strip() for w in config.devices.split(",") if w.strip()]
    source = "--devices"
    by_name = {}
    for dev in found:
        by_name[dev["id"]] = dev
        by_name[dev["spec"]] = dev
    chosen: list[dict] = []
    for name in wanted:
        dev = by_name.get(name)
        if dev is None:
            raise Unavailable(what=f"device {name!r} ({source})",
                              reason="this node has " + "; ".join(f"{d['spec']} = {d['id']} ({d['name']})"
                                                                  for d in found))
        if dev not in chosen:
            chosen.append(dev)
    if len(chosen) > MAX_DEVICES:
        raise ConfigInvalid(source=source, reason=f"at most {MAX_DEVICES} devices per node")
    return chosen
