# Helpers for the rig's provisioning scripts (sourced from the synced tree:
# Vagrant uploads each provisioning script alone, to /tmp, so they source
# this file by its path under /vagrant, never relative to themselves).
# shellcheck shell=bash
# shellcheck disable=SC2034  # (the variables are the sourcing scripts')

export DEBIAN_FRONTEND=noninteractive
export LC_ALL=C.UTF-8

#: the checkout, as rsync put it on every node
SRC=/vagrant
#: this directory there
RIG_TREE=$SRC/vagrant
#: the keys vagrant/rig-keys.sh made on the workstation (synced with the tree)
RIG_KEYS=$RIG_TREE/.rig
#: the rig's own state on each node: markers, the demo image, the wheelhouse
STATE=/var/lib/accelmig-rig

say() { printf '==> %s\n' "$*" >&2; }
die() { printf 'ERROR: %s\n' "$*" >&2; exit 1; }

# apt_install PACKAGE...: install what is missing.  apt-get update only when
# something is missing, so a second provisioning changes nothing.
apt_install() {
  local missing=() pkg
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep "install ok installed" >/dev/null || missing+=("$pkg")
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  say "installing Debian packages: ${missing[*]}"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# put_file DEST MODE < CONTENT: write DEST (atomically) only when its content
# or mode differs, and then set CHANGED=1.  Call it as a plain command, never
# in a condition: bash ignores `set -e` inside a function called from `if`
# or `&&`, and a failed write must stop the provisioning.
CHANGED=0
put_file() {
  local dest=$1 mode=$2 tmp
  install -d -m 0755 "$(dirname "$dest")"
  tmp=$(mktemp "$dest.XXXXXX")
  cat > "$tmp"
  if [ -f "$dest" ] && cmp -s "$tmp" "$dest" && [ "$(stat -c %a "$dest")" = "$(printf '%o' "0$mode")" ]; then
    rm -f "$tmp"
    return 0
  fi
  chmod "$mode" "$tmp"
  mv -f "$tmp" "$dest"
  say "wrote $dest"
  CHANGED=1
}

# toml_get FILE KEY...: a value of a TOML file (a list: one item a line):
# toml_get fleet.toml pool address.  The rig's inventory, vagrant/fleet.toml,
# is the one source of what the scripts need of its addresses and paths.
toml_get() {
  python3 -c 'import sys, tomllib
value = tomllib.load(open(sys.argv[1], "rb"))
for key in sys.argv[2:]:
    value = value[key]
print("\n".join(map(str, value)) if isinstance(value, list) else value)' "$@"
}

# demo_arg KEY: a value of the demo domain's render arguments (demo-vm.args,
# which demo.sh renders the domain from): the image's paths live there only.
demo_arg() {
  sed -n "s/^$1=//p" "$RIG_TREE/demo-vm.args" | tail -n 1
}
