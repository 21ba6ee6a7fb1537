"""Tables, JSON and plots shared by the benchmarks."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def median_of(fn, repeat: int) -> tuple[float, list[float]]:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), samples


class Table:
    """Rows of (label, baseline, accelmig, unit, better) with a ratio column."""

    def __init__(self, title: str, baseline_name: str, subject_name: str):
        self.title = title
        self.baseline_name = baseline_name
        self.subject_name = subject_name
        self.rows: list[dict] = []

    def add(self, label: str, baseline: float, subject: float, unit: str, better: str = "lower"):
        ratio = subject / baseline if baseline else float("inf")
        self.rows.append({"label": label, "baseline": baseline, "subject": subject, "unit": unit,
                          "better": better, "ratio": ratio})

    def render(self) -> str:
        head = f"{'':34} {self.baseline_name:>16} {self.subject_name:>16} {'ratio':>8}"
        lines = [self.title, "=" * len(head), head, "-" * len(head)]
        for r in self.rows:
            lines.append(f"{r['label']:34} {_fmt(r['baseline'], r['unit']):>16} "
                         f"{_fmt(r['subject'], r['unit']):>16} {_fmt_ratio(r['ratio']):>8}")
        lines.append("(ratio = %s / %s; %s)" % (self.subject_name, self.baseline_name,
                     "; ".join(f"{r['label']}: {r['better']} is better" for r in self.rows[:1])))
        return "\n".join(lines)

    def save(self, name: str, extra: dict | None = None) -> str:
        os.makedirs(RESULTS, exist_ok=True)
        path = os.path.join(RESULTS, f"{name}.json")
        with open(path, "w") as handle:
            json.dump({"title": self.title, "baseline": self.baseline_name,
                       "subject": self.subject_name, "rows": self.rows, "machine": machine(),
                       "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **(extra or {})},
                      handle, indent=2)
        return path

    def plot(self, name: str) -> str | None:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        fig, axes = plt.subplots(1, len(self.rows), figsize=(3.2 * len(self.rows), 3.6))
        if len(self.rows) == 1:
            axes = [axes]
        for ax, row in zip(axes, self.rows):
            bars = ax.bar([self.baseline_name, self.subject_name], [row["baseline"], row["subject"]],
                          color=["#888888", "#2b6cb0"])
            ax.set_title(row["label"], fontsize=9)
            ax.set_ylabel(row["unit"], fontsize=8)
            ax.tick_params(labelsize=8)
            ax.bar_label(bars, labels=[_fmt(row["baseline"], row["unit"]), _fmt(row["subject"], row["unit"])],
                         fontsize=7)
        # panels in the same unit are compared side by side: one y scale for them
        for unit in {row["unit"] for row in self.rows}:
            top = max(max(r["baseline"], r["subject"]) for r in self.rows if r["unit"] == unit)
            for ax, row in zip(axes, self.rows):
                if row["unit"] == unit and top > 0:
                    ax.set_ylim(0, top * 1.15)
        fig.suptitle(self.title, fontsize=10)
        return save_figure(fig, name)


def _fmt_ratio(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio >= 0.1 or ratio == 0 else f"{ratio:.2g}x"


def save_figure(fig, name: str) -> str:
    """Lay out, write bench/results/NAME.png, close; return the path."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(value: float, unit: str) -> str:
    if value >= 100:
        return f"{value:,.0f} {unit}"
    if value >= 1:
        return f"{value:.2f} {unit}"
    return f"{value:.4f} {unit}"


def machine() -> dict:
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "node": platform.node(),
            "kernel": platform.release()}


def report(table: Table, name: str, extra: dict | None = None) -> None:
    print()
    print(table.render())
    json_path = table.save(name, extra)
    png = table.plot(name)
    print(f"\nwrote {json_path}" + (f" and {png}" if png else ""))


# -- a real pool process with two emulated hypervisor hosts ---------------------------
# hostA is IPv4 loopback (127.0.0.0/8), hostB is IPv6 loopback (::1): the pool
# listens on both, so a driver "moves" from A to B by reconnecting over the
# other address family (as tests/continuity/conftest.py does, without root).
BENCH_TOKEN = "bench-token-0001"
HOST_SECRETS = {"hostA": "hostA-bench-secret-0123456789", "hostB": "hostB-bench-secret-9876543210"}
HOST_NETWORKS = {"hostA": "127.0.0.0/8", "hostB": "::1/128"}


