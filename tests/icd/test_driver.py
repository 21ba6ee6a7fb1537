"""libaccelmig-opencl.so through the Khronos loader, against a real pool on
PoCL: clinfo lists the accelmig platform and the pool's device with the
values local PoCL gives for it (but what the driver says it does not
offer), a plain OpenCL C program of ours computes bit-identically on the
driver and on local PoCL, what the driver does not offer is answered the
OpenCL way, and the driver's tables and proofs agree with the wire's."""

from __future__ import annotations

import os
import re
import secrets
import subprocess

import pytest

from accelmig.lab.poolthread import PoolThread
from accelmig.wire import dataplane as dp
from accelmig.wire import opencl as wcl
from tests.support import icd as icd_support
from tests.support.tenants import ALICE, BOB, TENANTS

#: What the driver answers otherwise than the device's runtime, on purpose
#: (icd/src/devparams.c, am_devparams_restrict), and why: the rest of
#: clinfo's device lines must be the runtime's own.
#: image limits: 0 without image support (and clinfo does not ask them then)
IMAGE_LIMITS = {
    "CL_DEVICE_MAX_READ_IMAGE_ARGS", "CL_DEVICE_MAX_WRITE_IMAGE_ARGS", "CL_DEVICE_MAX_READ_WRITE_IMAGE_ARGS",
    "CL_DEVICE_MAX_SAMPLERS", "CL_DEVICE_IMAGE_PITCH_ALIGNMENT", "CL_DEVICE_IMAGE_BASE_ADDRESS_ALIGNMENT",
    "CL_DEVICE_IMAGE2D_MAX_WIDTH", "CL_DEVICE_IMAGE2D_MAX_HEIGHT", "CL_DEVICE_IMAGE3D_MAX_WIDTH",
    "CL_DEVICE_IMAGE3D_MAX_HEIGHT", "CL_DEVICE_IMAGE3D_MAX_DEPTH", "CL_DEVICE_IMAGE_MAX_BUFFER_SIZE",
    "CL_DEVICE_IMAGE_MAX_ARRAY_SIZE",
}
RESTRICTED = IMAGE_LIMITS | {
    # no images (so no samplers)
    "CL_DEVICE_IMAGE_SUPPORT",
    # no shared virtual memory, no pipes, no device-side enqueue
    "CL_DEVICE_SVM_CAPABILITIES", "CL_DEVICE_PIPE_SUPPORT", "CL_DEVICE_MAX_PIPE_ARGS",
    "CL_DEVICE_PIPE_MAX_ACTIVE_RESERVATIONS", "CL_DEVICE_PIPE_MAX_PACKET_SIZE",
    "CL_DEVICE_DEVICE_ENQUEUE_CAPABILITIES", "CL_DEVICE_QUEUE_ON_DEVICE_PROPERTIES",
    "CL_DEVICE_QUEUE_ON_DEVICE_PREFERRED_SIZE", "CL_DEVICE_QUEUE_ON_DEVICE_MAX_SIZE",
    "CL_DEVICE_MAX_ON_DEVICE_QUEUES", "CL_DEVICE_MAX_ON_DEVICE_EVENTS",
    # the device is over a network
    "CL_DEVICE_HOST_UNIFIED_MEMORY",
    # no sub-devices, no native or built-in kernels, no IL
    "CL_DEVICE_PARTITION_MAX_SUB_DEVICES", "CL_DEVICE_PARTITION_PROPERTIES", "CL_DEVICE_PARTITION_AFFINITY_DOMAIN",
    "CL_DEVICE_EXECUTION_CAPABILITIES", "CL_DEVICE_BUILT_IN_KERNELS", "CL_DEVICE_BUILT_IN_KERNELS_WITH_VERSION",
    "CL_DEVICE_IL_VERSION", "CL_DEVICE_ILS_WITH_VERSION",
    # only the extensions the device compiler alone provides; C features without images, pipes, device enqueue
    "CL_DEVICE_EXTENSIONS", "CL_DEVICE_EXTENSIONS_WITH_VERSION", "CL_DEVICE_OPENCL_C_FEATURES",
}
#: lines clinfo prints only for an extension the driver does not offer
EXTENSION_ONLY = {"CL_DEVICE_COMMAND_BUFFER_CAPABILITIES_KHR", "CL_DEVICE_COMMAND_BUFFER_REQUIRED_QUEUE_PROPERTIES_KHR",
                  "CL_DEVICE_SPIR_VERSIONS"}
