"""``accelmig install`` / ``accelmig uninstall``: the libvirt qemu hook.

libvirt (>= 6.5) runs every executable in ``/etc/libvirt/hooks/qemu.d/``, in
name order, as ``DOMAIN OPERATION SUB-OPERATION EXTRA`` with the domain XML
on stdin and only ``LC_ALL``, ``PATH`` and ``HOME`` in its environment.  So
the script written here names this interpreter by its absolute path and
bakes the configuration path in (``ACCELMIG_CONFIG``).

libvirt looks for hooks only when the daemon starts and when it reloads
(SIGHUP).  ``install`` therefore signals the daemon named by its pid file
(checked to really be ``libvirtd`` or ``virtqemud``) and records in the state
directory which daemon (pid + start time) it reloaded and when, which is how
``accelmig doctor`` tells whether the running daemon has seen the hook.

The helpers shared by the other host commands (error reporting, daemon
lookup, the "hook seen" rule, the state file) live here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import shlex
import signal
import stat
import sys
import time

import click

from accelmig.plugin.config import DEFAULT_PATH, HostConfig, HostdConfig
from accelmig.runtime.cli import exit_codes_epilog
from accelmig.runtime.files import atomic_write
from accelmig.wire.errors import AccelmigError, BadRequest, Unavailable
from accelmig.wire.localapi import GATED_HOOK_STEPS

DEFAULT_HOOKS_DIR = "/etc/libvirt/hooks"
DEFAULT_HOOK_NAME = "50-accelmig"
HOOK_MODULE = "accelmig.plugin.hook"
CONFIG_ENV = "ACCELMIG_CONFIG"
#: The daemons that run qemu hooks: the monolithic one and the modular QEMU driver.
DAEMON_NAMES = ("libvirtd", "virtqemud")
DEFAULT_PID_FILES = ("/run/libvirtd.pid", "/var/run/libvirtd.pid",
                     "/run/virtqemud.pid", "/var/run/virtqemud.pid")
STATE_FILE = "hook-install.json"
#: /proc/stat's btime has whole seconds: a daemon start this close to the
#: hook's mtime proves nothing either way.
START_MARGIN_S = 1.0


# ---------------------------------------------------------------- errors and output

def cli_errors(func):
    """Every accelmig error (and an OSError the command did not expect) is
    one line on stderr, ``accelmig: <error>``, and exit status 1: never a
    traceback for a user's mistake."""
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except AccelmigError as exc:
            fail(exc.message)
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            fail(f"{where}{exc.strerror or exc}")
    return wrapper


def fail(message: str, code: int = 1):
    click.echo(f"accelmig: {message}", err=True)
    sys.exit(code)


def warn(message: str) -> None:
    click.echo(f"accelmig: warning: {message}", err=True)


def print_json(data) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def config_option(func):
    return click.option(
        "--config", "config_path", metavar="FILE", envvar=CONFIG_ENV, show_envvar=True,
        help=f"host configuration [default: {DEFAULT_PATH}]")(func)


def json_option(func):
    return click.option("--json", "as_json", is_flag=True, help="print the result as JSON")(func)


def load_config(path: str | None) -> tuple[HostConfig | None, AccelmigError | None, str]:
    """(config, error, path): a config that does not load is reported, not raised."""
    path = os.path.abspath(path or DEFAULT_PATH)
    try:
        return HostConfig.load(path), None, path
    except AccelmigError as exc:
        return None, exc, path


def hostd_settings(config: HostConfig | None) -> HostdConfig:
    return config.hostd if config is not None else HostdConfig()


# ---------------------------------------------------------------- the libvirt daemon

@dataclasses.dataclass(frozen=True)
class Daemon:
    pid: int
    starttime: int             # /proc/<pid>/stat field 22: clock ticks after boot
    comm: str
    pid_file: str

    @property
    def started_at(self) -> float:
        """Wall-clock start time (whole-second precision: btime)."""
        return boot_time() + self.starttime / os.sysconf("SC_CLK_TCK")

    def identity(self) -> dict:
        return {"pid": self.pid, "starttime": self.starttime, "comm": self.comm,
                "pid_file": self.pid_file}

    def __str__(self):
        return f"{self.comm} (pid {self.pid})"


def boot_time() -> float:
    with open("/proc/stat") as handle:
        for line in handle:
            if line.startswith("btime "):
                return float(line.split()[1])
    raise Unavailable(what="/proc/stat", reason="no btime line")


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, starttime) of a process, None when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[19])


