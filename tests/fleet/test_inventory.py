"""The fleet's inventory (fleet/inventory.py) and the files rendered from it
(fleet/render.py): every mistake found before any node is touched, named by
its key; relative paths resolved against the inventory's own directory."""

from __future__ import annotations

import pytest
import tomli_w

from accelmig.fleet import render
from accelmig.fleet.deploy import Wheelhouse
from accelmig.fleet.inventory import DEFAULT_PREFIX, DEFAULT_PYTHON, Inventory
from accelmig.plugin.config import HostConfig
from accelmig.pool.config import PoolConfig, load_tenants
from accelmig.wire.errors import ConfigInvalid
from tests.conftest import run_cli


def valid() -> dict:
    return {
        "ssh": {"key": "keys/id", "known_hosts": "keys/known_hosts"},
        "install": {"wheelhouse": "dist"},
        "tls": {"ca": "pki/ca.pem"},
        "pool": {"address": "10.88.0.10", "listen": "10.88.0.10:7070", "control_listen": "10.88.0.10:7071",
                 "cert": "pki/pool.pem", "key": "pki/pool.key"},
        "tenants": {"alice": {"quota": "8GiB"}},
        "hosts": {"hostA": {"address": "10.88.0.11", "cert": "pki/a.pem", "key": "pki/a.key",
                            "fabric": {"mode": "bridge", "bridge": "fab0", "guest_subnet": "10.89.1.0/24"}}},
    }


