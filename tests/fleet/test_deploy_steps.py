"""One deploy step at a time (fleet/deploy.py ``NodeDeploy``), with a
scripted node standing in for the SSH connection (a unit test of one class:
the real thing is tests/e2e/test_fleet.py): a hook this run added is removed
again when ``accelmig install`` fails, and one that was there before is left
as it was."""

from __future__ import annotations

import pytest
import tomli_w

from accelmig.fleet import deploy
from accelmig.fleet.inventory import Inventory
from accelmig.fleet.remote import RemoteFailed, Result


class ScriptedNode:
    """Answers ``run`` from a table of argv[1] -> Result; records every call."""

    def __init__(self, answers: dict[str, Result]):
        self.answers, self.calls = answers, []

    def run(self, argv, **kwargs):
        self.calls.append(argv)
        return self.answers.get(argv[1], Result(0, b"", b""))


@pytest.fixture
def node_deploy(tmp_path):
    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / "accelmig-0.1.0-py3-none-any.whl").write_bytes(b"wheel")
    data = {"install": {"wheelhouse": "dist"}, "tls": {"insecure": True}, "tenants": {"t": {"quota": "1GiB"}},
            "pool": {"address": "pool", "listen": "10.0.0.1:7070", "control_listen": "10.0.0.1:7071"},
            "hosts": {"hostA": {"address": "hosta"}}}
    (tmp_path / "fleet.toml").write_bytes(tomli_w.dumps(data).encode())
    inventory = Inventory.load(tmp_path / "fleet.toml")
    return deploy.NodeDeploy(deploy.Deployer(inventory), inventory.node("hostA"))


def failing_install() -> dict:
    return {"install": Result(1, b"", b"accelmig: the hook is installed, but libvirt does not see it yet\n")}


def test_a_hook_this_run_added_is_removed_when_the_install_fails(node_deploy):
    node_deploy.remote = ScriptedNode(failing_install())
    node_deploy.probe = {"paths": {deploy.HOOK: None}}            # no hook before this run
    with pytest.raises(RemoteFailed, match="the hook it added was removed"):
        node_deploy.hook()
    assert [argv[1] for argv in node_deploy.remote.calls] == ["install", "uninstall"]


def test_a_hook_that_was_there_before_is_left_alone(node_deploy):
    node_deploy.remote = ScriptedNode(failing_install())
    node_deploy.probe = {"paths": {deploy.HOOK: {"mode": 0o755, "sha256": "0" * 64}}}
    with pytest.raises(RemoteFailed, match="libvirt does not see it yet") as caught:
        node_deploy.hook()
    assert "removed" not in caught.value.message
    assert [argv[1] for argv in node_deploy.remote.calls] == ["install"]


def test_a_failed_removal_is_said_too(node_deploy):
    node_deploy.remote = ScriptedNode({**failing_install(), "uninstall": Result(1, b"", b"permission denied\n")})
    node_deploy.probe = {"paths": {deploy.HOOK: None}}
    with pytest.raises(RemoteFailed, match="removing the hook it added failed too: permission denied"):
        node_deploy.hook()


def test_a_pool_node_that_joins_etcd_installs_the_cluster_extra_in_a_venv_of_its_own(tmp_path):
    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / "accelmig-0.1.0-py3-none-any.whl").write_bytes(b"wheel")
    data = {"install": {"wheelhouse": "dist"}, "tls": {"insecure": True}, "tenants": {"t": {"quota": "1GiB"}},
            "pool": {"address": "pool", "listen": "10.0.0.1:7070", "control_listen": "10.0.0.1:7071"},
            "hosts": {"hostA": {"address": "hosta"}}}
    (tmp_path / "fleet.toml").write_bytes(tomli_w.dumps(data).encode())
    single = Inventory.load(tmp_path / "fleet.toml")
    data["pool"]["cluster"] = {"url": "etcd://10.0.0.5:2379"}
    (tmp_path / "fleet.toml").write_bytes(tomli_w.dumps(data).encode())
    joined = Inventory.load(tmp_path / "fleet.toml")
    alone = deploy.NodeDeploy(deploy.Deployer(single), single.pool)
    member = deploy.NodeDeploy(deploy.Deployer(joined), joined.pool)
    assert alone.extras == "pool" and member.extras == "pool,cluster"
    assert deploy.NodeDeploy(deploy.Deployer(joined), joined.node("hostA")).extras == "host"
    # an existing single-node venv lacks etcd3gw: joining gets a new one, never reuses it
    assert member.venv_tag != alone.venv_tag and member.venv_tag.endswith("-pool-cluster")
