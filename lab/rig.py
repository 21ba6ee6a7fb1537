"""The lab rig: topology + two libvirt daemons (+ optionally a pool) on this
machine, behind ``Lab.up()`` / ``Lab.down()``.

Crash safety is the point of the design: ``up()`` writes the state file
(JSON under the lab's directory) **before** each resource is created —
namespaces, directories, processes — and again once a process's PID is
known, so a ``down()`` from any later process (``accelmig lab down``,
the next test run) finds and removes everything
a crashed ``up()`` or a killed test left behind.  ``down()`` is idempotent
and also sweeps by identity rather than by memory: every process still
inside one of the lab's network namespaces is stopped (found by namespace
inode, never by process name), then the namespaces go, then the lab's
directory.

``env()`` says how to drive the lab by hand with plain ``virsh``.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import ssl

import libvirt

from accelmig.plugin.domain import AGENT_CHANNEL_NAME
from accelmig.plugin.domain.render import render
from accelmig.runtime.files import atomic_write

from . import certs, netns
from .guest import ResponderChannel, channel_source
from .image import DEFAULT_CACHE, GuestImage
from .libvirtd import LibvirtNode, proc_starttime, same_process, stop_process
from .topology import (BRIDGE, ETCD_ADDRESS, ETCD_CLIENT_PORT, ETCD_PEER_PORT, POOL_ADDRESS, TENANT_BRIDGE,
                       TENANT_GATEWAY, TENANT_GATEWAY_HOST, TENANT_SUBNET, Topology)

LOG = logging.getLogger("accelmig.lab.rig")

DEFAULT_BASE = Path(os.environ.get("ACCELMIG_LAB_DIR", "/run/accelmig-lab"))
POOL_DATA_PORT = 7070
POOL_CONTROL_PORT = 7071
DEFAULT_TENANTS = {"alice": ("alice-lab-token-0001", "1GiB"), "bob": ("bob-lab-token-00002", "1GiB")}
MIGRATION_PORTS = {"hostA": (49152, 49167), "hostB": (49168, 49183)}
#: ``ACCELMIG_LAB_INSECURE=1``: labs run their pool on plain TCP (debugging),
#: as ``accelmig lab up --insecure`` does.
INSECURE_ENV = "ACCELMIG_LAB_INSECURE"
#: Where a lab guest finds the pool's CA: ``/etc/accelmig/lib.sh`` writes it
#: from the kernel command line's ``accelmig.pool_ca=`` (base64 DER) and
#: exports ``ACCELMIG_CAFILE`` to every guest service and application.
GUEST_CA_PATH = "/run/accelmig/pool-ca.crt"
#: A pool of two nodes: which PoCL device each node serves (``POCL_DEVICES``
#: of its process): two different devices, so a device selector decides
#: the node a session lands on.
NODE_POCL_DEVICES = {"pool": "pthread", "pool2": "basic"}
#: The nodes' etcd lease in the lab (``--cluster-ttl``): short, so a killed
#: node leaves the pool within seconds (the pool's default is 10 s).
DEFAULT_CLUSTER_TTL = 3.0
ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def env_insecure() -> bool:
    return os.environ.get(INSECURE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


# ---------------------------------------------------------------- KVM or TCG

def kvm_status() -> tuple[bool, str]:
    """Whether KVM can boot a stock guest kernel here, and why (not).

    ``/dev/kvm`` existing is not enough: these machines have **kvm-pvm**,
    which only runs PVM-patched guest kernels (a stock Debian kernel never
    gets past its decompressor, ``type='kvm'`` hangs or is refused).
    """
    if not os.path.exists("/dev/kvm"):
        return False, "no /dev/kvm"
    if os.path.isdir("/sys/module/kvm_pvm"):
        return False, "/dev/kvm is kvm-pvm (boots only PVM guest kernels)"
    vendor = next((m for m in ("kvm_intel", "kvm_amd") if os.path.isdir(f"/sys/module/{m}")), None)
    if vendor is None:
        return False, "neither kvm_intel nor kvm_amd is loaded"
    try:
        os.close(os.open("/dev/kvm", os.O_RDWR))
    except OSError as exc:
        return False, f"/dev/kvm: {exc.strerror}"
    return True, f"{vendor} on /dev/kvm"


def probe_kvm_boot(image: GuestImage, timeout: float = 15.0) -> bool:
    """Boot ``image`` under ``-accel kvm`` for real and see whether its /init
    speaks within ``timeout`` (the "try and time out" check, for when the
    heuristics of :func:`kvm_status` are not trusted)."""
    import tempfile
    with tempfile.TemporaryDirectory(prefix="accelmig-kvm-probe-") as tmp:
        console = Path(tmp) / "console.log"
        cmd = ["qemu-system-x86_64", "-accel", "kvm", "-M", "pc", "-m", "256", "-nodefaults",
               "-no-user-config", "-display", "none", "-no-reboot", "-kernel", str(image.kernel),
               "-initrd", str(image.initrd), "-append", "console=ttyS0 panic=-1 accelmig.agent=off",
               "-serial", f"file:{console}"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and proc.poll() is None:
                if console.exists() and b"accelmig-guest[init]" in console.read_bytes():
                    return True
                time.sleep(0.1)
            return False
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def detect_virt_type(setting: str | None = None) -> str:
    """``qemu`` (TCG) or ``kvm``: ``setting`` (or $ACCELMIG_LAB_VIRT) may be
    ``qemu``, ``kvm`` or ``auto``; auto picks KVM only when it can boot a
    stock kernel, TCG when unsure."""
    setting = (setting or os.environ.get("ACCELMIG_LAB_VIRT") or "auto").lower()
    if setting in ("qemu", "tcg"):
        return "qemu"
    if setting == "kvm":
        return "kvm"
    if setting != "auto":
        raise ValueError(f"virt type {setting!r}: use qemu, kvm or auto")
    usable, why = kvm_status()
    LOG.info("KVM %s: %s", "usable" if usable else "not usable", why)
    return "kvm" if usable else "qemu"


def guest_mac(name: str) -> str:
    """A stable MAC per domain name (QEMU's 52:54:00 prefix, unicast), so a
    domain keeps its MAC across labs and runs."""
    digest = hashlib.sha256(name.encode()).digest()
    return "52:54:00:%02x:%02x:%02x" % (digest[0], digest[1], digest[2])


# ---------------------------------------------------------------- the lab

class Lab:
    """One lab: ``<name>-pool``, ``<name>-hostA``, ``<name>-hostB``.

    ::

        with Lab("lab1") as lab:          # up() ... down()
            xml = lab.domain_xml("vm1", image, "hostA")
            lab.connect("hostA").createXML(xml)
    """

    HOSTS = ("hostA", "hostB")
    #: the hosts the pool knows (its hosts file, a client certificate each):
    #: the two above, and hostC, which runs no libvirt of the lab's — a third
    #: hypervisor host with a valid certificate and secret, for the tests of
    #: what one host may do to another's VMs (it calls from a host's namespace)
    CONTROL_HOSTS = ("hostA", "hostB", "hostC")

    def __init__(self, name: str = "lab", *, base_dir: Path | str = DEFAULT_BASE,
                 cache: Path | str = DEFAULT_CACHE, virt_type: str | None = None,
                 pool: bool = False, tenants: dict | None = None, pool_args: list | None = None,
                 insecure: bool | None = None, pool_nodes: int | None = None,
                 cluster_ttl: float = DEFAULT_CLUSTER_TTL):
        self.name = name
        # pool_nodes=2: a second pool node (pool2) and etcd, each in a namespace
        # of its own (lab/topology.py); None: what a running lab's state file
        # says, else 1
        self._pool_nodes_wanted = pool_nodes
        self.topology = Topology(name, pool_nodes or 1)
        self.cluster_ttl = cluster_ttl
        self.dir = Path(base_dir) / name
        self.state_file = self.dir / "state.json"
        self.cache = Path(cache)
        self._virt_setting = virt_type
        self._virt_type: str | None = None
        self.want_pool = pool
        self.pool_args = list(pool_args or [])     # extra 'accelmig-pool serve' flags (e.g. --lease-ttl)
        self.tenants = dict(tenants or DEFAULT_TENANTS)
        self.state: dict = {}
        self.nodes: dict[str, LibvirtNode] = {}
        self._popens: dict[str, subprocess.Popen] = {}
        self._conns: dict[str, libvirt.virConnect] = {}
        self.timings: dict[str, float] = {}
        # TLS (the default) or plain TCP, said explicitly: ``insecure``, else
        # what a running lab's state file says, else $ACCELMIG_LAB_INSECURE.
        self._insecure_setting = insecure
        if self.state_file.exists():
            self._load_state()

    @property
    def insecure(self) -> bool:
        if self._insecure_setting is not None:
            return self._insecure_setting
        if "insecure" in self.state:
            return bool(self.state["insecure"])
        return env_insecure()

    # ------------------------------------------------------------ state file

    def _write_state(self):
        """Atomically (write + rename): a crash never leaves half a state file."""
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.state_file, json.dumps(self.state, indent=1, sort_keys=True))

    def _load_state(self):
        try:
            self.state = json.loads(self.state_file.read_text())
        except (OSError, ValueError) as exc:
            LOG.warning("unreadable state file %s (%s): down() will sweep by name", self.state_file, exc)
            self.state = {}
            return
        if self.state.get("pool_nodes", 1) != self.topology.pool_nodes:
            self.topology = Topology(self.name, self.state["pool_nodes"])
        if self.state.get("cluster_ttl"):
            self.cluster_ttl = self.state["cluster_ttl"]
        for host, node_state in self.state.get("nodes", {}).items():
            self.nodes[host] = self._node(host, node_state)
        if self.state.get("virt_type"):
            self._virt_type = self.state["virt_type"]

    def _node(self, host: str, saved: dict | None = None) -> LibvirtNode:
        saved = saved or {}
        node = LibvirtNode(
            name=host, root=self.dir / host, netns=self.topology.host_ns[host],
            hostname=f"{self.name}-{host}", tcp_port=16509,
            migration_ports=MIGRATION_PORTS[host], etc_hosts=self.topology.etc_hosts(),
            caps_cache=self.cache / "qemu-capabilities")
        for key in ("host_uuid", "pid", "pid_starttime", "reaper_pid", "reaper_starttime"):
            if saved.get(key) is not None:
                setattr(node, key, saved[key])
        return node

    def _record_process(self, key: str, pid: int | None, **extra):
        self.state.setdefault("processes", {})[key] = {"pid": pid, "starttime": proc_starttime(pid) if pid else None,
                                                      **extra}
        self._write_state()

    @property
    def virt_type(self) -> str:
        if self._virt_type is None:
            self._virt_type = detect_virt_type(self._virt_setting)
        return self._virt_type

    # ------------------------------------------------------------ up

    def is_up(self) -> bool:
        return (self.state.get("status") == "up"
                and all(node.running() for node in self.nodes.values())
                and len(self.nodes) == len(self.HOSTS)
                and set(self.topology.exists()) == set(self.topology.namespaces))

    def pool_running(self, node: str = "pool") -> bool:
        return self.process_running(node)

    def process_running(self, key: str) -> bool:
        """Whether the process recorded under ``key`` (``pool``, ``pool2``,
        ``etcd``, ...) still runs: the same PID *and* start time."""
        info = self.state.get("processes", {}).get(key) or {}
        return same_process(info.get("pid"), info.get("starttime"))

    @property
    def pool_nodes(self) -> list[str]:
        """The pool's nodes: ``["pool"]``, or ``["pool", "pool2"]`` with etcd."""
        return list(self.topology.pool_plans)

    @property
    def cluster(self) -> bool:
        return self.topology.pool_nodes > 1

    def up(self) -> "Lab":
        """Build the topology, start both daemons (and the pool if asked).
        A lab that is already fully up is left as it is (a pool that died is
        started again, nothing else touched); leftovers of a crashed one are
        removed first."""
        if self.is_up():
            running_insecure = bool(self.state.get("insecure", False))
            if self._insecure_setting is not None and self._insecure_setting != running_insecure:
                raise RuntimeError(f"lab {self.name} is up with {'plain TCP' if running_insecure else 'TLS'}: "
                                   f"take it down first (accelmig lab down --name {self.name})")
            if self._pool_nodes_wanted is not None and self.state.get("pool_nodes", 1) != self._pool_nodes_wanted:
                raise RuntimeError(f"lab {self.name} is up with {self.state.get('pool_nodes', 1)} pool node(s), "
                                   f"not {self._pool_nodes_wanted}: take it down first "
                                   f"(accelmig lab down --name {self.name})")
            restarted = False
            if self.want_pool and self.cluster and not self.process_running("etcd"):
                LOG.warning("lab %s: its etcd is not running: starting it again", self.name)
                self.start_etcd()
                restarted = True
            for node in self.pool_nodes if self.want_pool else ():
                if not self.pool_running(node):
                    LOG.warning("lab %s: its pool node %s is not running: starting it again", self.name, node)
                    self.start_pool_node(node)
                    restarted = True
            if not restarted:
                LOG.info("lab %s is already up", self.name)
            return self
        if self.state_file.exists() or self.topology.exists():
            LOG.info("lab %s: cleaning up leftovers first", self.name)
            self.down()
        t0 = time.monotonic()
        self.state = {"name": self.name, "dir": str(self.dir), "status": "starting",
                      "created": time.time(), "namespaces": self.topology.namespaces,
                      "netns_dir_before": self._note_netns_dir(), "dirs": [str(self.dir)],
                      "mounts": [], "processes": {}, "nodes": {}, "virt_type": self.virt_type,
                      "insecure": self.insecure, "pool_nodes": self.topology.pool_nodes,
                      "cluster_ttl": self.cluster_ttl}
        self._write_state()           # before anything exists
        try:
            self.topology.up()
            self.timings["topology"] = time.monotonic() - t0
            self._start_daemons()
            self._start_ssh()
            if self.want_pool:
                if self.cluster:
                    self.start_etcd()
                for node in self.pool_nodes:
                    self.start_pool_node(node)
        except BaseException:
            LOG.error("lab %s failed to come up: tearing down", self.name)
            with contextlib.suppress(Exception):
                self.down()
            raise
        self.state["status"] = "up"
        self._write_state()
        self.timings["up"] = time.monotonic() - t0
        LOG.info("lab %s up in %.2f s (%s)", self.name, self.timings["up"],
                 ", ".join(f"{k} {v:.2f} s" for k, v in self.timings.items() if k != "up"))
        return self

    def _start_daemons(self):
        for host in self.HOSTS:
            node = self._node(host)
            self.nodes[host] = node
            self.state["nodes"][host] = node.state()
            # libvirt's bind mounts exist only inside the node's own mount
            # namespace; recorded so down() can verify none leaked out.
            self.state["mounts"] += [str(node.root / sub) for sub in ("etc", "run", "lib", "cache", "log")]
        self._write_state()
        caps = self.cache / "qemu-capabilities"
        have_caps = caps.is_dir() and any(caps.glob("*.xml"))
        order = [list(self.HOSTS)] if have_caps else [[self.HOSTS[0]], list(self.HOSTS[1:])]
        for batch in order:
            t0 = time.monotonic()
            for host in batch:
                node = self.nodes[host]
                node.start()
                self.state["nodes"][host] = node.state()
                self._write_state()
            for host in batch:
                node = self.nodes[host]
                node.wait_ready()
                self.state["nodes"][host] = node.state()
                self._write_state()
            # libvirt probes QEMU lazily, on the first request that needs
            # it (1.5 s here; ~0.05 s from a valid cache).  Ask now, in
            # parallel, so no boot or incoming migration pays for it, and
            # keep the first node's cache for the next lab (libvirt re-probes
            # by itself when QEMU or libvirt changed).
            with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
                list(pool.map(self._warm_caps, batch))
            self.nodes[batch[0]].save_caps_cache()
            self.timings["daemons " + "+".join(batch)] = time.monotonic() - t0

    def _start_ssh(self):
        """An sshd per host for qemu+ssh migrations (lab/ssh.py); without
        openssh-server the lab runs on, migrating over TCP only, and says so."""
        from .ssh import LabSsh, available
        missing = available()
        self.state["ssh"] = missing is None
        if missing:
            LOG.warning("lab %s: NO qemu+ssh between the hosts: %s", self.name, missing)
            return
        t0 = time.monotonic()
        LabSsh(self).up()
        self._write_state()
        self.timings["sshd"] = time.monotonic() - t0

    @property
    def ssh(self) -> bool:
        """Whether the hosts reach each other's libvirtd over ssh (qemu+ssh)."""
        return bool(self.state.get("ssh"))

    def _warm_caps(self, host: str):
        with contextlib.closing(self.nodes[host].connect()) as conn:
            conn.getDomainCapabilities(None, None, None, self.virt_type, 0)

    # ------------------------------------------------------------ processes in namespaces

    def ns_of(self, node: str) -> str:
        """The network namespace of ``pool``, ``hostA`` or ``hostB`` (and of
        ``pool2`` and ``etcd`` in a pool of two nodes)."""
        if node == "etcd" and self.topology.etcd_ns:
            return self.topology.etcd_ns
        if node in self.topology.node_ns:
            return self.topology.node_ns[node]
        return self.topology.host_ns[node]

    def spawn(self, key: str, node: str, argv: list[str], *, log: Path | None = None,
              stdout=None, env: dict | None = None) -> subprocess.Popen:
        """Run ``argv`` inside a lab node's network namespace, recorded in the
        state file (``down()`` stops it); ``env``: variables added to ours."""
        self._record_process(key, None, netns=self.ns_of(node), argv=argv, env=env or {})
        out = open(log, "ab") if log else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(netns.exec_argv(self.ns_of(node), argv),
                                    stdin=subprocess.DEVNULL, stdout=stdout if stdout is not None else out,
                                    stderr=out, start_new_session=True,
                                    env={**os.environ, **env} if env else None)
        finally:
            if log:
                out.close()
        self._popens[key] = proc
        self._record_process(key, proc.pid, netns=self.ns_of(node), argv=argv, env=env or {})
        return proc

    def stop_spawned(self, key: str, timeout: float = 5.0):
        info = self.state.get("processes", {}).get(key)
        if info:
            stop_process(info["pid"], info["starttime"], timeout=timeout, popen=self._popens.get(key))
            self.state["processes"].pop(key, None)
            self._popens.pop(key, None)
            self._write_state()

    def machine_root(self, node: str) -> Path:
        """Where ``node``'s machine directories are (lab/machine.py)."""
        from .ssh import LabSsh
        return LabSsh(self).pool_root if node == "pool" else self.nodes[node].root

    def machine_path(self, node: str, path: str) -> Path:
        """A path of ``node``'s machine (its /etc, /opt, ...) seen from here."""
        if node != "pool":
            return self.nodes[node].host_path(path)
        from . import machine
        return machine.host_path(self.machine_root(node), path)

    def start_unit(self, node: str, unit: str, log: Path | None = None) -> subprocess.Popen:
        """Start the systemd unit ``unit`` installed on ``node``
        (/etc/systemd/system) the way lab/machine.py's
        :func:`service_command` can without systemd; recorded, so
        ``down()`` stops it."""
        from . import machine
        from .ssh import LabSsh
        text = self.machine_path(node, f"/etc/systemd/system/{unit}").read_text()
        argv, preparations = machine.service_command(text, LabSsh(self).machine_pid(node))
        for step in preparations:
            subprocess.run(step, check=True, capture_output=True, timeout=30)
        key = f"unit-{node}-{unit}"
        self._record_process(key, None, argv=argv)
        log = log or self.dir / f"{key}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    start_new_session=True)
        self._popens[key] = proc
        self._record_process(key, proc.pid, argv=argv)
        return proc

    def _pool_dir(self, node: str = "pool") -> Path:
        """A pool node's directory: its admin socket, stdout, log.  The
        tenants and hosts files are the first node's (``pool/``): every
        node of the pool reads the same two files."""
        return self.dir / node

    def _write_pool_files(self) -> tuple[Path, Path]:
        pdir = self._pool_dir("pool")
        pdir.mkdir(parents=True, exist_ok=True)
        tokens = pdir / "tokens.toml"
        hosts = pdir / "hosts.toml"
        secrets_by_host = self.state.setdefault("host_secrets", {})
        for h in self.CONTROL_HOSTS:
            secrets_by_host.setdefault(h, secrets.token_hex(16))
        tokens.write_text("".join(f'[tenants.{name}]\ntoken = "{token}"\nquota = "{quota}"\n\n'
                                  for name, (token, quota) in self.tenants.items()))

        def addresses(h: str) -> str:
            if h not in self.HOSTS:
                return ""                    # (no guests: no networks)
            plan = self.topology.host(h)
            # a host's own connections reach each node from its end of that node's link
            ends = [plan.uplink_address, *(node.host_end(h) for name, node in self.topology.pool_plans.items()
                                           if name != "pool")]
            return ", ".join(f'"{a}"' for a in [plan.guest_subnet, *(f"{e}/32" for e in ends)])
        hosts.write_text("".join(f'[hosts.{h}]\nsecret = "{secrets_by_host[h]}"\naddresses = [{addresses(h)}]\n\n'
                                 for h in self.CONTROL_HOSTS))
        return tokens, hosts

    def start_pool_node(self, node: str = "pool") -> dict:
        """Start pool node ``node`` (``pool``, or ``pool2`` in a pool of two
        nodes) in its namespace and wait for its ready line; returns that
        line (``instance``: new at every start).  In a pool of two nodes
        each node joins etcd under the name ``node`` with its own PoCL
        device (``NODE_POCL_DEVICES``); started again after a kill, it is
        the same name and a new instance (its join waits out the old
        instance's lease)."""
        t0 = time.monotonic()
        plan = self.topology.pool_plans[node]
        pdir = self._pool_dir(node)
        pdir.mkdir(parents=True, exist_ok=True)
        tokens, hosts = self._write_pool_files()
        exe = Path(sys.executable).with_name("accelmig-pool")
        ready = pdir / "stdout"
        ready.write_bytes(b"")
        if "--tls-cert" in self.pool_args or "--insecure" in self.pool_args:
            tls_args = []                        # the caller chose
        elif self.insecure:
            LOG.warning("lab %s: INSECURE: the pool serves plain TCP on both planes (--insecure)", self.name)
            tls_args = ["--insecure"]
        else:
            pki = self.pki()
            LOG.info("lab %s: TLS on both planes (pool certificate for %s, hosts' certificates "
                     "required on the control plane; CA %s)", self.name,
                     ", ".join(self.topology.pool_addresses()), pki["ca"])
            tls_args = ["--tls-cert", pki["pool"]["cert"], "--tls-key", pki["pool"]["key"],
                        "--tls-client-ca", pki["ca"]]
        cluster_args, env = [], None
        if self.cluster:
            cluster_args = ["--cluster", self.etcd_url, "--node-name", node,
                            "--cluster-advertise", f"{plan.address}:{POOL_DATA_PORT}",
                            "--cluster-ttl", str(self.cluster_ttl), *self.etcd_client_args("--cluster-tls-")]
            env = {"POCL_DEVICES": NODE_POCL_DEVICES[node]}
        argv = [str(exe), "serve", "--listen", f"{plan.address}:{POOL_DATA_PORT}",
                "--control-listen", f"{plan.address}:{POOL_CONTROL_PORT}",
                "--tokens", str(tokens), "--hosts", str(hosts),
                "--admin-socket", str(pdir / "pool.sock"), "--log-format", "text",
                *tls_args, *cluster_args, *self.pool_args]
        with open(ready, "ab") as out:
            proc = self.spawn(node, node, argv, log=pdir / "pool.log", stdout=out, env=env)
        # a node that joins etcd waits out a dead instance's lease under its name first
        deadline = time.monotonic() + 60 + (self.cluster_ttl if self.cluster else 0)
        while time.monotonic() < deadline:
            text = ready.read_text()
            if '"ready"' in text:
                line = json.loads(text.splitlines()[0])
                self.state[node] = {"ready": line, "dir": str(pdir)}
                self._write_state()
                self.timings[node] = time.monotonic() - t0
                LOG.info("lab %s: pool node %s ready (instance %s) on %s", self.name, node,
                         line.get("instance"), plan.address)
                return line
            if proc.poll() is not None:
                raise RuntimeError(f"accelmig-pool ({node}) exited with {proc.returncode}: "
                                   f"{(pdir / 'pool.log').read_text()[-2000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"accelmig-pool ({node}) did not report ready within 60 s")

    def kill_pool_node(self, node: str) -> dict:
        """SIGKILL pool node ``node`` by its recorded PID (no clean stop: its
        etcd lease is not revoked, it runs out), reaped before this returns.
        Returns the ready line of the instance that died."""
        info = self.state.get("processes", {}).get(node) or {}
        if not same_process(info.get("pid"), info.get("starttime")):
            raise RuntimeError(f"lab {self.name}: pool node {node} is not running")
        stop_process(info["pid"], info["starttime"], sig=signal.SIGKILL, popen=self._popens.get(node))
        self.state["processes"].pop(node, None)
        self._popens.pop(node, None)
        gone = self.state.pop(node, {}).get("ready", {})
        self._write_state()
        LOG.info("lab %s: pool node %s (pid %s, instance %s) killed", self.name, node, info["pid"],
                 gone.get("instance"))
        return gone

    def pool_node_ready(self, node: str = "pool") -> dict:
        """The ready line of the running instance of pool node ``node``."""
        return self.state[node]["ready"]

    def pool_admin_socket(self, node: str = "pool") -> Path:
        return self._pool_dir(node) / "pool.sock"

    def pool_endpoint(self, node: str = "pool", plane: str = "data") -> str:
        port = POOL_DATA_PORT if plane == "data" else POOL_CONTROL_PORT
        return f"{self.topology.pool_plans[node].address}:{port}"

    # ------------------------------------------------------------ etcd (a pool of two nodes)

    @property
    def etcd_endpoint(self) -> str:
        return f"{ETCD_ADDRESS}:{ETCD_CLIENT_PORT}"

    @property
    def etcd_tls(self) -> bool:
        """etcd over TLS, as deployed, unless the lab's pool runs --insecure
        (a pool refuses plain ``etcd://`` without it)."""
        return not (self.insecure or "--insecure" in self.pool_args)

    @property
    def etcd_url(self) -> str:
        """What the nodes' ``--cluster`` names: ``etcds://`` (etcd verified
        by the lab's CA, each node by its client certificate) on the lab's
        own cluster network, which only the two pool nodes' namespaces join;
        plain ``etcd://`` for a lab run --insecure."""
        return f"{'etcds' if self.etcd_tls else 'etcd'}://{self.etcd_endpoint}"

    def etcd_client_args(self, prefix: str = "--") -> list[str]:
        """The TLS files an etcd client of the lab presents (``--ca``,
        ``--cert``, ``--key`` after ``prefix``); none for plain etcd."""
        if not self.etcd_tls:
            return []
        pki = self.pki()
        return [f"{prefix}ca", pki["ca"], f"{prefix}cert", pki["etcd_client"]["cert"],
                f"{prefix}key", pki["etcd_client"]["key"]]

    def _etcd_dir(self) -> Path:
        return self.dir / "etcd"

    def start_etcd(self, timeout: float = 30.0):
        """etcd (Debian's etcd-server) in its own namespace, on the cluster
        network, its data under the lab's directory (kept across
        :meth:`restart_etcd`); waits for its "serving client traffic" line."""
        if not os.access(ETCD, os.X_OK):
            raise RuntimeError("a pool of two nodes needs etcd: apt-get install etcd-server")
        t0 = time.monotonic()
        edir = self._etcd_dir()
        edir.mkdir(parents=True, exist_ok=True)
        log = edir / "etcd.log"
        offset = log.stat().st_size if log.exists() else 0
        client = f"{'https' if self.etcd_tls else 'http'}://{ETCD_ADDRESS}:{ETCD_CLIENT_PORT}"
        # one member: no peer traffic ever crosses its peer URL
        peer = f"http://{ETCD_ADDRESS}:{ETCD_PEER_PORT}"
        tls_args = []
        if self.etcd_tls:
            pki = self.pki()
            tls_args = ["--cert-file", pki["etcd"]["cert"], "--key-file", pki["etcd"]["key"],
                        "--trusted-ca-file", pki["ca"], "--client-cert-auth"]
        argv = [ETCD, "--name", "lab", "--data-dir", str(edir / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"lab={peer}", "--logger", "zap", "--log-outputs", "stderr", *tls_args]
        proc = self.spawn("etcd", "etcd", argv, log=log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(log, "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
            # 3.4 with zap says it serves; later versions also "ready to serve client requests"
            if '"msg":"serving client traffic' in text or '"msg":"ready to serve client' in text:
                self.timings["etcd"] = time.monotonic() - t0
                LOG.info("lab %s: etcd serves %s", self.name, client)
                return
            if proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {proc.returncode}: {text[-2000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"etcd did not serve within {timeout} s; see {log}")

    def etcd_nodes(self) -> dict:
        """The live pool nodes as etcd holds them (read from the first node's
        namespace: etcd is on the lab's cluster network only)."""
        from .etcdview import live_nodes
        return live_nodes(self.ns_of("pool"), self.etcd_endpoint, tls_args=self.etcd_client_args())

    def etcd_watch(self, prefix: str):
        """An ``EtcdWatch`` of ``prefix`` (lab/etcdview.py), in place when
        this returns; close it (``with``)."""
        from .etcdview import EtcdWatch
        return EtcdWatch(self.ns_of("pool"), self.etcd_endpoint, prefix, tls_args=self.etcd_client_args())

    def restart_etcd(self):
        """Stop etcd (SIGTERM by its PID) and start it again on the same data:
        nothing it stored is lost; the nodes' leases live on in its data."""
        self.stop_spawned("etcd", timeout=10)
        self.start_etcd()

    # ------------------------------------------------------------ TLS

    def pki(self) -> dict:
        """The lab's throwaway PKI (``lab/certs.py``), made once per lab under
        its directory: a CA, the pool's certificate (IP SAN: the pool's
        address) and a client certificate per host; paths, as strings."""
        saved = self.state.get("pki")
        if saved and "etcd_client" in saved and set(saved.get("hosts", {})) >= set(self.CONTROL_HOSTS) and all(
                Path(p).exists() for p in (saved["ca"], saved["pool"]["cert"], saved["pool"]["key"],
                                           saved["etcd"]["cert"], saved["etcd_client"]["cert"])):
            return saved
        t0 = time.monotonic()
        # 127.0.0.1 too: a test's relay on a host's own loopback stands in for
        # the pool there (tests/e2e/test_migration.py, the pool blip)
        # every pool node's address: the nodes share one certificate, and a
        # driver redirected to pool2 checks that it names pool2's address
        made = certs.make_pki(self.dir / "pki", pool_addresses=(*self.topology.pool_addresses(), "127.0.0.1"),
                              pool_dns=(), hosts=self.CONTROL_HOSTS)
        # etcd's own (it dials its gRPC server with it too) and the pool
        # nodes' client certificate for it: the lab's etcd is etcds://, as deployed
        etcd = certs.issue(made.ca.parent, made.ca, made.ca_key, "etcd", addresses=(ETCD_ADDRESS,),
                           server_and_client=True)
        etcd_client = certs.issue(made.ca.parent, made.ca, made.ca_key, "pool-etcd", client=True)
        self.state["pki"] = {
            "ca": str(made.ca), "pool": {"cert": str(made.pool.cert), "key": str(made.pool.key)},
            "hosts": {h: {"cert": str(i.cert), "key": str(i.key)} for h, i in made.hosts.items()},
            "etcd": {"cert": str(etcd.cert), "key": str(etcd.key)},
            "etcd_client": {"cert": str(etcd_client.cert), "key": str(etcd_client.key)}}
        self._write_state()
        self.timings["pki"] = time.monotonic() - t0
        return self.state["pki"]

    @property
    def tls(self) -> bool:
        """Whether this lab's pool serves TLS (it has a PKI and is not insecure)."""
        return not self.insecure and "pki" in self.state

    @property
    def pool_ca(self) -> str | None:
        """The CA file that verifies the pool (None: plain TCP)."""
        return self.state["pki"]["ca"] if self.tls else None

    def host_cert(self, host: str) -> tuple[str, str] | None:
        """``host``'s control-plane client certificate and key (None: plain TCP)."""
        if not self.tls:
            return None
        issued = self.state["pki"]["hosts"][host]
        return issued["cert"], issued["key"]

    def control_tls(self, host: str) -> ssl.SSLContext | None:
        """What a control-plane client of ``host`` needs (``ControlClient(tls=...)``)."""
        from accelmig.wire import tls
        cert = self.host_cert(host)
        return tls.client_context(self.pool_ca, *cert) if cert else None

    def guest_tls_word(self) -> str:
        """The kernel command-line word that tells a guest how to reach the
        pool: ``accelmig.pool_ca=<the CA, base64 DER>`` (the guest writes
        it to ``GUEST_CA_PATH`` and exports ``ACCELMIG_CAFILE``) or, for a
        lab run insecure, ``accelmig.insecure=1`` (``ACCELMIG_INSECURE``);
        "" without a pool."""
        if "pool" not in self.state and not self.want_pool and "pki" not in self.state:
            return ""           # (a PKI without the lab's pool: a pool someone deployed, accelmig fleet)
        if self.insecure:
            return "accelmig.insecure=1"
        if "pki" not in self.state:
            return ""
        der = ssl.PEM_cert_to_DER_cert(Path(self.state["pki"]["ca"]).read_text())
        return "accelmig.pool_ca=" + base64.b64encode(der).decode()

    # ------------------------------------------------------------ down

    def down(self, *, keep_dir: bool = False):
        """Remove everything this lab created, whatever state it is in."""
        t0 = time.monotonic()
        for conn in self._conns.values():
            with contextlib.suppress(libvirt.libvirtError):
                conn.close()
        self._conns.clear()
        if self.state_file.exists() and not self.state:
            self._load_state()
        # 1. processes we recorded (pool nodes, helpers; etcd last, so that a
        #    node stopping cleanly can still revoke its lease), then the
        #    daemons (each reaper ends the QEMUs its libvirtd left behind)
        for key in sorted(self.state.get("processes", {}), key=lambda k: k == "etcd"):
            info = self.state["processes"][key]
            stop_process(info.get("pid"), info.get("starttime"), timeout=5, popen=self._popens.get(key))
        for host, node in list(self.nodes.items()):
            node.stop()
        # 2. anything still inside the lab's namespaces (a crash between
        #    spawning and recording a PID, a QEMU that outlived its reaper);
        #    a pool of two nodes' namespaces too, whatever the state file
        #    said (an unreadable one, a lab of one node under the same name)
        self.topology = Topology(self.name, pool_nodes=2)
        netns.stop_processes_inside(self.topology.exists())
        # 3. namespaces (links, bridges, addresses go with them)
        self.topology.down()
        self.topology = Topology(self.name, self._pool_nodes_wanted or 1)
        self._restore_netns_dir()
        # 4. no mount of ours may be left in this namespace
        self._unmount_leftovers()
        # 5. the directory
        if not keep_dir and self.dir.exists():
            shutil.rmtree(self.dir, ignore_errors=True)
        elif self.state_file.exists():
            self.state_file.unlink()
        if not keep_dir:
            with contextlib.suppress(OSError):
                self.dir.parent.rmdir()     # the base directory, once no lab uses it
        self.state = {}
        self.nodes = {}
        self._popens = {}
        LOG.info("lab %s down in %.2f s", self.name, time.monotonic() - t0)

    # Creating the first network namespace makes /run/netns a (self bind)
    # mount, as `ip netns add` does.  Whichever lab finds it absent notes
    # that in the base directory, shared by all labs, so that the last lab
    # to go down removes it even when labs overlap in time.

    @property
    def _netns_marker(self) -> Path:
        return self.dir.parent / ".netns-dir-created-by-lab.json"

    def _note_netns_dir(self) -> dict:
        before = netns.netns_dir_state()
        if not before["mounted"] and not self._netns_marker.exists():
            self._netns_marker.parent.mkdir(parents=True, exist_ok=True)
            self._netns_marker.write_text(json.dumps(before))
        return before

    def _restore_netns_dir(self):
        try:
            before = json.loads(self._netns_marker.read_text())
        except (OSError, ValueError):
            return
        netns.restore_netns_dir(before)
        if not netns.netns_dir_state()["mounted"]:
            self._netns_marker.unlink(missing_ok=True)

    # libvirt's fixed paths that a fresh machine lacks (/run/libvirt, ...) are
    # created by each daemon's reaper right before its bind mount and left in
    # place: removing one here would detach it from under every other lab
    # daemon that has a mount there (lab/reaper.py).

    def _unmount_leftovers(self):
        prefix = str(self.dir) + "/"
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f if line.split()[4].startswith(prefix)]
        for point in sorted(points, key=len, reverse=True):
            LOG.warning("unmounting leftover %s", point)
            subprocess.run(["umount", "-l", point], check=False)

    def __enter__(self) -> "Lab":
        return self.up()

    def __exit__(self, *exc):
        self.down()

    # ------------------------------------------------------------ using it

    def node(self, host: str) -> LibvirtNode:
        return self.nodes[host]

    def connect(self, host: str) -> libvirt.virConnect:
        """A (cached) libvirt connection to ``host``'s daemon."""
        conn = self._conns.get(host)
        if conn is None or not conn.isAlive():
            conn = self._conns[host] = self.nodes[host].connect()
        return conn

    def uri(self, host: str) -> str:
        return self.nodes[host].uri

    def migration_address(self, host: str) -> str:
        return self.topology.host(host).address

    def migration_uris(self, dst: str, transport: str = "tcp") -> tuple[str, str]:
        """(peer-to-peer libvirt URI, QEMU migration URI) to migrate *to*
        ``dst``: the source's daemon reaches ``dst``'s over ``qemu+tcp`` or,
        ``transport="ssh"``, ``qemu+ssh`` (its sshd, lab/ssh.py)."""
        address = self.migration_address(dst)
        if transport == "ssh":
            if not self.ssh:
                raise RuntimeError(f"lab {self.name} runs no sshd (see its log): no qemu+ssh")
            from .ssh import LabSsh
            return LabSsh(self).uri(dst), f"tcp://{address}"
        if transport != "tcp":
            raise ValueError(f"transport {transport!r}: tcp or ssh")
        return self.nodes[dst].tcp_uri(address), f"tcp://{address}"

    def domain_xml(self, name: str, image: GuestImage, host: str = "hostA", *, guest_index: int = 10,
                   cmdline: str | None = None, mac: str | None = None, memory_mib: int = 256,
                   **values) -> str:
        """A lab domain: ``image`` booted directly, the agent channel, a
        fabric NIC on ``host``'s ``fab0`` with an address of that host's
        guest subnet on the kernel command line, the serial console in the
        node's /var/log/libvirt/qemu/<name>-console.log.  With a pool, the
        command line also carries how the guest reaches it (the pool's CA,
        or ``accelmig.insecure=1``: :meth:`guest_tls_word`), unless it says
        so already."""
        if cmdline is None:
            cmdline = image.cmdline(net=self.topology.host(host).guest_net(guest_index))
        word = self.guest_tls_word()
        if word and word.split("=")[0] + "=" not in cmdline:
            cmdline = f"{cmdline} {word}"
        return render("accelerator-domain.xml.j2", name=name, memory_mib=memory_mib,
                      virt_type=self.virt_type, kernel=str(image.kernel), initrd=str(image.initrd),
                      cmdline=cmdline, console_log=f"/var/log/libvirt/qemu/{name}-console.log",
                      fabric_mac=mac or guest_mac(name), fabric_type="bridge",
                      fabric_source=BRIDGE, **values)

    def console_log(self, host: str, name: str) -> Path:
        return self.nodes[host].host_path(f"/var/log/libvirt/qemu/{name}-console.log")

    def channel_path(self, host: str, domain: str, channel: str = AGENT_CHANNEL_NAME) -> Path:
        """The per-domain channel socket on ``host``, seen from here (read
        from the live XML: its domain id changes with every incoming migration)."""
        dom = self.connect(host).lookupByName(domain)
        return self.nodes[host].host_path(channel_source(dom.XMLDesc(0), channel))

    def channel(self, host: str, domain: str, timeout: float = 10.0) -> ResponderChannel:
        return ResponderChannel(self.channel_path(host, domain), timeout=timeout)

    def migrate(self, domain: str, src: str, dst: str, *, flags: int | None = None,
                params: dict | None = None) -> dict:
        """Live-migrate ``domain`` peer-to-peer from ``src`` to ``dst`` over
        the host link (``--migrateuri tcp://<dst address>``); returns wall
        time and the destination's completed-job stats (downtime included)."""
        dest_uri, migrate_uri = self.migration_uris(dst)
        if flags is None:
            flags = libvirt.VIR_MIGRATE_LIVE | libvirt.VIR_MIGRATE_PEER2PEER
        dom = self.connect(src).lookupByName(domain)
        t0 = time.monotonic()
        dom.migrateToURI3(dest_uri, {libvirt.VIR_MIGRATE_PARAM_URI: migrate_uri, **(params or {})}, flags)
        wall = time.monotonic() - t0
        stats = {}
        with contextlib.suppress(libvirt.libvirtError):
            stats = self.connect(dst).lookupByName(domain).jobStats(libvirt.VIR_DOMAIN_JOB_STATS_COMPLETED)
        return {"wall": wall, "downtime_ms": stats.get("downtime"), "stats": stats}

    # ------------------------------------------------------------ env

    def env(self) -> dict:
        """What a person needs to drive the lab by hand with plain virsh.

        Per host: ``uri`` (connect to that host's daemon from anywhere on
        this machine), ``p2p_uri`` and ``migrate_uri`` (what to pass to
        ``virsh migrate --live --p2p DOM <p2p_uri> --migrateuri
        <migrate_uri>`` to move a domain *to* that host), ``hooks_dir``,
        the guest subnet and gateway, and the host's control-plane secret
        when a pool runs.  ``tenant``: the tenant network (one subnet on
        both hosts' ``ten0``, its gateway on hostA: a Neutron tenant
        network's stand-in, lab/topology.py)."""
        hosts = {}
        for host in self.HOSTS:
            plan = self.topology.host(host)
            node = self.nodes.get(host)
            dest_uri, migrate_uri = self.migration_uris(host) if node else (None, None)
            hosts[host] = {
                "uri": node.uri if node else None,
                "netns": self.topology.host_ns[host],
                "hostname": node.hostname if node else None,
                "host_uuid": node.host_uuid if node else None,
                "p2p_uri": dest_uri, "migrate_uri": migrate_uri,
                # what operators type: virsh migrate --live --p2p DOM <ssh_uri> --migrateuri <migrate_uri>
                "ssh_uri": f"qemu+ssh://root@{host}/system" if self.ssh else None,
                "hooks_dir": str(node.hooks_dir) if node else None,
                "dir": str(node.root) if node else None,
                "log": str(node.log_file) if node else None,
                "guest_subnet": plan.guest_subnet, "gateway": plan.gateway,
                "bridge": BRIDGE, "bridge_mac": plan.bridge_mac,
                "tenant_bridge": TENANT_BRIDGE, "tenant_bridge_mac": plan.tenant_bridge_mac,
                "uplink": plan.uplink, "secret": self.state.get("host_secrets", {}).get(host),
            }
        pool = {"netns": self.topology.pool_ns, "address": POOL_ADDRESS,
                "data": f"{POOL_ADDRESS}:{POOL_DATA_PORT}",
                "control": f"{POOL_ADDRESS}:{POOL_CONTROL_PORT}",
                "running": "pool" in self.state.get("processes", {}),
                "tls": self.tls, "ca": self.pool_ca,
                "host_certs": {h: self.host_cert(h) for h in self.HOSTS} if self.tls else {}}
        if "pool" in self.state:
            pdir = Path(self.state["pool"]["dir"])
            pool.update(admin_socket=str(pdir / "pool.sock"), tokens=str(pdir / "tokens.toml"),
                        hosts_file=str(pdir / "hosts.toml"), log=str(pdir / "pool.log"),
                        tenants={n: t for n, (t, _q) in self.tenants.items()})
        if self.cluster:
            # a pool of two nodes: each node's own namespace, address, device, instance, files
            pool["nodes"] = {
                name: {"netns": self.ns_of(name), "address": plan.address,
                       "data": self.pool_endpoint(name), "control": self.pool_endpoint(name, "control"),
                       "pocl_devices": NODE_POCL_DEVICES[name], "running": self.pool_running(name),
                       "instance": self.state.get(name, {}).get("ready", {}).get("instance"),
                       "admin_socket": str(self.pool_admin_socket(name)),
                       "log": str(self._pool_dir(name) / "pool.log")}
                for name, plan in self.topology.pool_plans.items()}
            pool["etcd"] = {"netns": self.topology.etcd_ns, "url": self.etcd_url,
                            "running": self.process_running("etcd"), "ttl": self.cluster_ttl,
                            "log": str(self._etcd_dir() / "etcd.log")}
        a, b = hosts["hostA"], hosts["hostB"]
        return {
            "name": self.name, "dir": str(self.dir), "state_file": str(self.state_file),
            "status": self.state.get("status", "down"), "virt_type": self._virt_type,
            "hosts": hosts, "pool": pool,
            "tenant": {"bridge": TENANT_BRIDGE, "subnet": TENANT_SUBNET, "gateway": TENANT_GATEWAY,
                       "gateway_host": TENANT_GATEWAY_HOST},
            "examples": [
                f"virsh -c '{a['uri']}' list --all",
                f"virsh -c '{a['uri']}' migrate --live --p2p DOMAIN {b['p2p_uri']} --migrateuri {b['migrate_uri']}",
                *([f"virsh -c '{a['uri']}' migrate --live --p2p DOMAIN {b['ssh_uri']} --migrateuri "
                   f"{b['migrate_uri']}"] if b["ssh_uri"] else []),
                f"ip netns exec {a['netns']} ip -br addr",
            ],
        }
