#!/usr/bin/env bash
# On the last node (the Vagrantfile's DEPLOYER, hostB): accelmig on all three
# nodes the way any deployment gets it, from wheels, with `accelmig fleet
# deploy` over SSH (the rig key), and the demo guest's image on both hosts.
#
#  1. wait until every node of fleet.toml says it is ready (provision-host.sh,
#     provision-pool.sh): vagrant-libvirt brings machines up in parallel
#  2. the wheelhouse: the accelmig wheel and every dependency's, built from
#     the synced checkout (pip wheel '.[host,pool,cluster]'), again only when the
#     checkout changed; and the lab's wheel (accelmig-lab: the image builder)
#  3. an admin venv, /opt/accelmig-rig/venv: accelmig[fleet] from that same
#     wheel, plus accelmig-lab (never an editable install, never on the
#     nodes: they get exactly what the wheelhouse holds)
#  4. accelmig fleet deploy --inventory fleet.toml (idempotent: it changes
#     what differs from the inventory and the wheelhouse, nothing else)
#  5. the demo image: the lab's RAM-only guest running the demo solver with
#     the demo tenant's token (made on the pool at the first deploy, read
#     there over SSH), at the kernel/initrd paths of demo-vm.args on every
#     host: direct kernel boot needs them at the same path on a migration's
#     destination
#  6. accelmig fleet doctor: every host's `accelmig doctor`, one table
set -euo pipefail
. /vagrant/vagrant/lib.sh