#: clinfo's words for a query that failed
ERROR_LINE = re.compile(r"<error|error:|Invalid|CL_INVALID|not available|\(err", re.IGNORECASE)


def test_the_unit_tests_pass(icd):
    done = icd_support.run(icd.program("icd-unit"), dict(os.environ))
    assert re.search(r"\d+ checks, 0 failed", done.stdout), done.stdout


def test_the_device_parameter_table_is_the_wires(icd):
    done = icd_support.run(icd.program("icd-unit"), dict(os.environ), "params")
    table = [tuple(line.split()) for line in done.stdout.splitlines()]
    assert table == [(name, hex(code), kind) for name, code, kind in wcl.DEVICE_PARAMS]


@pytest.mark.parametrize("binding", [b"", b"tls-server-end-point:" + bytes(range(32)),
                                     b"tls-server-end-point:\x00\xff|tls-unique:\x01\x02"])
def test_the_ownership_proof_is_the_wires(icd, binding):
    secret = secrets.token_bytes(32)
    challenge, sid, epoch = secrets.token_hex(16), "s-0123abcd-7-89ef01", 12345678901
    done = icd_support.run(icd.program("icd-unit"), dict(os.environ), "proof", secret.hex(), challenge, sid,
                           str(epoch), binding.hex())
    assert done.stdout.strip() == dp.ownership_proof(secret, challenge, sid, epoch, binding)


def test_the_binding_proof_is_the_wires(icd):
    from accelmig.wire import attestation as att
    secret = secrets.token_bytes(32)
    claims = {"instance": "0123abcd", "challenge": secrets.token_hex(16), "host": "hostA",
              "domain": "6a1c0de5-0000-4000-8000-00000000000a", "sid": "s-0123abcd-7-89ef01"}
    done = icd_support.run(icd.program("icd-unit"), dict(os.environ), "bind", secret.hex(), claims["instance"],
                           claims["challenge"], claims["host"], claims["domain"], claims["sid"])
    assert done.stdout.strip() == att.bind_proof(secret, **claims)


def test_only_the_icd_entry_points_leave_the_library(icd):
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(icd.library)], capture_output=True, text=True,
                             check=True).stdout
    exported = sorted(line.split()[-1] for line in symbols.splitlines() if line.split()[1] in "TW")
    assert exported == ["clGetExtensionFunctionAddress", "clGetPlatformInfo", "clIcdGetPlatformIDsKHR"]
    needed = subprocess.run(["readelf", "-d", str(icd.library)], capture_output=True, text=True).stdout
    assert "libOpenCL" not in needed          # the loader is the application's, never ours


@pytest.mark.parametrize("isolation", ["process", "none"])
def test_clinfo_lists_the_platform_and_the_pools_device_as_local_pocl_sees_it(icd, tmp_path, isolation):
    with PoolThread(TENANTS, device_isolation=isolation, allow_unconfined_builds=isolation == "none") as pool:
        ours, output = icd_support.clinfo_raw(icd_support.driver_env(icd, pool.endpoint, ALICE))
    local, local_output = icd_support.clinfo_raw(icd_support.local_env(tmp_path))
    assert "CL_PLATFORM_NAME                                accelmig" in output
    assert "#DEVICES                                          1" in output, output
    assert not [line for line in output.splitlines() if ERROR_LINE.search(line)], output
    assert ours["CL_DEVICE_NAME"] == local["CL_DEVICE_NAME"]
    same = {name: value for name, value in local.items() if name not in RESTRICTED | EXTENSION_ONLY}
    assert {name: ours.get(name) for name in same} == same
    assert set(local) - set(ours) <= EXTENSION_ONLY | IMAGE_LIMITS and set(ours) <= set(local)
    assert ours["CL_DEVICE_IMAGE_SUPPORT"] == "CL_FALSE" and ours["CL_DEVICE_SVM_CAPABILITIES"] == ""
    # the kernel query clinfo makes (it builds a kernel): through the pool
    assert ours["CL_KERNEL_PREFERRED_WORK_GROUP_SIZE_MULTIPLE"] == local["CL_KERNEL_PREFERRED_WORK_GROUP_SIZE_MULTIPLE"]


