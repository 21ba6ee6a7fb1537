"""accelmig's wire formats: the one module every side imports.

- ``accelmig.wire.frames``: the frame format shared by every TCP/unix link;
- ``accelmig.wire.dataplane``: driver <-> pool commands, versions, digests;
- ``accelmig.wire.control``: host <-> pool control plane (HMAC-authenticated);
- ``accelmig.wire.devices``: device ids and types, the device selector a
  session opens with (tenant input: parsed strictly, bounded);
- ``accelmig.wire.identity``: what a host tells its guests about itself;
- ``accelmig.wire.channel``: host <-> guest agent messages (virtio-serial)
  and agent <-> driver messages inside the guest;
- ``accelmig.wire.errors``: the error codes and the exception family.

Standard library only: this package ships inside guest images.
"""