@pytest.fixture
def write(tmp_path):
    for name in ("keys/id", "pki/ca.pem", "pki/pool.pem", "pki/pool.key", "pki/a.pem", "pki/a.key"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(f"{name}\n")

    def write(data: dict):
        path = tmp_path / "fleet.toml"
        path.write_bytes(tomli_w.dumps(data).encode())
        return path
    return write


def refused(write, data, *words):
    with pytest.raises(ConfigInvalid) as caught:
        Inventory.load(write(data))
    for word in words:
        assert word in caught.value.message, caught.value.message
    return caught.value.message


def test_a_valid_inventory_with_its_defaults_and_paths_relative_to_it(write, tmp_path):
    inventory = Inventory.load(write(valid()))
    assert inventory.ssh.user == "root" and inventory.ssh.port == 22 and inventory.ssh.jump is None
    assert inventory.ssh.key == str(tmp_path / "keys/id")
    assert inventory.ssh.known_hosts == str(tmp_path / "keys/known_hosts")
    assert inventory.wheelhouse == (str(tmp_path / "dist"),)
    assert inventory.prefix == DEFAULT_PREFIX and inventory.python == DEFAULT_PYTHON
    assert inventory.endpoint == "10.88.0.10:7070" and inventory.control == "10.88.0.10:7071"
    host = inventory.node("hostA")
    assert host.role == "host" and host.pool_addresses == ("10.89.1.0/24",) and not host.sudo
    assert [n.name for n in inventory.nodes] == ["pool", "hostA"]


def test_a_jump_host_and_a_user_that_needs_sudo(write):
    data = valid()
    data["ssh"].update(user="deploy", jump="admin@bastion:2222")
    inventory = Inventory.load(write(data))
    assert inventory.ssh.jump == ("admin", "bastion", 2222)
    assert inventory.node("hostA").sudo


@pytest.mark.parametrize("change, words", [
    (lambda d: d.update(extra={}), ["unknown key(s) extra"]),
    (lambda d: d["hosts"]["hostA"].update(adress="x"), ["hosts.hostA", "unknown key(s) adress"]),
    (lambda d: d.update(tls={}), ["tls", "insecure = true"]),
    (lambda d: d["tls"].update(insecure=True), ["insecure = true and a ca"]),
    (lambda d: d["hosts"]["hostA"].pop("key"), ["hosts.hostA", "needs cert and key"]),
    (lambda d: d["hosts"]["hostA"].update(cert="pki/none.pem"), ["hosts.hostA.cert", "is not a file"]),
    (lambda d: d["ssh"].update(jump="a@b@c"), ["ssh.jump"]),
    (lambda d: d["ssh"].update(port=70000), ["ssh.port"]),
    (lambda d: d["hosts"].update(admin=d["hosts"]["hostA"]), ["hosts.admin", "not 'admin'"]),
    (lambda d: d["hosts"]["hostA"].update(address="10.88.0.10"), ["also pool's"]),
    (lambda d: d["tenants"]["alice"].pop("quota"), ["tenants.alice.quota", "required"]),
    (lambda d: d["pool"].update(listen="0.0.0.0:7070"), ["pool.listen", "wildcard"]),
    (lambda d: d["pool"].update(settings={"tls_cert": "x"}), ["pool.settings.tls_cert", "set by the fleet"]),
    (lambda d: d["pool"].update(device="opencl:1"),
     ["pool.device: `device` was removed: write `devices = \"opencl:1\"` (one device is a list of one)"]),
    (lambda d: d["pool"].update(settings={"device": "auto"}),
     ["pool.settings.device: `device` was removed", 'write `devices = "opencl:0"`']),
    (lambda d: d["install"].update(prefix="opt/x"), ["install.prefix"]),
    (lambda d: d["install"].update(python="python3"), ["install.python"]),
    (lambda d: d.pop("hosts"), ["hosts", "missing"]),
    (lambda d: d.pop("tenants"), ["tenants", "refuses to start without a tenant"]),
])
def test_mistakes_are_named_by_their_key(write, change, words):
    data = valid()
    change(data)
    refused(write, data, *words)


def test_an_inventory_with_the_removed_device_key_stops_the_fleet_command(write):
    """What an operator sees: ``accelmig fleet`` exits 2 naming the key to
    write instead, before any node is reached."""
    data = valid()
    data["pool"]["device"] = "opencl:0"
    out = run_cli("accelmig", "fleet", "doctor", "--inventory", str(write(data)))
    assert out.returncode == 2, out
    assert 'pool.device: `device` was removed: write `devices = "opencl:0"`' in out.stderr, out.stderr


def test_a_wildcard_listen_is_fine_with_the_endpoint_guests_use(write):
    data = valid()
    data["pool"].update(listen="0.0.0.0:7070", endpoint="10.88.0.10:7070")
    assert Inventory.load(write(data)).endpoint == "10.88.0.10:7070"


def test_configurations_are_checked_by_the_sides_own_loaders(write, tmp_path):
    data = valid()
    inventory = Inventory.load(write(data))
    host = render.host_config(inventory, inventory.node("hostA"))
    assert host.path == render.HOST_CONFIG and host.mode == 0o644
    (tmp_path / "host.toml").write_bytes(host.data)          # as deploy leaves it on the node
    config = HostConfig.load(tmp_path / "host.toml")         # and as hostd and the hook read it
    assert config.host_id == "hostA" and config.pool.ca_file == f"{render.TLS_DIR}/ca.pem"
    assert str(config.fabric.guest_subnet) == "10.89.1.0/24"
    # a fabric hostd would refuse, refused here, before any node is touched
    data["hosts"]["hostA"]["fabric"]["mode"] = "wormhole"
    inventory = Inventory.load(write(data))
    with pytest.raises(ConfigInvalid, match="hostA.*fabric.mode"):
        render.host_config(inventory, inventory.node("hostA"))
    data = valid()
    data["pool"]["settings"] = {"grace": -1}
    with pytest.raises(ConfigInvalid, match="grace must be positive"):
        render.pool_config(Inventory.load(write(data)))
    data = valid()
    data["tenants"]["alice"]["quota"] = "lots"
    inventory = Inventory.load(write(data))
    with pytest.raises(ConfigInvalid, match=r"\[tenants\]"):
        render.pool_tokens(inventory, {"alice": "t" * 32}, "root")
    data = valid()
    data["tenants"]["alice"]["quota_by_type"] = {"tpu": "1GiB"}        # no such device type
    inventory = Inventory.load(write(data))
    with pytest.raises(ConfigInvalid, match="'tpu' is no device type"):
        render.pool_tokens(inventory, {"alice": "t" * 32}, "root")
    data["tenants"]["alice"]["quota_by_type"] = "1GiB"
    with pytest.raises(ConfigInvalid, match="tenants.alice.quota_by_type"):
        Inventory.load(write(data))


def test_a_tenants_quota_by_type_reaches_the_pools_tenants_file(write, tmp_path):
    data = valid()
    data["tenants"]["alice"]["quota_by_type"] = {"gpu": "2GiB", "fpga": "1GiB"}
    tokens = render.pool_tokens(Inventory.load(write(data)), {"alice": "t" * 32}, "root")
    (tmp_path / "tokens.toml").write_bytes(tokens.data)
    assert load_tenants(str(tmp_path / "tokens.toml"))["alice"].quota_by_type == \
        {"gpu": 2 << 30, "accelerator": 1 << 30}


def test_secret_files_are_private_and_only_ready_hosts_are_served(write):
    inventory = Inventory.load(write(valid()))
    hosts = render.pool_hosts(inventory, {"hostA": "s" * 64}, "accelmig-pool")
    assert hosts.secret and hosts.mode == 0o640 and hosts.group == "accelmig-pool"
    assert b'secret = "' + b"s" * 64 + b'"' in hosts.data
    assert render.pool_hosts(inventory, {"hostA": "s" * 64}, "root").mode == 0o600
    assert b"hostA" not in render.pool_hosts(inventory, {}, "root").data.split(b"\n", 2)[2]
    key = [f for f in render.tls_files(inventory, inventory.pool, "accelmig-pool") if f.path.endswith(".key")]
    assert key[0].mode == 0o640 and key[0].secret


def test_the_wheelhouse_holds_exactly_one_accelmig_wheel(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "click-8.1.0-py3-none-any.whl").write_bytes(b"x")
    with pytest.raises(ConfigInvalid, match="exactly one accelmig wheel, found none"):
        Wheelhouse((str(tmp_path / "a"),), "fleet.toml")
    (tmp_path / "a" / "accelmig-0.1.0-py3-none-any.whl").write_bytes(b"y")
    house = Wheelhouse((str(tmp_path / "a"),), "fleet.toml")
    assert house.version == "0.1.0" and house.tag.startswith("0.1.0-") and len(house.files) == 2
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "accelmig-0.2.0-py3-none-any.whl").write_bytes(b"z")
    with pytest.raises(ConfigInvalid, match="found accelmig-0.1.0"):
        Wheelhouse((str(tmp_path / "a"), str(tmp_path / "b")), "fleet.toml")
    with pytest.raises(ConfigInvalid, match="is not a directory"):
        Wheelhouse((str(tmp_path / "none"),), "fleet.toml")


