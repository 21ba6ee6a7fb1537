"""``accelmig doctor``: is this host ready to live-migrate accelmig domains?

Every check is reported as ``ok``, ``warn``, ``FAIL`` (or ``skip`` when an
earlier failure leaves nothing to check), with a one-line reason and, when
it is not ok, a hint.  The exit status is 0 when nothing FAILed.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess

import click

from accelmig.plugin.commands.install import (DEFAULT_HOOK_NAME, DEFAULT_HOOKS_DIR, cli_errors,
                                              config_option, find_daemon, hook_path, hook_seen,
                                              hostd_settings, json_option, load_config,
                                              parse_hook_script, print_json, read_state)
from accelmig.plugin.config import DEFAULT_PATH
from accelmig.wire.localapi import LocalClient
from accelmig.wire.errors import AccelmigError, ErrorCode

OK, WARN, FAIL, SKIP = "ok", "warn", "FAIL", "skip"
HOSTD_TIMEOUT = 3.0
HOOK_PROBE_TIMEOUT = 10.0
#: virDomainState -> words.
STATES = {0: "in no state", 1: "running", 2: "blocked", 3: "paused", 4: "shutting down", 5: "shut off",
          6: "crashed", 7: "suspended by guest power management"}
#: libvirt runs qemu.d scripts from 6.5.0 on.
MIN_LIBVIRT = 6_005_000
#: A domain no hook acts on ("accelmig" nowhere in it): the hook must exit 0, silently.
PROBE_XML = ("<domain type='qemu'><name>doctor-probe</name>"
             "<uuid>00000000-0000-4000-8000-000000000000</uuid></domain>\n")
#: The environment libvirt gives a hook.
HOOK_ENV = {"LC_ALL": "C", "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/"}


@dataclasses.dataclass
class Check:
    name: str
    status: str
    reason: str
    hint: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class Doctor:
    def __init__(self, config_path, hooks_dir, name, pid_file):
        self.config_path = config_path
        self.hooks_dir, self.name, self.pid_file = hooks_dir, name, pid_file
        self.checks: list[Check] = []
        self.config = None

    def add(self, name, status, reason, hint=None) -> Check:
        check = Check(name, status, reason, hint if status != OK else None)
        self.checks.append(check)
        return check

    def run(self) -> list[Check]:
        self.check_config()
        self.check_secret()
        hooks = self.hooks()
        for path, record in hooks:
            self.check_hook(path, record, "hook" if len(hooks) == 1 else f"hook {path}")
        self.check_hostd()
        self.check_pool()
        self.check_libvirt()
        return self.checks

    # -- config and secret -------------------------------------------------

    def check_config(self):
        config, error, path = load_config(self.config_path)
        self.path = path
        self.config = config
        if error is not None:
            hint = (f"write {path} (see 'accelmig hostd --help'), or pass --config FILE"
                    if "file not found" in error.message else f"fix {path}")
            self.add("config", FAIL, error.message, hint)
        else:
            self.add("config", OK, f"{path} loads (host {config.host_id}, pool {config.pool.endpoint}, "
                                   f"control {config.pool.control})")

    def check_secret(self):
        if self.config is None:
            return self.add("secret", SKIP, "no configuration to name the secret file")
        path = self.config.pool.secret_file
        try:
            secret = self.config.read_secret()
        except AccelmigError as exc:
            hint = f"chmod 600 {path}" if "accessible" in exc.message else (
                f"write this host's secret (as in the pool's hosts.toml) to {path}, mode 0600")
            return self.add("secret", FAIL, exc.message, hint)
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:
            return self.add("secret", WARN, f"{path} is accessible to its group (mode {mode:04o})",
                            f"chmod 600 {path}")
        self.add("secret", OK, f"{path} readable, mode {mode:04o}, {len(secret)} bytes")

    # -- the hook ----------------------------------------------------------

    def hooks(self) -> list[tuple[str, dict | None]]:
        """The hook scripts to check: the one the options name, else those
        'accelmig install' recorded, else the default."""
        state = read_state(hostd_settings(self.config).state_dir)["hooks"]
        if self.hooks_dir or self.name:
            path = hook_path(self.hooks_dir or DEFAULT_HOOKS_DIR, self.name or DEFAULT_HOOK_NAME)
            return [(path, state.get(path))]
        if state:
            return sorted(state.items())
        path = hook_path(DEFAULT_HOOKS_DIR, DEFAULT_HOOK_NAME)
        return [(path, None)]

    def check_hook(self, path: str, record: dict | None, label: str):
        fix = "run 'accelmig install" + (f" --config {self.path}" if self.config_path else "") + "'"
        try:
            info = os.stat(path)
        except FileNotFoundError:
            self.add(label, FAIL, f"{path} is not installed", fix)
            return
        if not stat.S_ISREG(info.st_mode) or not os.access(path, os.X_OK):
            self.add(label, FAIL, f"{path} is not an executable file (libvirt skips it)",
                     f"chmod 755 {path}, or {fix}")
            return
        try:
            text = open(path).read()
        except (OSError, UnicodeDecodeError) as exc:
            self.add(label, FAIL, f"{path} cannot be read: {exc}", fix)
            return
        script = parse_hook_script(text)
        if not script["accelmig"]:
            self.add(label, FAIL, f"{path} does not run accelmig's hook", fix)
            return
        interpreter = script["interpreter"]
        if not interpreter or not os.access(interpreter, os.X_OK):
            self.add(label, FAIL, f"{path}: its interpreter {interpreter} is missing (accelmig moved "
                                  f"or was removed?)", fix)
            return
        baked = script["config"] or DEFAULT_PATH
        if os.path.abspath(baked) != self.path:
            self.add(label, WARN, f"{path} reads {baked}, these checks read {self.path}",
                     f"run 'accelmig install --config {self.path}' or 'accelmig doctor --config {baked}'")
        else:
            self.add(label, OK, f"{path} installed, executable, runs {interpreter}, reads {baked}")
        self.check_hook_runs(path, label)
        self.check_hook_seen(path, record, label)

    def check_hook_runs(self, path: str, label: str):
        """Run it as libvirt would, for a domain that is not accelmig's."""
        try:
            proc = subprocess.run([path, "doctor-probe", "started", "begin", "-"], input=PROBE_XML,
                                  capture_output=True, text=True, env=HOOK_ENV,
                                  timeout=HOOK_PROBE_TIMEOUT, cwd="/")
        except subprocess.TimeoutExpired:
            self.add(f"{label} runs", FAIL, f"it did not finish within {HOOK_PROBE_TIMEOUT:.0f} s for a "
                                           f"foreign domain (libvirt waits for it)", "report a bug")
            return
        except OSError as exc:
            self.add(f"{label} runs", FAIL, f"it cannot be run: {exc.strerror}", "run 'accelmig install'")
            return
        if proc.returncode != 0 or proc.stdout or proc.stderr:
            detail = (proc.stderr or proc.stdout).strip().splitlines()
            self.add(f"{label} runs", FAIL, f"for a foreign domain it exited {proc.returncode}"
                     + (f": {detail[-1]}" if detail else "") + " (it must exit 0 silently)",
                     "check that accelmig is installed for its interpreter; rerun 'accelmig install'")
            return
        self.add(f"{label} runs", OK, "exits 0 silently for a foreign domain, with libvirt's environment")

    def check_hook_seen(self, path: str, record: dict | None, label: str):
        pid_file = self.pid_file or (record or {}).get("pid_file")
        try:
            daemon = find_daemon(pid_file)
        except AccelmigError as exc:
            # socket activation stops an idle libvirtd: the next one reads the hook
            self.add(f"{label} seen", WARN, f"no libvirt daemon is running: {exc.message}; the next "
                     f"one to start reads the hook",
                     "start libvirtd (or virtqemud; 'virsh list' starts a socket-activated one) and "
                     "rerun accelmig doctor, or pass --libvirtd-pid-file FILE")
            return
        seen, why = hook_seen(path, daemon, record)
        if seen:
            self.add(f"{label} seen", OK, why)
        else:
            self.add(f"{label} seen", WARN, why,
                     f"reload libvirtd (kill -HUP {daemon.pid}) or run accelmig install")

    # -- hostd and the pool -----------------------------------------------

    def check_hostd(self):
        socket_path = hostd_settings(self.config).socket
        try:
            answer = LocalClient(socket_path, timeout=HOSTD_TIMEOUT).call("ping")
        except AccelmigError as exc:
            start = "accelmig hostd" + (f" --config {self.path}" if self.config_path else "")
            self.add("hostd", FAIL, exc.message, f"start it: {start}")
            return
        answer = answer if isinstance(answer, dict) else {}
        bits = [f"pid {answer.get('pid', '?')}", f"host {answer.get('host', '?')}"]
        if "pool" in answer:
            bits.append("pool reachable" if answer["pool"] else "pool NOT reachable")
        if "libvirt" in answer:
            bits.append("libvirt connected" if answer["libvirt"] else "libvirt NOT connected")
        self.add("hostd", OK, f"answers at {socket_path} ({', '.join(bits)})")

    def check_pool(self):
        if self.config is None:
            return self.add("pool", SKIP, "no configuration to name the pool")
        from accelmig.plugin.commands.status import pool_ping
        result = pool_ping(self.config)
        control = self.config.pool.control
        if result["reachable"]:
            return self.add("pool", OK, f"control plane {control} answers this host "
                                        f"(pool instance {result['instance']})")
        code = result.get("code")
        if code == ErrorCode.AUTH_FAILED.value:
            hint = (f"the secret in {self.config.pool.secret_file} must match host "
                    f"{self.config.host_id} in the pool's hosts.toml")
        elif code == ErrorCode.NO_SUCH_HOST.value:
            hint = f"add host {self.config.host_id} to the pool's hosts.toml"
        elif "no host secret" in result.get("error", ""):
            hint = "fix the secret file (see the secret check)"
        else:
            hint = f"is accelmig-pool running, and {control} reachable from this host?"
        self.add("pool", FAIL, f"control plane {control}: {result.get('error')}", hint)

    # -- libvirt and the channels -----------------------------------------

    def check_libvirt(self):
        uri = hostd_settings(self.config).libvirt_uri
        try:
            import libvirt
        except ImportError:
            self.add("libvirt", FAIL, "libvirt-python is not installed", "pip install 'accelmig[host]'")
            return
        libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
        try:
            conn = libvirt.openReadOnly(uri)
        except libvirt.libvirtError as exc:
            self.add("libvirt", FAIL, f"{uri}: {exc.get_error_message() or exc}",
                     "is libvirtd running? check [hostd] libvirt_uri")
            return
        try:
            self._domains(conn, uri, libvirt)
        except libvirt.libvirtError as exc:
            self.add("libvirt", FAIL, f"{uri}: {exc.get_error_message() or exc}", "check libvirtd's log")
        finally:
            conn.close()

    def _domains(self, conn, uri, libvirt):
        from accelmig.plugin.domain.model import DomainXML
        version = conn.getLibVersion()
        text = f"{version // 1_000_000}.{version // 1000 % 1000}.{version % 1000}"
        if version < MIN_LIBVIRT:
            self.add("libvirt", FAIL, f"{uri}: libvirt {text} runs no hooks/qemu.d scripts (6.5 or later does)",
                     "upgrade libvirt")
        domains = conn.listAllDomains(libvirt.VIR_CONNECT_LIST_DOMAINS_ACTIVE)
        ours = []
        for dom in domains:
            try:
                model = DomainXML.parse(dom.XMLDesc(0))
            except libvirt.libvirtError:
                continue                    # it went away meanwhile
            except AccelmigError as exc:
                self.add(f"channel {dom.name()}", WARN, f"its live XML cannot be read: {exc.message}")
                continue
            if model.is_accelmig():
                ours.append((dom, model))
        if version >= MIN_LIBVIRT:
            self.add("libvirt", OK, f"{uri}: libvirt {text}, {len(domains)} running domain(s), "
                                    f"{len(ours)} of them accelmig's")
        if not ours:
            self.add("channels", OK, "no accelmig domain is running")
        for dom, model in ours:
            self._channel(dom, model, libvirt)

    def _channel(self, dom, model, libvirt):
        name = model.name
        label = f"channel {name}"
        chan = model.agent_channel()
        if chan is None:
            if model.has_guest_agent():
                self.add(label, WARN, "no accelmig agent channel: hostd rehomes it through "
                                      "qemu-guest-agent's guest-exec (libvirt marks that as tainting)",
                         "add the agent channel: accelmig domain render agent-channel")
            else:
                self.add(label, FAIL, "neither the accelmig agent channel nor qemu-guest-agent's: "
                                      "its sessions cannot be rehomed after a migration",
                         "add the channel (accelmig domain render agent-channel; virsh attach-device "
                         "--config) and restart the domain")
            return
        where = f" at {chan.path}" if chan.path else ""
        if chan.connected:
            self.add(label, OK, f"agent channel connected{where}")
            return
        state = dom.state()[0]
        if chan.connected is None:
            self.add(label, WARN, f"libvirt reports no state for the agent channel{where}",
                     "check the domain's live XML (virsh dumpxml)")
        elif state == libvirt.VIR_DOMAIN_RUNNING:
            self.add(label, FAIL, f"agent channel present{where} but state='disconnected': the guest "
                                  f"agent is not listening (still booting, or not started)",
                     "start accelmig-agent in the guest (accelmig-agent run)")
        else:
            self.add(label, WARN, f"agent channel disconnected{where}; the domain is "
                                  f"{STATES.get(state, f'in state {state}')}: the guest agent cannot answer",
                     f"resume it (virsh resume {name})")


