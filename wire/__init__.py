"""accelmig's wire formats: the one module every side imports.

- ``accelmig.wire.frames``: the frame format shared by every TCP/unix link;
- ``accelmig.wire.dataplane``: driver <-> pool commands, versions, digests;
- ``accelmig.wire.batch``, ``accelmig.wire.opencl``: data-plane protocols 2
  (launch batches) and 3 (what the OpenCL API needs: device listing and
  parameters, fill, rect transfers, sub-buffers, kernel info, profiling);
- ``accelmig.wire.driverconfig``: a guest's ``driver.toml`` (both drivers);
- ``accelmig.wire.control``: host <-> pool control plane (HMAC-authenticated);
- ``accelmig.wire.devices``: device ids and types, the device selector a
  session opens with (tenant input: parsed strictly, bounded);
- ``accelmig.wire.identity``: what a host tells its guests about itself;
- ``accelmig.wire.channel``: host <-> guest agent messages (virtio-serial)
  and agent <-> driver messages inside the guest;
- ``accelmig.wire.values``: what counts as an integer, a number or a field
  of a type in anything a peer sends;
- ``accelmig.wire.errors``: the error codes and the exception family.

Contracts between sides only: what every side's process runs on (command
lines, logs, units, sockets, retries, files, state machines) is
``accelmig.runtime``, which imports this package, never the reverse.
Standard library only: this package ships inside guest images.
"""
