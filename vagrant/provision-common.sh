#!/usr/bin/env bash
# Every node: accelmig from the synced tree into /opt/accelmig (the same
# ./dev.sh setup a developer runs), and the rig's shared secrets.
set -euo pipefail
cd /vagrant
./dev.sh setup
install -d -m 0755 /opt/accelmig /etc/accelmig
ln -sfn /vagrant/.venv /opt/accelmig/venv
# Deterministic per-rig secrets (a test rig, not production): the pool and
# each host derive the same value from the rig's name.
for h in hostA hostB; do
  printf '%s' "$(echo "accelmig-vagrant-rig-$h" | sha256sum | cut -c1-32)" > "/etc/accelmig/$h.secret"
done
chmod 0600 /etc/accelmig/*.secret
