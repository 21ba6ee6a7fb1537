"""The accelmig OpenCL driver (``icd/``) in tests: built with CMake into a
build directory of the checkout (``icd/build``, what ``./dev.sh setup``
makes; ``icd/build-asan``, ``icd/build-fuzz`` for the sanitizer and fuzz
tiers), incremental, so a run with nothing changed builds nothing; and
run with the Khronos loader's ``OCL_ICD_VENDORS`` pointing at one vendors
directory: the driver's alone, or local PoCL's alone (a copy of its
``.icd`` in the test's temporary directory).

``ACCELMIG_ICD_BUILD``: another directory for the normal build.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "icd"
POCL_ICD = Path("/etc/OpenCL/vendors/pocl.icd")


@dataclasses.dataclass(frozen=True)
class IcdBuild:
    directory: Path

    @property
    def library(self) -> Path:
        return self.directory / "libaccelmig-opencl.so"

    @property
    def vendors(self) -> Path:
        return self.directory / "vendors"

    def program(self, name: str) -> Path:
        return self.directory / name


def build(directory: Path, *options: str, compiler: str | None = None, targets: tuple = ()) -> IcdBuild:
    """Configure (once) and build ``directory`` from ``icd/``; a failed build
    fails the test with the compiler's words."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".build-lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)       # (two runs at once: one builds, the other waits)
        if not (directory / "CMakeCache.txt").exists():
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            env = dict(os.environ, CC=compiler) if compiler else None
            configured = subprocess.run(["cmake", "-S", str(SOURCE), "-B", str(directory), *generator, *options],
                                        capture_output=True, text=True, env=env)
            if configured.returncode != 0:
                raise AssertionError(f"cmake could not configure icd/:\n{configured.stdout}\n{configured.stderr}")
        target_args = [arg for target in targets for arg in ("--target", target)]
        built = subprocess.run(["cmake", "--build", str(directory), "--parallel", "2", *target_args],
                               capture_output=True, text=True)
        if built.returncode != 0:
            raise AssertionError(f"icd/ does not build:\n{built.stdout[-6000:]}\n{built.stderr[-3000:]}")
    return IcdBuild(directory)


def normal_build() -> IcdBuild:
    return build(Path(os.environ.get("ACCELMIG_ICD_BUILD", SOURCE / "build")))


def local_vendors(tmp_path: Path) -> Path:
    """A vendors directory holding local PoCL's ``.icd`` alone."""
    vendors = tmp_path / "pocl-vendors"
    vendors.mkdir(exist_ok=True)
    shutil.copy(POCL_ICD, vendors / "pocl.icd")
    return vendors


def driver_env(icd: IcdBuild, endpoint: str, token: str, *, cafile: str | None = None, **extra) -> dict:
    """The environment of an application on the accelmig driver: its vendors
    directory alone, the pool from the environment, no guest agent, no
    config file of the machine's."""
    env = dict(os.environ, OCL_ICD_VENDORS=str(icd.vendors), ACCELMIG_ENDPOINT=endpoint, ACCELMIG_TOKEN=token,
               ACCELMIG_AGENT_SOCKET="", ACCELMIG_DRIVER_CONFIG="/nonexistent/accelmig-driver.toml")
    env.pop("ACCELMIG_CAFILE", None)
    if cafile is not None:
        env.pop("ACCELMIG_INSECURE", None)
        env["ACCELMIG_CAFILE"] = cafile
    else:
        env["ACCELMIG_INSECURE"] = "1"
    env.update(extra)
    return env


def local_env(tmp_path: Path) -> dict:
    return dict(os.environ, OCL_ICD_VENDORS=str(local_vendors(tmp_path)))


def run(program, env: dict, *args, timeout: float = 240, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([str(program), *args], env=env, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"{program} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done


def clinfo_raw(env: dict) -> tuple[dict, str]:
    """``clinfo --raw``'s first device as {CL_DEVICE_*: value}, and the whole output."""
    done = run("clinfo", env, "--raw", timeout=120, check=False)
    params = {}
    for line in done.stdout.splitlines():
        if line.startswith("[") and "/0]" in line.split()[0]:
            parts = line.split(None, 2)
            if len(parts) >= 2:
                params[parts[1]] = parts[2].strip() if len(parts) == 3 else ""
    return params, done.stdout + done.stderr


class Solver:
    """``cl-moves`` (``icd/tests/cl_moves.c``: a solver whose state stays in
    device memory) driven a line at a time, so that a test can move its
    session between the steps: ``ask`` sends one command and returns the
    line it printed; ``finish`` ends it and returns its stderr (the driver's
    log).  Its stderr is read all along (a debug log must not fill a pipe);
    a solver still running at the end is killed, whatever happened."""

    def __init__(self, icd: IcdBuild, env: dict, cwd=None):
        import queue
        import threading
        self.proc = subprocess.Popen([str(icd.program("cl-moves"))], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
        self._lines: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self._lines.put), daemon=True).start()
        self._stderr_done = threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr.append),
                                             daemon=True)
        self._stderr_done.start()
        first = self._line(120)
        if first != "ready":
            self.close()
            raise AssertionError(f"cl-moves did not start: {first!r}\n{self.log()[-4000:]}")

    @staticmethod
    def _pump(stream, put) -> None:
        for line in stream:
            put(line.rstrip("\n"))
        put(None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return "\n".join(line for line in self.stderr if line is not None)

    def _line(self, timeout: float) -> str | None:
        import queue
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"cl-moves said nothing for {timeout} s\n{self.log()[-4000:]}") from None

    def ask(self, command: str, timeout: float = 120) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self._line(timeout)
        if line is None:
            raise AssertionError(f"cl-moves ended at {command!r} (exit {self.proc.wait(10)})\n{self.log()[-4000:]}")
        return line

    def finish(self, timeout: float = 60) -> str:
        """quit; its stderr (it must say done and exit 0)."""
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        last = self._line(timeout)
        code = self.proc.wait(timeout)
        self._stderr_done.join(timeout)
        assert last == "done" and code == 0, f"cl-moves: {last!r}, exit {code}\n{self.log()[-4000:]}"
        return self.log()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "Solver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def solver_reference(icd: IcdBuild, tmp_path: Path, commands: list[str]) -> list[str]:
    """What ``cl-moves`` prints for ``commands`` on local PoCL (no pool, nothing moved)."""
    with Solver(icd, local_env(tmp_path)) as solver:
        out = [solver.ask(command) for command in commands]
        solver.finish()
    return out
