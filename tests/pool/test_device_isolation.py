"""One tenant cannot stall the device for everyone (issue 14, item 4).

Real pools, real PoCL, real device processes (``device_isolation =
"process"``, the default).  A kernel that spins (``while (a[0] == 0) {}``)
keeps its tenant busy; another tenant is served beside it; past the
device time limit the spinner's process is killed, its owner told
``KILLED``, its quota given back, and the tenant can start again.  Builds
read nothing from the pool node and each tenant has a kernel cache of its
own.  Without the fix (all tenants in the pool's process), the second
tenant's read waits behind the spin until its driver gives up, and the
spinner is never stopped.  (What a build can read: test_build_sandbox.py.)"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from accelmig.agent.driver import connect
from accelmig.lab.cutproxy import CutProxy
from accelmig.lab.poolthread import PoolThread
from accelmig.wire.errors import AccelmigError, BadRequest, BuildFailed
from tests.support.wait import wait_for

SPIN = "__kernel void spin(__global volatile uint *a) { while (a[0] == 0) { } }"
ADD = "__kernel void add(__global uint *a, uint n) { a[get_global_id(0)] += n; }"
TENANTS = {"spinner": ("spinner-token-0001", "1GiB"), "other": ("other-token-00001", "1GiB")}
SPINNER, OTHER = TENANTS["spinner"][0], TENANTS["other"][0]


def start_spinning(dev):
    """Launch the spin on a buffer of zeros: nothing ever ends it."""
    flag = dev.upload(np.zeros(4, np.uint32).tobytes())
    # every work-group spins: all of the device's compute units are held
    dev.launch(dev.build(SPIN), "spin", (256,), (1,), flag)
    return flag


def add_and_read(dev, n: int) -> np.ndarray:
    buf = dev.upload(np.arange(64, dtype=np.uint32).tobytes())
    dev.launch(dev.build(ADD), "add", (64,), None, buf, np.uint32(n))
    return np.frombuffer(dev.read(buf), np.uint32)


def tenant_used(pool, name: str) -> int:
    return pool.call(lambda: next(t.used for t in pool.pool.tenants.values() if t.name == name))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead too (reaped by the pool's wait)
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().split(")")[-1].split()[0] != "Z"


def test_a_spinning_kernel_stalls_only_its_tenant():
    spinner = None
    with PoolThread(tenants=TENANTS, device_time_limit=120) as pool:
        spinner = connect(pool.endpoint, SPINNER, agent=False, timeout=150)
        start_spinning(spinner)
        finished = threading.Event()

        def wait_for_spin():
            try:
                spinner.finish()
            except AccelmigError:
                pass                       # the pool's stop ends it
            finished.set()
        threading.Thread(target=wait_for_spin, daemon=True).start()
        with connect(pool.endpoint, OTHER, agent=False, timeout=60) as other:
            result = add_and_read(other, 5)
        assert (result == np.arange(64) + 5).all()
        assert not finished.is_set(), "the spin ended: the test proves nothing"
        processes = pool.backend.processes()
        assert set(processes) == {"spinner", "other"} and processes["spinner"] != processes["other"]
    spinner.close()           # after the pool: its release would wait behind the spin


def test_past_the_time_limit_the_spinner_is_killed_its_quota_freed_and_others_go_on():
    # the limit is every device call's, the other tenant's builds too: room
    # for those on a loaded machine (the spin is killed when it runs out)
    with PoolThread(tenants=TENANTS, device_time_limit=8) as pool:
        with connect(pool.endpoint, OTHER, agent=False, timeout=60) as other:
            assert (add_and_read(other, 1) == np.arange(64) + 1).all()
            spinner = connect(pool.endpoint, SPINNER, agent=False, timeout=60)
            spinner.alloc(1 << 20)
            start_spinning(spinner)
            pid = pool.backend.processes()["spinner"]
            # the pool's process is the sandbox's outer one; the kernel spins in its child
            import psutil
            confined = [child.pid for child in psutil.Process(pid).children()]
            assert len(confined) == 1
            assert tenant_used(pool, "spinner") == (1 << 20) + 16
            with pytest.raises(AccelmigError) as killed:
                spinner.finish()
            assert killed.value.code.value == "KILLED", killed.value
            assert "device time limit of 8 s" in killed.value.message
            assert spinner.state.value == "failed"          # terminal for the driver
            wait_for(lambda: not alive(pid), 20, "the spinner's device process to be gone")
            wait_for(lambda: not alive(confined[0]), 20, "the confined process, where the kernel spun, to be gone")
            wait_for(lambda: spinner.sid not in pool.pool.sessions, 10, "the session to end")
            assert tenant_used(pool, "spinner") == 0
            assert pool.pool.tombstones[spinner.sid].startswith("killed:")
            # the other tenant's process and session never noticed
            assert (add_and_read(other, 2) == np.arange(64) + 2).all()
            spinner.close()
            # and the spinner's tenant starts again, in a new process
            with connect(pool.endpoint, SPINNER, agent=False, timeout=60) as again:
                assert (add_and_read(again, 3) == np.arange(64) + 3).all()
                assert pool.backend.processes()["spinner"] != pid


def test_a_session_released_while_its_kernel_spins_gives_its_quota_back_at_once():
    with PoolThread(tenants=TENANTS, device_time_limit=120, grace=0.5) as pool:
        proxy = CutProxy(pool.endpoint)
        try:
            dev = connect(proxy.endpoint, SPINNER, agent=False, timeout=30)
            dev.auto_reconnect = False
            dev.alloc(8 << 20)
            start_spinning(dev)
            wait_for(lambda: tenant_used(pool, "spinner") == (8 << 20) + 16, 10, "the allocation")
            proxy.close()                          # the guest vanished; the kernel spins on
            wait_for(lambda: dev.sid not in pool.pool.sessions, 20, "the grace period to end the session")
            assert tenant_used(pool, "spinner") == 0
            dev.close()
        finally:
            proxy.close()


def built_programs(cache: str) -> set[str]:
    """PoCL's cache: a directory per program, holding its program.bc."""
    return {os.path.relpath(root, cache) for root, _, files in os.walk(cache) if "program.bc" in files}


