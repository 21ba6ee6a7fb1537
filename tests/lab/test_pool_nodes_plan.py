"""The lab's pool of two nodes, as planned (lab/topology.py), fast tier: names,
addresses and what ``accelmig lab up --help`` says.  The real thing (etcd,
two nodes, a VM) is tests/e2e/test_pool_nodes.py and
tests/e2e/test_rig.py::test_a_pool_of_two_nodes_on_etcd_reaches_both_hosts_and_leaves_nothing."""

from __future__ import annotations

import ipaddress
import itertools

import pytest
from click.testing import CliRunner

from accelmig.lab import netns
from accelmig.lab.topology import (CLUSTER_SUBNET, ETCD_ADDRESS, HOSTS, POOL2_ADDRESS, POOL_ADDRESS, POOL_NODES,
                                   TENANT_SUBNET, Topology)


def test_one_node_is_the_default_and_the_lab_of_before():
    topo = Topology("t")
    assert topo.namespaces == ["t-pool", "t-hostA", "t-hostB"]
    assert topo.pool_addresses() == [POOL_ADDRESS] and topo.etcd_ns is None
    assert "pool2" not in topo.etc_hosts()


def test_two_nodes_add_pool2_and_etcd_each_in_its_own_namespace():
    topo = Topology("t", pool_nodes=2)
    assert topo.namespaces == ["t-pool", "t-hostA", "t-hostB", "t-pool2", "t-etcd"]
    assert topo.pool_addresses() == [POOL_ADDRESS, POOL2_ADDRESS] == ["10.88.0.1", "10.88.0.2"]
    assert f"{POOL2_ADDRESS}\tpool2 t-pool2" in topo.etc_hosts()
    for bad in (0, 3, "2"):
        with pytest.raises(ValueError, match="pool nodes"):
            Topology("t", pool_nodes=bad)


def test_no_two_links_share_a_subnet_and_every_name_fits():
    subnets = [ipaddress.ip_network(cidr, strict=False) for cidr in itertools.chain(
        (h.guest_subnet for h in HOSTS), (HOSTS[0].migration, TENANT_SUBNET, CLUSTER_SUBNET),
        (node.links[h.name][0] for node in POOL_NODES for h in HOSTS))]
    # each /30 link once (its two ends are one subnet), nothing overlapping anything else
    for a, b in itertools.combinations(subnets, 2):
        assert not a.overlaps(b), (a, b)
    for node in POOL_NODES:
        for host in HOSTS:
            ours, theirs = (ipaddress.ip_interface(c) for c in node.links[host.name])
            assert ours.network == theirs.network and ours.ip != theirs.ip
        assert ipaddress.ip_interface(node.cluster).network == ipaddress.ip_network(CLUSTER_SUBNET)
    assert ipaddress.ip_address(ETCD_ADDRESS) in ipaddress.ip_network(CLUSTER_SUBNET)
    assert all(len(name) <= netns.IFNAMSIZ for name in Topology.LINKS)


def test_lab_up_help_explains_the_pool_of_two_nodes():
    from accelmig.lab.cli import lab
    out = CliRunner().invoke(lab, ["up", "--help"])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert "--pool-nodes" in text and "etcd" in text and "pool2" in text and "'basic'" in text
    assert "--cluster-ttl" in text and "killed node leaves the pool" in text
