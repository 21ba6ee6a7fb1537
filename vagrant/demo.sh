#!/usr/bin/env bash
# The rig's demo, as an operator would run it, with plain virsh:
#
#   sudo /vagrant/vagrant/demo.sh        on hostA: boot demo-vm on fab0 (its solver computes on
#                                        the pool), live-migrate it to hostB and back over
#                                        qemu+ssh peer to peer, and print the solver's result
#   demo.sh render FILE                  only write the domain XML (no root, no libvirt)
#
# The domain is rendered from demo-vm.args, one `--set` value a line (the
# test tests/lab/test_vagrant_rig.py renders it with `demo.sh render`).  The
# image (kernel, initrd: the lab's RAM-only guest with the demo solver and
# the tenant's token) is built by provision-deploy.sh, at the same path on
# both hosts.  Each run starts from scratch: a demo-vm left by an earlier
# run, on either host, is destroyed first.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ARGS_FILE=${DEMO_ARGS:-$HERE/demo-vm.args}
ACCELMIG=${ACCELMIG:-/opt/accelmig/venv/bin/accelmig}
INVENTORY=${INVENTORY:-$HERE/fleet.toml}
STEP_TIMEOUT=${STEP_TIMEOUT:-180}

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
die() { printf 'ERROR: %s\n' "$*" >&2; exit 1; }
arg() { sed -n "s/^$1=//p" "$ARGS_FILE" | tail -n 1; }

# render FILE: accelmig domain render accelerator-domain --set LINE... -o FILE
render() {
  local sets=() line
  while IFS= read -r line || [ -n "$line" ]; do
    case $line in ''|'#'*) continue ;; esac
    sets+=(--set "$line")
  done < "$ARGS_FILE"
  "$ACCELMIG" domain render accelerator-domain "${sets[@]}" -o "$1"
}

# address NAME: a host's address on the host network, from the inventory
address() {
  python3 -c 'import sys, tomllib
print(tomllib.load(open(sys.argv[1], "rb"))["hosts"][sys.argv[2]]["address"])' "$INVENTORY" "$1"
}

# wait_line WHERE PATTERN: until the console log on WHERE (local, or an
# address reached over ssh) has a line with PATTERN; prints that line.
wait_line() {
  local where=$1 pattern=$2 deadline=$((SECONDS + STEP_TIMEOUT)) line
  while :; do
    if [ "$where" = local ]; then
      line=$(grep -F -- "$pattern" "$CONSOLE" 2>/dev/null | tail -n 1 || true)
    else
      line=$(ssh "root@$where" "grep -F -- '$pattern' '$CONSOLE' 2>/dev/null | tail -n 1" || true)
    fi
    if [ -n "$line" ]; then
      printf '%s\n' "$line"
      return 0
    fi
    if [ $SECONDS -ge $deadline ]; then
      echo "--- the last lines of $CONSOLE on $where:" >&2
      if [ "$where" = local ]; then tail -n 30 "$CONSOLE" >&2 || true
      else ssh "root@$where" "tail -n 30 '$CONSOLE'" >&2 || true; fi
      die "no '$pattern' on $where's console after ${STEP_TIMEOUT}s ('accelmig status' on the host says what hostd sees)"
    fi
    sleep 2
  done
}

case ${1:-run} in
  render)
    [ $# -eq 2 ] || die "usage: $0 render FILE"
    render "$2"
    exit 0 ;;
  run) ;;
  *) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac

[ "$(id -u)" -eq 0 ] || die "run as root: sudo $0"
NAME=$(arg name)
CONSOLE=$(arg console_log)
for file in "$(arg kernel)" "$(arg initrd)"; do
  [ -s "$file" ] || die "$file is missing: the deploying node builds the demo image and copies it to both hosts (vagrant provision hostB --provision-with deploy)"
done
if [ "$(arg virt_type)" = kvm ] && [ ! -e /dev/kvm ]; then
  die "no /dev/kvm here: the rig needs nested virtualisation (kvm_intel/kvm_amd nested=1 on the workstation), or set virt_type=qemu in demo-vm.args"
fi
SELF=$(address "$(hostname)")
for name in $(python3 -c 'import sys, tomllib
print(" ".join(tomllib.load(open(sys.argv[1], "rb"))["hosts"]))' "$INVENTORY"); do
  [ "$name" = "$(hostname)" ] || PEER=$(address "$name")
done
: "${PEER:?no other host in $INVENTORY}"
SELF_URI=qemu+ssh://$SELF/system
PEER_URI=qemu+ssh://$PEER/system

# direct kernel boot: the destination's QEMU opens the same paths
ssh "root@$PEER" "test -s '$(arg kernel)' && test -s '$(arg initrd)'" \
  || die "the image is missing on $PEER (vagrant provision hostB --provision-with deploy copies it)"

say "$NAME's domain (from $ARGS_FILE)"
XML=$(dirname "$(arg kernel)")/$NAME.xml
render "$XML"

for uri in qemu:///system "$PEER_URI"; do
  if virsh -c "$uri" domstate "$NAME" >/dev/null 2>&1; then
    say "destroying the $NAME an earlier run left ($uri)"
    virsh -c "$uri" destroy "$NAME" >/dev/null
  fi
done

say "booting $NAME on $(hostname) ($SELF)"
virsh create "$XML"
say "waiting for its solver to compute on the pool"
wait_line local 'DEMO {"step"'

say "live migration $(hostname) -> $PEER (peer to peer over qemu+ssh)"
virsh migrate --live --p2p --verbose "$NAME" "$PEER_URI" --migrateuri "tcp://$PEER"
wait_line "$PEER" 'DEMO {"step"'

say "live migration $PEER -> $(hostname)"
virsh -c "$PEER_URI" migrate --live --p2p --verbose "$NAME" "$SELF_URI" --migrateuri "tcp://$SELF"
result=$(wait_line local 'DEMO {"done"')
say "result: $result"
case $result in
  *'"done": true'*) say "$NAME computed on the pool through two live migrations" ;;
  *) die "the solver did not finish: $result" ;;
esac
