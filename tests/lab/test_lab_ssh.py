"""qemu+ssh between the lab's hosts (lab/ssh.py): a real OpenSSH server in
each host's namespaces, keys the lab made, host keys checked.

- fast tier: root's home inside a node is the node's own;
- root + libvirt: from hostA's namespaces (where its libvirtd's own ``ssh``
  runs for a peer-to-peer migration) ``virsh -c qemu+ssh://root@hostB/system``
  reaches hostB's daemon, not hostA's; a host key other than the one the lab
  recorded is refused (no trust on first use); the machine's own /root/.ssh
  is never written.  The migrations themselves: tests/e2e/test_migration.py.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from accelmig.lab.ssh import ROOT_HOME, available, with_root_home

PASSWD = "root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n"


def test_roots_home_inside_a_node_is_the_nodes_own():
    lines = with_root_home(PASSWD).splitlines()
    assert lines[0] == f"root:x:0:0:root:{ROOT_HOME}:/bin/bash"
    assert lines[1] == PASSWD.splitlines()[1]                     # nobody else moves
    assert ROOT_HOME.startswith("/var/lib/libvirt/")              # bind-mounted per node


def in_node(lab, host, *argv, timeout=60):
    node = lab.nodes[host]
    return subprocess.run(["nsenter", "--target", str(node.pid), "--mount", "--net", "--uts", "--", *argv],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.root
@pytest.mark.libvirt
def test_hosts_reach_each_others_libvirtd_over_ssh_with_checked_host_keys():
    missing = available()
    if missing:
        pytest.skip(f"SKIPPED LOUDLY: {missing}")
    from accelmig.lab.rig import Lab
    from accelmig.lab.ssh import LabSsh
    from tests.support.e2e import assert_clean, snapshot

    root_ssh = "/root/.ssh"
    before_root_ssh = sorted(os.listdir(root_ssh)) if os.path.isdir(root_ssh) else None
    lab = Lab(f"ssh{os.getpid() % 100000}", pool=False)
    before = snapshot()
    try:
        lab.up()
        assert lab.ssh and lab.env()["hosts"]["hostB"]["ssh_uri"] == "qemu+ssh://root@hostB/system"
        for src, dst in (("hostA", "hostB"), ("hostB", "hostA")):
            dest_uri, migrate_uri = lab.migration_uris(dst, "ssh")
            assert dest_uri == f"qemu+ssh://root@{dst}/system" and migrate_uri.startswith("tcp://10.88.3.")
            out = in_node(lab, src, "virsh", "-c", dest_uri, "hostname")
            assert out.returncode == 0 and out.stdout.strip() == dst, out.stderr
        # a host key other than the one recorded: refused, never learned
        known = LabSsh(lab).home("hostA") / ".ssh" / "known_hosts"
        recorded = known.read_text()
        forged = subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(known.parent / "forged")],
                                capture_output=True, timeout=30)
        assert forged.returncode == 0
        other_key = (known.parent / "forged.pub").read_text().split()[:2]
        known.write_text(recorded.split(" ")[0] + " " + " ".join(other_key) + "\n")
        out = in_node(lab, "hostA", "virsh", "-c", "qemu+ssh://root@hostB/system", "hostname")
        assert out.returncode != 0 and "Host key verification failed" in out.stderr, out.stderr
        assert known.read_text().count("\n") == 1                  # nothing added
    finally:
        lab.down()
    assert_clean(lab, before)
    assert (sorted(os.listdir(root_ssh)) if os.path.isdir(root_ssh) else None) == before_root_ssh
