#!/usr/bin/env bash
# A hypervisor host: libvirt (with systemd here: a real host), the fabric
# bridge with this host's guest subnet, hostd as a service, the hook.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq --no-install-recommends libvirt-daemon-system qemu-system-x86 >/dev/null
GATEWAY=$(python3 -c "import ipaddress,sys; print(next(ipaddress.ip_network('$GUEST_SUBNET').hosts()))")
PREFIX=${GUEST_SUBNET#*/}
# fab0: the guests' accelerator fabric; an explicit MAC (docs/lab-notes.md: else it
# takes a tap's, derived from the guest's, the same on both hosts).
ip link show fab0 >/dev/null 2>&1 || ip link add fab0 type bridge
ip link set fab0 address "02:ac:4d:00:00:$(printf '%02x' "${HOST_IP##*.}")" up
ip addr replace "$GATEWAY/$PREFIX" dev fab0
sysctl -qw net.ipv4.ip_forward=1
ip route replace "$OTHER_SUBNET" via "$OTHER_IP"
cat > /etc/accelmig/host.toml <<TOML
[host]
id = "$HOST_ID"
[pool]
endpoint = "$POOL_IP:7070"
control = "$POOL_IP:7071"
secret_file = "/etc/accelmig/$HOST_ID.secret"
[fabric]
mode = "bridge"
bridge = "fab0"
guest_subnet = "$GUEST_SUBNET"
gateway = "$GATEWAY"
routes = ["$POOL_IP/32"]
[hostd]
socket = "/run/accelmig/hostd.sock"
state_dir = "/var/lib/accelmig"
strict = true
libvirt_uri = "qemu:///system"
TOML
cat > /etc/systemd/system/accelmig-hostd.service <<UNIT
[Unit]
Description=accelmig host daemon
After=libvirtd.service
Requires=libvirtd.service
[Service]
ExecStart=/opt/accelmig/venv/bin/accelmig hostd --config /etc/accelmig/host.toml
Restart=on-failure
[Install]
WantedBy=multi-user.target
UNIT
systemctl daemon-reload
/opt/accelmig/venv/bin/accelmig install --config /etc/accelmig/host.toml --libvirtd-pid-file /run/libvirtd.pid
systemctl enable --now accelmig-hostd
/opt/accelmig/venv/bin/accelmig doctor --config /etc/accelmig/host.toml || true
