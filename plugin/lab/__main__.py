"""``python -m accelmig.plugin.lab up|down|env|image|boot-test`` — the lab by
hand, until ``accelmig lab`` (click) wraps the same calls.

  up [--pool]     build the topology, start both libvirt daemons (and a pool)
  down            remove everything the lab created (also after a crash)
  env             JSON: libvirt URIs, migration URIs, the pool's endpoints
  image           build (or fetch from the cache) the guest image
  boot-test       up, boot a guest, channel, migrate A->B, channel, down

Common options: --name NAME (default "lab"), --dir BASE (default
/run/accelmig-lab), --virt qemu|kvm|auto.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m accelmig.plugin.lab",
                                     description="The accelmig local lab rig.")
    parser.add_argument("command", choices=["up", "down", "env", "image", "boot-test"])
    parser.add_argument("--name", default="lab")
    parser.add_argument("--dir", default=None, help="base directory (default /run/accelmig-lab)")
    parser.add_argument("--virt", default=None, help="qemu, kvm or auto (default: $ACCELMIG_LAB_VIRT or auto)")
    parser.add_argument("--pool", action="store_true", help="up: also run accelmig-pool in the pool namespace")
    parser.add_argument("--keep", action="store_true", help="boot-test: leave the lab up afterwards")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    if os.geteuid() != 0 and args.command != "env":
        print("the lab needs root (network namespaces, mounts)", file=sys.stderr)
        return 2

    from .image import ImageSpec, build_image
    from .rig import Lab
    kwargs = {"virt_type": args.virt, "pool": args.pool}
    if args.dir:
        kwargs["base_dir"] = args.dir
    lab = Lab(args.name, **kwargs)

    if args.command == "up":
        lab.up()
        print(json.dumps(lab.env(), indent=1))
    elif args.command == "down":
        lab.down()
    elif args.command == "env":
        print(json.dumps(lab.env(), indent=1))
    elif args.command == "image":
        image = build_image(ImageSpec())
        print(json.dumps({"kernel": str(image.kernel), "initrd": str(image.initrd), "key": image.key,
                          "build_seconds": image.build_seconds, "cmdline": image.cmdline()}, indent=1))
    elif args.command == "boot-test":
        from . import boottest
        try:
            lab.up()
            result = boottest.run(lab)
            result["lab_timings"] = lab.timings
            print(json.dumps(result, indent=1, default=str))
        finally:
            if not args.keep:
                lab.down()
        ok = (result.get("pool_saw_from_A") == result.get("guest_address_A")
              and result.get("pool_saw_from_B") == result.get("guest_address_B"))
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
