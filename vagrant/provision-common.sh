#!/usr/bin/env bash
# Every node: what `accelmig fleet deploy` needs of it (python3 and
# python3-venv: deploy installs no Debian package), the rig's SSH (this
# node's host key, root's rig key, the other nodes' host keys), and its
# static routes, made to survive a reboot.  accelmig itself is installed by
# provision-deploy.sh on the last node, from a wheel, on all three.
#
# Environment (from the Vagrantfile): NODE (this node's name), RIG_NET (the
# host network, CIDR), RIG_NODES ("NAME=ADDRESS ..."), ROUTES ("SUBNET=VIA
# ...": the guest subnets behind other nodes).
set -euo pipefail
. /vagrant/vagrant/lib.sh
: "${NODE:?}" "${RIG_NET:?}" "${RIG_NODES:?}" "${ROUTES?}"

apt_install python3 python3-venv openssh-server openssh-client iproute2 ifupdown
install -d -m 0755 "$STATE"

# ---------------------------------------------------------------- sshd: the rig's host key
# The key rig-keys.sh made for this node, whose public half every node's
# known hosts already hold.  Only this key is offered (a HostKey line
# replaces sshd's default set), so no client meets an unknown one.  Root
# logs in with keys only.  Debian's sshd_config includes sshd_config.d/*.conf
# first, and the first value sshd reads wins.
[ -s "$RIG_KEYS/hostkeys/$NODE/ssh_host_ed25519_key" ] \
  || die "no rig host key for $NODE in $RIG_KEYS: the Vagrantfile makes them (vagrant/rig-keys.sh); run 'vagrant rsync $NODE' after it did"
CHANGED=0
put_file /etc/ssh/accelmig-rig_host_ed25519_key 0600 < "$RIG_KEYS/hostkeys/$NODE/ssh_host_ed25519_key"
put_file /etc/ssh/accelmig-rig_host_ed25519_key.pub 0644 < "$RIG_KEYS/hostkeys/$NODE/ssh_host_ed25519_key.pub"
put_file /etc/ssh/sshd_config.d/00-accelmig-rig.conf 0644 <<'EOF'
# written by vagrant/provision-common.sh: the rig's host key (vagrant/rig-keys.sh), keys only for root
HostKey /etc/ssh/accelmig-rig_host_ed25519_key
PermitRootLogin prohibit-password
EOF
if [ "$CHANGED" = 1 ]; then
  sshd -t || die "sshd rejects its configuration (see above)"
  systemctl reload ssh
fi
# (a box whose sshd_config does not include sshd_config.d would offer other keys)
sshd -T | grep -x "hostkey /etc/ssh/accelmig-rig_host_ed25519_key" >/dev/null \
  || die "sshd does not use the rig's host key: does /etc/ssh/sshd_config include sshd_config.d/*.conf?"

# ---------------------------------------------------------------- root: the rig key, known hosts
# Root's identity towards the other nodes (libvirtd's `ssh` for qemu+ssh
# peer-to-peer migration runs as root and reads the system ssh_config), host
# keys checked against the rig's known hosts, strictly: never trust on first
# use.  Only for root and only for the rig's names and addresses.
hosts=""
for node in $RIG_NODES; do hosts+="${hosts:+,}${node#*=},${node%%=*}"; done
install -d -m 0700 /root/.ssh
put_file /root/.ssh/accelmig-rig_ed25519 0600 < "$RIG_KEYS/id_ed25519"
put_file /root/.ssh/accelmig-rig_ed25519.pub 0644 < "$RIG_KEYS/id_ed25519.pub"
put_file /etc/ssh/accelmig-rig_known_hosts 0644 < "$RIG_KEYS/known_hosts"
put_file /etc/ssh/ssh_config.d/accelmig-rig.conf 0644 <<EOF
# written by vagrant/provision-common.sh: root reaches the rig's nodes with the rig key,
# their host keys checked against the rig's known hosts (vagrant/rig-keys.sh)
Match localuser root host $hosts
    IdentityFile /root/.ssh/accelmig-rig_ed25519
    GlobalKnownHostsFile /etc/ssh/accelmig-rig_known_hosts
    StrictHostKeyChecking yes
EOF

# (likewise: a box whose ssh_config does not include ssh_config.d)
first=${RIG_NODES%% *}
ssh -G "${first#*=}" 2>/dev/null | grep -x "identityfile /root/.ssh/accelmig-rig_ed25519" >/dev/null \
  || die "root's ssh does not use the rig key: does /etc/ssh/ssh_config include ssh_config.d/*.conf?"

# The rig key may log in as root, from the host network only.  Lines of an
# older rig key (same comment) are replaced, the others kept.
touch /root/.ssh/authorized_keys
key="from=\"$RIG_NET\" $(cat "$RIG_KEYS/id_ed25519.pub")"
{ grep -v ' accelmig-rig$' /root/.ssh/authorized_keys || true; printf '%s\n' "$key"; } \
  | put_file /root/.ssh/authorized_keys 0600

# ---------------------------------------------------------------- static routes
# The guest subnets behind the other nodes (pool: both hosts'; a host: the
# other host's), through the host network, without NAT.  That network's
# interface is Vagrant's: it writes its stanza into /etc/network/interfaces
# itself (and again at every `vagrant up`), so the routes cannot sit in it.
# ifupdown runs /etc/network/if-up.d/* after bringing up each interface, at
# boot and later: the script adds the routes each time, failing quietly
# until the host network is up (the gateway is not on-link before).
routes_script="#!/bin/sh
# written by vagrant/provision-common.sh: the rig's routes to the guest subnets behind
# other nodes (run by ifupdown after each interface comes up; see that script)
"
for route in $ROUTES; do
  routes_script+="ip route replace ${route%%=*} via ${route#*=} 2>/dev/null || true
"
done
routes_script+="exit 0
"
printf '%s' "$routes_script" | put_file /etc/network/if-up.d/accelmig-rig-routes 0755
/etc/network/if-up.d/accelmig-rig-routes
for route in $ROUTES; do
  ip -4 route show "${route%%=*}" | grep "via ${route#*=} " >/dev/null \
    || die "no route to ${route%%=*} via ${route#*=}: is the host network (${RIG_NET}) up?"
done