def daemon_name(pid: int) -> str | None:
    """``libvirtd``/``virtqemud`` when ``pid`` is one, by comm or argv[0]."""
    try:
        with open(f"/proc/{pid}/comm") as handle:
            comm = handle.read().strip()
    except OSError:
        return None
    if comm in DAEMON_NAMES:
        return comm
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            argv0 = handle.read().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return None
    name = os.path.basename(argv0)
    return name if name in DAEMON_NAMES else None


def _daemon_from(pid_file: str) -> tuple[Daemon | None, str]:
    """The daemon a pid file names, or why not."""
    try:
        text = open(pid_file).read().strip()
    except FileNotFoundError:
        return None, f"{pid_file}: no such file"
    except OSError as exc:
        return None, f"{pid_file}: {exc.strerror}"
    if not text.isdigit() or int(text) <= 0:
        return None, f"{pid_file} holds {text[:40]!r}, not a process id"
    pid = int(text)
    info = proc_stat(pid)
    if info is None or info[0] in ("Z", "X"):
        return None, f"{pid_file} names pid {pid}, which is not running (a stale pid file)"
    name = daemon_name(pid)
    if name is None:
        return None, (f"{pid_file} names pid {pid}, which is not {' or '.join(DAEMON_NAMES)} "
                      f"(a stale pid file, the pid reused)")
    return Daemon(pid=pid, starttime=info[1], comm=name, pid_file=pid_file), ""


def find_daemon(pid_file: str | None = None) -> Daemon:
    """The running libvirt daemon: from ``pid_file``, else the first of the
    default pid files that names a live libvirtd/virtqemud."""
    candidates = [pid_file] if pid_file else list(DEFAULT_PID_FILES)
    reasons = []
    for candidate in candidates:
        daemon, why = _daemon_from(os.path.abspath(candidate))
        if daemon is not None:
            return daemon
        reasons.append(why)
    hint = "" if pid_file else "; pass --libvirtd-pid-file FILE"
    raise Unavailable(what="the libvirt daemon", reason="none found: " + "; ".join(reasons) + hint)


def reload_daemon(daemon: Daemon) -> float:
    """SIGHUP the daemon (re-checked by start time first); returns when."""
    info = proc_stat(daemon.pid)
    if info is None or info[1] != daemon.starttime:
        raise Unavailable(what=str(daemon), reason="it exited before it could be reloaded")
    try:
        os.kill(daemon.pid, signal.SIGHUP)
    except ProcessLookupError:
        raise Unavailable(what=str(daemon), reason="it exited before it could be reloaded") from None
    except PermissionError:
        raise Unavailable(what=str(daemon), reason="not allowed to signal it (run as root)") from None
    return time.time()


# ---------------------------------------------------------------- the state file

def state_path(state_dir: str) -> str:
    return os.path.join(state_dir, STATE_FILE)


def read_state(state_dir: str) -> dict:
    try:
        with open(state_path(state_dir)) as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return {"version": 1, "hooks": {}}
    if not isinstance(data, dict) or not isinstance(data.get("hooks"), dict):
        return {"version": 1, "hooks": {}}
    return data


def write_state(state_dir: str, data: dict) -> str:
    path = state_path(state_dir)
    os.makedirs(state_dir, mode=0o755, exist_ok=True)
    atomic_write(path, json.dumps(data, indent=1, sort_keys=True) + "\n", 0o644)
    return path


# ---------------------------------------------------------------- the hook script

def hook_path(hooks_dir: str, name: str) -> str:
    return os.path.join(os.path.abspath(hooks_dir), "qemu.d", name)


def check_name(name: str) -> str:
    if not name or "/" in name or name.startswith(".") or not re.fullmatch(r"[A-Za-z0-9._+-]+", name):
        raise BadRequest(f"hook name {name!r}: a plain file name (letters, digits, . _ + -; "
                                f"not starting with '.')")
    return name


