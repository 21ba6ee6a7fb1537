"""A demo application: an iterative solver that keeps its state on the pool.

It solves ``A x = b`` by Jacobi iteration on the accelerator.  The matrix
and right-hand side (the *fixed data*) are uploaded once, the program (the
*compute logic*) is built once, and the iterate ``x`` (the *intermediate
state*) lives in device memory between steps.  Every ``report`` steps it
reads the residual and prints progress.  The final iterate's SHA-256 makes
results comparable bit for bit with a run that was never migrated.

Standard library only (it runs inside bare guest images)::

    python3 -m accelmig.agent.demoapp --endpoint 10.88.0.1:7070 --token T --steps 400

Progress goes to stdout as JSON lines: first ``{"opened": true, "sid": ...,
"device": ..., "endpoint": ..., "instance": ...}`` (where the pool placed the
session), then ``{"step": 40, "residual": ...}`` (with ``--digest``, also the
iterate's ``sha256`` at that step, comparable bit for bit with another run's
at the same step, and the session's ``sid``); the last line is ``{"done":
true, "sha256": ..., "steps": ...}``, or ``{"done": false, "error": {"code":
...}}`` (with the ``sid`` when a session was open).
"""

from __future__ import annotations

import argparse
import array
import hashlib
import json
import math
import struct
import sys
import time

SOURCE = r"""
__kernel void jacobi(int n, __global const float *a, __global const float *b,
                     __global const float *x, __global float *x_next) {
    int i = get_global_id(0);
    float sigma = 0.0f;
    for (int j = 0; j < n; j++)
        if (j != i) sigma += a[i * n + j] * x[j];
    x_next[i] = (b[i] - sigma) / a[i * n + i];
}

__kernel void residual(int n, __global const float *a, __global const float *b,
                       __global const float *x, __global float *r) {
    int i = get_global_id(0);
    float acc = 0.0f;
    for (int j = 0; j < n; j++) acc += a[i * n + j] * x[j];
    r[i] = b[i] - acc;
}
"""


def problem(n: int, seed: int = 12345) -> tuple[array.array, array.array]:
    """A deterministic, diagonally dominant system (so Jacobi converges)."""
    state = seed

    def rand() -> float:
        nonlocal state
        state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        return ((state >> 33) / float(1 << 31)) - 0.5

    a = array.array("f", (0.0,) * (n * n))
    for i in range(n):
        row = 0.0
        for j in range(n):
            if i != j:
                v = rand() + 0.5      # positive couplings: Jacobi converges slowly
                a[i * n + j] = v
                row += v
        a[i * n + i] = row * 1.05      # barely dominant: ~45 steps per decade of residual
    b = array.array("f", (rand() * 10 for _ in range(n)))
    return a, b


class JacobiSolver:
    """The application's own state: step counter, buffers, last residual."""

    def __init__(self, device, n: int = 256):
        from accelmig.agent.driver import i32
        self.i32 = i32
        self.device = device
        self.n = n
        a, b = problem(n)
        self.program = device.build(SOURCE)
        self.a = device.upload(a)
        self.b = device.upload(b)
        self.x = [device.upload(array.array("f", (0.0,) * n)), device.alloc(4 * n)]
        self.r = device.alloc(4 * n)
        self.step = 0
        self.residual = float("inf")

    def advance(self, steps: int = 1) -> None:
        n = self.i32(self.n)
        for _ in range(steps):
            cur, nxt = self.x[self.step % 2], self.x[(self.step + 1) % 2]
            self.program.launch("jacobi", self.n, None, n, self.a, self.b, cur, nxt)
            self.step += 1

    def measure(self) -> float:
        cur = self.x[self.step % 2]
        self.program.launch("residual", self.n, None, self.i32(self.n), self.a, self.b, cur, self.r)
        values = struct.unpack(f"<{self.n}f", self.device.read(self.r))
        self.residual = math.sqrt(sum(v * v for v in values))
        return self.residual

    def result(self) -> bytes:
        return self.device.read(self.x[self.step % 2])

    def digest(self) -> str:
        return hashlib.sha256(self.result()).hexdigest()


