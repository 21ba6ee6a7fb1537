"""``qemu+ssh`` between the lab's hosts: a real OpenSSH server (Debian's
``openssh-server``) in each host's namespaces, with throwaway keys the lab
makes, so that ``virsh migrate --live --p2p DOM qemu+ssh://hostB/system``
works as operators type it.

- Each host's sshd runs inside that host's libvirtd namespaces (network,
  mount, UTS: entered with ``nsenter`` at the daemon's reaper), on port 22
  of the host's migration-link address.  What it runs for a client —
  libvirt's remote side, ``virt-ssh-helper qemu:///system`` — therefore
  reaches *that* host's daemon socket.
- Root's home inside a node is node-private (``ROOT_HOME``, under the
  node's own ``/var/lib/libvirt``; the node's private ``/etc/passwd`` says
  so): the source libvirtd's ``ssh`` reads its key, its ``known_hosts`` (the
  other host's real host key: checked, never trusted on first use) and its
  config there, and the machine's own ``/root/.ssh`` is never touched.
- Keys are ed25519, made with ``ssh-keygen`` per lab and removed with it.

``sshd`` needs its privilege-separation directory ``/run/sshd`` (compiled
in): each node has its own, empty (lab/machine.py).

**The operator** (``accelmig fleet``): a key of the lab's own
(``operator/id_ed25519``) is authorized on every node, the pool node
included, and ``operator/known_hosts`` has every node's host key under
its names and addresses.  The pool node gets a sshd too, in a mount
namespace of its own made by the same reaper the hosts' daemons run under
(``pool-machine``): like the hosts, it is a machine of its own
(lab/machine.py), so a deploy onto it stays inside the lab.  The operator
runs in the pool's network namespace, which reaches every node: the pool
at its service address, the hosts at their uplinks.  ``AllowTcpForwarding``
is on, so that a node can be a jump host (``ssh -J``).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from . import machine
from .libvirtd import REAPER, proc_starttime
from .netns import exec_argv

LOG = logging.getLogger("accelmig.lab.ssh")

SSHD = "/usr/sbin/sshd"
SSH_KEYGEN = "ssh-keygen"
#: root's home inside a node (a path of the node's own /var/lib/libvirt)
ROOT_HOME = "/var/lib/libvirt/accelmig-root"
PRIVSEP_DIR = "/run/sshd"
PORT = 22


def available() -> str | None:
    """None when the lab can run sshd, else why not."""
    if not os.path.exists(SSHD):
        return f"{SSHD} is missing (apt-get install openssh-server; ./dev.sh setup installs it)"
    if shutil.which(SSH_KEYGEN) is None or shutil.which("ssh") is None:
        return "ssh or ssh-keygen is missing (apt-get install openssh-client)"
    if shutil.which("virt-ssh-helper") is None:
        return "virt-ssh-helper is missing (apt-get install libvirt-clients)"
    return None


def with_root_home(passwd: str, home: str = ROOT_HOME) -> str:
    """An /etc/passwd text whose root has ``home`` as its home directory."""
    out = []
    for line in passwd.splitlines():
        fields = line.split(":")
        if len(fields) == 7 and fields[0] == "root":
            fields[5] = home
            line = ":".join(fields)
        out.append(line)
    return "\n".join(out) + "\n"


def _keygen(path: Path, comment: str) -> str:
    """A new ed25519 key pair at ``path`` (and ``path``.pub); the public line."""
    for old in (path, path.with_name(path.name + ".pub")):
        old.unlink(missing_ok=True)
    subprocess.run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, capture_output=True, timeout=30)
    return path.with_name(path.name + ".pub").read_text().strip()


class LabSsh:
    """The sshd and the client files of every host of a lab."""

    def __init__(self, lab):
        self.lab = lab

    def _dir(self, host: str) -> Path:
        return (self.pool_root if host == "pool" else self.lab.nodes[host].root) / "sshd"

    def home(self, host: str) -> Path:
        """Root's home inside ``host``, seen from here."""
        return self.lab.nodes[host].host_path(ROOT_HOME)

    @property
    def operator_dir(self) -> Path:
        """The operator's key (``id_ed25519``) and ``known_hosts``."""
        return self.lab.dir / "operator"

    def listen_addresses(self, node: str) -> list[str]:
        """Where ``node``'s sshd listens (each a name in known_hosts)."""
        if node == "pool":
            from .topology import POOL_ADDRESS
            return [POOL_ADDRESS]
        plan = self.lab.topology.host(node)
        return [plan.address, plan.uplink_address]

    def sshd_config(self, node: str) -> str:
        sshd_dir = self._dir(node)
        return "\n".join([
            f"# accelmig lab: {node}'s sshd (lab/ssh.py); keys are the lab's own",
            *(f"ListenAddress {address}:{PORT}" for address in self.listen_addresses(node)),
            f"HostKey {sshd_dir / 'ssh_host_ed25519_key'}",
            f"PidFile {sshd_dir / 'sshd.pid'}",
            f"AuthorizedKeysFile {sshd_dir / 'authorized_keys'}",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",            # the lab's directories are root's, not mode-checked
            "PrintMotd no",
            "X11Forwarding no",
            "AllowTcpForwarding yes",    # a node may be a jump host
            "MaxStartups 50",            # the fleet opens one connection per node at once
            "",
        ])

    def prepare(self) -> None:
        """Keys, sshd configs, and each host's client files (its key
        authorized on every other host, their host keys known); the
        operator's key, authorized everywhere, and its known_hosts."""
        hosts = list(self.lab.HOSTS)
        host_keys, client_keys = {}, {}
        self.operator_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.operator_dir, 0o700)
        operator_key = _keygen(self.operator_dir / "id_ed25519", "operator (accelmig lab)")
        for node in (*hosts, "pool"):
            sshd_dir = self._dir(node)
            sshd_dir.mkdir(parents=True, exist_ok=True)
            host_keys[node] = _keygen(sshd_dir / "ssh_host_ed25519_key", f"accelmig-lab {node} host key")
        (self._dir("pool") / "authorized_keys").write_text(operator_key + "\n")
        (self._dir("pool") / "sshd_config").write_text(self.sshd_config("pool"))
        known = []
        for node in (*hosts, "pool"):
            names = [node, *self.listen_addresses(node)]
            known.append(f"{','.join(names)} {host_keys[node]}\n")
        (self.operator_dir / "known_hosts").write_text("".join(known))
        for host in hosts:
            dot_ssh = self.home(host) / ".ssh"
            dot_ssh.mkdir(parents=True, exist_ok=True)
            os.chmod(self.home(host), 0o700)
            os.chmod(dot_ssh, 0o700)
            client_keys[host] = _keygen(dot_ssh / "id_ed25519", f"root@{host} (accelmig lab)")
        for host in hosts:
            sshd_dir = self._dir(host)
            others = [h for h in hosts if h != host]
            (sshd_dir / "authorized_keys").write_text(
                "".join(client_keys[h] + "\n" for h in others) + operator_key + "\n")
            (sshd_dir / "sshd_config").write_text(self.sshd_config(host))
            dot_ssh = self.home(host) / ".ssh"
            known = []
            for other in others:
                o = self.lab.topology.host(other)
                names = ",".join([other, self.lab.topology.host_ns[other], o.address])
                known.append(f"{names} {host_keys[other]}\n")
            (dot_ssh / "known_hosts").write_text("".join(known))
            (dot_ssh / "config").write_text("\n".join([
                "# accelmig lab: how this host's root (its libvirtd) reaches the other hosts",
                "Host *",
                "    User root",
                f"    IdentityFile {ROOT_HOME}/.ssh/id_ed25519",
                f"    UserKnownHostsFile {ROOT_HOME}/.ssh/known_hosts",
                "    StrictHostKeyChecking yes",
                "    BatchMode yes",
                "    ConnectTimeout 10",
                "",
            ]))

    def start(self, host: str, timeout: float = 15.0) -> int:
        """sshd in ``host``'s namespaces (``pool``: in a mount namespace of
        the pool node's own, under the lab's reaper); returns once it listens."""
        # sshd's privilege-separation directory (PRIVSEP_DIR) is the node's
        # own, empty (lab/machine.py): nothing is created on the machine
        sshd_dir = self._dir(host)
        log = sshd_dir / "sshd.log"
        sshd = [SSHD, "-D", "-e", "-f", str(sshd_dir / "sshd_config")]
        if host == "pool":
            root = self.pool_root
            machine.prepare(root)
            inner = [sys.executable, "-I", "-S", str(REAPER), "--hostname", f"{self.lab.name}-pool",
                     *machine.reaper_args(root, pool=True)]
            argv = exec_argv(self.lab.topology.pool_ns,
                             ["unshare", "--mount", "--uts", "--propagation", "private", *inner, "--", *sshd])
        else:
            argv = ["nsenter", "--target", str(self.lab.nodes[host].pid), "--mount", "--net", "--uts", "--",
                    *sshd]
        key = f"sshd-{host}"
        self.lab._record_process(key, None, argv=argv)
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    start_new_session=True)
        self.lab._popens[key] = proc
        self.lab._record_process(key, proc.pid, argv=argv)
        deadline = time.monotonic() + timeout
        while "Server listening" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {host} did not start: {log.read_text(errors='replace')[-800:]}")
            time.sleep(0.02)
        return proc.pid

    @property
    def pool_root(self) -> Path:
        """The pool node's machine directories (lab/machine.py)."""
        return self.lab.dir / "pool-machine"

    def machine_pid(self, node: str) -> int:
        """A process in ``node``'s namespaces (network, mount, UTS): what
        ``nsenter --target`` takes to run a command as on that machine."""
        # sshd: the one process every node has (a host's libvirtd may be
        # stopped by a test while its machine lives on)
        try:
            pid = int((self._dir(node) / "sshd.pid").read_text().strip())
        except (OSError, ValueError):
            pid = None
        if pid is not None and proc_starttime(pid) is not None:
            return pid
        if node != "pool" and self.lab.nodes[node].pid:
            return self.lab.nodes[node].pid
        raise RuntimeError(f"{node}: no process of its machine runs (sshd pid {pid})")

    def up(self) -> None:
        self.prepare()
        for node in (*self.lab.HOSTS, "pool"):
            self.start(node)

    def uri(self, host: str) -> str:
        """The libvirt URI another host's daemon uses to reach ``host`` over ssh."""
        return f"qemu+ssh://root@{host}/system"