def hook_script(interpreter: str, config: str | None) -> str:
    """The script libvirt runs: a few lines of sh.  libvirt runs the hook for
    every step of every domain, and only ``migrate begin``/``restore begin``
    need accelmig: every other operation exits 0 at once, without starting
    Python.  The gated two run the hook module with ``-I`` (the hook's own
    directory and any PYTHON* variable stay out of its imports); if accelmig
    cannot even be imported they fail, which refuses the migration (a refused
    migration beats a VM that arrives without its accelerator)."""
    if not os.path.isabs(interpreter) or re.search(r"\s", interpreter):
        raise BadRequest(f"interpreter {interpreter!r}: the hook needs an absolute path without blanks")
    lines = [
        "#!/bin/sh",
        "# accelmig's libvirt qemu hook, written by 'accelmig install' (removed by",
        "# 'accelmig uninstall').  libvirt runs it as DOMAIN OPERATION SUB-OPERATION EXTRA",
        "# with the domain XML on stdin.  Do not edit: rerun 'accelmig install'.",
        'case "$2 $3" in',
        '    ' + '|'.join(f'"{op} {sub}"' for op, sub in sorted(GATED_HOOK_STEPS)) + ') ;;',
        "    *) exec cat >/dev/null ;;      # drain the XML libvirt writes; nothing to do",
        "esac",
    ]
    if config is not None:
        lines.append(f"{CONFIG_ENV}={shlex.quote(config)}; export {CONFIG_ENV}")
    lines += [f'exec {shlex.quote(interpreter)} -I -m {HOOK_MODULE} "$@"', ""]
    return "\n".join(lines)


def parse_hook_script(text: str) -> dict:
    """What an installed script says: its interpreter and baked config."""
    out = {"interpreter": None, "config": None, "accelmig": HOOK_MODULE in text}
    for line in text.splitlines():
        words = shlex.split(line, comments=True) if line.strip() else []
        if words[:1] == ["exec"] and HOOK_MODULE in words:
            out["interpreter"] = words[1]
        elif words and words[0].startswith(f"{CONFIG_ENV}="):
            out["config"] = words[0].split("=", 1)[1].rstrip(";")
    return out


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def hook_seen(path: str, daemon: Daemon, record: dict | None) -> tuple[bool, str]:
    """Whether the running daemon has seen the hook at ``path``: it started
    after the file was written, or ``accelmig install`` reloaded this very
    daemon (pid + start time) after the file was written."""
    mtime = os.stat(path).st_mtime
    started = daemon.started_at
    if started > mtime + START_MARGIN_S:
        return True, (f"{daemon} started {_when(started)}, after the hook was written "
                      f"({_when(mtime)})")
    reload = (record or {}).get("reload") or {}
    if (reload.get("pid") == daemon.pid and reload.get("starttime") == daemon.starttime
            and isinstance(reload.get("at"), (int, float)) and reload["at"] >= mtime):
        return True, f"{daemon} was reloaded (SIGHUP) by accelmig install {_when(reload['at'])}"
    why = (f"{daemon} started {_when(started)}, before the hook was written ({_when(mtime)}), "
           f"and no reload of it since is recorded")
    if reload.get("pid"):
        why += f" (the recorded reload was of pid {reload['pid']}, another daemon or an older file)"
    return False, why


def _when(when: float) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))
    return f"at {stamp}"


# ---------------------------------------------------------------- commands

def _common(func):
    """The options install and uninstall share (applied last first: listed in this order)."""
    func = json_option(func)
    func = config_option(func)
    func = click.option("--no-reload", is_flag=True,
                        help="do not signal the daemon (it sees the change at its next start or "
                             "SIGHUP)")(func)
    func = click.option("--libvirtd-pid-file", metavar="FILE",
                        help="the daemon to reload [default: the first of "
                             + ", ".join(DEFAULT_PID_FILES) + " that names a running daemon]")(func)
    func = click.option("--name", default=DEFAULT_HOOK_NAME, show_default=True,
                        help="file name in qemu.d (libvirt runs its scripts in name order)")(func)
    func = click.option("--hooks-dir", default=DEFAULT_HOOKS_DIR, show_default=True, metavar="DIR",
                        help="libvirt's hooks directory; the script goes into DIR/qemu.d/")(func)
    return func


@click.command("install", epilog=exit_codes_epilog(
    {0: "the hook is installed (a libvirt daemon that is not running reads it when it starts)",
     1: "failure: the hooks directory is missing, or a running daemon could not be reloaded"},
    click=True))
@_common
@click.option("--systemd", is_flag=True,
              help="also install hostd's systemd unit, accelmig-hostd.service (docs/systemd.md)")
@click.option("--unit-dir", default="/etc/systemd/system", show_default=True, metavar="DIR",
              help="where --systemd puts the unit (systemctl daemon-reload only for a directory "
                   "systemd reads, on a machine booted with systemd)")