def test_clinfo_without_a_pool_lists_the_platform_and_no_device(icd, tmp_path):
    env = icd_support.driver_env(icd, "127.0.0.1:9", ALICE, ACCELMIG_ICD_LOG="warning")
    done = icd_support.run("clinfo", env, timeout=60, check=False)
    assert "Platform Name                                   accelmig" in done.stdout
    assert "Number of devices                                 0" in done.stdout
    assert "no devices: the pool at 127.0.0.1:9" in done.stderr      # said once, clearly


def test_a_plain_opencl_program_computes_bit_identically_on_the_driver_and_on_local_pocl(icd, tmp_path):
    local = icd_support.run(icd.program("cl-checks"), icd_support.local_env(tmp_path))
    # a pool whose frame limit is 1 MiB: the program's 48 MiB transfers go in chunks
    with PoolThread(TENANTS, max_payload=1 << 20) as pool:
        ours = icd_support.run(icd.program("cl-checks"), icd_support.driver_env(icd, pool.endpoint, ALICE))
        # its clReleaseContext released the session at the pool: every byte back, no session left
        left = pool.call(lambda: (pool.pool.tenants[ALICE].used, pool.pool.tenants[ALICE].live_sessions))
    assert ours.stdout == local.stdout
    assert "failures: 0" in ours.stdout
    assert left == (0, 0)


@pytest.mark.slow
def test_the_same_program_with_device_work_in_the_pool_process(icd, tmp_path):
    local = icd_support.run(icd.program("cl-checks"), icd_support.local_env(tmp_path))
    with PoolThread(TENANTS, device_isolation="none", allow_unconfined_builds=True) as pool:
        ours = icd_support.run(icd.program("cl-checks"), icd_support.driver_env(icd, pool.endpoint, BOB))
    assert ours.stdout == local.stdout


REFUSALS = {
    "image support": 0, "clCreateImage": -59, "clGetSupportedImageFormats": 0, "image formats": 0,
    "clCreateSamplerWithProperties": -59, "clSVMAlloc gives NULL": 1, "clCreatePipe": -59,
    "clCreateSubDevices": -30, "clCreateProgramWithIL": -59, "clCreateProgramWithBuiltInKernels": -30,
    "clCompileProgram": 0, "clBuildProgram": 0, "clGetKernelArgInfo without -cl-kernel-arg-info": -19,
    "a global work offset": 0, "clEnqueueNativeKernel": -59, "clSetKernelArgSVMPointer": -59,
    "clEnqueueReadImage of a buffer": -38, "clGetHostTimer": -59, "a context of the same device twice": 0,
    "clFinish": 0,
}


