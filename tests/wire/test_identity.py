"""The host identity from the wire (issue 14, fuzz findings): whatever a peer
sends, every field of the wrong type is a ``BadRequest`` that names it,
never a TypeError (``tuple(5)`` of a number for the routes was one); a good
identity reads back as it was sent."""

from __future__ import annotations

import pytest

from accelmig.wire import channel as ch
from accelmig.wire.errors import BadRequest
from accelmig.wire.identity import GuestNic, HostIdentity

NIC = {"address": "10.0.0.1", "prefixlen": 24}
IDENTITY = {"host_id": "hostB", "pool_endpoint": "127.0.0.1:7070"}


@pytest.mark.parametrize("nic, words", [
    ({**NIC, "routes": 5}, "routes must be a list or null, not a number (5)"),
    ({**NIC, "routes": True}, "routes must be a list or null, not a boolean"),
    ({**NIC, "routes": "10.1.0.0/16"}, "routes must be a list or null, not a string"),
    ({**NIC, "routes": {"10.1.0.0/16": 1}}, "routes must be a list or null, not an object"),
    ({**NIC, "routes": [5]}, "route a number (5) is not a CIDR string"),
    ({**NIC, "routes": [["10.1.0.0/16"]]}, "route a list is not a CIDR string"),
    ({**NIC, "routes": ["nope"]}, "route 'nope' is not a CIDR"),
    ({"address": 167772161, "prefixlen": 24}, "address must be a string, not a number"),
    ({"address": ["10.0.0.1"], "prefixlen": 24}, "address must be a string, not a list"),
    ({"address": "10.0.0.1", "prefixlen": "24"}, "prefixlen must be an integer, not a string"),
    ({"address": "10.0.0.1", "prefixlen": True}, "prefixlen must be an integer, not a boolean"),
    ({**NIC, "gateway": 5}, "gateway must be a string or null, not a number"),
    ({**NIC, "mac": ["52:54:00:00:00:01"]}, "mac must be a string or null, not a list"),
    ({**NIC, "mtu": "1500"}, "mtu must be an integer or null, not a string"),
    ({**NIC, "mtu": 1500.0}, "mtu must be an integer or null, not a number"),
    ({"prefixlen": 24}, "guest_nic lacks 'address'"),
    ([NIC], "guest_nic must be an object"),
])
def test_a_guest_nic_field_of_the_wrong_type_is_a_clear_bad_request(nic, words):
    with pytest.raises(BadRequest) as refused:
        GuestNic.from_wire(nic)
    assert words in refused.value.message
    with pytest.raises(BadRequest) as refused:        # inside an identity, and a rehome, the same
        ch.parse_rehome({"migration_id": "m1", "identity": {**IDENTITY, "guest_nic": nic}})
    assert words in refused.value.message


@pytest.mark.parametrize("identity, words", [
    ({**IDENTITY, "host_id": 5}, "host_id must be a string, not a number"),
    ({**IDENTITY, "pool_endpoint": ["a", 1]}, "pool_endpoint must be a string, not a list"),
    ({**IDENTITY, "host_address": 5}, "host_address must be a string or null"),
    ({**IDENTITY, "interface": {}}, "interface must be a string or null, not an object"),
    ({**IDENTITY, "mtu": [1500]}, "mtu must be an integer or null, not a list"),
    ({**IDENTITY, "mac": 5}, "mac must be a string or null"),
    ({**IDENTITY, "guest_nic": 5}, "guest_nic must be an object or null, not a number"),
    ({**IDENTITY, "version": True}, "version must be an integer of 1 or more, not a boolean"),
    ({**IDENTITY, "version": [1]}, "version must be an integer of 1 or more, not a list"),
    ({"pool_endpoint": "127.0.0.1:7070"}, "identity lacks 'host_id'"),
    ("hostB", "identity must be an object, not a string"),
])
def test_an_identity_field_of_the_wrong_type_is_a_clear_bad_request(identity, words):
    with pytest.raises(BadRequest) as refused:
        HostIdentity.from_wire(identity)
    assert words in refused.value.message


def test_a_deeply_nested_wrong_value_is_named_without_its_repr():
    deep = [[[[[[[[[[[[["x"]]]]]]]]]]]]]
    with pytest.raises(BadRequest) as refused:
        GuestNic.from_wire({**NIC, "routes": [deep]})
    assert "route a list is not a CIDR string" in refused.value.message


@pytest.mark.parametrize("document", [[1], "x", 5, None])
def test_a_rehome_document_that_is_no_object_is_a_clear_bad_request(document):
    with pytest.raises(BadRequest, match="the document must be a JSON object"):
        ch.parse_rehome(document)


def test_a_good_identity_reads_back_as_it_was_sent():
    nic = {**NIC, "gateway": "10.0.0.254", "mtu": 9000, "mac": "52:54:00:00:00:01", "routes": ["10.9.0.0/16"]}
    identity = HostIdentity.from_wire({**IDENTITY, "host_address": "10.0.0.2", "interface": "eth0", "mtu": 1500,
                                       "guest_nic": nic, "future_field": [1]})
    assert HostIdentity.from_wire(identity.to_wire()) == identity
    assert identity.guest_nic.to_wire() == nic
    # absent and null are the same; an empty list of routes is none
    assert GuestNic.from_wire({**NIC, "routes": None}) == GuestNic.from_wire({**NIC, "routes": []}) == \
        GuestNic.from_wire(NIC)
