#!/usr/bin/env bash
# The pool node: accelmig-pool on its OpenCL device (PoCL in the VM), as a service.
set -euo pipefail
cat > /etc/accelmig/tokens.toml <<TOML
[tenants.demo]
token = "vagrant-demo-token"
quota = "1GiB"
TOML
cat > /etc/accelmig/hosts.toml <<TOML
[hosts.hostA]
secret = "$(cat /etc/accelmig/hostA.secret)"
addresses = ["10.89.1.0/24"]
[hosts.hostB]
secret = "$(cat /etc/accelmig/hostB.secret)"
addresses = ["10.89.2.0/24"]
TOML
cat > /etc/systemd/system/accelmig-pool.service <<UNIT
[Unit]
Description=accelmig accelerator pool
After=network-online.target
[Service]
ExecStart=/opt/accelmig/venv/bin/accelmig-pool serve --listen ${POOL_IP}:7070 --control-listen ${POOL_IP}:7071 --tokens /etc/accelmig/tokens.toml --hosts /etc/accelmig/hosts.toml --log-format json
Restart=on-failure
[Install]
WantedBy=multi-user.target
UNIT
# The guests' subnets are behind the hosts: no NAT, the pool sees guest addresses.
ip route replace 10.89.1.0/24 via 10.88.0.11
ip route replace 10.89.2.0/24 via 10.88.0.12
systemctl daemon-reload
systemctl enable --now accelmig-pool