def test_what_the_driver_does_not_offer_is_answered_the_opencl_way(icd, pool):
    done = icd_support.run(icd.program("cl-refusals"), icd_support.driver_env(icd, pool.endpoint, ALICE))
    answers = dict(line.rsplit(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert {key: int(value) for key, value in answers.items()} == REFUSALS
    assert done.stdout.endswith("done\n")


def test_a_pool_of_protocol_3_gets_no_global_offset_and_the_driver_says_why(icd):
    """A pool from before protocol 4 would not know a launch's offset: the
    driver refuses it the OpenCL way (CL_INVALID_GLOBAL_OFFSET), not a
    kernel run on the wrong work-items; everything else is as ever."""
    with PoolThread(TENANTS, data_versions=(1, 2, 3)) as old:
        done = icd_support.run(icd.program("cl-refusals"), icd_support.driver_env(icd, old.endpoint, ALICE))
    answers = dict(line.rsplit(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert {key: int(value) for key, value in answers.items()} == dict(REFUSALS, **{"a global work offset": -56})
    assert "the pool speaks data-plane protocol 3, without global work offsets" in done.stderr


CONFIGS = [
    None,                   # the reference page's sample file
    'endpoint = "10.0.0.1:7070"\ntoken = "a \\"quoted\\" token" # a comment\ninsecure = true\n',
    '[other]\nendpoint = "not this one"\n[driver]\ntimeout = 2.5\nconnect_timeout = 1\ncafile = "/ca.pem"\n',
    'unknown_key = 1\nendpoint = "[::1]:7070"\n',
    'endpoint = 10.0.0.1:7070\n',
    'insecure = "yes"\n',
    'timeout = 0\n',
    'just words\n',
    'token = "unterminated\n',
    'token = "bad \\q escape"\n',
]


@pytest.mark.parametrize("text", CONFIGS)
def test_the_c_driver_reads_driver_toml_as_the_python_driver_does(icd, tmp_path, text):
    from accelmig.wire import driverconfig
    from accelmig.wire.errors import ConfigInvalid
    if text is None:
        import importlib.util
        spec = importlib.util.spec_from_file_location("configref_for_icd", icd_support.ROOT / "docs" / "configref.py")
        configref = importlib.util.module_from_spec(spec)
        import sys
        sys.modules[spec.name] = configref
        spec.loader.exec_module(configref)
        text = configref.sample_toml(next(f for f in configref.files() if f.name == "driver.toml"))
    path = tmp_path / "driver.toml"
    path.write_text(text)
    c_side = icd_support.run(icd.program("icd-unit"), dict(os.environ), "config", str(path)).stdout
    try:
        cfg = driverconfig.parse(text)
    except ConfigInvalid:
        assert c_side == "refused\n", c_side
        return
    fields = dict(line.split("=", 1) for line in c_side.splitlines())
    assert fields == {"endpoint": cfg.endpoint or "", "token": cfg.token or "", "token_file": cfg.token_file or "",
                      "cafile": cfg.cafile or "", "insecure": str({None: -1, False: 0, True: 1}[cfg.insecure]),
                      "timeout": f"{cfg.timeout:g}", "connect_timeout": f"{cfg.connect_timeout:g}"}


def test_a_pool_never_serves_the_accelmig_platform_as_a_device(icd, pool, tmp_path):
    """A machine with the accelmig driver installed (its .icd beside PoCL's)
    that runs a pool: the pool's devices are PoCL's, not the driver's own
    platform (whose devices would be this very pool)."""
    vendors = icd_support.local_vendors(tmp_path)
    (vendors / "accelmig.icd").write_text((icd.vendors / "accelmig.icd").read_text())
    env = icd_support.driver_env(icd, pool.endpoint, ALICE, OCL_ICD_VENDORS=str(vendors))
    probe = ("import pyopencl as cl; from accelmig.pool.devices import opencl; "
             "print(sorted(p.name for p in cl.get_platforms())); print(len(opencl.list_devices()))")
    import sys
    done = icd_support.run(sys.executable, env, "-c", probe, timeout=120)
    platforms, count = done.stdout.splitlines()
    assert "accelmig" in platforms and "Portable Computing Language" in platforms    # both there
    assert count == "1"


def test_a_pool_of_an_older_protocol_is_named_and_lists_no_device(icd):
    with PoolThread(TENANTS, data_versions=(1, 2)) as pool:
        done = icd_support.run("clinfo", icd_support.driver_env(icd, pool.endpoint, ALICE), timeout=60, check=False)
    assert "Number of devices                                 0" in done.stdout
    assert "does not speak data-plane protocol 3" in done.stderr and "upgrade the pool" in done.stderr, done.stderr
