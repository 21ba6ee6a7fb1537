"""The device process's sandbox (``accelmig.pool.devices.sandbox``) on this
kernel, seen from inside: a real process confines itself as a device
process does and reports what it can still see and do; the test judges.
As root (CI), as an unprivileged user (a deployment's pool user), as root
where user namespaces are off, and where nothing can be had.  Landlock's
own layer is checked alone too, since the mount namespace hides what it
would deny.  The attack through a real pool: test_build_sandbox.py."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

from accelmig.pool.devices import landlock
from accelmig.pool.devices.sandbox import device_environment

INSIDE = r"""
import ctypes, errno, json, os, socket, subprocess, sys
from accelmig.pool.devices.sandbox import CLONE_NEWNET, CLONE_NEWUSER, confine
from accelmig.wire.errors import Unavailable
try:
    confinement = confine(sys.argv[1], keep_fds=(1, 2))
except Unavailable as exc:
    print(json.dumps({"unavailable": exc.kwargs["reason"]}))
    sys.exit(0)
libc = ctypes.CDLL(None, use_errno=True)

def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))

def unshare(flags):
    if libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare")

def write(path):
    with open(path, "w") as handle:
        handle.write("x")

header, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()
libc.capget(header, data)
print(json.dumps({
    "layers": list(confinement.layers), "missing": list(confinement.missing),
    "visible": [p for p in sys.argv[3:] if os.path.lexists(p)],
    "root": sorted(os.listdir("/")), "etc": sorted(os.listdir("/etc")), "proc": sorted(os.listdir("/proc")),
    "dev": sorted(os.listdir("/dev")), "cwd": os.getcwd(), "hostname": socket.gethostname(), "pid": os.getpid(),
    "capabilities": list(data),
    "write_tenant": attempt(lambda: write("/tenant/written")), "write_tmp": attempt(lambda: write("/tmp/x")),
    "write_root": attempt(lambda: write("/x")), "write_usr": attempt(lambda: write("/usr/x")),
    "write_etc": attempt(lambda: write("/etc/ld.so.cache")),
    "connect": attempt(lambda: socket.create_connection(("127.0.0.1", int(sys.argv[2])), 2)),
    "new_user_namespace": attempt(lambda: unshare(CLONE_NEWUSER)),
    "new_network_namespace": attempt(lambda: unshare(CLONE_NEWNET)),
    "reopen_own_fd": attempt(lambda: open("/proc/self/fd/1", "wb")),
    "spawn": subprocess.run(["/usr/bin/true"]).returncode,
}))
"""


@pytest.fixture
def listener():
    """A TCP port on the node's loopback (as the pool's control plane)."""
    sock = socket.create_server(("127.0.0.1", 0))
    yield sock.getsockname()[1]
    sock.close()


@pytest.fixture
def tenant_dir():
    """A tenant's directory, as the pool makes them (under the run's TMPDIR,
    which any user may enter), and a secret file beside it."""
    base = tempfile.mkdtemp(prefix="sandbox-test-")
    os.chmod(base, 0o755)
    directory = os.path.join(base, "tenant")
    os.mkdir(directory)
    with open(os.path.join(base, "secret"), "w") as handle:
        handle.write("node secret")
    yield directory
    shutil.rmtree(base, ignore_errors=True)


def run_inside(directory: str, port: int, *, prefix=(), user: int | None = None) -> dict:
    if user is not None:
        os.chown(directory, user, user)
        prefix = ("setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *prefix)
    node_paths = [os.path.join(os.path.dirname(directory), "secret"), directory, "/etc/hostname", "/etc/passwd",
                  "/etc/OpenCL/vendors/../../hostname", "/root", "/home", "/var", "/run", "/srv", "/proc/1",
                  "/proc/self", "/proc/sys", "/sys/class", "/dev/sda", "/dev/vda", "/dev/shm", "/dev/mem"]
    done = subprocess.run([*prefix, sys.executable, "-c", INSIDE, directory, str(port), *node_paths],
                          cwd=directory, env=device_environment(os.environ), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def software_roots() -> set[str]:
    """The top directories the Python environment's paths lie under (a venv
    outside /usr, an editable checkout): shown, read-only, down to those paths."""
    import accelmig.pool
    import accelmig.wire
    paths = [sys.prefix, sys.base_prefix, *accelmig.pool.__path__, *accelmig.wire.__path__]
    return {os.path.realpath(p).split("/")[1] for p in paths}


def assert_confined(seen: dict) -> None:
    assert seen["visible"] == [], seen["visible"]
    assert set(seen["root"]) <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "dev", "proc",
                                 "sys", "tmp", "tenant"} | software_roots(), seen["root"]
    assert "OpenCL" in seen["etc"] and set(seen["etc"]) <= {"OpenCL", "ld.so.cache", "os-release",
                                                             "debian_version"}, seen["etc"]
    assert seen["proc"] == ["cpuinfo", "meminfo"]
    assert seen["dev"] == ["full", "null", "random", "urandom", "zero"]
    assert seen["cwd"] == "/tenant" and seen["hostname"] == "accelmig-device" and seen["pid"] == 1
    assert seen["capabilities"] == [0] * 6
    assert seen["write_tenant"] == "ok" and seen["write_tmp"] == "ok"
    assert {seen["write_root"], seen["write_usr"], seen["write_etc"]} <= {"EROFS", "EACCES"}
    assert seen["connect"] in ("ENETUNREACH", "EACCES")       # no network: not even the node's loopback
    assert seen["new_user_namespace"] == "EPERM" and seen["new_network_namespace"] == "EPERM"
    assert seen["reopen_own_fd"] == "ENOENT"                  # (the upload arena: no way to write it)
    assert seen["spawn"] == 0                                 # PoCL runs its linker: processes still start


def test_as_root_the_process_sees_its_view_only(tenant_dir, listener):
    seen = run_inside(tenant_dir, listener)
    assert_confined(seen)
    assert "user namespace" in seen["layers"] and seen["missing"] == []
    assert os.path.exists(os.path.join(tenant_dir, "written"))      # /tenant is the tenant's directory


@pytest.mark.root
def test_as_an_unprivileged_user_the_same(tenant_dir, listener):
    seen = run_inside(tenant_dir, listener, user=65534)
    assert_confined(seen)
    assert "user namespace" in seen["layers"]


def test_where_user_namespaces_are_off_root_goes_on_without_one(tenant_dir, listener):
    """(Root inside a user namespace whose limit is 0 stands for a root
    pool on a kernel without user namespaces: it has the privilege.)"""
    seen = run_inside(tenant_dir, listener, prefix=(
        "unshare", "--user", "--map-root-user", "sh", "-c",
        'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"', "sh"))
    assert_confined(seen)
    assert "uid 0 without capabilities" in seen["layers"]


#: user namespaces off (their limit at 0) and no privilege
NO_NAMESPACES = ("unshare", "--user", "--map-root-user", "sh", "-c",
                 'echo 0 > /proc/sys/user/max_user_namespaces && exec setpriv --bounding-set=-all --inh-caps=-all "$@"',
                 "sh")


def test_where_nothing_can_be_had_it_says_why(tenant_dir, listener):
    seen = run_inside(tenant_dir, listener, prefix=NO_NAMESPACES)
    assert seen["unavailable"].startswith("the kernel gives no namespaces (No space left on device): "
                                          "user namespaces are off"), seen


def test_the_pool_checks_once_with_the_same_steps(tmp_path):
    from accelmig.pool.devices import sandbox
    sandbox._probed.clear()
    confinement, why = sandbox.probe(str(tmp_path))
    assert why == "" and "mount namespace with a root of its own" in confinement.layers
    assert os.listdir(tmp_path) == []                 # its scratch directory is gone


LANDLOCKED = r"""
import errno, json, os, socket, sys
from accelmig.pool.devices import landlock
import ctypes
ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)             # no_new_privs
ruleset = landlock.Ruleset(landlock.abi())
ruleset.allow("/usr", landlock.READABLE | landlock.EXECUTE)
ruleset.restrict()