def _print(checks: list[Check]) -> None:
    width = max(len(c.name) for c in checks)
    for check in checks:
        click.echo(f"{check.status:<4}  {check.name:<{width}}  {check.reason}")
        if check.hint:
            click.echo(f"{'':<4}  {'':<{width}}  hint: {check.hint}")


@click.command("doctor")
@config_option
@click.option("--hooks-dir", metavar="DIR",
              help=f"libvirt's hooks directory [default: where 'accelmig install' put the hook, "
                   f"else {DEFAULT_HOOKS_DIR}]")
@click.option("--name", help=f"the hook's file name in qemu.d [default: {DEFAULT_HOOK_NAME}]")
@click.option("--libvirtd-pid-file", metavar="FILE",
              help="the libvirt daemon's pid file [default: the one 'accelmig install' used, else "
                   "the usual ones]")
@json_option
@cli_errors
def doctor(config_path, hooks_dir, name, libvirtd_pid_file, as_json):
    """Check that this host can live-migrate accelmig domains.

    \b
    Checks, each ok / warn / FAIL with a reason and a hint:
      config     the host configuration loads
      secret     the control-plane secret is readable, and by nobody else
      hook       accelmig's hook is in hooks/qemu.d, executable, and runs
      hook seen  the running libvirt daemon has seen it (started after it
                 was written, or reloaded by 'accelmig install'); warn
                 while no daemon runs (the next one to start reads it)
      hostd      the host daemon answers on its local socket
      pool       the pool's control plane answers this host (its secret)
      libvirt    [hostd] libvirt_uri answers
      channel D  each running accelmig domain has the agent channel, and
                 its live XML says state='connected'

    Exits 0 when no check FAILed, 1 otherwise.
    """
    checks = Doctor(config_path, hooks_dir, name, libvirtd_pid_file).run()
    failed = [c for c in checks if c.status == FAIL]
    counts = {s: sum(c.status == s for c in checks) for s in (OK, WARN, FAIL, SKIP)}
    if as_json:
        print_json({"ok": not failed, "counts": counts, "checks": [c.to_dict() for c in checks]})
    else:
        _print(checks)
        click.echo(f"{counts[OK]} ok, {counts[WARN]} warn, {counts[FAIL]} FAIL"
                   + (f", {counts[SKIP]} skipped" if counts[SKIP] else ""))
    if failed:
        raise SystemExit(1)