def test_each_tenant_has_its_own_kernel_cache_and_working_directory():
    with PoolThread(tenants=TENANTS) as pool:
        with connect(pool.endpoint, SPINNER, agent=False) as a, connect(pool.endpoint, OTHER, agent=False) as b:
            a.build(ADD)
            b.info()
            pids = pool.backend.processes()

            def environment(pid):
                with open(f"/proc/{pid}/environ", "rb") as handle:
                    pairs = [item.split(b"=", 1) for item in handle.read().split(b"\0") if b"=" in item]
                return {k.decode(): v.decode() for k, v in pairs}
            caches = {name: environment(pid)["POCL_CACHE_DIR"] for name, pid in pids.items()}
            cwds = {name: os.readlink(f"/proc/{pid}/cwd") for name, pid in pids.items()}
            assert caches["spinner"] != caches["other"]
            for name in pids:
                assert caches[name].startswith(cwds[name] + os.sep)
                assert cwds[name].startswith(pool.backend.directory + os.sep)
            assert built_programs(caches["spinner"]), "the build left nothing in its tenant's cache"
            assert not built_programs(caches["other"]), "one tenant's build is in another's cache"
            b.build(ADD)               # the same source: built again, into its own cache
            assert built_programs(caches["other"]) == built_programs(caches["spinner"])
        directory = pool.backend.directory
    assert not os.path.exists(directory), "the device processes' directories outlived the pool"


def test_through_a_real_pool_an_oversized_source_or_options_are_refused_and_includes_find_nothing():
    """The bounds that stay (buildpolicy); an #include or -I of the node's
    files is no longer refused by its spelling: it finds nothing
    (tests/pool/test_build_sandbox.py)."""
    with PoolThread(tenants=TENANTS, max_source_bytes=64 << 10) as pool:
        with connect(pool.endpoint, OTHER, agent=False) as dev:
            with pytest.raises(BadRequest, match="over the pool's limit of 65536"):
                dev.build(ADD + "\n//" + "x" * (64 << 10))
            with pytest.raises(BadRequest, match="options of 4097 characters"):
                dev.build(ADD, options="-DX=" + "1" * 4093)
            with pytest.raises(BuildFailed, match="BUILD_PROGRAM_FAILURE") as missing:
                dev.build('#include "/etc/passwd"\n' + ADD)
            assert "'/etc/passwd' file not found" in missing.value.details["log"]
            with pytest.raises(BuildFailed) as missing:
                dev.build('#include "passwd"\n' + ADD, options="-I /etc")
            assert "'passwd' file not found" in missing.value.details["log"]
            assert (add_and_read(dev, 7) == np.arange(64) + 7).all()     # the session goes on


def test_a_new_buffer_holds_zeros_never_what_a_freed_one_held():
    """Found by the soak: device memory is recycled; without zeroing, a new
    4 KiB buffer held a freed one's bytes (222 of 256 buffers, same tenant;
    any tenant with device_isolation = "none")."""
    pattern = bytes([0xAB]) * 4096
    with PoolThread(tenants=TENANTS) as pool:
        with connect(pool.endpoint, OTHER, agent=False) as first:
            for buf in [first.upload(pattern) for _ in range(64)]:
                first.free(buf)
            first.finish()
        with connect(pool.endpoint, OTHER, agent=False) as second:
            fresh = [second.alloc(4096) for _ in range(256)]
            assert all(second.read(buf) == bytes(4096) for buf in fresh)