def test_a_pool_node_on_etcds_gets_its_cluster_settings_and_etcd_files(write, tmp_path):
    for name in ("pki/etcd-ca.pem", "pki/pool-etcd.pem", "pki/pool-etcd.key"):
        (tmp_path / name).write_text(f"{name}\n")
    data = valid()
    data["pool"]["cluster"] = {"url": "etcds://10.88.0.5:2379,10.88.0.6:2379", "ttl": 5,
                               "ca": "pki/etcd-ca.pem", "cert": "pki/pool-etcd.pem", "key": "pki/pool-etcd.key"}
    inventory = Inventory.load(write(data))
    config = render.pool_config(inventory)
    (tmp_path / "pool.toml").write_bytes(config.data)
    loaded = PoolConfig.load(str(tmp_path / "pool.toml"))          # what the pool itself will read
    assert loaded.cluster == "etcds://10.88.0.5:2379,10.88.0.6:2379" and loaded.cluster_ttl == 5.0
    assert loaded.node_name == "pool" and loaded.cluster_advertise == "10.88.0.10:7070"
    assert (loaded.cluster_tls_ca, loaded.cluster_tls_cert, loaded.cluster_tls_key) == render.CLUSTER_TLS_FILES
    files = {f.path: f for f in render.tls_files(inventory, inventory.pool, "accelmig-pool")}
    assert files[render.CLUSTER_TLS_FILES[0]].data == b"pki/etcd-ca.pem\n"
    key = files[render.CLUSTER_TLS_FILES[2]]
    assert key.data == b"pki/pool-etcd.key\n" and key.secret and key.mode == 0o640 and key.group == "accelmig-pool"
    # etcd's TLS is its own: the pool's planes may be plain in a test rig, etcd's files still go
    data["tls"] = {"insecure": True}
    for side in ("pool", "hosts"):
        for node in ([data["pool"]] if side == "pool" else data["hosts"].values()):
            node.pop("cert"), node.pop("key")
    inventory = Inventory.load(write(data))
    assert [f.path for f in render.tls_files(inventory, inventory.pool)] == list(render.CLUSTER_TLS_FILES)
    assert render.tls_files(inventory, inventory.node("hostA")) == []