def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))

print(json.dumps({
    "usr": attempt(lambda: open("/usr/lib/os-release").read()),
    "etc": attempt(lambda: open("/etc/hostname").read()),
    "missing": attempt(lambda: open("/etc/no-such-file").read()),
    "write_tmp": attempt(lambda: open(sys.argv[2], "w")),
    "connect": attempt(lambda: socket.create_connection(("127.0.0.1", int(sys.argv[1])), 2)),
    "signal_parent": attempt(lambda: os.kill(os.getppid(), 0)),
}))
"""


def test_landlock_alone_denies_reads_writes_tcp_and_signals_out_of_its_domain(listener, tmp_path):
    """The second layer by itself (the stdlib-only interpreter: nothing
    is imported after the restriction but json)."""
    version = landlock.abi()
    if version < 6:
        pytest.skip(f"SKIPPED LOUDLY: Landlock ABI {version} here, 6 needed for TCP and signal scoping")
    done = subprocess.run([sys.executable, "-c", LANDLOCKED, str(listener), str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {"usr": "ok", "etc": "EACCES", "missing": "ENOENT", "write_tmp": "EACCES",
                    "connect": "EACCES", "signal_parent": "EPERM"}
    # EACCES against ENOENT: Landlock alone would tell a tenant a file exists


def test_a_device_process_gets_no_secret_of_the_pools_environment():
    env = device_environment({"PATH": "/usr/bin", "POCL_DEVICES": "cpu", "OCL_ICD_VENDORS": "/x",
                              "PYTHONPATH": "/p", "LC_ALL": "C", "AWS_SECRET_ACCESS_KEY": "s",
                              "ACCELMIG_HOST_SECRET": "s", "ETCD_PASSWORD": "s", "SSH_AUTH_SOCK": "/s"},
                             POCL_CACHE_DIR="/c")
    assert env == {"PATH": "/usr/bin", "POCL_DEVICES": "cpu", "OCL_ICD_VENDORS": "/x", "PYTHONPATH": "/p",
                   "LC_ALL": "C", "POCL_CACHE_DIR": "/c"}


def test_a_device_process_that_cannot_confine_itself_never_serves(tenant_dir):
    """The pool found at start that it could (``--sandbox required``), and
    now it cannot: the process says why and exits, unconfined never."""
    from accelmig.pool.devices.worker import PIPE_LIMITS
    from accelmig.wire.frames import FrameReader
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([*NO_NAMESPACES, sys.executable, "-m", "accelmig.pool.devices.worker",
                             "--fd", str(theirs.fileno()), "--device", "opencl:0", "--tenant", "t",
                             "--sandbox", "required"], pass_fds=[theirs.fileno()], cwd=tenant_dir,
                            env=device_environment(os.environ), stderr=subprocess.DEVNULL)
    theirs.close()
    try:
        reader, frames = FrameReader(PIPE_LIMITS), []
        while not frames:
            n = ours.recv_into(reader.get_buffer())
            assert n, "the device process closed its socket without a word"
            frames.extend(reader.feed(n))
        assert frames[0].header["op"] == "failed", frames[0].header
        assert frames[0].header["error"]["code"] == "UNAVAILABLE"
        assert "no namespaces" in frames[0].header["error"]["message"]
        assert proc.wait(30) == 1
    finally:
        ours.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
