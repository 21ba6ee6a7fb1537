"""The lab with accelmig in it: a hostd and the hook on each host, a guest
running the demo solver on the pool, migrations, and what they cost.

Each host's hostd runs inside its libvirt daemon's own mount, network and
UTS namespaces (``nsenter``), exactly as on a real host: ``qemu:///system``
is that daemon, channel socket paths in the live XML are real paths, and
the hook (run by that daemon) reaches hostd on a socket in the lab's run
directory.  The hook is installed with ``accelmig install``, as an operator
would.  Guests boot without a fabric address: hostd tells them theirs at
first contact (a host-bound fabric: each host its own subnet).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import libvirt

from accelmig.lab import netns
from accelmig.lab.image import GuestImage, ImageSpec, build_image
from accelmig.lab.libvirtd import proc_starttime, same_process
from accelmig.lab.rig import POOL_CONTROL_PORT, POOL_DATA_PORT, Lab
from accelmig.lab.topology import BRIDGE, POOL_ADDRESS
from accelmig.wire.control import ControlClient

LOG = logging.getLogger("accelmig.lab")

TENANT = "alice"
DEMO_STEPS = 600
DEMO_SIZE = 128


def venv_bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def demo_command(token: str, steps: int, size: int, report: int, pause: float, *, prefix: str = "DEMO",
                 extra: str = "") -> str:
    """The demo solver inside the guest: it learns the pool's endpoint from
    the agent (the host told it), prints progress lines on the console,
    each after ``prefix`` and a space (``AccelLab.demo_lines(name, prefix)``);
    ``extra``: more demoapp flags (``--device name=basic --digest``)."""
    # No TLS flag here, so one cached image serves both modes: the guest's
    # environment says how to reach the pool, from the domain's kernel command
    # line (Lab.guest_tls_word): ACCELMIG_CAFILE, the lab's CA written at boot
    # (TLS), or ACCELMIG_INSECURE=1 for a lab run --insecure.
    # --token=: a token may start with "-" (one made by token_urlsafe)
    return (f"python3 -m accelmig.agent.demoapp --token={shlex.quote(token)} --steps {steps} --size {size} "
            f"--report {report} --pause {pause} --wait-endpoint 120 --timeout 120 "
            f"--prefix '{prefix} '" + (f" {extra}" if extra else ""))


class AccelLab:
    """``Lab`` + hostd/hook per host + a demo guest."""

    def __init__(self, name: str = "accelmig", **lab_options):
        lab_options.setdefault("pool", True)
        self.lab = Lab(name, **lab_options)
        self.name = name

    # -- bring-up ----------------------------------------------------------------------
    def up(self, *, strict: bool = True) -> "AccelLab":
        """Idempotent: what already runs (each daemon checked by its recorded
        pid and start time) is left alone; what is missing is started."""
        self.lab.up()
        LOG.info("lab %s: %s", self.name, f"TLS (CA {self.lab.pool_ca})" if self.lab.tls
                 else "INSECURE: plain TCP between guests, hosts and the pool (--insecure)")
        for host in self.lab.HOSTS:
            self.write_host_config(host, strict=strict)
            self.install_hook(host)
            pid = self.hostd_pid(host)
            if pid is None:
                self.start_hostd(host)
            else:
                LOG.info("hostd on %s already runs (pid %d)", host, pid)
        for host in self.lab.HOSTS:
            self.wait_hostd(host)
        return self

    def hostd_pid(self, host: str) -> int | None:
        """The pid of the hostd this lab started on ``host``, while it runs."""
        info = self.lab.state.get("processes", {}).get(f"hostd-{host}") or {}
        return info["pid"] if same_process(info.get("pid"), info.get("starttime")) else None

    def down(self) -> None:
        self.lab.down()

    def __enter__(self) -> "AccelLab":
        try:
            return self.up()
        except BaseException:        # half up (a hostd that did not start): nothing left behind
            self.down()
            raise

    def __exit__(self, *exc) -> None:
        self.down()

    def host_dir(self, host: str) -> Path:
        path = self.lab.dir / f"accelmig-{host}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def config_path(self, host: str) -> Path:
        return self.host_dir(host) / "host.toml"

    def hostd_socket(self, host: str) -> Path:
        return self.host_dir(host) / "hostd.sock"

    def write_host_config(self, host: str, *, strict: bool = True) -> Path:
        plan = self.lab.topology.host(host)
        hdir = self.host_dir(host)
        secret = hdir / "host.secret"
        secret.write_text(self.lab.state["host_secrets"][host])
        os.chmod(secret, 0o600)
        config = self.config_path(host)
        config.write_text(f"""# accelmig host config for lab {self.name}, {host}
