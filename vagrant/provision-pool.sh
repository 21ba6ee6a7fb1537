#!/usr/bin/env bash
# The pool node: its OpenCL device (PoCL on the VM's CPUs; pyopencl's wheel
# brings its own ICD loader, which reads /etc/OpenCL/vendors/).  Its routes
# to the guest subnets come from provision-common.sh; accelmig-pool, its
# configuration, the tenants' tokens and the hosts' secrets from
# provision-deploy.sh (accelmig fleet).
set -euo pipefail
. /vagrant/vagrant/lib.sh

apt_install pocl-opencl-icd

# For provision-deploy.sh (on the last node): this node is ready for accelmig.
[ -e "$STATE/ready" ] || touch "$STATE/ready"
