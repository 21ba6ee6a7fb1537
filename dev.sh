#!/usr/bin/env bash
# accelmig's front door on a Debian 12 machine.  Idempotent: it installs what
# is missing (apt packages, a virtualenv in .venv) and then does the job.
#
#   ./dev.sh demo          the main job: the local lab demo (a VM live-migrating while it
#                          computes on the pool); as non-root, the pool demo
#   ./dev.sh pool-demo     the pool alone: a solver whose connection is cut five times
#   ./dev.sh test          every test tier, as CI runs it (.ci/run calls exactly this)
#   ./dev.sh test --fast   the seconds-long tier: no root, no VM
#   ./dev.sh bench [NAME]  benchmarks under bench/ (tables, JSON, PNG and REPORT.md in bench/results/)
#   ./dev.sh setup         only install (and build the OpenCL driver, icd/build)
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(pwd)
VENV="$ROOT/.venv"

APT_PACKAGES=(
  python3 python3-venv python3-dev gcc pkg-config
  pocl-opencl-icd ocl-icd-libopencl1 ocl-icd-opencl-dev
  iproute2 procps util-linux openssl libxml2-utils openssh-server openssh-client
  ruby
  etcd-server
  libvirt-dev
  qemu-system-x86 qemu-utils libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients busybox-static
  # the OpenCL driver (icd/): its build, clinfo to prove it, clang's libFuzzer for its fuzz tier
  cmake ninja-build libjson-c-dev libssl-dev opencl-c-headers clinfo clang libclang-rt-14-dev
  # pyopencl's own test suite through the OpenCL driver (tests/icd/test_pyopencl_suite.py): Debian's
  # pyopencl, the guests' package, with the pytest it runs under
  python3-pyopencl python3-pytest
)

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

install_apt() {
  local missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    say "installing Debian packages: ${missing[*]}"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

install_venv() {
  # Debian's own Python, so the guest image can reuse the same interpreter.
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating virtualenv $VENV"
    /usr/bin/python3 -m venv "$VENV"
  fi
  local stamp="$VENV/.accelmig-installed"
  local want
  # a pool node joining etcd needs the cluster extra's client (etcd3gw) in the wheelhouse too
  local wheel_extras="host,pool,cluster"
  want=$( (cat setup.cfg pyproject.toml lab/pyproject.toml; echo "wheelhouse: $wheel_extras") | sha256sum | cut -d' ' -f1)
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    say "installing accelmig, accelmig-lab (the local lab: lab/) and their dependencies into $VENV"
    "$VENV/bin/pip" install -q --upgrade pip setuptools wheel
    "$VENV/bin/pip" install -q -e ".[pool,host,dev,nova-test,fleet,cluster]" -e ./lab
    # The wheels of every dependency of a host and a pool node, for 'accelmig
    # fleet deploy' in the tests (lab nodes reach no package index); the
    # accelmig wheel itself is built from the checkout by each test run.
    say "building the dependencies' wheelhouse $VENV/wheelhouse"
    rm -rf "$VENV/wheelhouse"
    "$VENV/bin/pip" wheel -q -w "$VENV/wheelhouse" ".[$wheel_extras]"
    rm -f "$VENV"/wheelhouse/accelmig-*.whl
    echo "$want" > "$stamp"
  fi
}

build_icd() {
  # libaccelmig-opencl.so, the OpenCL driver for guests (icd/README.md); incremental
  local build="$ROOT/icd/build"
  if [ ! -f "$build/CMakeCache.txt" ]; then
    say "configuring the OpenCL driver (icd/) in $build"
    cmake -S "$ROOT/icd" -B "$build" -G Ninja >/dev/null
  fi
  if ! cmake --build "$build" >"$build/last-build.log" 2>&1; then
    cat "$build/last-build.log" >&2
    say "the OpenCL driver (icd/) does not build: see above"
    return 1
  fi
}

setup() {
  install_apt "${APT_PACKAGES[@]}"
  install_venv
  build_icd
}

cmd=${1:-help}
shift || true
case "$cmd" in
  setup)
    setup ;;
  demo)
    setup
    if [ "$(id -u)" -ne 0 ]; then
      say "the lab demo needs root (namespaces, libvirt daemons): running the pool demo instead"
      exec "$VENV/bin/python" -m accelmig.lab.pooldemo "$@"
    fi
    exec "$VENV/bin/accelmig" lab demo "$@" ;;
  pool-demo)
    setup
    exec "$VENV/bin/python" -m accelmig.lab.pooldemo "$@" ;;
  test)
    setup
    if [ "${1:-}" = "--fast" ]; then
      shift
      exec "$VENV/bin/pytest" -m "not root and not libvirt and not vm" "$@"
    fi
    if [ "$(id -u)" -eq 0 ]; then
      # As on a fresh machine: libvirt's own directories absent (in a mount
      # namespace of the run's own; the machine is not touched), so the lab
      # and the e2e tier prove they create what they need.
      exec "$VENV/bin/python" -m accelmig.lab.fresh -- "$VENV/bin/pytest" "$@"
    fi
    exec "$VENV/bin/pytest" "$@" ;;
  bench)
    setup
    name=${1:-all}
    shift || true
    exec "$VENV/bin/python" -m bench "$name" "$@" ;;
  *)
    sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
    [ "$cmd" = help ] || exit 2 ;;
esac
