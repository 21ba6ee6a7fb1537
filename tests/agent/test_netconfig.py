"""Choosing the guest's fabric NIC."""

import pytest

from accelmig.agent.daemon.netconfig import choose_interface
from accelmig.wire.errors import Unavailable

LINKS = [("eth0", "52:54:00:00:00:01"), ("eth1", "52:54:00:00:00:02")]


def test_by_mac_case_insensitively():
    assert choose_interface(LINKS, "52:54:00:00:00:02") == "eth1"
    assert choose_interface(LINKS, "52:54:00:00:00:01".upper()) == "eth0"


def test_unknown_mac_and_ambiguity_are_clear_errors():
    with pytest.raises(Unavailable, match="no interface has that MAC"):
        choose_interface(LINKS, "52:54:00:00:00:09")
    with pytest.raises(Unavailable, match="2 Ethernet interfaces and no MAC"):
        choose_interface(LINKS, None)
    assert choose_interface(LINKS[:1], None) == "eth0"
