#!/usr/bin/env bash
# A hypervisor host: libvirt and QEMU from Debian (`accelmig fleet deploy`
# installs no Debian package), and the guests' fabric bridge fab0 with this
# host's guest subnet and IP forwarding, made to survive a reboot.  hostd,
# the hook and host.toml come from provision-deploy.sh (accelmig fleet).
#
# Environment (from the Vagrantfile): HOST_IP (this host on the host
# network), GUEST_SUBNET (its guests' subnet, on fab0).
set -euo pipefail
. /vagrant/vagrant/lib.sh
: "${HOST_IP:?}" "${GUEST_SUBNET:?}"

apt_install libvirt-daemon-system libvirt-clients qemu-system-x86 iproute2 ifupdown

GATEWAY=$(python3 -c "import ipaddress, sys; print(next(ipaddress.ip_network(sys.argv[1]).hosts()))" "$GUEST_SUBNET")
PREFIX=${GUEST_SUBNET#*/}
# An explicit MAC for fab0 (docs/lab-notes.md): a bridge without one takes
# its first port's, a tap whose MAC libvirt derives from the guest's, so
# both hosts' fab0 had the same MAC and a migrated guest's cached gateway
# entry still "worked" with its old address.  One per host, from its address.
MAC=$(printf '02:ac:4d:00:00:%02x' "${HOST_IP##*.}")

# ---------------------------------------------------------------- fab0, persistent
# ifupdown, not systemd-networkd: debian/bookworm64 configures its network
# with ifupdown (networking.service; Vagrant writes its own stanzas into
# /etc/network/interfaces), and a second network manager would be one more
# thing to keep off those interfaces (and networkd's wait-online would wait
# for a bridge that has no carrier until a guest starts).  The bridge is
# made with iproute2 in pre-up, so bridge-utils is not needed; ifupdown's
# static method adds the address, sets `hwaddress` and brings it up, at boot
# and at `ifup fab0`.
[ -f /etc/network/interfaces ] \
  || die "/etc/network/interfaces is missing: this box does not use ifupdown (the rig is written for debian/bookworm64)"
# Debian's default file sources interfaces.d; add that line where a box's does not.
grep -Eq '^[[:space:]]*source(-directory)?[[:space:]]+/etc/network/interfaces\.d' /etc/network/interfaces \
  || printf '\nsource /etc/network/interfaces.d/*\n' >> /etc/network/interfaces
CHANGED=0
put_file /etc/network/interfaces.d/accelmig-fab0 0644 <<EOF
# written by vagrant/provision-host.sh: the guests' accelerator fabric, this host's
# guest subnet $GUEST_SUBNET (its gateway on fab0), with an explicit MAC (docs/lab-notes.md);
# the bridge itself is made with iproute2 (no bridge-utils)
auto fab0
iface fab0 inet static
    address $GATEWAY/$PREFIX
    hwaddress $MAC
    pre-up ip link show fab0 >/dev/null 2>&1 || ip link add fab0 type bridge
    post-down ip link del fab0 2>/dev/null || true
EOF
if ! ifquery --state fab0 >/dev/null 2>&1; then
  # Not up for ifupdown.  A fab0 made by hand (an older provisioning) would
  # make ifup's `ip addr add` fail: remove it first (no guest runs yet).
  ip link del fab0 2>/dev/null || true
  ifup fab0
elif [ "$CHANGED" = 1 ]; then
  ifdown fab0
  ifup fab0
fi
# ifup exits 0 even when a pre-up command failed: check what it did.
ip -4 -o addr show dev fab0 | grep " $GATEWAY/$PREFIX " >/dev/null || die "fab0 lacks $GATEWAY/$PREFIX after ifup fab0"
[ "$(cat /sys/class/net/fab0/address)" = "$MAC" ] || die "fab0's MAC is not $MAC after ifup fab0"

# ---------------------------------------------------------------- forwarding, persistent
# The host routes its guests' traffic to the pool (and the pool's replies back).
put_file /etc/sysctl.d/60-accelmig-rig.conf 0644 <<'EOF'
# written by vagrant/provision-host.sh: this host routes its guests' fabric traffic (docs/deploy.md)
net.ipv4.ip_forward = 1
EOF
sysctl -q -p /etc/sysctl.d/60-accelmig-rig.conf
[ "$(sysctl -n net.ipv4.ip_forward)" = 1 ] || die "net.ipv4.ip_forward is not 1"

# For provision-deploy.sh (on the last node): this node is ready for accelmig.
[ -e "$STATE/ready" ] || touch "$STATE/ready"
