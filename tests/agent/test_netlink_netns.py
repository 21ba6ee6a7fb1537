"""The guest's NIC re-addressed with netlink from the standard library
(``agent.daemon.rtnetlink``), in a real network namespace: on the oldest
Python a guest may bring (3.9, no site-packages) as the guest runs it, and
on this one for what the kernel refuses."""

from __future__ import annotations

import ipaddress
import json
import os
import textwrap

import pytest

from accelmig.agent.daemon.netconfig import NetworkConfigurator
from accelmig.agent.daemon.rtnetlink import RtNetlink
from accelmig.wire.errors import Unavailable
from accelmig.wire.identity import GuestNic
from tests.support.oldpython import SKIP_REASON, oldest_python

pytestmark = pytest.mark.root

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAC = "52:54:00:aa:bb:01"

MOVE = textwrap.dedent("""
    import json, sys
    from accelmig.agent.daemon.netconfig import NetworkConfigurator
    from accelmig.wire.identity import GuestNic
    nic = GuestNic.from_wire(json.loads(sys.argv[1]))
    configurator = NetworkConfigurator()
    first = configurator.apply(nic)
    again = configurator.apply(nic)
    print(json.dumps({"method": configurator.method, "first": first, "again": again,
                      "version": list(sys.version_info[:2])}))
""")


@pytest.fixture
def guest_net(netns_factory):
    """A "guest" namespace whose NIC holds the old host's address, linked to a "host"."""
    guest, host = netns_factory.add("guest"), netns_factory.add("host")
    link = netns_factory.link(guest, host, "10.89.1.10/24", "10.89.2.1/24", mac_a=MAC)
    netns_factory.address(host, link.b.ifname, "10.89.1.1/24")
    return guest, link


def _state(guest, ifname):
    with guest.ipr() as ipr:
        index = ipr.link_lookup(ifname=ifname)[0]
        addresses = {f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}" for a in ipr.get_addr(index=index, family=2)}
        link = ipr.get_links(index)[0]
        route = ipr.route("get", dst="10.88.0.1")[0]
        return addresses, link.get_attr("IFLA_MTU"), link.get_attr("IFLA_OPERSTATE"), route.get_attr("RTA_GATEWAY")


def test_the_oldest_python_re_addresses_the_nic_with_stdlib_netlink(guest_net, tmp_path):
    python = oldest_python()
    if python is None:
        pytest.skip(SKIP_REASON)
    guest, link = guest_net
    site = tmp_path / "site"
    (site / "accelmig").mkdir(parents=True)
    os.symlink(os.path.join(ROOT, "agent"), site / "accelmig" / "agent")
    os.symlink(os.path.join(ROOT, "wire"), site / "accelmig" / "wire")
    os.symlink(os.path.join(ROOT, "runtime"), site / "accelmig" / "runtime")
    nic = {"address": "10.89.2.10", "prefixlen": 24, "gateway": "10.89.2.1", "mac": MAC, "mtu": 1400,
           "routes": ["10.88.0.1/32"]}
    out = guest.exec(["env", "-i", f"PYTHONPATH={site}", "PYTHONDONTWRITEBYTECODE=1", python, "-S",
                      "-c", MOVE, json.dumps(nic)])
    result = json.loads(out.stdout)
    assert result["method"] == "netlink" and result["version"] == [3, 9], result
    assert f"{link.a.ifname}: removed 10.89.1.10/24" in result["first"]
    assert f"{link.a.ifname}: added 10.89.2.10/24" in result["first"]
    assert f"{link.a.ifname}: mtu 1500 -> 1400" in result["first"]
    # applied again, nothing is removed or added: only the route is said again
    assert result["again"] == [f"route 10.88.0.1/32 via 10.89.2.1 dev {link.a.ifname}"]
    assert _state(guest, link.a.ifname) == ({"10.89.2.10/24"}, 1400, "UP", "10.89.2.1")


def test_what_the_kernel_refuses_is_a_clear_error_and_a_down_nic_comes_up(guest_net):
    guest, link = guest_net
    with guest.ipr() as ipr:
        ipr.link("set", index=ipr.link_lookup(ifname=link.a.ifname)[0], state="down")
    with guest.entered():
        configurator = NetworkConfigurator()
        with pytest.raises(Unavailable, match="no interface has that MAC"):
            configurator.apply(GuestNic.from_wire({"address": "10.89.2.10", "prefixlen": 24,
                                                   "mac": "52:54:00:00:00:99"}))
        # a gateway on no subnet of the NIC: the kernel says why
        with pytest.raises(Unavailable, match="unreachable"):
            configurator.apply(GuestNic.from_wire({"address": "10.89.2.10", "prefixlen": 24, "gateway": "192.0.2.1",
                                                   "mac": MAC}))
        with RtNetlink() as nl:
            index = next(l["index"] for l in nl.links() if l["name"] == link.a.ifname)
            assert nl.addresses(index, 2) == [ipaddress.ip_interface("10.89.2.10/24")]
            with pytest.raises(Unavailable, match="netlink delete address"):
                nl.delete_address(index, ipaddress.ip_interface("10.77.0.1/24"))   # not there
    with guest.ipr() as ipr:
        link_state = ipr.get_links(ipr.link_lookup(ifname=link.a.ifname)[0])[0]
        assert link_state["flags"] & 1           # IFF_UP: the re-address brought it up
