"""systemd units: render a side's unit template and install it.

Each side ships its unit as package data (``pool/data/accelmig-pool.service.in``,
``plugin/data/accelmig-hostd.service.in``, ``agent/data/accelmig-agent.service.in``)
and installs it with its own command (``accelmig-pool install --systemd``,
``accelmig install --systemd``, ``accelmig-agent install --systemd``).  The
plumbing they share is here, beside ``logs`` and ``sockets``, in the package
every side's process runs on; standard library only (the guest agent uses
it).

- Templates use ``@NAME@`` placeholders (the ``configure_file`` convention of
  ``*.service.in`` files): ``$`` and ``%`` keep their systemd meanings
  (``$MAINPID``, ``%S``).  Every placeholder must get a value and every value
  must be used: a typo fails loudly instead of installing a broken unit.
- ``ExecStart`` names the console script of *this* installation (the one
  beside ``sys.executable``: a virtualenv's ``bin/``, pip's ``--prefix``), not
  a guessed ``/usr/bin``.
- Installing is idempotent (same bytes: "unchanged", the file untouched) and
  atomic.  ``systemctl daemon-reload`` runs only when a real systemd is PID 1
  and the unit went into a directory that systemd reads (not under ``--root``).
docs/systemd.md has what each directive is for.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import os
import re
import shutil
import subprocess
import sys
import zipimport

from accelmig.runtime.files import atomic_write
from accelmig.wire.errors import BadRequest

DEFAULT_UNIT_DIR = "/etc/systemd/system"
DEFAULT_SYSUSERS_DIR = "/etc/sysusers.d"
#: Where the system manager reads units (systemd.unit(5), "System Unit Search Path").
SYSTEM_UNIT_PATHS = ("/etc/systemd/system", "/run/systemd/system", "/usr/local/lib/systemd/system",
                     "/usr/lib/systemd/system", "/lib/systemd/system")

_PLACEHOLDER = re.compile(r"@([A-Z][A-Z0-9_]*)@")
_PLAIN_ARG = re.compile(r"[A-Za-z0-9_./:=,+@-]+")


def template(package: str, name: str) -> str:
    """The text of ``data/NAME`` in ``package`` (package data)."""
    # one name per joinpath: in a zip (the guest bundle) Python 3.9's Traversable takes only one
    return importlib.resources.files(package).joinpath("data").joinpath(name).read_text(encoding="utf-8")


def render(text: str, values: dict[str, str]) -> str:
    """``text`` with each ``@NAME@`` replaced by ``values[NAME]``."""
    used = set(_PLACEHOLDER.findall(text))
    missing = sorted(used - set(values))
    unused = sorted(set(values) - used)
    if missing or unused:
        raise ValueError(f"unit template: missing values {missing}, unused values {unused}")
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def quote_arg(arg: str, command: bool = True) -> str:
    """One word as systemd parses it (a command line's, or with ``command``
    false a path list's): quoted when it has blanks or quotes, ``%`` doubled
    (no specifier expansion) and in a command line ``$`` too (no variable
    expansion of a path or a value)."""
    if not arg:
        word = '""'
    elif _PLAIN_ARG.fullmatch(arg):
        word = arg
    else:
        word = '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
    word = word.replace("%", "%%")
    return word.replace("$", "$$") if command else word


def command_line(argv: list[str]) -> str:
    """An ``ExecStart=`` value.  The executable's name gets no variable
    expansion, so only its ``%`` is doubled; a quote, a backslash or a
    control character in it systemd refuses ("special characters")."""
    if re.search(r'["\\\x00-\x1f\x7f]', argv[0]):
        raise BadRequest(f"{argv[0]!r}: systemd cannot run a program whose path has quotes, "
                         f"backslashes or control characters (install it elsewhere)")
    return " ".join([quote_arg(argv[0], command=False), *(quote_arg(arg) for arg in argv[1:])])


def entry_point(script: str, module: str) -> list[str]:
    """The argv that runs console script ``script`` of this installation:
    the script beside this interpreter (a venv's ``bin/``, ``pip install
    --prefix``), else the one on PATH, else this interpreter with ``-m
    module`` (a copy of the sources without entry points).  Run from the
    guest bundle (``accelmig guest-bundle``), it is this interpreter and the
    bundle: the bundle's ``__main__`` is the agent's command line."""
    if script == "accelmig-agent" and isinstance(__loader__, zipimport.zipimporter):   # out of the bundle
        return [os.path.abspath(sys.executable), os.path.abspath(__loader__.archive)]
    beside = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), script)
    if os.access(beside, os.X_OK):
        return [beside]
    found = shutil.which(script)
    if found:
        return [os.path.abspath(found)]
    return [os.path.abspath(sys.executable), "-m", module]


def escape_path(path: str) -> str:
    """``systemd-escape --path``: the unit-name form of a file system path."""
    parts = [p for p in path.split("/") if p]
    if not parts:
        return "-"
    if any(p in (".", "..") for p in parts):
        raise BadRequest(f"{path!r}: not a normalised absolute path")
    out = []
    for i, ch in enumerate("/".join(parts)):
        if ch == "/":
            out.append("-")
        elif ch.isascii() and (ch.isalnum() or ch in ":_" or (ch == "." and i > 0)):
            out.append(ch)
        else:
            out.extend(f"\\x{b:02x}" for b in ch.encode())
    return "".join(out)


def device_unit(path: str) -> str:
    """The ``.device`` unit systemd makes for a device node (or its udev symlink)."""
    return escape_path(path) + ".device"


def pid1() -> str:
    try:
        with open("/proc/1/comm") as handle:
            return handle.read().strip()
    except OSError:
        return "unknown"


def systemd_booted() -> bool:
    """sd_booted(3): the machine runs systemd as its system manager."""
    return os.path.isdir("/run/systemd/system") and pid1() == "systemd"


def under_root(root: str | None, path: str) -> str:
    """``path`` inside the alternate file system root ``root`` (``systemctl --root``)."""
    if not root or os.path.abspath(root) == "/":
        return os.path.abspath(path)
    return os.path.join(os.path.abspath(root), os.path.abspath(path).lstrip("/"))


def install_file(path: str, text: str, mode: int = 0o644) -> str:
    """Write ``text`` to ``path`` atomically; "unchanged" (file untouched)
    when it already holds exactly that with that mode, else "written"."""
    with contextlib.suppress(FileNotFoundError, IsADirectoryError, UnicodeDecodeError):
        with open(path, encoding="utf-8") as handle:
            if handle.read() == text and (os.stat(path).st_mode & 0o7777) == mode:
                return "unchanged"
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    atomic_write(path, text, mode)
    return "written"


def _real_target(root: str | None, directory: str) -> bool:
    if root and os.path.abspath(root) != "/":
        return False
    real = os.path.realpath(directory)
    return any(real == os.path.realpath(p) for p in SYSTEM_UNIT_PATHS)


def reload_manager(changed: bool, root: str | None, unit_dir: str) -> dict:
    """Make systemd see a changed unit: ``systemctl daemon-reload``, only
    where that means something.  Returns ``{"action", "reason"}``."""
    if not changed:
        return {"action": "not needed", "reason": "nothing changed"}
    if not _real_target(root, unit_dir):
        return {"action": "skipped", "reason": f"{unit_dir} is not a directory this machine's "
                                               f"systemd reads (an alternate root or unit directory)"}
    if not systemd_booted():
        return {"action": "skipped", "reason": f"PID 1 is {pid1()!r}, not systemd: the unit takes "
                                               f"effect when this system boots with systemd"}
    done = subprocess.run(["systemctl", "daemon-reload"], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return {"action": "failed", "reason": done.stderr.strip() or f"exit {done.returncode}"}
    return {"action": "reloaded", "reason": "systemctl daemon-reload"}


def create_users(root: str | None, conf_path: str) -> dict:
    """Create the users a sysusers.d file declares (``systemd-sysusers``,
    which also works offline and under ``--root``)."""
    tool = shutil.which("systemd-sysusers")
    if tool is None:
        return {"action": "skipped", "reason": f"no systemd-sysusers here: create the user that "
                                               f"{conf_path} declares by hand (useradd --system)"}
    argv = [tool]
    if root and os.path.abspath(root) != "/":
        argv.append(f"--root={os.path.abspath(root)}")
    argv.append(conf_path)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return {"action": "failed", "reason": done.stderr.strip() or f"exit {done.returncode}"}
    return {"action": "done", "reason": " ".join(argv)}


def summary(result: dict) -> list[str]:
    """Human-readable lines of an install result (see ``install_units``)."""
    lines = [f"{f['path']}: {f['action']}" for f in result["files"]]
    if "users" in result:
        lines.append(f"users: {result['users']['action']} ({result['users']['reason']})")
    reload = result["reload"]
    lines.append(f"systemd: {reload['action']} ({reload['reason']})")
    return lines


def install_units(units: dict[str, str], *, root: str | None = None, unit_dir: str = DEFAULT_UNIT_DIR,
                  sysusers: dict[str, str] | None = None,
                  sysusers_dir: str = DEFAULT_SYSUSERS_DIR) -> dict:
    """Install ``units`` (file name -> text) into ``unit_dir`` and the
    ``sysusers`` files (name -> text) into ``sysusers_dir``, both under
    ``root``; create the declared users; reload systemd where it applies.

    Returns ``{"files": [{"path", "action"}], "users"?, "reload"}``.
    """
    target = under_root(root, unit_dir)
    files = []
    for name, text in (sysusers or {}).items():
        path = os.path.join(under_root(root, sysusers_dir), name)
        files.append({"path": path, "action": install_file(path, text)})
    for name, text in units.items():
        path = os.path.join(target, name)
        files.append({"path": path, "action": install_file(path, text)})
    result: dict = {"files": files}
    if sysusers:
        # Always, not only when the file changed: a user deleted since is
        # made again (systemd-sysusers leaves existing ones alone).
        users = [create_users(root, f["path"]) for f in files[:len(sysusers)]]
        result["users"] = next((u for u in users if u["action"] != "done"), users[0])
    changed = any(f["action"] != "unchanged" for f in files[len(sysusers or {}):])
    result["reload"] = reload_manager(changed, root, target)
    return result
