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
in): created when absent, empty, mode 0755, like libvirt's own absent
directories (lab/libvirtd.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

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
        return self.lab.nodes[host].root / "sshd"

    def home(self, host: str) -> Path:
        """Root's home inside ``host``, seen from here."""
        return self.lab.nodes[host].host_path(ROOT_HOME)

    def prepare(self) -> None:
        """Keys, sshd configs, and each host's client files (its key
        authorized on every other host, their host keys known)."""
        hosts = list(self.lab.HOSTS)
        host_keys, client_keys = {}, {}
        for host in hosts:
            sshd_dir = self._dir(host)
            sshd_dir.mkdir(parents=True, exist_ok=True)
            host_keys[host] = _keygen(sshd_dir / "ssh_host_ed25519_key", f"accelmig-lab {host} host key")
            dot_ssh = self.home(host) / ".ssh"
            dot_ssh.mkdir(parents=True, exist_ok=True)
            os.chmod(self.home(host), 0o700)
            os.chmod(dot_ssh, 0o700)
            client_keys[host] = _keygen(dot_ssh / "id_ed25519", f"root@{host} (accelmig lab)")
        for host in hosts:
            plan = self.lab.topology.host(host)
            sshd_dir = self._dir(host)
            others = [h for h in hosts if h != host]
            (sshd_dir / "authorized_keys").write_text("".join(client_keys[h] + "\n" for h in others))
            (sshd_dir / "sshd_config").write_text("\n".join([
                "# accelmig lab: this host's sshd (lab/ssh.py); keys are the lab's own",
                f"ListenAddress {plan.address}:{PORT}",
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
                "AllowTcpForwarding no",
                "",
            ]))
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
        """sshd in ``host``'s namespaces; returns once it listens."""
        node = self.lab.nodes[host]
        if not os.path.isdir(PRIVSEP_DIR):
            LOG.info("creating sshd's privilege-separation directory %s (mode 0755, empty, left in place)",
                     PRIVSEP_DIR)
            os.makedirs(PRIVSEP_DIR, mode=0o755, exist_ok=True)
        sshd_dir = self._dir(host)
        log = sshd_dir / "sshd.log"
        argv = ["nsenter", "--target", str(node.pid), "--mount", "--net", "--uts", "--",
                SSHD, "-D", "-e", "-f", str(sshd_dir / "sshd_config")]
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

    def up(self) -> None:
        self.prepare()
        for host in self.lab.HOSTS:
            self.start(host)

    def uri(self, host: str) -> str:
        """The libvirt URI another host's daemon uses to reach ``host`` over ssh."""
        return f"qemu+ssh://root@{host}/system"
