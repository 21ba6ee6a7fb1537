"""The pool demo: a real pool process, a real solver on it, connections cut
under it, and a result bit-identical to an uncut run.

Run by ``./dev.sh pool-demo`` (and by ``./dev.sh demo`` as a user who may
not start the local lab of real VMs).  A demo, so the lab's, not the pool's
distribution.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile

from accelmig.agent import demoapp
from accelmig.agent.driver import connect
from accelmig.lab.cutproxy import CutProxy
from accelmig.wire.control import ControlClient

TOKEN = "demo-tenant-token"


def bold(text: str) -> str:
    return f"\033[1m{text}\033[0m" if sys.stdout.isatty() else text


def make_certs(workdir: str) -> dict:
    """A throwaway CA and the pool's certificate for 127.0.0.1 (the lab's
    certificate maker, ``accelmig.lab.certs``, installed by ./dev.sh)."""
    try:
        from accelmig.lab.certs import make_pki
    except ImportError:
        raise SystemExit("the pool demo makes its TLS certificates with accelmig.lab.certs "
                         "(pip install -e ./lab), or run it with --insecure") from None
    pki = make_pki(os.path.join(workdir, "pki"), hosts=())
    return {"ca": str(pki.ca), "cert": str(pki.pool.cert), "key": str(pki.pool.key)}


def start_pool(workdir: str, tls: dict | None):
    tokens = os.path.join(workdir, "tokens.toml")
    with open(tokens, "w") as handle:
        handle.write(f'[tenants.demo]\ntoken = "{TOKEN}"\nquota = "1GiB"\n')
    admin = os.path.join(workdir, "pool.sock")
    exe = os.path.join(os.path.dirname(sys.executable), "accelmig-pool")
    proc = subprocess.Popen([exe, "serve", "--listen", "127.0.0.1:0", "--control-listen", "",
                             "--tokens", tokens, "--admin-socket", admin, "--log-format", "text",
                             *(["--tls-cert", tls["cert"], "--tls-key", tls["key"]] if tls else ["--insecure"])],
                            stdout=subprocess.PIPE, stderr=open(os.path.join(workdir, "pool.log"), "w"),
                            text=True)
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"the pool did not start; see {workdir}/pool.log")
    ready = json.loads(line)
    return proc, ready


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--cuts", type=int, default=5, help="connection cuts during the run")
    parser.add_argument("--insecure", action="store_true",
                        help="plain TCP between the solver and the pool instead of TLS (debugging)")
    args = parser.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="accelmig-demo-")
    print(bold("accelmig pool demo") + f"  (work dir {workdir})")
    tls = None if args.insecure else make_certs(workdir)
    proc, ready = start_pool(workdir, tls)
    # the driver: the demo's CA (TLS), or plain TCP said explicitly on both ends
    options = {"insecure": True} if tls is None else {"cafile": tls["ca"], "insecure": False}
    print(f"pool {ready['instance']} serving on {ready['data']} (PoCL OpenCL device), "
          + ("INSECURE: plain TCP (--insecure)" if tls is None else f"TLS (throwaway CA {tls['ca']})"))
    try:
        print(bold(f"1. reference run: {args.steps} Jacobi steps, {args.size} unknowns, no cut"))
        with connect(ready["data"], TOKEN, agent=False, **options) as dev:
            reference = demoapp.run(dev, args.steps, args.size, report=args.steps // 4)
        proxy = CutProxy(ready["data"])
        every = max(1, args.steps // 20 // (args.cuts + 1)) * 20
        cut_log = []

        def maybe_cut(solver):
            if len(cut_log) < args.cuts and solver.step % every == 0:
                cut_log.append((solver.step, proxy.cut()))
                print(f"   -- connection cut at step {solver.step} --")

        print(bold(f"2. the same run through a relay that cuts the connection {args.cuts} times"))
        with connect(proxy.endpoint, TOKEN, agent=False, **options) as dev:
            result = demoapp.run(dev, args.steps, args.size, report=20, on_step=maybe_cut,
                                 out=None)
            sid = dev.sid
            stats = dev.describe()
            with ControlClient(ready["admin"], "admin", None) as admin:
                counters = next(s for s in admin.call_all("list_sessions")["sessions"]
                                if s["sid"] == sid)["counters"]
        proxy.close()
        same = result["sha256"] == reference["sha256"]
        print()
        print(f"{'':28} {'reference':>18} {'with cuts':>18}")
        print(f"{'steps':28} {reference['steps']:>18} {result['steps']:>18}")
        print(f"{'connection cuts':28} {0:>18} {len(cut_log):>18}")
        print(f"{'session resumes':28} {reference['resumes']:>18} {stats['resumes']:>18}")
        print(f"{'program builds at the pool':28} {1:>18} {counters['builds']:>18}")
        print(f"{'bytes uploaded to the pool':28} {'-':>18} {counters['bytes_uploaded']:>18}")
        print(f"{'commands re-sent':28} {'-':>18} {stats['resent_commands']:>18}")
        print(f"{'replies replayed':28} {'-':>18} {counters['replayed']:>18}")
        print(f"{'result sha256':28} {reference['sha256'][:16]:>18} {result['sha256'][:16]:>18}")
        print()
        print(bold("bit-identical: yes") if same else bold("RESULTS DIFFER"))
        return 0 if same and counters["builds"] == 1 else 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


if __name__ == "__main__":
    sys.exit(main())