INVENTORY=$RIG_TREE/fleet.toml
ADMIN=/opt/accelmig-rig
BUILD_VENV=$ADMIN/build-venv        # only its pip: `pip wheel`
VENV=$ADMIN/venv                    # accelmig[fleet] + accelmig-lab
WHEELHOUSE=$(toml_get "$INVENTORY" install wheelhouse | sed -n 1p)
LAB_WHEELS=$STATE/lab-wheels        # accelmig-lab: the admin venv's, never deployed
POOL=$(toml_get "$INVENTORY" pool address)
HOSTS=$(python3 -c 'import sys, tomllib
print(" ".join(h["address"] for h in tomllib.load(open(sys.argv[1], "rb"))["hosts"].values()))' "$INVENTORY")
TENANT=$(demo_arg tenant)
KERNEL=$(demo_arg kernel)
INITRD=$(demo_arg initrd)
if [ -z "$TENANT" ] || [ -z "$KERNEL" ] || [ -z "$INITRD" ]; then
  die "demo-vm.args lacks tenant, kernel or initrd"
fi

# pip builds libvirt-python from its sdist (no wheel on PyPI: it links the
# installed libvirt); the lab's image builder takes busybox from the system.
apt_install python3-venv python3-dev gcc pkg-config libvirt-dev busybox-static

# ---------------------------------------------------------------- 1. every node ready
say "waiting for every node to be provisioned ($POOL $HOSTS)"
deadline=$((SECONDS + ${RIG_WAIT_S:-1800}))
for address in $POOL $HOSTS; do
  # root's ssh: the rig key, host keys checked (provision-common.sh)
  until ssh -o BatchMode=yes -o ConnectTimeout=5 "root@$address" test -e "$STATE/ready" 2>/dev/null; do
    [ $SECONDS -lt $deadline ] || die "$address is not ready after ${RIG_WAIT_S:-1800}s: did its provisioning fail? ('vagrant provision' it, then this node)"
    sleep 10
  done
done

# ---------------------------------------------------------------- 2. the wheelhouse
# The checkout's fingerprint: every file but VCS, caches and build output.
# Unchanged: no rebuild, so a second provisioning changes nothing.
fingerprint=$(cd "$SRC" && find . \( -name .git -o -name .venv -o -name __pycache__ -o -name '*.egg-info' \
    -o -name .pytest_cache -o -name .hypothesis -o -path ./build -o -path ./dist -o -path ./lab/build \
    -o -path ./bench/results -o -path ./vagrant/.rig -o -path ./vagrant/.vagrant -o -path ./.lab \) -prune \
    -o -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STATE/wheelhouse.source" 2>/dev/null)" != "$fingerprint" ]; then
  say "building the wheelhouse $WHEELHOUSE from $SRC"
  [ -x "$BUILD_VENV/bin/pip" ] || python3 -m venv "$BUILD_VENV"
  stage=$(mktemp -d "$STATE/build.XXXXXX")
  trap 'rm -rf "$stage"' EXIT
  # A clean copy: no build/ left from anything (setuptools packs what it finds there).
  cp -a "$SRC/." "$stage/src"
  rm -rf "$stage/src/build" "$stage/src/lab/build" "$stage/src/vagrant/.rig"
  find "$stage/src" -name '*.egg-info' -prune -exec rm -rf {} +
  # SOURCE_DATE_EPOCH: the same sources give the same wheel bytes.
  SOURCE_DATE_EPOCH=315532800 "$BUILD_VENV/bin/pip" wheel -q -w "$stage/wheels" "${stage}/src[host,pool,cluster]"
  SOURCE_DATE_EPOCH=315532800 "$BUILD_VENV/bin/pip" wheel -q --no-deps -w "$stage/lab-wheels" "$stage/src/lab"
  rm -rf "$WHEELHOUSE" "$LAB_WHEELS"
  install -d -m 0755 "$(dirname "$WHEELHOUSE")"
  mv "$stage/wheels" "$WHEELHOUSE"
  mv "$stage/lab-wheels" "$LAB_WHEELS"
  # (the stamp outside the wheelhouse: fleet deploy copies that directory)
  echo "$fingerprint" > "$STATE/wheelhouse.source"
fi
wheel=$(ls "$WHEELHOUSE"/accelmig-*-py3-none-any.whl)
lab_wheel=$(ls "$LAB_WHEELS"/accelmig_lab-*.whl)

# ---------------------------------------------------------------- 3. the admin venv
# Made anew when the wheels changed (a venv cannot be moved into place, and
# pip keeps an installed accelmig 0.1.0 when handed another 0.1.0).
if [ "$(cat "$VENV/.wheelhouse" 2>/dev/null)" != "$fingerprint" ]; then
  say "admin venv $VENV: accelmig[fleet] and accelmig-lab from the wheelhouse"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  # the wheel's own path: an 'accelmig' on PyPI must never stand in for it
  "$VENV/bin/pip" install -q --find-links "$WHEELHOUSE" --find-links "$LAB_WHEELS" "${wheel}[fleet]" "$lab_wheel"
  echo "$fingerprint" > "$VENV/.wheelhouse"
fi

# ---------------------------------------------------------------- 4. deploy
say "accelmig fleet deploy --inventory $INVENTORY"
"$VENV/bin/accelmig" fleet deploy --inventory "$INVENTORY"

# ---------------------------------------------------------------- 5. the demo image
# The token never goes on a command line (argv is public): through stdin
# and the environment only.
say "the demo image (tenant $TENANT), on every host"
token=$(ssh "root@$POOL" cat /etc/accelmig/tokens.toml | python3 -c 'import sys, tomllib
print(tomllib.loads(sys.stdin.read())["tenants"][sys.argv[1]]["token"])' "$TENANT")
# (the image's app command is a shell word list: a token_urlsafe needs no quoting)
[[ $token =~ ^[A-Za-z0-9_-]+$ ]] || die "the pool's token for $TENANT is not URL-safe base64: the guest's app command cannot carry it"
image=$(RIG_TOKEN=$token "$VENV/bin/python" - <<'PYCODE'
import logging, os
from accelmig.lab.accel import demo_command
from accelmig.lab.image import ImageSpec, build_image
logging.basicConfig(level=logging.INFO, format="%(message)s")
# the lab demo's solver, longer and slower: time to watch two migrations
img = build_image(ImageSpec(app_command=demo_command(os.environ["RIG_TOKEN"], steps=2000, size=128,
                                                     report=20, pause=0.3)))
print(img.kernel, img.initrd)
PYCODE
)
read -r built_kernel built_initrd <<< "$image"

# push SRC ADDRESS DEST: SRC to DEST on a host over SSH, only when it differs.
# Mode 0644: libvirt's QEMU user reads it (the initrd holds the demo
# tenant's token: a throwaway tenant of a private rig).
push() {
  local want have
  want=$(sha256sum < "$1" | cut -d' ' -f1)
  have=$(ssh "root@$2" "[ -f '$3' ] && sha256sum < '$3' | cut -d' ' -f1" || true)
  [ "$want" != "$have" ] || return 0
  say "copying $(basename "$3") to $2"
  ssh "root@$2" "install -d -m 0755 '$(dirname "$3")' && cat > '$3.tmp' && chmod 0644 '$3.tmp' && mv -f '$3.tmp' '$3'" < "$1"
}
for address in $HOSTS; do
  push "$built_kernel" "$address" "$KERNEL"
  push "$built_initrd" "$address" "$INITRD"
done

# ---------------------------------------------------------------- 6. doctor
say "accelmig fleet doctor --inventory $INVENTORY"
"$VENV/bin/accelmig" fleet doctor --inventory "$INVENTORY"
