"""``accelmig fleet deploy``: every node of the inventory installed from a
wheel, configured, hooked into libvirt and started; idempotent.

Order, and why:

1. **Locally, before any node is touched**: the inventory, the wheelhouse
   (exactly one accelmig wheel) and every configuration that does not need
   a node's answer, checked by the sides' own loaders.
2. **The hosts, in parallel.**  Each one is probed first (python3 >= 3.11
   with venv, a running libvirt daemon): a host that fails the probe is
   reported and left exactly as it was.  Then the wheels, a virtual
   environment of its own per version (``PREFIX/venvs/TAG``, made
   complete before anything points at it), the configuration, the host
   secret (made there once, kept after), and last the hook and the unit
   (``accelmig install --systemd``): the hook only ever names a complete
   environment, and a failed install removes a hook it had just added.
3. **The pool**, which needs every host's secret for its hosts file.
4. **Services** where systemd is PID 1 (restarted when something they
   read changed, reloaded when only the pool's tenants or hosts did), then
   **verification** (``accelmig doctor`` on each host).

Every step reports ``unchanged``, what it changed, or why it failed; a
second run over an unchanged inventory reports nothing changed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import secrets
import tomllib
from typing import Callable

from accelmig.fleet import render
from accelmig.fleet.inventory import Inventory, Node
from accelmig.fleet.remote import Remote, RemoteFailed
from accelmig.wire.errors import AccelmigError, ConfigInvalid

UNCHANGED, CHANGED, WOULD, FAILED, SKIPPED, OK = "unchanged", "changed", "would change", "FAILED", "skipped", "ok"
MIN_PYTHON = (3, 11)
HOOK = "/etc/libvirt/hooks/qemu.d/50-accelmig"
SIDES = {"host": ("accelmig", "accelmig-hostd.service"), "pool": ("accelmig-pool", "accelmig-pool.service")}
WHEEL = re.compile(r"^accelmig-(?P<version>[^-]+)-.*\.whl$")


@dataclasses.dataclass
class Step:
    name: str
    action: str
    detail: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class NodeReport:
    node: str
    role: str
    steps: list[Step] = dataclasses.field(default_factory=list)
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def changed(self) -> bool:
        return any(step.action in (CHANGED, WOULD) for step in self.steps)

    def to_dict(self) -> dict:
        return {"node": self.node, "role": self.role, "changed": self.changed, "failed": self.failed,
                "error": self.error, "steps": [s.to_dict() for s in self.steps]}


class Wheelhouse:
    """The local wheels: exactly one accelmig wheel, and its dependencies'."""

    def __init__(self, directories: tuple[str, ...], source: str):
        self.files: dict[str, str] = {}
        for directory in directories:
            if not os.path.isdir(directory):
                raise ConfigInvalid(source=source, reason=f"install.wheelhouse: {directory} is not a directory")
            for name in sorted(os.listdir(directory)):
                if name.endswith(".whl"):
                    self.files.setdefault(name, os.path.join(directory, name))
        ours = [name for name in self.files if WHEEL.match(name)]
        if len(ours) != 1:
            raise ConfigInvalid(source=source, reason=(
                f"install.wheelhouse must hold exactly one accelmig wheel, found "
                f"{', '.join(ours) or 'none'} (build it: pip wheel -w DIR '.[host,pool,cluster]' in a checkout)"))
        self.wheel = ours[0]
        self.version = WHEEL.match(self.wheel)["version"]
        self.sha256 = {name: _sha256(path) for name, path in self.files.items()}
        self.tag = f"{self.version}-{self.sha256[self.wheel][:12]}"


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class NodeDeploy:
    """One node's deploy; ``steps`` is its report as it goes."""

    def __init__(self, deployer: "Deployer", node: Node):
        self.deployer, self.node = deployer, node
        self.inventory, self.dry_run = deployer.inventory, deployer.dry_run
        self.report = NodeReport(node.name, node.role)
        self.remote: Remote | None = None
        self.probe: dict = {}
        self.changed_inputs: set[str] = set()     # what the service reads that changed
        self.secret: str | None = None
        self.prefix = self.inventory.prefix

    # ------------------------------------------------------------ reporting

    def step(self, name: str, action: str, detail: str = "") -> Step:
        step = Step(name, action, detail)
        self.report.steps.append(step)
        self.deployer.progress(self.node.name, step)
        return step

    def changed(self, name: str, detail: str, inputs: str | None = None) -> Step:
        if inputs:
            self.changed_inputs.add(inputs)
        return self.step(name, WOULD if self.dry_run else CHANGED, detail)

    # ------------------------------------------------------------ paths

    @property
    def venv_tag(self) -> str:
        return f"{self.deployer.wheelhouse.tag}-{self.extras.replace(',', '-')}"

    @property
    def extras(self) -> str:
        """What this node installs: its side, and etcd's client for a pool
        node that joins a cluster (a venv of its own: its tag says so)."""
        return "pool,cluster" if self.node.role == "pool" and self.node.settings.get("cluster") else self.node.role

    @property
    def venv_dir(self) -> str:
        return f"{self.prefix}/venvs/{self.venv_tag}"

    @property
    def command(self) -> str:
        return self.inventory.command(self.node)

    # ------------------------------------------------------------ common steps

    def connect(self) -> None:
        self.remote = Remote(self.inventory, self.node).connect()
        self.step("ssh", OK, f"{self.node.user}@{self.node.address}:{self.node.port}, host key checked")

    def do_probe(self, extra_paths: list[str]) -> None:
        wheels = [f"{self.prefix}/wheels/{name}" for name in self.deployer.wheelhouse.files]
        paths = [f"{self.prefix}/venv", f"{self.venv_dir}/.fleet-complete", *wheels, *extra_paths]
        args = ["probe", *paths]
        if self.node.libvirtd_pid_file:
            args += ["--pid-files", self.node.libvirtd_pid_file]
        self.probe = self.remote.op(*args)
        version = tuple(self.probe["python"])
        problems = []
        if version < MIN_PYTHON:
            problems.append(f"{self.inventory.python} is {'.'.join(map(str, version))}; accelmig needs 3.11 or later")
        if not self.probe["venv"]:
            problems.append(f"{self.inventory.python} has no venv/ensurepip (Debian: apt-get install python3-venv)")
        if self.node.role == "host" and not self.probe["libvirt"] and not self._socket_activated():
            where = self.node.libvirtd_pid_file or "the usual pid files"
            problems.append(f"no libvirt daemon runs (libvirtd or virtqemud; looked at {where}): "
                            f"start libvirt first")
        if problems:
            raise AccelmigError("; ".join(problems) + ": nothing was changed on this node")
        daemon = self.probe["libvirt"]
        self.step("probe", OK, f"python {'.'.join(map(str, version))}, "
                               f"systemd {'PID 1' if self.probe['systemd'] else 'not PID 1'}"
                               + (f", {daemon['comm']} pid {daemon['pid']}" if daemon else ""))

    def _socket_activated(self) -> bool:
        if not self.probe.get("systemd"):
            return False
        result = self.remote.run(["systemctl", "is-active", "libvirtd.socket", "virtqemud.socket"])
        return "active" in result.text.split()

    def path_info(self, path: str) -> dict | None:
        return self.probe["paths"].get(path)

    def wheels(self) -> None:
        house = self.deployer.wheelhouse
        missing = [name for name in house.files
                   if (self.path_info(f"{self.prefix}/wheels/{name}") or {}).get("sha256") != house.sha256[name]]
        if not missing:
            self.step("wheels", UNCHANGED, f"{len(house.files)} wheels there")
            return
        size = sum(os.path.getsize(house.files[name]) for name in missing)
        if not self.dry_run:
            for name in missing:
                with open(house.files[name], "rb") as handle:
                    self.remote.op("put", f"{self.prefix}/wheels/{name}", "0644", "root", "root", stdin=handle.read())
            self.remote.op("prune", f"{self.prefix}/wheels", *house.files)
        self.changed("wheels", f"{len(missing)} of {len(house.files)} uploaded ({size / 2**20:.1f} MiB)")

    def venv(self) -> None:
        complete = self.path_info(f"{self.venv_dir}/.fleet-complete") is not None
        link = (self.path_info(f"{self.prefix}/venv") or {}).get("link")
        target = f"venvs/{self.venv_tag}"
        if complete and link == target:
            self.step("venv", UNCHANGED, f"{self.prefix}/venv -> {target}")
            return
        extra = self.extras
        if not complete and not self.dry_run:
            version = self.deployer.wheelhouse.version
            self.remote.run(["rm", "-rf", self.venv_dir], check="removing an incomplete venv")
            self.remote.run([self.inventory.python, "-m", "venv", self.venv_dir], check=f"{self.inventory.python} -m venv")
            self.remote.run([f"{self.venv_dir}/bin/pip", "install", "--quiet", "--no-index",
                             "--disable-pip-version-check", "--no-cache-dir", "--find-links", f"{self.prefix}/wheels",
                             f"accelmig[{extra}]=={version}"], check=f"pip install accelmig[{extra}]")
            said = self.remote.run([f"{self.venv_dir}/bin/{SIDES[self.node.role][0]}", "--version"],
                                   check="the installed command").text.strip()
            if not said.endswith(version):
                raise AccelmigError(f"the new environment says {said!r}, not version {version}")
            self.remote.op("put", f"{self.venv_dir}/.fleet-complete", "0644", "root", "root",
                           stdin=f"{self.deployer.wheelhouse.wheel}\n".encode())
        if not self.dry_run:
            self.remote.op("link", target, f"{self.prefix}/venv")
            keep = {self.venv_tag}
            if link and link.startswith("venvs/"):
                keep.add(link.split("/", 1)[1])          # the one before: what a rollback needs
            self.remote.op("prune", f"{self.prefix}/venvs", *keep)
        self.changed("venv", f"{'installed ' if not complete else ''}accelmig[{extra}] "
                             f"{self.deployer.wheelhouse.version} at {self.venv_dir}; {self.prefix}/venv -> {target}",
                     inputs="venv")

    def put(self, remote_file: render.RemoteFile, inputs: str = "config") -> bool:
        args = ["put", remote_file.path, f"{remote_file.mode:04o}", remote_file.owner, remote_file.group]
        if self.dry_run:
            args.append("--check")
        answer = self.remote.op(*args, stdin=remote_file.data)
        if answer["action"] == UNCHANGED:
            return False
        self.changed(f"file {remote_file.path}", answer["action"]
                     + (f", mode {remote_file.mode:04o} {remote_file.owner}:{remote_file.group}"), inputs=inputs)
        return True

    def files(self, files: list[render.RemoteFile], label: str, inputs: str = "config") -> None:
        changed = [f for f in files if self.put(f, inputs)]
        if not changed:
            self.step(label, UNCHANGED, ", ".join(os.path.basename(f.path) for f in files))

    def read_text(self, path: str) -> str | None:
        return self.remote.op("read", path)["text"]

    def service(self) -> None:
        unit = SIDES[self.node.role][1]
        if not self.probe["systemd"]:
            self.step("service", SKIPPED, f"systemd is not PID 1 on {self.node.name}: start {unit}'s "
                                          f"ExecStart yourself (or your init's equivalent)")
            return
        if self.dry_run:
            if self.changed_inputs:
                self.changed("service", f"{unit} would be restarted ({', '.join(sorted(self.changed_inputs))})")
            else:
                self.step("service", UNCHANGED, f"{unit}: started if it is not")
            return
        self.remote.run(["systemctl", "enable", "--quiet", unit], check=f"systemctl enable {unit}")
        active = self.remote.run(["systemctl", "is-active", "--quiet", unit]).status == 0
        restart = self.changed_inputs - {"secrets"}
        if active and restart:
            self.remote.run(["systemctl", "restart", unit], check=f"systemctl restart {unit}")
            self.changed("service", f"{unit} restarted ({', '.join(sorted(restart))} changed)")
        elif active and self.changed_inputs:
            self.remote.run(["systemctl", "reload", unit], check=f"systemctl reload {unit}")
            self.changed("service", f"{unit} reloaded (its tenants or hosts changed)")
        elif not active:
            self.remote.run(["systemctl", "start", unit], check=f"systemctl start {unit}")
            self.changed("service", f"{unit} started")
        else:
            self.step("service", UNCHANGED, f"{unit} active")

    # ------------------------------------------------------------ the sides

    def host(self) -> None:
        node = self.node
        config = render.host_config(self.inventory, node)
        self.do_probe([HOOK, render.HOST_SECRET])
        self.wheels()
        self.venv()
        self.host_secret()
        self.files([*render.tls_files(self.inventory, node), config], "config")
        self.hook()
        self.service()

    def host_secret(self) -> None:
        text = self.read_text(render.HOST_SECRET) if not self.dry_run or self.path_info(render.HOST_SECRET) else None
        if text is not None and len(text.strip()) >= 16:
            self.secret = text.strip()
            mode = (self.path_info(render.HOST_SECRET) or {}).get("mode")
            if mode == 0o600:
                self.step("secret", UNCHANGED, f"{render.HOST_SECRET} kept")
                return
        else:
            self.secret = secrets.token_hex(32)
        self.put(render.RemoteFile(render.HOST_SECRET, (self.secret + "\n").encode(), mode=0o600, secret=True),
                 inputs="secrets")

    def hook(self) -> None:
        """``accelmig install --systemd``: the hook (libvirt reloaded) and the
        unit.  Removed again if this run added it and the install failed."""
        if self.dry_run:
            present = self.path_info(HOOK) is not None
            if present and not self.changed_inputs:
                self.step("hook", UNCHANGED, f"{HOOK} (checked by accelmig install on a real run)")
            else:
                self.changed("hook", f"accelmig install --systemd would {'rewrite' if present else 'add'} {HOOK} "
                                     f"and reload libvirt")
            return
        argv = [self.command, "install", "--systemd", "--config", render.HOST_CONFIG, "--json"]
        if self.node.libvirtd_pid_file:
            argv += ["--libvirtd-pid-file", self.node.libvirtd_pid_file]
        result = self.remote.run(argv)
        try:
            answer = json.loads(result.stdout)
        except ValueError:
            answer = None
        if result.status != 0 or answer is None:
            undo = ""
            if self.path_info(HOOK) is None:
                undone = self.remote.run([self.command, "uninstall", "--config", render.HOST_CONFIG]
                                         + (["--libvirtd-pid-file", self.node.libvirtd_pid_file]
                                            if self.node.libvirtd_pid_file else []))
                undo = ("; the hook it added was removed" if undone.status == 0
                        else f"; removing the hook it added failed too: {undone.why()}")
            raise RemoteFailed(node=self.node.name, what="accelmig install --systemd", status=result.status,
                               reason=result.why() + undo)
        unit_changed = any(f["action"] != "unchanged" for f in answer.get("systemd", {}).get("files", []))
        reload = answer.get("reload", {}).get("action", "?")
        if answer["action"] == "unchanged" and not unit_changed and reload == "not needed":
            self.step("hook", UNCHANGED, f"{answer['hook']}; unit unchanged; libvirt sees it")
        else:
            self.changed("hook", f"hook {answer['action']}, unit {'written' if unit_changed else 'unchanged'}, "
                                 f"libvirt {reload}", inputs="unit" if unit_changed else None)

    def pool(self, host_secrets: dict[str, str]) -> None:
        inventory = self.inventory
        pool_config = render.pool_config(inventory)
        self.do_probe([render.POOL_HOSTS, render.POOL_TOKENS])
        self.wheels()
        self.venv()
        self.pool_unit()
        group = render.POOL_USER if self.remote.run(["id", "-u", render.POOL_USER]).status == 0 else "root"
        if group == "root":
            self.step("user", SKIPPED, f"no user {render.POOL_USER} here (no systemd-sysusers?): "
                                       f"secrets stay root's (0600)")
        secrets_now = dict(host_secrets)
        missing = [h.name for h in inventory.hosts if h.name not in secrets_now]
        if missing:
            # A host that failed keeps what the pool already had for it.
            current = self._toml(render.POOL_HOSTS).get("hosts", {})
            for name in missing:
                if isinstance(current.get(name), dict) and isinstance(current[name].get("secret"), str):
                    secrets_now[name] = current[name]["secret"]
            gone = [name for name in missing if name not in secrets_now]
            if gone:
                # Serve the hosts that are ready; the others join at the next deploy.
                self.step("hosts", SKIPPED, f"left out of the pool's hosts file: {', '.join(gone)} (failed "
                                            f"before its secret was known; deploy again once fixed)")
        self.files([*render.tls_files(inventory, self.node, group), pool_config], "config")
        self.files([render.pool_hosts(inventory, secrets_now, group)], "hosts", inputs="secrets")
        self.files([render.pool_tokens(inventory, self.tokens(), group)], "tenants", inputs="secrets")
        self.service()

    def _toml(self, path: str) -> dict:
        if self.path_info(path) is None:
            return {}
        try:
            return tomllib.loads(self.read_text(path) or "")
        except tomllib.TOMLDecodeError:
            return {}

    def tokens(self) -> dict[str, str]:
        """Each tenant's token: the one the pool has, else a new one."""
        current = self._toml(render.POOL_TOKENS).get("tenants", {})
        out = {}
        for tenant in self.inventory.tenants:
            token = current.get(tenant.name, {}).get("token") if isinstance(current.get(tenant.name), dict) else None
            if not isinstance(token, str) or len(token) < 8:
                # hex: a token is pasted into command lines, and one of
                # token_urlsafe's may start with "-" (read there as an option)
                token = secrets.token_hex(32)
                self.step(f"tenant {tenant.name}", WOULD if self.dry_run else CHANGED,
                          f"new token, in {render.POOL_TOKENS} on {self.node.name}")
            out[tenant.name] = token
        return out

    def pool_unit(self) -> None:
        if self.dry_run:
            self.step("unit", UNCHANGED if not self.changed_inputs else WOULD,
                      "accelmig-pool install --systemd (idempotent; not run in --dry-run)")
            return
        result = self.remote.run([self.command, "install", "--systemd", "--config", render.POOL_CONFIG, "--json"],
                                 check="accelmig-pool install --systemd")
        answer = json.loads(result.stdout)
        changed = [f["path"] for f in answer.get("files", []) if f["action"] != "unchanged"]
        if changed:
            self.changed("unit", f"written: {', '.join(changed)}", inputs="unit")
        else:
            self.step("unit", UNCHANGED, "accelmig-pool.service and its user")

    def verify(self) -> None:
        """``accelmig doctor`` on a host: what the deploy installed must be
        ok; hostd and the pool only where the services were started here."""
        from accelmig.fleet.checks import doctor_argv
        result = self.remote.run(doctor_argv(self.inventory, self.node))
        try:
            checks = json.loads(result.stdout)["checks"]
        except (ValueError, KeyError):
            raise RemoteFailed(node=self.node.name, what="accelmig doctor", status=result.status,
                               reason=result.why()) from None
        running = bool(self.probe.get("systemd"))
        ours = [c for c in checks if running or c["name"] not in ("hostd", "pool")]
        failed = [c for c in ours if c["status"] == "FAIL"]
        if failed:
            raise AccelmigError("verify: " + "; ".join(f"{c['name']}: {c['reason']}" for c in failed))
        waiting = [c["name"] for c in checks if c not in ours and c["status"] == "FAIL"]
        self.step("verify", OK, f"accelmig doctor: {len(ours) - len(failed)} checks ok"
                                + (f" ({', '.join(waiting)}: start the services)" if waiting else ""))

    # ------------------------------------------------------------ run

    def guarded(self, body: Callable[[], None]) -> NodeReport:
        try:
            if self.remote is None:
                self.connect()
            body()
        except AccelmigError as exc:
            self.report.error = exc.message
            self.deployer.progress(self.node.name, Step("error", FAILED, exc.message))
        except OSError as exc:
            self.report.error = f"{type(exc).__name__}: {exc}"
            self.deployer.progress(self.node.name, Step("error", FAILED, self.report.error))
        return self.report

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()


