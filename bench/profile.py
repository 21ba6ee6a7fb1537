"""Where the data plane's time goes: py-spy on the driver, the pool and the
tenant's device process at once, while the driver runs one hot loop.

    python -m bench.profile finish     # finish() on an idle session, in a loop
    python -m bench.profile launch     # pipelined launches of a trivial kernel, a finish per 1,000
    python -m bench.profile upload     # 64 MiB writes into one buffer, back to back
    python -m bench.profile read       # 64 B reads, each waiting for its reply
    python -m bench.profile read --tls # any loop over TLS (a throwaway CA), as deployed

Needs py-spy (``.venv/bin/pip install py-spy``; not a dependency of the
project) and the rights to attach to the processes it starts (root, or
ptrace allowed).  Prints, per process, the share of samples per thread and
the functions the samples ended in (blocking calls included: on a hand-off
chain the waits are the cost), and the loop's rate.  A sampler at 1 kHz on
three processes slows them: read the shares, not the rate.  The raw
collapsed stacks stay in ``bench/results/profile-<loop>-<process>.txt``.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from bench.common import RESULTS
from bench.remoting import COUNTER, SMALL, start_pool


UPLOAD = 64 << 20


def hot_loop(dev, prog, small, which: str, seconds: float, bulk=None) -> float:
    """Run the loop for ``seconds``; its rate per second (bytes for uploads)."""
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        if which == "upload":
            dev.write(bulk[0], bulk[1])
            done += len(bulk[1])
        elif which == "read":
            for _ in range(100):
                dev.read(small, SMALL)
            done += 100
        elif which == "finish":
            for _ in range(100):
                dev.finish()
            done += 100
        else:
            for _ in range(1000):
                prog.launch("bump", 16, None, small)
            dev.finish()
            done += 1000
    return done / (time.perf_counter() - start)


def summarise(path: str, top: int = 15) -> str:
    threads: collections.Counter = collections.Counter()
    leaves: collections.Counter = collections.Counter()
    total = 0
    with open(path) as handle:
        for line in handle:
            stack, _, count = line.rstrip().rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            total += int(count)
            threads[re.sub(r" \(\d+\)", "", frames[0])] += int(count)
            leaves[re.sub(r"\(([^()]*/)?([^/()]+)\)", r"(\2)", frames[-1])] += int(count)
    lines = [f"{total} samples"]
    lines += [f"  {n * 100 / total:5.1f}%  {name}" for name, n in threads.most_common(6)]
    lines += [f"        {n * 100 / total:5.1f}%  {name}" for name, n in leaves.most_common(top)]
    return "\n".join(lines) if total else "no samples"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="bench profile", description=__doc__.split("\n")[0])
    parser.add_argument("loop", choices=("finish", "launch", "upload", "read"))
    parser.add_argument("--tls", action="store_true", help="the pool serves TLS, the driver verifies it")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rate", type=int, default=1000, help="py-spy samples per second")
    args = parser.parse_args(argv)
    venv_bin = os.path.dirname(sys.executable)
    spy = shutil.which("py-spy", path=venv_bin + os.pathsep + os.environ.get("PATH", ""))
    if spy is None:
        parser.error("py-spy is not installed: .venv/bin/pip install py-spy")
    from accelmig.agent.driver import connect
    workdir = tempfile.mkdtemp(prefix="accelmig-profile-")
    os.makedirs(RESULTS, exist_ok=True)
    tls, options = None, {"insecure": True}
    if args.tls:
        from pathlib import Path
        from accelmig.lab.certs import make_pki
        pki = make_pki(Path(workdir) / "pki", hosts=())
        tls, options = (str(pki.pool.cert), str(pki.pool.key)), {"cafile": str(pki.ca)}
    pool, endpoint = start_pool(workdir, tls=tls)
    spies = []
    try:
        dev = connect(endpoint, "bench-token-0001", agent=False, **options)
        prog = dev.build(COUNTER)          # the tenant's device process runs from here on
        small = dev.upload(bytes(SMALL))
        data = os.urandom(UPLOAD) if args.loop == "upload" else b""
        bulk = (dev.upload(data), data) if data else None
        hot_loop(dev, prog, small, args.loop, 0.5, bulk)     # warm up
        children = subprocess.run(["pgrep", "-P", str(pool.pid)], capture_output=True,
                                  text=True).stdout.split()
        targets = {"driver": os.getpid(), "pool": pool.pid, "device-process": int(children[0])}
        outputs = {}
        for name, pid in targets.items():
            outputs[name] = os.path.join(RESULTS, f"profile-{args.loop}-{name}.txt")
            spies.append(subprocess.Popen(
                [spy, "record", "-r", str(args.rate), "--nonblocking", "--threads", "-f", "raw",
                 "-o", outputs[name], "--pid", str(pid), "-d", str(int(args.seconds))],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(0.5)                    # the samplers attach
        rate = hot_loop(dev, prog, small, args.loop, args.seconds, bulk)
        for spy_proc in spies:
            spy_proc.wait(60)
        dev.close()
        print(f"{args.loop}: " + (f"{rate / (1 << 30):.2f} GiB/s" if bulk else f"{rate:,.0f}/s")
              + " under the samplers")
        for name, path in outputs.items():
            print(f"\n== {name}: " + (summarise(path) if os.path.exists(path) else "py-spy wrote nothing"))
    finally:
        for spy_proc in spies:
            if spy_proc.poll() is None:
                spy_proc.kill()
                spy_proc.wait()
        pool.send_signal(signal.SIGTERM)
        pool.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