def test_a_pool_node_with_an_etcd_user_gets_its_password_as_a_secret_file(write, tmp_path):
    for name in ("pki/etcd-ca.pem", "pki/pool-etcd.pem", "pki/pool-etcd.key"):
        (tmp_path / name).write_text(f"{name}\n")
    (tmp_path / "pki/etcd-password").write_text("s3cret-etcd-password\n")
    data = valid()
    data["pool"]["cluster"] = {"url": "etcds://10.88.0.5:2379", "ca": "pki/etcd-ca.pem",
                               "cert": "pki/pool-etcd.pem", "key": "pki/pool-etcd.key",
                               "user": "accelmig-pool", "password_file": "pki/etcd-password"}
    inventory = Inventory.load(write(data))
    (tmp_path / "pool.toml").write_bytes(render.pool_config(inventory).data)
    loaded = PoolConfig.load(str(tmp_path / "pool.toml"))
    assert (loaded.cluster_user, loaded.cluster_password_file) == ("accelmig-pool", render.CLUSTER_PASSWORD_FILE)
    assert b"s3cret" not in (tmp_path / "pool.toml").read_bytes()       # the config names the file only
    files = {f.path: f for f in render.tls_files(inventory, inventory.pool, "accelmig-pool")}
    secret = files[render.CLUSTER_PASSWORD_FILE]
    assert secret.data == b"s3cret-etcd-password\n" and secret.secret
    assert (secret.mode, secret.group) == (0o640, "accelmig-pool")
    for half in ("user", "password_file"):                   # one without the other
        broken = {k: v for k, v in data["pool"]["cluster"].items() if k != half}
        with pytest.raises(ConfigInvalid, match="user and password_file go together"):
            Inventory.load(write({**data, "pool": {**data["pool"], "cluster": broken}}))
    plain = {**data["pool"]["cluster"], "url": "etcd://10.88.0.5:2379"}
    for key in ("ca", "cert", "key"):
        plain.pop(key)
    with pytest.raises(ConfigInvalid, match="an etcd password goes over TLS only"):
        render.pool_config(Inventory.load(write({**data, "pool": {**data["pool"], "cluster": plain}})))


@pytest.mark.parametrize("cluster, words", [
    ({"url": "etcds://10.88.0.5:2379"}, ["[pool]", "give cluster_tls_ca and cluster_tls_cert"]),
    ({"url": "etcd://10.88.0.5:2379", "ca": "pki/ca.pem", "cert": "pki/pool.pem", "key": "pki/pool.key"},
     ["[pool]", "is plain etcd:// but cluster_tls_ca, cluster_tls_cert, cluster_tls_key given"]),
    ({"url": "https://10.88.0.5:2379"}, ["[pool]", "write etcds://"]),
])
def test_cluster_settings_the_pool_would_refuse_are_refused_at_render(write, cluster, words):
    data = valid()
    data["pool"]["cluster"] = cluster
    with pytest.raises(ConfigInvalid) as caught:
        render.pool_config(Inventory.load(write(data)))
    for word in words:
        assert word in caught.value.message, caught.value.message


@pytest.mark.parametrize("change, words", [
    (lambda c: c.pop("url"), ["pool.cluster.url", "missing"]),
    (lambda c: c.pop("key"), ["pool.cluster", "ca, cert and key go together"]),
    (lambda c: c.update(cert="pki/none.pem"), ["pool.cluster.cert", "is not a file"]),
    (lambda c: c.update(advertise="0.0.0.0:7070"), ["pool.cluster.advertise", "wildcard"]),
    (lambda c: c.update(ttl=0), ["pool.cluster.ttl"]),
    (lambda c: c.update(endpoints="x"), ["pool.cluster", "unknown key(s) endpoints"]),
])
def test_cluster_mistakes_are_named_by_their_key(write, change, words):
    data = valid()
    data["pool"]["cluster"] = {"url": "etcds://10.88.0.5:2379", "ca": "pki/ca.pem", "cert": "pki/pool.pem",
                               "key": "pki/pool.key"}
    change(data["pool"]["cluster"])
    refused(write, data, *words)
    data = valid()
    data["pool"]["settings"] = {"cluster": "etcd://10.88.0.5:2379"}
    refused(write, data, "pool.settings.cluster", "[pool.cluster]")