@cli_errors
def install(hooks_dir, name, libvirtd_pid_file, no_reload, config_path, as_json, systemd, unit_dir):
    """Install accelmig's libvirt qemu hook and make libvirt see it.

    Writes an executable script to HOOKS_DIR/qemu.d/NAME (atomically; a
    rerun that would write the same file leaves it and says "unchanged")
    that runs accelmig's hook with this Python interpreter, then sends
    SIGHUP to the libvirt daemon named by the pid file (libvirt looks for
    hooks only at start and on reload) and records which daemon it reloaded
    in hostd's state directory, so that 'accelmig doctor' can tell.  With
    --config the hook reads that configuration file (hooks get no
    environment of their own); a missing file is a warning.

    No libvirt daemon running is a warning, not an error (socket
    activation stops an idle libvirtd): the daemon reads qemu.d when it
    next starts, and 'accelmig doctor' then verifies it (its 'hook seen'
    check: the running daemon started after the hook was written).
    """
    check_name(name)
    warnings = []
    config, error, resolved = load_config(config_path)
    if error is not None:
        why = ("not found: until it exists the hook refuses accelmig migrations (strict mode)"
               if "file not found" in error.message else f"does not load: {error.message}")
        warnings.append(f"config {resolved} {why}")
    baked = resolved if config_path else None
    state_dir = hostd_settings(config).state_dir

    path = hook_path(hooks_dir, name)
    qemu_d = os.path.dirname(path)
    parent = os.path.dirname(os.path.abspath(hooks_dir))
    if not os.path.isdir(parent):
        raise Unavailable(what=f"the hooks directory {hooks_dir}",
                          reason=f"{parent} does not exist (is libvirt installed? else pass --hooks-dir)")
    os.makedirs(qemu_d, mode=0o755, exist_ok=True)
    text = hook_script(os.path.abspath(sys.executable), baked)
    current = None
    with contextlib.suppress(FileNotFoundError, IsADirectoryError, UnicodeDecodeError):
        with open(path) as handle:
            current = handle.read()
    unchanged = current == text and stat.S_IMODE(os.stat(path).st_mode) == 0o755
    if not unchanged:
        atomic_write(path, text, 0o755)
    result = {"hook": path, "action": "unchanged" if unchanged else "written",
              "interpreter": os.path.abspath(sys.executable), "config": baked,
              "config_read": resolved, "state_dir": state_dir}

    state = read_state(state_dir)
    record = state["hooks"].get(path)
    new_reload = (record or {}).get("reload") if unchanged else None
    reload_error = None
    if no_reload:
        result["reload"] = {"action": "skipped (--no-reload)"}
    else:
        try:
            daemon = find_daemon(libvirtd_pid_file)
            seen, _ = hook_seen(path, daemon, record) if unchanged else (False, "")
            if seen:
                result["reload"] = {"action": "not needed", **daemon.identity()}
            else:
                new_reload = {**daemon.identity(), "at": reload_daemon(daemon)}
                result["reload"] = {"action": "reloaded", **new_reload}
        except AccelmigError as exc:
            if _running(exc):
                reload_error = exc
                result["reload"] = {"action": "failed", "error": exc.message}
            else:
                # A normal state: socket activation stops an idle libvirtd.
                # The next daemon to start reads qemu.d; 'accelmig doctor'
                # verifies it then (that daemon started after the hook was written).
                result["reload"] = {"action": "not running", "error": exc.message}
                warnings.append(f"no libvirt daemon is running ({exc.message}): it reads the hook when "
                                f"it next starts; then 'accelmig doctor' checks that it has ('hook seen')")
    state["hooks"][path] = {
        "hooks_dir": os.path.abspath(hooks_dir), "name": name, "sha256": sha256(text),
        "interpreter": result["interpreter"], "config": baked,
        "pid_file": os.path.abspath(libvirtd_pid_file) if libvirtd_pid_file else None,
        "installed_at": ((record or {}).get("installed_at") if unchanged else None) or time.time(),
        "reload": new_reload,
    }
    try:
        result["state_file"] = write_state(state_dir, state)
    except OSError as exc:
        warnings.append(f"cannot record the install in {state_dir} ({exc.strerror}): "
                        f"accelmig doctor will not know about the reload")
        result["state_file"] = None
    unit_failed = None
    if systemd:
        from accelmig.plugin import unit
        from accelmig.runtime import units
        unit_text = unit.render(resolved, hostd_settings(config))
        result["systemd"] = units.install_units({unit.UNIT_NAME: unit_text}, unit_dir=unit_dir)
        if result["systemd"]["reload"]["action"] == "failed":
            unit_failed = result["systemd"]["reload"]["reason"]
    result["warnings"] = warnings
    for message in warnings:
        warn(message)
    if as_json:
        print_json(result)
    else:
        click.echo(f"hook {path}: {result['action']} (interpreter {result['interpreter']}, "
                   f"config {baked or 'the hook default ' + DEFAULT_PATH})")
        click.echo(_reload_line(result["reload"]))
        if result["state_file"]:
            click.echo(f"recorded in {result['state_file']}")
        if systemd:
            from accelmig.runtime import units
            for line in units.summary(result["systemd"]):
                click.echo(f"unit {line}")
    if unit_failed is not None:
        fail(f"the unit is installed, but systemd did not reload: {unit_failed}")
    if reload_error is not None:
        fail(f"the hook is installed, but libvirt does not see it yet: {reload_error.message} "
             f"(start or reload the daemon, or pass --no-reload)")