def emit(out, prefix: str, record: dict) -> None:
    """One progress line in one write: the guest runs Python unbuffered
    (PYTHONUNBUFFERED=1), where print() writes the text and its newline in two
    system calls, and another process sharing the console (the agent's log)
    can land between them."""
    out.write(prefix + json.dumps(record) + "\n")
    out.flush()


def run(device, steps: int, n: int = 256, report: int = 20, out=sys.stdout, pause: float = 0.0,
        on_step=None, prefix: str = "", digest: bool = False) -> dict:
    solver = JacobiSolver(device, n)
    started = time.monotonic()
    while solver.step < steps:
        solver.advance(min(report, steps - solver.step))
        residual = solver.measure()
        line = {"step": solver.step, "residual": residual, "t": round(time.monotonic() - started, 3)}
        if digest:
            # the sid too: a migrated guest's console is in several files, whose
            # order says nothing about which run a line belongs to
            line.update(sha256=solver.digest(), sid=device.sid)
        if out is not None:
            emit(out, prefix, line)
        if on_step is not None:
            on_step(solver)
        if pause:
            time.sleep(pause)
    result = {"done": True, "sha256": solver.digest(), "steps": solver.step, "n": n,
              "residual": solver.residual, "seconds": round(time.monotonic() - started, 3),
              "sid": device.sid, "epoch": device.epoch, "resumes": device.stats["resumes"]}
    if out is not None:
        emit(out, prefix, result)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="accelmig-demoapp", description=__doc__.split("\n")[0])
    parser.add_argument("--endpoint", help="pool HOST:PORT (default: ask the guest agent, "
                                           "then $ACCELMIG_ENDPOINT)")
    parser.add_argument("--token", help="tenant token (default $ACCELMIG_TOKEN)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--size", type=int, default=256, help="unknowns (matrix is size x size)")
    parser.add_argument("--report", type=int, default=20, help="steps between progress lines")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds to sleep between reports")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="how long a call may wait (covers a migration's blackout)")
    parser.add_argument("--prefix", default="", help="put this before every output line "
                        "(to find them on a shared console)")
    parser.add_argument("--device", metavar="SELECTOR", help="which device the session needs: a device id "
                        "or key=value terms (id, type, vendor, name, min_memory), e.g. 'name=basic'; "
                        "in a pool of several nodes it decides the node too (default: the pool's choice)")
    parser.add_argument("--digest", action="store_true", help="add the iterate's SHA-256 to every "
                        "progress line (one more read of the iterate per report)")
    parser.add_argument("--wait-endpoint", type=float, default=0.0, metavar="SECONDS",
                        help="without --endpoint, wait this long for the host to tell the guest "
                             "agent where the pool is (a guest that just booted)")
    tls = parser.add_mutually_exclusive_group()
    tls.add_argument("--cafile", help="CA file that verifies the pool's certificate "
                                      "(default $ACCELMIG_CAFILE, else the system's trust store)")
    tls.add_argument("--insecure", action="store_true", default=None,
                     help="plain TCP to a pool run with --insecure (default $ACCELMIG_INSECURE)")
    args = parser.parse_args(argv)
    from accelmig.agent.driver import connect
    from accelmig.agent.driver.registry import endpoint_from_agent
    from accelmig.wire.errors import AccelmigError
    endpoint = args.endpoint
    deadline = time.monotonic() + args.wait_endpoint
    while endpoint is None and time.monotonic() < deadline:
        endpoint = endpoint_from_agent()
        if endpoint is None:
            time.sleep(0.2)
    device = None
    try:
        with connect(endpoint, args.token, timeout=args.timeout, cafile=args.cafile,
                     insecure=args.insecure, device=args.device) as device:
            # where the pool placed the session (a pool of several nodes may have redirected it)
            emit(sys.stdout, args.prefix, {"opened": True, "sid": device.sid, "device": device.device_id,
                                           "endpoint": device.endpoint, "instance": device.pool_instance})
            run(device, args.steps, args.size, args.report, out=sys.stdout, pause=args.pause,
                prefix=args.prefix, digest=args.digest)
    except AccelmigError as exc:
        emit(sys.stdout, args.prefix, {"done": False, "error": exc.to_wire(),
                                       **({"sid": device.sid} if device is not None else {})})
        print(f"accelmig-demoapp: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
