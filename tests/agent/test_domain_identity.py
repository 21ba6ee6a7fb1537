"""Which domain a guest says it is: its SMBIOS system UUID, read by root
(the agent) from /sys and told to drivers of other users through the
agent's ``where``; the driver says it at ``open`` (tests/plugin/
test_unmarked_domains.py has the pool's and the hosts' side)."""

from __future__ import annotations

import pytest

from accelmig.agent import dmi
from accelmig.agent.driver import registry

UUID = "4c4c4544-0031-3510-8052-b4c04f564433"


@pytest.mark.parametrize("text, expected", [
    (UUID.upper() + "\n", UUID),                                   # canonical: lower case
    ("00000000-0000-0000-0000-000000000000\n", None),              # firmware without one
    ("03000200-0400-0500-0006-000700080009\n", None),              # a known placeholder
    ("not a uuid\n", None),
    ("", None),
])
def test_the_smbios_uuid_is_read_canonical_or_not_at_all(tmp_path, text, expected):
    path = tmp_path / "product_uuid"
    path.write_text(text)
    assert dmi.system_uuid(str(path)) == expected


def test_an_unreadable_or_missing_file_is_no_uuid(tmp_path):
    assert dmi.system_uuid(str(tmp_path / "absent")) is None
    assert dmi.system_uuid(str(tmp_path)) is None                  # a directory: an OSError too


def test_a_driver_that_may_not_read_sys_asks_the_agent(tmp_path, agent_on_thread, monkeypatch):
    path = tmp_path / "product_uuid"
    path.write_text(UUID + "\n")
    agent = agent_on_thread(dmi_path=str(path))
    assert agent.domain == UUID
    # the driver's own read fails, as it does for every user but root
    monkeypatch.setattr(dmi, "system_uuid", lambda path=dmi.PRODUCT_UUID: None)
    assert registry.domain_of_this_guest(str(tmp_path / "agent.sock")) == UUID
    # no agent at all: no claim
    assert registry.domain_of_this_guest(str(tmp_path / "nobody.sock")) is None