class Deployer:
    def __init__(self, inventory: Inventory, *, dry_run: bool = False,
                 progress: Callable[[str, Step], None] | None = None, only: tuple[str, ...] = ()):
        self.inventory, self.dry_run = inventory, dry_run
        self.progress = progress or (lambda node, step: None)
        self.wheelhouse = Wheelhouse(inventory.wheelhouse, inventory.path)
        for name in only:
            inventory.node(name)
        self.only = set(only)
        # Everything that needs no node's answer is checked before one is touched.
        for host in inventory.hosts:
            render.host_config(inventory, host)
        render.pool_config(inventory)
        for node in inventory.nodes:
            render.tls_files(inventory, node)

    def wanted(self, node: Node) -> bool:
        return not self.only or node.name in self.only

    def run(self) -> list[NodeReport]:
        hosts = [NodeDeploy(self, h) for h in self.inventory.hosts if self.wanted(h)]
        pool = NodeDeploy(self, self.inventory.pool)
        try:
            with concurrent.futures.ThreadPoolExecutor(max(1, len(hosts))) as workers:
                reports = list(workers.map(lambda d: d.guarded(d.host), hosts))
                secrets_by_host = {d.node.name: d.secret for d in hosts if d.secret and not d.report.failed}
                if self.wanted(self.inventory.pool):
                    reports.append(pool.guarded(lambda: pool.pool(secrets_by_host)))
                live = [d for d in hosts if not d.report.failed]
                if not self.dry_run:
                    list(workers.map(lambda d: d.guarded(d.verify), live))
        finally:
            for deploy in (*hosts, pool):
                deploy.close()
        return reports