def _running(exc: AccelmigError) -> bool:
    """Whether a failed reload left a daemon running that has not seen the hook
    (not allowed to signal it), rather than finding none (none running, a
    stale pid file, a daemon that exited meanwhile)."""
    reason = str(exc.kwargs.get("reason", ""))
    return not (reason.startswith("none found") or reason.startswith("it exited"))


def _reload_line(reload: dict) -> str:
    action = reload.get("action")
    if action == "not running":
        return "libvirt daemon: not running; the next one to start reads the hook"
    if action == "reloaded":
        return (f"{reload['comm']} (pid {reload['pid']}, pid file {reload['pid_file']}): reloaded "
                f"(SIGHUP); libvirt re-reads its hooks")
    if action == "not needed":
        return f"{reload['comm']} (pid {reload['pid']}): already sees this hook, not reloaded"
    if action == "failed":
        return f"libvirt daemon: not reloaded: {reload.get('error')}"
    return f"libvirt daemon: not reloaded ({action.split('(')[-1].rstrip(')') if '(' in action else action})"


@click.command("uninstall")
@_common
@cli_errors
def uninstall(hooks_dir, name, libvirtd_pid_file, no_reload, config_path, as_json):
    """Remove accelmig's libvirt qemu hook and make libvirt forget it.

    Removes HOOKS_DIR/qemu.d/NAME (only a script that 'accelmig install'
    wrote: one that does not run accelmig's hook is refused) and reloads
    the libvirt daemon (SIGHUP) so that it stops running it.  Nothing to
    remove is not an error.
    """
    check_name(name)
    config, error, resolved = load_config(config_path)
    state_dir = hostd_settings(config).state_dir
    path = hook_path(hooks_dir, name)
    result = {"hook": path, "state_dir": state_dir}
    try:
        with open(path) as handle:
            text = handle.read()
    except FileNotFoundError:
        text = None
    except (IsADirectoryError, UnicodeDecodeError):
        raise BadRequest(f"{path} is not accelmig's hook script: left alone") from None
    reload_error = None
    if text is None:
        result["action"] = "not installed"
        result["reload"] = {"action": "not needed"}
    else:
        if not parse_hook_script(text)["accelmig"]:
            raise BadRequest(f"{path} does not run accelmig's hook: left alone "
                                    f"(another tool's script? pass the right --name)")
        os.unlink(path)
        result["action"] = "removed"
        if no_reload:
            result["reload"] = {"action": "skipped (--no-reload)"}
        else:
            try:
                daemon = find_daemon(libvirtd_pid_file)
                at = reload_daemon(daemon)
                result["reload"] = {"action": "reloaded", **daemon.identity(), "at": at}
            except AccelmigError as exc:
                reload_error = exc
                result["reload"] = {"action": "failed", "error": exc.message}
    state = read_state(state_dir)
    if state["hooks"].pop(path, None) is not None:
        with contextlib.suppress(OSError):
            write_state(state_dir, state)
    if as_json:
        print_json(result)
    else:
        click.echo(f"hook {path}: {result['action']}")
        if text is not None:
            click.echo(_reload_line(result["reload"]))
    if reload_error is not None:
        fail(f"the hook is removed, but the daemon was not reloaded: {reload_error.message}")
