"""pyopencl's own test suite, unmodified, through the accelmig OpenCL driver
and, side by side, on local PoCL (issue 30: software nobody here wrote).

The suite is pyopencl's, at the version installed (Debian's
``python3-pyopencl``: the guests' package), from a checkout of its source
repository that this project never carries: give its path.  Get one with

    git clone https://github.com/inducer/pyopencl && git -C pyopencl checkout v2022.3.1

(``python3 -c 'import pyopencl; print(pyopencl.VERSION_TEXT)'`` says the
version; the tag is ``v`` and it).  Each run gets a fresh pyopencl cache in
a temporary directory; the accelmig run talks to a real pool on a thread of
this process (``PoolThread``: PoCL behind it, each tenant's device work in a
process of its own), the driver found through the Khronos loader
(``OCL_ICD_VENDORS``: its vendors directory alone), exactly as an
application finds it.

    python -m tests.support.pyopencl_suite CHECKOUT [--only accelmig|pocl] [-k EXPR] [--json FILE]

prints the passed/failed/skipped table of both runs and every test whose
outcome differs, with the reason this project knows for it (``KNOWN``).
``tests/icd/test_pyopencl_suite.py`` runs it (slow tier) when
``ACCELMIG_PYOPENCL_CHECKOUT`` names a checkout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

#: the files of pyopencl's suite the issue names
FILES = ("test_wrapper.py", "test_enqueue_copy.py", "test_array.py", "test_algorithm.py")
#: the interpreter that has Debian's python3-pyopencl (and python3-pytest)
PYTHON = os.environ.get("ACCELMIG_PYOPENCL_PYTHON", "/usr/bin/python3")
#: what one run of the four files may take at most (local PoCL on two cores: ~12 minutes)
RUN_TIMEOUT = 3 * 3600
#: the tenant the suite runs as: the device's memory as local PoCL gives it
#: (test_zeros_large_array holds three arrays of 2 GiB), and a context per
#: test alive until Python collects it (a session each: hundreds at once)
SUITE_TENANT = {"suite": ("pyopencl-suite-token-0001", "16GiB", 1024)}
#: the pool's bound on one device call (a read waiting for its kernels): the
#: suite's largest kernels on a shared two-core machine ran past the default
#: 60 s, which kills the tenant's device process and every session of it;
#: local PoCL bounds nothing, so the comparison must not either
SUITE_DEVICE_TIME_LIMIT = 900.0

#: Tests whose outcome through the driver differs from local PoCL's, and why
#: (a test id without its device parameter: ``file::name`` or
#: ``file::name[param]``).  Anything that differs and is not here is a
#: defect of the driver.
_NO_IMAGES = "the driver offers no images (CL_DEVICE_IMAGE_SUPPORT = CL_FALSE): pyopencl skips it"
_NO_SVM = "the driver offers no shared virtual memory (CL_DEVICE_SVM_CAPABILITIES = 0): pyopencl skips it"
KNOWN: dict[str, str] = {
    "test_wrapper.py::test_nonempty_supported_image_formats": _NO_IMAGES,
    "test_wrapper.py::test_image_2d": _NO_IMAGES + " (local PoCL: an expected failure)",
    "test_wrapper.py::test_image_3d": _NO_IMAGES + " (local PoCL: an expected failure)",
    "test_wrapper.py::test_enqueue_copy_array": _NO_IMAGES,
    "test_wrapper.py::test_enqueue_copy_array_2": _NO_IMAGES,
    "test_wrapper.py::test_coarse_grain_svm": _NO_SVM,
    "test_wrapper.py::test_fine_grain_svm": _NO_SVM,
    "test_array.py::test_arrays_with_svm_allocators": _NO_SVM,
}


@dataclasses.dataclass
class Outcome:
    """One run: each test's outcome (``passed``, ``failed``, ``error``,
    ``skipped``, ``xfailed``, ``xpassed``) and its message."""

    name: str
    tests: dict[str, str]
    messages: dict[str, str]
    seconds: float
    exit_code: int

    def count(self, file: str | None = None) -> dict[str, int]:
        counts: dict[str, int] = {}
        for test, outcome in self.tests.items():
            if file is None or test.startswith(file + "::"):
                counts[outcome] = counts.get(outcome, 0) + 1
        return counts


def pyopencl_version() -> str:
    done = subprocess.run([PYTHON, "-c", "import pyopencl; print(pyopencl.VERSION_TEXT)"], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"no pyopencl for {PYTHON} (Debian: apt-get install python3-pyopencl python3-pytest):\n"
                         f"{done.stderr[-2000:]}")
    return done.stdout.strip()


def _test_id(case: ET.Element) -> str:
    """``file::name[params]`` without pyopencl's device parameter (it names
    the platform: the two runs must compare)."""
    module = case.get("classname", "").split(".")[-1]
    name = case.get("name", "")
    if "[" in name:
        base, _, params = name.partition("[")
        params = params.rstrip("]")
        # pyopencl's parameters start with its "<context factory for <pyopencl.Device ...>>"
        if params.startswith("<context factory"):
            params = params.split(">>", 1)[1] if ">>" in params else ""
            params = params[1:] if params.startswith("-") else params     # (one: a parameter may be "-inf")
        name = f"{base}[{params}]" if params else base
    # (a test parametrized by the platform itself names it: the two runs' platforms differ)
    name = name.replace("<pyopencl.Platform 'Portable Computing Language'>", "<platform>")
    name = name.replace("<pyopencl.Platform 'accelmig'>", "<platform>")
    return f"{module}.py::{name}"


def read_junit(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    tests, messages = {}, {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test = _test_id(case)
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = ("failed" if child.tag == "failure" else "error"), child.get("message", "")
            elif child.tag == "skipped":
                kind = child.get("type", "")
                outcome = "xfailed" if kind == "pytest.xfail" else "skipped"
                message = child.get("message", "")
        tests[test], messages[test] = outcome, message[:500]
    return tests, messages


def run_suite(checkout: Path, name: str, env: dict, work: Path, files=FILES, select: str | None = None) -> Outcome:
    """pytest over ``files`` of the checkout's ``test/`` in a subprocess
    with ``env``; its outcomes from its JUnit XML."""
    xml = work / f"{name}.xml"
    env = dict(env, XDG_CACHE_HOME=str(work / f"{name}-cache"), HOME=str(work / f"{name}-home"),
               PYTHONDONTWRITEBYTECODE="1")
    os.makedirs(env["HOME"], exist_ok=True)
    argv = [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
            f"--junitxml={xml}", *files, *(["-k", select] if select else [])]
    started = time.monotonic()
    with open(work / f"{name}.log", "w") as log:
        done = subprocess.run(argv, cwd=checkout / "test", env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=RUN_TIMEOUT)
    seconds = time.monotonic() - started
    if not xml.exists():
        raise RuntimeError(f"pyopencl's suite ({name}) wrote no results (exit {done.returncode}): "
                           f"{(work / f'{name}.log').read_text()[-3000:]}")
    tests, messages = read_junit(xml)
    return Outcome(name, tests, messages, seconds, done.returncode)


def local_pocl_env(work: Path) -> dict:
    from tests.support import icd as icd_support
    return dict(os.environ, OCL_ICD_VENDORS=str(icd_support.local_vendors(work)))


def run_both(checkout: Path, work: Path, *, only: str | None = None, select: str | None = None) -> dict:
    """Both runs (or ``only`` one): {"pocl": Outcome, "accelmig": Outcome}."""
    from accelmig.lab.poolthread import PoolThread
    from tests.support import icd as icd_support
    outcomes = {}
    if only in (None, "pocl"):
        outcomes["pocl"] = run_suite(checkout, "pocl", local_pocl_env(work), work, select=select)
    if only in (None, "accelmig"):
        icd = icd_support.normal_build()
        with PoolThread(SUITE_TENANT, device_time_limit=SUITE_DEVICE_TIME_LIMIT) as pool:
            env = icd_support.driver_env(icd, pool.endpoint, SUITE_TENANT["suite"][0])
            outcomes["accelmig"] = run_suite(checkout, "accelmig", env, work, select=select)
    return outcomes


def differences(pocl: Outcome, ours: Outcome) -> dict[str, tuple[str, str, str]]:
    """{test: (local PoCL's outcome, the driver's, the driver's message)}
    for every test whose outcome differs (a test one run lacks counts as
    "absent")."""
    out = {}
    for test in sorted(set(pocl.tests) | set(ours.tests)):
        theirs, mine = pocl.tests.get(test, "absent"), ours.tests.get(test, "absent")
        if theirs != mine:
            out[test] = (theirs, mine, ours.messages.get(test, ""))
    return out


def unexplained(pocl: Outcome, ours: Outcome) -> dict[str, tuple[str, str, str]]:
    """The differences where the driver does worse and KNOWN says nothing."""
    worse = {"failed", "error", "absent"}
    return {test: diff for test, diff in differences(pocl, ours).items()
            if diff[1] in worse and test not in KNOWN and test.split("[")[0] not in KNOWN}


def table(outcomes: dict) -> str:
    kinds = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
    lines = [f"| file | run | {' | '.join(kinds)} | seconds |", "|---|---|" + "---|" * (len(kinds) + 1)]
    for file in FILES:
        for name, outcome in outcomes.items():
            counts = outcome.count(file)
            lines.append(f"| {file} | {name} | " + " | ".join(str(counts.get(k, 0)) for k in kinds) + " | |")
    for name, outcome in outcomes.items():
        counts = outcome.count()
        lines.append(f"| all | {name} | " + " | ".join(str(counts.get(k, 0)) for k in kinds) +
                     f" | {outcome.seconds:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.pyopencl_suite",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout", type=Path, help="a checkout of pyopencl's source at the installed version")
    parser.add_argument("--only", choices=["accelmig", "pocl"], help="one run only")
    parser.add_argument("-k", dest="select", help="pytest's -k: some of the tests only")
    parser.add_argument("--json", type=Path, help="write every outcome here")
    parser.add_argument("--keep", type=Path, help="keep the runs' logs and XML here (default: a temporary directory)")
    args = parser.parse_args(argv)
    if not (args.checkout / "test" / FILES[0]).exists():
        parser.error(f"{args.checkout} is no pyopencl checkout (no test/{FILES[0]})")
    version = pyopencl_version()
    work = args.keep or Path(tempfile.mkdtemp(prefix="accelmig-pyopencl-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        outcomes = run_both(args.checkout, work, only=args.only, select=args.select)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"pyopencl {version}, {time.strftime('%Y-%m-%d')}, {os.uname().nodename} ({os.cpu_count()} CPUs)")
    print(table(outcomes))
    if len(outcomes) == 2:
        for test, (theirs, mine, message) in differences(outcomes["pocl"], outcomes["accelmig"]).items():
            reason = KNOWN.get(test) or KNOWN.get(test.split("[")[0]) or "UNEXPLAINED"
            print(f"- {test}: local PoCL {theirs}, accelmig {mine}: {reason}" +
                  (f" ({message[:200]})" if reason == "UNEXPLAINED" else ""))
    if args.json:
        args.json.write_text(json.dumps({name: dataclasses.asdict(o) for name, o in outcomes.items()}, indent=1))
    if len(outcomes) == 2 and unexplained(outcomes["pocl"], outcomes["accelmig"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
