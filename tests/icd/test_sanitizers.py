"""The sanitizer tier: the driver built with AddressSanitizer and
UndefinedBehaviorSanitizer (``icd/build-asan``), its unit tests, the plain
OpenCL program (still bit-identical to local PoCL), the refusals, clinfo
and a cut mid-transfer run with it, every finding fatal (leaks included);
and the fuzz tier: each libFuzzer harness of its decoders (frames through
a session's dispatch, device listings, the configuration file, the guest
agent's lines, a handshake's answers) for a short
run over its corpus (``icd/fuzz/corpus``), built with clang."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from accelmig.lab.cutproxy import CutProxy
from accelmig.lab.poolthread import PoolThread
from tests.support import icd as icd_support
from tests.support.tenants import ALICE, BOB, TENANTS

pytestmark = pytest.mark.slow

SANITIZERS = "halt_on_error=1:abort_on_error=0:detect_leaks=1:exitcode=86"
UBSAN = "halt_on_error=1:print_stacktrace=1:exitcode=87"
#: seconds each harness fuzzes in a test run (ACCELMIG_FUZZ_SECONDS: longer locally)
FUZZ_SECONDS = int(os.environ.get("ACCELMIG_FUZZ_SECONDS", "15"))


def _libasan() -> str:
    path = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        pytest.skip("SKIPPED LOUDLY: gcc's AddressSanitizer runtime (libasan) is not installed")
    return path


@pytest.fixture(scope="module")
def asan():
    libasan = _libasan()
    build = icd_support.build(icd_support.SOURCE / "build-asan", "-DACCELMIG_SANITIZE=ON")
    # (the runtime comes first: the application and the loader are not instrumented, its
    # allocator still sees theirs; LeakSanitizer found no leak of theirs to suppress)
    return build, {"LD_PRELOAD": libasan, "ASAN_OPTIONS": SANITIZERS, "UBSAN_OPTIONS": UBSAN}


def _clean(done: subprocess.CompletedProcess) -> None:
    text = done.stdout + done.stderr
    for sign in ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:", "SUMMARY: "):
        assert sign not in text, text[-6000:]
    assert done.returncode == 0, text[-6000:]


def test_the_unit_tests_under_sanitizers(asan):
    build, extra = asan
    env = dict(os.environ, ASAN_OPTIONS=SANITIZERS, UBSAN_OPTIONS=UBSAN)
    _clean(icd_support.run(build.program("icd-unit"), env, check=False))


def test_the_program_clinfo_and_refusals_under_sanitizers(asan, tmp_path, icd):
    build, extra = asan
    local = icd_support.run(icd.program("cl-checks"), icd_support.local_env(tmp_path))
    with PoolThread(TENANTS, max_payload=1 << 20) as pool:
        env = icd_support.driver_env(build, pool.endpoint, ALICE, **extra)
        ours = icd_support.run(build.program("cl-checks"), env, check=False)
        _clean(ours)
        assert ours.stdout == local.stdout
        _clean(icd_support.run(build.program("cl-refusals"), env, check=False))
        clinfo = icd_support.run("clinfo", env, check=False)
        _clean(clinfo)
        assert "Number of devices                                 1" in clinfo.stdout


def test_a_cut_under_sanitizers(asan, tmp_path, icd):
    build, extra = asan
    local = icd_support.run(icd.program("cl-checks"), icd_support.local_env(tmp_path))
    with PoolThread(TENANTS) as pool, CutProxy(pool.endpoint) as proxy:
        proxy.cut_after(20 << 20, "up")
        env = icd_support.driver_env(build, proxy.endpoint, BOB, **extra)
        ours = icd_support.run(build.program("cl-checks"), env, check=False)
        assert proxy.tripped.is_set()
    _clean(ours)
    assert ours.stdout == local.stdout


def test_the_agent_s_requests_under_sanitizers(asan, tmp_path, icd, guest_agent):
    """Registration, a binding proof and a rehome (the agent's resume: the
    connection dropped, the session resumed where it is told) under the
    sanitizers, leaks fatal; the solver's results are local PoCL's."""
    import uuid

    from accelmig.plugin.channel import GuestChannel
    from tests.support.wait import wait_for
    build, extra = asan
    script = ["step 4", "sum", "step 3", "sum"]
    reference = icd_support.solver_reference(icd, tmp_path, script)
    agent = guest_agent(str(uuid.uuid4()))
    with PoolThread(TENANTS) as pool:
        env = icd_support.driver_env(build, pool.endpoint, ALICE, ACCELMIG_AGENT_SOCKET=agent.socket_path, **extra)
        with icd_support.Solver(build, env) as solver:
            out = [solver.ask(command) for command in script[:2]]
            sid = wait_for(lambda: next(iter(agent.sessions()), None), 10, "the session registered")["sid"]
            with GuestChannel(agent.port_path) as channel:
                channel.connect()
                proven = channel.request("prove", host="hostA", challenges={pool.pool.instance: "cd" * 16})
                rehomed = channel.request("rehome", migration_id="m-asan", tickets={},
                                          identity={"host_id": "here", "pool_endpoint": pool.endpoint})
            assert set(proven["proofs"]) == {sid} and rehomed["ok"], (proven, rehomed)
            out += [solver.ask(command) for command in script[2:]]
            solver.proc.stdin.write("quit\n")
            solver.proc.stdin.flush()
            solver.proc.wait(60)
            solver._stderr_done.join(60)
            done = subprocess.CompletedProcess([], solver.proc.returncode, "", solver.log())
    _clean(done)
    assert out == reference


@pytest.fixture(scope="module")
def fuzzers():
    if shutil.which("clang") is None:
        pytest.skip("SKIPPED LOUDLY: the fuzz tier needs clang with libFuzzer (apt-get install clang libclang-rt-14-dev)")
    return icd_support.build(icd_support.SOURCE / "build-fuzz", "-DACCELMIG_FUZZ=ON", compiler="clang",
                             targets=tuple(f"fuzz-{harness}" for harness in HARNESSES))


#: frames through a session's dispatch, device listings, the configuration
#: file, the guest agent's lines, a handshake's answers (welcome, redirect,
#: an error naming where a session lives)
HARNESSES = ["frames", "devices", "config", "agent", "handshake"]


@pytest.mark.parametrize("harness", HARNESSES)
def test_the_decoders_survive_fuzzing(fuzzers, harness, tmp_path):
    corpus = icd_support.SOURCE / "fuzz" / "corpus" / harness
    work = tmp_path / "corpus"
    shutil.copytree(corpus, work)            # (new inputs go here, not into the repository)
    done = subprocess.run([str(fuzzers.program(f"fuzz-{harness}")), f"-max_total_time={FUZZ_SECONDS}",
                           # the peak RSS a process starts with is its parent's (Linux keeps it
                           # across exec: a pytest of 1 GiB made libFuzzer see an "out of memory"
                           # before its first input), so the bound is on each allocation instead
                           "-rss_limit_mb=0", "-malloc_limit_mb=1024", "-timeout=10",
                           f"-artifact_prefix={tmp_path}/", str(work)],
                          capture_output=True, text=True, errors="replace", timeout=FUZZ_SECONDS + 120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-6000:]
    assert "Done" in done.stderr and not list(tmp_path.glob("crash-*")) and not list(tmp_path.glob("leak-*"))
