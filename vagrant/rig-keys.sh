#!/usr/bin/env bash
# The rig's SSH keys, made on the workstation: the Vagrantfile runs this at
# every vagrant command, before any machine is synced, and it only makes
# what is missing.  Usage: rig-keys.sh DIR NAME=ADDRESS...
#
#   DIR/id_ed25519, .pub                     the rig key: root's identity on every node, authorized
#                                            for root on every node (libvirt's qemu+ssh between the
#                                            hosts, `accelmig fleet` from the deploying node)
#   DIR/hostkeys/NAME/ssh_host_ed25519_key   each node's sshd host key, installed by
#                                            provision-common.sh
#   DIR/known_hosts                          every node's host key under its name and address
#
# Why host keys made here and not ssh-keyscan on the nodes: the synced folder
# is rsync (a copy per VM, made at `vagrant up`), so a key a node published
# into it would never reach the others; and known hosts made here are the
# nodes' real keys from the start, so every connection checks the host key
# and none trusts the first key it is shown.  DIR is git-ignored
# (vagrant/.gitignore); delete it (and `vagrant provision`) for new keys.
set -euo pipefail

[ $# -ge 2 ] || { echo "usage: $0 DIR NAME=ADDRESS..." >&2; exit 2; }
dir=$1
shift
command -v ssh-keygen >/dev/null || { echo "rig-keys.sh: ssh-keygen is missing (openssh-client)" >&2; exit 1; }

umask 077
mkdir -p "$dir/hostkeys"

# newkey FILE COMMENT: an ed25519 key pair without passphrase, once.
newkey() {
  [ -s "$1" ] && [ -s "$1.pub" ] && return 0
  rm -f "$1" "$1.pub"
  ssh-keygen -q -t ed25519 -N '' -C "$2" -f "$1"
}

newkey "$dir/id_ed25519" accelmig-rig
known=""
for node in "$@"; do
  name=${node%%=*}
  address=${node#*=}
  [[ $name =~ ^[A-Za-z][A-Za-z0-9-]*$ && $address =~ ^[0-9.]+$ ]] \
    || { echo "rig-keys.sh: $node is not NAME=ADDRESS" >&2; exit 2; }
  mkdir -p "$dir/hostkeys/$name"
  newkey "$dir/hostkeys/$name/ssh_host_ed25519_key" "root@$name"
  # "NAME,ADDRESS TYPE KEY": OpenSSH and paramiko both read a comma list of names
  read -r type key _ < "$dir/hostkeys/$name/ssh_host_ed25519_key.pub"
  known+="$name,$address $type $key"$'\n'
done

# Rewritten only when it differs (a new node, a new key): nothing changes otherwise.
if [ ! -f "$dir/known_hosts" ] || [ "$(cat "$dir/known_hosts")"$'\n' != "$known" ]; then
  printf '%s' "$known" > "$dir/known_hosts.tmp"
  chmod 0644 "$dir/known_hosts.tmp"
  mv -f "$dir/known_hosts.tmp" "$dir/known_hosts"
fi