class TwoHostPool:
    """``accelmig-pool serve`` in its own process, listening on 127.0.0.1 and
    [::1], with hostA/hostB in its hosts file.  ``env`` adds to its
    environment (e.g. ``{"POCL_KERNEL_CACHE": "0"}``)."""

    def __init__(self, workdir: str, *, quota: str = "16GiB", env: dict | None = None,
                 extra_args: tuple = ()):
        import subprocess
        import sys
        self.workdir = workdir
        tokens = os.path.join(workdir, "tokens.toml")
        with open(tokens, "w") as handle:
            # max_sessions: the storm bench opens up to --sessions at once
            handle.write(f'[tenants.bench]\ntoken = "{BENCH_TOKEN}"\nquota = "{quota}"\n'
                         f'max_sessions = 1024\n')
        hosts = os.path.join(workdir, "hosts.toml")
        with open(hosts, "w") as handle:
            for name, secret in HOST_SECRETS.items():
                handle.write(f'[hosts.{name}]\nsecret = "{secret}"\naddresses = ["{HOST_NETWORKS[name]}"]\n')
        self.log_path = os.path.join(workdir, "pool.log")
        exe = os.path.join(os.path.dirname(sys.executable), "accelmig-pool")
        argv = [exe, "serve", "--listen", "127.0.0.1:0,[::1]:0", "--control-listen", "127.0.0.1:0",
                "--hosts", hosts, "--tokens", tokens, "--admin-socket", os.path.join(workdir, "pool.sock"),
                "--log-level", "WARNING", "--log-format", "text", "--insecure", *extra_args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True,
                                         env={**os.environ, **(env or {})})
        line = self.proc.stdout.readline()
        if not line:
            self.stop()
            raise RuntimeError(f"accelmig-pool did not start: {self.log_tail()}")
        self.ready = json.loads(line)
        port = self.ready["data"].rsplit(":", 1)[1]
        self.endpoints = {"hostA": f"127.0.0.1:{port}", "hostB": f"[::1]:{port}"}
        self.control_endpoint = self.ready["control"]
        self.admin_socket = os.path.join(workdir, "pool.sock")

    def host(self, name: str) -> "BenchHost":
        return BenchHost(self, name)

    def admin_call(self, method: str, **args):
        from accelmig.wire.control import ControlClient
        with ControlClient("unix:" + self.admin_socket, "admin", None) as client:
            return client.call_all(method, **args)

    def session(self, sid: str) -> dict:
        return next(s for s in self.admin_call("list_sessions")["sessions"] if s["sid"] == sid)

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, errors="replace") as handle:
                return handle.read()[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        stop_process(self.proc)


class BenchHost:
    """A hypervisor host's side of the control plane (what hostd does, by hand)."""

    def __init__(self, pool: TwoHostPool, name: str):
        from accelmig.wire.control import ControlClient
        self.name = name
        self.endpoint = pool.endpoints[name]
        self.client = ControlClient(pool.control_endpoint, name, HOST_SECRETS[name].encode())

    def call(self, method: str, **args):
        return self.client.call(method, **args)

    def bind(self, devs, domain: str) -> list[str]:
        """Bind sessions of this process's drivers to ``domain`` with their
        proofs (``driver_proofs``): the sessions bound."""
        issued = self.call("bind_challenge")
        return self.bind_proven(domain, issued["challenge"], driver_proofs(devs, issued, self.name, domain))

    def bind_proven(self, domain: str, challenge: str, proofs: dict) -> list[str]:
        """hostd's binds of what its guest proved, a batch at a time."""
        from accelmig.wire import attestation as att
        bound = []
        for batch in att.bind_batches(proofs):
            answer = self.call("bind_sessions", domain_uuid=domain, challenge=challenge, sessions=batch)
            if answer["refused"]:
                raise RuntimeError(f"{self.name}: sessions not bound: {answer['refused']}")
            bound += answer["bound"]
        return bound

    def close(self) -> None:
        self.client.close()


def driver_proofs(devs, issued: dict, host: str, domain: str) -> dict:
    """What each driver answers its guest agent's ``prove``
    (``accelmig.wire.attestation``), made here: the benches' drivers run in
    their own process, with no agent between them and the host."""
    from accelmig.wire import attestation as att
    return {dev.sid: att.bind_proof(dev._session.secret, challenge=issued["challenge"], instance=issued["instance"],
                                    host=host, domain=domain, sid=dev.sid) for dev in devs}


def migrate_record(domain: str, src: BenchHost, dst: BenchHost, close: bool = True):
    """Open, switch over and complete a migration record of ``domain`` from
    ``src`` to ``dst`` (what the hosts' hooks do), then close it (the
    source's QEMU stopped): the resume tickets, by session id.  With
    ``close=False``: (tickets, a function that closes the record)."""
    record = dst.call("open_migration", domain_uuid=domain)
    src.call("switchover", domain_uuid=domain)
    done = dst.client.call_all("complete", domain_uuid=domain, migration_id=record["migration_id"])

    def close_record():
        src.call("close", domain_uuid=domain, migration_id=record["migration_id"])
    if not close:
        return done["tickets"], close_record
    close_record()
    return done["tickets"]


def stop_process(proc, timeout: float = 10) -> None:
    """SIGTERM the process we started (by its PID), then SIGKILL if it lingers."""
    import subprocess
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)
