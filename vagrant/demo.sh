#!/usr/bin/env bash
# On hostA: boot the demo guest (the lab's image) on fab0 and move it to hostB
# and back with plain virsh, as an operator would.
set -euo pipefail
PY=/opt/accelmig/venv/bin/python
IMAGE=$($PY - <<PYCODE
from accelmig.lab.image import ImageSpec, build_image
cmd = ("python3 -m accelmig.agent.demoapp --token vagrant-demo-token --steps 2000 --size 128 "
       "--report 20 --pause 0.3 --wait-endpoint 120 --timeout 120 --prefix 'DEMO '")
img = build_image(ImageSpec(app_command=cmd))
print(img.kernel, img.initrd)
PYCODE
)
set -- $IMAGE
/opt/accelmig/venv/bin/accelmig domain render accelerator-domain --set name=demo-vm --set kernel="$1" \
    --set initrd="$2" --set fabric_type=bridge --set fabric_source=fab0 --set virt_type=kvm \
    --set console_log=/var/log/libvirt/qemu/demo-vm-console.log -o /tmp/demo-vm.xml
virsh create /tmp/demo-vm.xml
sleep 20
virsh migrate --live --p2p demo-vm qemu+ssh://10.88.0.12/system --migrateuri tcp://10.88.0.12
echo "demo-vm now on hostB: watch its console there (/var/log/libvirt/qemu/demo-vm-console.log)"