[host]
id = "{host}"
[pool]
endpoint = "{POOL_ADDRESS}:{POOL_DATA_PORT}"
control = "{POOL_ADDRESS}:{POOL_CONTROL_PORT}"
secret_file = "{secret}"
{self._tls_lines(host)}
[fabric]
mode = "bridge"
bridge = "{BRIDGE}"
guest_subnet = "{plan.guest_subnet}"
gateway = "{plan.gateway}"
routes = [{", ".join(f'"{a}/32"' for a in self.lab.topology.pool_addresses())}]
[hostd]
socket = "{self.hostd_socket(host)}"
state_dir = "{hdir / 'state'}"
strict = {"true" if strict else "false"}
hook_timeout = 5.0
libvirt_uri = "qemu:///system"
""")
        return config

    def _tls_lines(self, host: str) -> str:
        """host.toml's [pool] TLS keys: the lab's CA and ``host``'s client
        certificate (mutual TLS), or ``insecure`` for a lab run --insecure."""
        cert = self.lab.host_cert(host)
        if cert is None:
            return "insecure = true          # the lab runs --insecure: plain TCP (lab/rig.py)"
        return (f'ca_file = "{self.lab.pool_ca}"\n'
                f'cert_file = "{cert[0]}"\n'
                f'key_file = "{cert[1]}"')

    def install_hook(self, host: str) -> dict:
        node = self.lab.node(host)
        out = subprocess.run([venv_bin("accelmig"), "install", "--hooks-dir", str(node.hooks_dir.parent),
                              "--libvirtd-pid-file", str(node.pid_file), "--config",
                              str(self.config_path(host)), "--json"],
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"accelmig install on {host} failed: {out.stderr.strip()}")
        return json.loads(out.stdout)

    def set_strict(self, host: str, strict: bool) -> None:
        """The hook reads the config at every call: no restart needed."""
        self.write_host_config(host, strict=strict)

    def start_hostd(self, host: str) -> subprocess.Popen:
        node = self.lab.node(host)
        key = f"hostd-{host}"
        argv = ["nsenter", "--target", str(node.pid), "--mount", "--net", "--uts", "--",
                venv_bin("accelmig"), "hostd", "--config", str(self.config_path(host)), "--log-format",
                "text", "--log-level", "INFO"]
        log = self.host_dir(host) / "hostd.log"
        self.lab._record_process(key, None, argv=argv)
        out = open(log, "ab")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
        out.close()
        self.lab._popens[key] = proc
        self.lab._record_process(key, proc.pid, argv=argv)
        return proc

    def stop_hostd(self, host: str) -> None:
        self.lab.stop_spawned(f"hostd-{host}")
        with contextlib.suppress(FileNotFoundError):
            self.hostd_socket(host).unlink()

    def wait_hostd(self, host: str, timeout: float = 30.0) -> dict:
        from accelmig.wire.localapi import LocalClient
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                ping = LocalClient(str(self.hostd_socket(host)), timeout=2).call("ping")
                if ping.get("pool") and ping.get("libvirt"):
                    return ping
                last = ping
            except Exception as exc:  # not up yet
                last = exc
            time.sleep(0.1)
        raise TimeoutError(f"hostd on {host} not ready in {timeout} s: {last}; "
                           f"see {self.host_dir(host) / 'hostd.log'}")

    def hostd_log(self, host: str) -> str:
        with contextlib.suppress(OSError):
            return (self.host_dir(host) / "hostd.log").read_text()
        return ""

    # -- the pool -------------------------------------------------------------------------
    @property
    def token(self) -> str:
        return self.lab.tenants[TENANT][0]

    def admin(self, node: str = "pool") -> ControlClient:
        """Pool node ``node``'s admin socket (``pool2``: the second node of a
        pool of two)."""
        return ControlClient("unix:" + str(self.lab.pool_admin_socket(node)), "admin", None)

    def sessions(self, domain_uuid: str | None = None, node: str = "pool") -> list[dict]:
        with self.admin(node) as admin:
            return admin.call_all("list_sessions", domain_uuid=domain_uuid)["sessions"]

    def records(self, domain_uuid: str | None = None, node: str = "pool") -> list[dict]:
        with self.admin(node) as admin:
            return admin.call_all("list_records", domain_uuid=domain_uuid)["records"]

    COUNTED = ("builds", "bytes_uploaded", "source_bytes")

    def counters(self) -> dict:
        """Per session id (every session: a VM without the accelmig channel
        has its sessions attested to its domain only at its destination)."""
        return {s["sid"]: {k: s["counters"][k] for k in self.COUNTED} for s in self.sessions()}

    # -- guests --------------------------------------------------------------------------
    def image(self, *, app_command: str | None = None, **spec) -> GuestImage:
        return build_image(ImageSpec(app_command=app_command, **spec), cache=self.lab.cache)

    def demo_image(self, steps: int = DEMO_STEPS, size: int = DEMO_SIZE, report: int = 20,
                   pause: float = 0.05) -> GuestImage:
        return self.image(app_command=demo_command(self.token, steps, size, report, pause))

    def boot(self, name: str, image: GuestImage, host: str = "hostA", **values) -> libvirt.virDomain:
        cmdline = image.cmdline(**values.pop("cmdline_options", {}))
        xml = self.lab.domain_xml(name, image, host, cmdline=cmdline, **values)
        return self.lab.connect(host).createXML(xml, 0)

    def where(self, name: str) -> str | None:
        for host in self.lab.HOSTS:
            with contextlib.suppress(libvirt.libvirtError):
                dom = self.lab.connect(host).lookupByName(name)
                if dom.isActive():
                    return host
        return None

    def console(self, name: str) -> list[str]:
        """Console lines of ``name`` from both hosts, oldest first (a migrated
        guest's console goes on in the destination's log)."""
        lines = []
        for host in self.lab.HOSTS:
            path = self.lab.console_log(host, name)
            with contextlib.suppress(OSError):
                stamp = path.stat().st_mtime
                lines.append((stamp, path.read_text(errors="replace").splitlines()))
        return [line for _, chunk in sorted(lines) for line in chunk]

    def demo_lines(self, name: str, prefix: str = "DEMO") -> list[dict]:
        """The demo's JSON records on the console (those of the application
        whose ``--prefix`` is ``prefix`` followed by a space). A record is
        decoded up to its own end: another writer on the shared console (an
        older guest image's two-write print, the kernel) may have appended
        to its line."""
        decoder = json.JSONDecoder()
        marker = f"{prefix} {{"
        out = []
        for line in self.console(name):
            if marker in line:
                with contextlib.suppress(ValueError):
                    out.append(decoder.raw_decode(line, line.index(marker) + len(marker) - 1)[0])
        return out

    def wait_demo(self, name: str, predicate, timeout: float = 180.0, what: str = "demo progress",
                  prefix: str = "DEMO"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.demo_lines(name, prefix)
            value = predicate(lines)
            if value:
                return value
            time.sleep(0.2)
        raise TimeoutError(f"{what} not reached in {timeout} s; console:\n" + "\n".join(self.console(name)[-40:]))

    def demo_done(self, name: str, timeout: float = 300.0) -> dict:
        return self.wait_demo(name, lambda ls: next((l for l in ls if "done" in l), None), timeout, "demo end")

    def reference(self, steps: int = DEMO_STEPS, size: int = DEMO_SIZE, *, device: str | None = None,
                  report: int | None = None) -> dict:
        """The same solver, never migrated: run from hostA's namespace, opened
        at the pool's first node (placed by the pool, like any open).
        ``device``: its device selector; ``report``: print the iterate's
        SHA-256 every ``report`` steps (``digests``: step -> SHA-256, to
        compare with an application's own ``--digest`` lines)."""
        argv = [sys.executable, "-m", "accelmig.agent.demoapp", "--endpoint", f"{POOL_ADDRESS}:{POOL_DATA_PORT}",
                "--token", self.token, "--steps", str(steps), "--size", str(size),
                "--report", str(report or steps), *(["--digest"] if report else []),
                *(["--device", device] if device else []),
                *(["--cafile", self.lab.pool_ca] if self.lab.tls else ["--insecure"])]
        out = subprocess.run(netns.exec_argv(self.lab.ns_of("hostA"), argv), capture_output=True, text=True,
                             timeout=300)
        if out.returncode != 0:
            raise RuntimeError(f"reference run failed: {out.stderr[-2000:]}")
        lines = [json.loads(line) for line in out.stdout.strip().splitlines()]
        result = lines[-1]
        if report:
            result["digests"] = {line["step"]: line["sha256"] for line in lines if "step" in line}
            result["opened"] = next((line for line in lines if line.get("opened")), None)
        return result

    # -- migrations -----------------------------------------------------------------------
    def virsh(self, host: str, *args, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["virsh", "-c", self.lab.uri(host), *args], capture_output=True, text=True,
                              timeout=timeout)

    def migrate_virsh(self, name: str, src: str, dst: str, *extra, transport: str = "tcp") -> dict:
        """``virsh migrate --live --p2p`` — no accelmig command involved
        (``transport="ssh"``: to ``qemu+ssh://root@DST/system``)."""
        uuid = self.lab.connect(src).lookupByName(name).UUIDString()
        before = self.counters()
        dest_uri, migrate_uri = self.lab.migration_uris(dst, transport)
        started = time.monotonic()
        out = self.virsh(src, "migrate", "--live", "--p2p", *extra, name, dest_uri, "--migrateuri", migrate_uri)
        wall = time.monotonic() - started
        via = "virsh" if transport == "tcp" else f"virsh qemu+{transport}"
        if out.returncode != 0:
            return {"ok": False, "error": out.stderr.strip(), "wall_s": wall, "via": via}
        return self._measure(name, uuid, dst, before, wall, via)

    def migrate_accelmig(self, name: str, src: str, dst: str, *extra, transport: str = "tcp") -> dict:
        uuid = self.lab.connect(src).lookupByName(name).UUIDString()
        before = self.counters()
        dest_uri, migrate_uri = self.lab.migration_uris(dst, transport)
        started = time.monotonic()
        out = subprocess.run([venv_bin("accelmig"), "migrate", name, dest_uri, "--migrate-uri", migrate_uri,
                              "--connect", self.lab.uri(src), "--config", str(self.config_path(src)),
                              "--json", *extra], capture_output=True, text=True, timeout=300)
        wall = time.monotonic() - started
        via = "accelmig migrate" if transport == "tcp" else f"accelmig qemu+{transport}"
        if out.returncode not in (0, 1) or not out.stdout.strip():
            return {"ok": False, "error": out.stderr.strip(), "wall_s": wall, "via": via}
        result = self._measure(name, uuid, dst, before, wall, via)
        result["cli"] = json.loads(out.stdout)
        return result

    def rehome_here(self, name: str, host: str, address: str = "lease", timeout: float = 60.0) -> dict:
        """hostd's ``rehome_here`` of ``name`` on ``host``, where it runs and
        stays (the warm baseline of a migration's rehome): its answer."""
        from accelmig.wire.localapi import LocalClient
        uuid = self.lab.connect(host).lookupByName(name).UUIDString()
        return LocalClient(str(self.hostd_socket(host)), timeout=timeout).call(
            "rehome_here", uuid=uuid, address=address)

    def wait_rehomed(self, uuid: str, dst: str, after: float, timeout: float = 60.0) -> dict | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            records = [r for r in self.records(uuid) if r["dest_host"] == dst and r["times"]["opened"] >= after]
            if records:
                record = max(records, key=lambda r: r["times"]["opened"])
                if record["state"] in ("completed", "closed") and record["sessions"] and \
                        set(record["sessions"]) <= set(record["resumed"]):
                    return record
                if record["state"] == "aborted":
                    return record
            time.sleep(0.1)
        return None

    #: libvirt's completed-job statistics a migration's result carries
    JOB_STATS = ("time_elapsed", "downtime", "memory_iteration", "memory_processed", "memory_total",
                 "memory_dirty_rate", "memory_bps", "setup_time")

    def _measure(self, name: str, uuid: str, dst: str, before: dict, wall: float, via: str) -> dict:
        started = time.time() - wall - 1
        record = self.wait_rehomed(uuid, dst, started)
        stats = {}
        with contextlib.suppress(libvirt.libvirtError):
            stats = self.lab.connect(dst).lookupByName(name).jobStats(libvirt.VIR_DOMAIN_JOB_STATS_COMPLETED)
        after = self.counters()
        mine = {s["sid"] for s in self.sessions(uuid)}
        zero = dict.fromkeys(self.COUNTED, 0)
        delta = {k: sum(after[sid][k] - before.get(sid, zero)[k] for sid in mine if sid in after)
                 for k in self.COUNTED}
        resent = delta["bytes_uploaded"] + delta["source_bytes"]
        resumed = (record or {}).get("resumed") or {}
        return {"ok": record is not None and record["state"] != "aborted", "via": via, "to": dst,
                "wall_s": round(wall, 3), "downtime_ms": stats.get("downtime"),
                # the migration itself, as QEMU saw it (pre-copy rounds, bytes, the guest's dirtying)
                "job": {k: stats[k] for k in self.JOB_STATS if k in stats},
                "blackout_ms": {sid[-6:]: round(v * 1000, 1) for sid, v in resumed.items()},
                "sessions": len((record or {}).get("sessions") or []), "resumed": len(resumed),
                "bytes_resent": resent, "rebuilds": delta["builds"],
                "record": record}

    # -- by hand -------------------------------------------------------------------------
    def env_lines(self, domain: str | None = None) -> list[str]:
        env = self.lab.env()
        a, b = env["hosts"]["hostA"], env["hosts"]["hostB"]
        lines = [f"ACCELMIG_LAB={self.name}",
                 f"HOSTA_URI='{a['uri']}'", f"HOSTB_URI='{b['uri']}'",
                 f"HOSTA_P2P_URI={a['p2p_uri']}", f"HOSTB_P2P_URI={b['p2p_uri']}",
                 f"HOSTA_MIGRATE_URI={a['migrate_uri']}", f"HOSTB_MIGRATE_URI={b['migrate_uri']}",
                 f"HOSTA_CONFIG={self.config_path('hostA')}", f"HOSTB_CONFIG={self.config_path('hostB')}",
                 f"POOL_DATA={env['pool']['data']}", f"POOL_CONTROL={env['pool']['control']}",
                 f"POOL_ADMIN_SOCKET={env['pool'].get('admin_socket', '')}",
                 f"POOL_TLS={'yes' if env['pool']['tls'] else 'no'}",
                 f"TENANT_BRIDGE={env['tenant']['bridge']}", f"TENANT_SUBNET={env['tenant']['subnet']}",
                 f"TENANT_GATEWAY={env['tenant']['gateway']}"]
        if a["ssh_uri"]:
            lines += [f"HOSTA_SSH_URI={a['ssh_uri']}", f"HOSTB_SSH_URI={b['ssh_uri']}"]
        if "nodes" in env["pool"]:          # a pool of two nodes (accelmig lab up --pool-nodes 2)
            pool2 = env["pool"]["nodes"]["pool2"]
            lines += [f"POOL2_DATA={pool2['data']}", f"POOL2_CONTROL={pool2['control']}",
                      f"POOL2_ADMIN_SOCKET={pool2['admin_socket']}", f"POOL2_NETNS={pool2['netns']}",
                      f"ETCD_URL={env['pool']['etcd']['url']}", f"ETCD_NETNS={env['pool']['etcd']['netns']}"]
        if env["pool"]["tls"]:
            lines.append(f"ACCELMIG_CAFILE={env['pool']['ca']}")
        if domain:
            lines.append(f"DOMAIN={domain}")
        return lines


def pids_alive(state: dict) -> dict:
    return {key: info.get("pid") for key, info in state.get("processes", {}).items()
            if info.get("pid") and proc_starttime(info["pid"]) == info.get("starttime")}
