"""HostConfig: the hypervisor host's TOML config and its secret file."""

from __future__ import annotations

import ipaddress
import os
import socket
import textwrap

import pytest

import accelmig.plugin.config as config_module
from accelmig.plugin.config import FabricConfig, HostConfig, HostdConfig
from accelmig.wire.errors import ConfigInvalid

MINIMAL = '[pool]\nendpoint = "10.88.0.1:7070"\n'


def write(tmp_path, text, name="host.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def load(tmp_path, text):
    return HostConfig.load(write(tmp_path, text))


def test_the_documented_example_loads_as_documented(tmp_path):
    doc = config_module.__doc__
    example = textwrap.dedent(doc[doc.index("    [host]"):doc.index("Unknown sections")])
    cfg = load(tmp_path, example)
    assert cfg.host_id == "hostA"
    assert (cfg.pool.endpoint, cfg.pool.control, cfg.pool.secret_file) == \
           ("10.88.0.1:7070", "10.88.0.1:7071", "/etc/accelmig/host.secret")
    assert cfg.pool.address == "10.88.0.1"
    f = cfg.fabric
    assert (f.mode, f.bridge, f.device, f.mtu, f.interfaces_owner) == ("bridge", "fab0", "eth1", 1500, "accelmig")
    assert f.guest_subnet == ipaddress.ip_network("10.89.1.0/24")
    assert f.gateway == ipaddress.ip_address("10.89.1.1")
    assert f.routes == ("10.88.0.0/16",)
    assert f.host_bound and not f.external
    assert cfg.hostd == HostdConfig(socket="/run/accelmig/hostd.sock", state_dir="/var/lib/accelmig",
                                    strict=True, hook_timeout=3.0, metrics_listen="",
                                    libvirt_uri="qemu:///system")
    assert cfg.source == str(tmp_path / "host.toml")


def test_defaults(tmp_path):
    cfg = load(tmp_path, MINIMAL)
    assert cfg.host_id == socket.gethostname()
    assert cfg.pool.control == "10.88.0.1:7071"
    assert cfg.fabric == FabricConfig()
    assert cfg.fabric.mode == "none" and not cfg.fabric.host_bound
    assert cfg.hostd == HostdConfig()


def test_ipv6_endpoint_default_control(tmp_path):
    cfg = load(tmp_path, '[pool]\nendpoint = "[fd00::1]:7070"\n')
    assert cfg.pool.control == "[fd00::1]:7071"
    assert cfg.pool.address == "fd00::1"


def test_host_bound_defaults_gateway_and_routes(tmp_path):
    cfg = load(tmp_path, MINIMAL + '[fabric]\nmode = "bridge"\nbridge = "fab0"\nguest_subnet = "10.89.2.0/24"\n')
    assert cfg.fabric.gateway == ipaddress.ip_address("10.89.2.1")
    assert cfg.fabric.routes == ("10.88.0.1/32",)       # the pool's own address
    assert cfg.fabric.mtu is None


def test_no_default_route_for_a_pool_inside_the_guest_subnet_or_by_name(tmp_path):
    cfg = load(tmp_path, '[pool]\nendpoint = "10.89.2.9:7070"\n[fabric]\nguest_subnet = "10.89.2.0/24"\n')
    assert cfg.fabric.routes == ()
    cfg = load(tmp_path, '[pool]\nendpoint = "pool.example:7070"\n[fabric]\nguest_subnet = "10.89.2.0/24"\n')
    assert cfg.fabric.routes == ()


@pytest.mark.parametrize("text, message", [
    ("[pool]\n", "pool.endpoint: is required"),
    ('[pool]\nendpoint = "10.88.0.1"\n', "pool.endpoint: endpoint '10.88.0.1' has no port"),
    ('[pool]\nendpoint = 7070\n', "pool.endpoint: must be a string, not an integer"),
    (MINIMAL + '[pool2]\n', "unknown section(s) pool2"),
    (MINIMAL.replace("]\n", "]\nendpont = 1\n", 1), "unknown key(s) in [pool]: endpont"),
    (MINIMAL + '[fabric]\nmode = "macvtap"\n', "fabric.mode: 'macvtap' is not one of bridge, direct, none"),
    (MINIMAL + '[fabric]\nmode = "bridge"\n', 'fabric.bridge: is required when mode = "bridge"'),
    (MINIMAL + '[fabric]\nmode = "direct"\n', 'fabric.device: is required when mode = "direct"'),
    (MINIMAL + '[fabric]\nmode = "bridge"\nbridge = "a-very-long-bridge-name"\n', "is not an interface name"),
    (MINIMAL + '[fabric]\nmode = "bridge"\nbridge = "br/0"\n', "is not an interface name"),
    (MINIMAL + '[fabric]\nguest_subnet = "10.89.1.5/24"\n', "fabric.guest_subnet: '10.89.1.5/24' is not a network (10.89.1.5/24 has host bits set)"),
    (MINIMAL + '[fabric]\nguest_subnet = "10.89.1.0/31"\n', "is too small"),
    (MINIMAL + '[fabric]\nguest_subnet = "10.89.1.0/24"\ngateway = "10.89.2.1"\n', "fabric.gateway: 10.89.2.1 is not in guest_subnet"),
    (MINIMAL + '[fabric]\nguest_subnet = "10.89.1.0/24"\ngateway = "10.89.1.255"\n', "network or broadcast"),
    (MINIMAL + '[fabric]\ngateway = "10.89.1.1"\n', "fabric.gateway: needs fabric.guest_subnet"),
    (MINIMAL + '[fabric]\nguest_subnet = "10.89.1.0/24"\nroutes = ["10.88.0.0/33"]\n', "fabric.routes: '10.88.0.0/33' is not a CIDR"),
    (MINIMAL + '[fabric]\nguest_subnet = "10.89.1.0/24"\nroutes = ["fd00::/64"]\n', "is IPv6, guest_subnet is IPv4"),
    (MINIMAL + '[fabric]\nguest_subnet = "10.89.1.0/24"\nroutes = "10.88.0.0/16"\n', "fabric.routes: must be a list of strings"),
    (MINIMAL + '[fabric]\nmtu = 1500.5\n', "fabric.mtu: 1500.5 is not an MTU"),
    (MINIMAL + '[fabric]\nmtu = 40\n', "fabric.mtu: 40 is not an MTU"),
    (MINIMAL + '[fabric]\ninterfaces_owner = "nova"\n', "fabric.interfaces_owner: 'nova' is not one of accelmig, external"),
    (MINIMAL + '[hostd]\nstrict = "yes"\n', "hostd.strict: must be true or false, not a string"),
    (MINIMAL + '[hostd]\nhook_timeout = 0\n', "hostd.hook_timeout"),
    (MINIMAL + '[hostd]\nhook_timeout = true\n', "hostd.hook_timeout: must be a number, not a boolean"),
    (MINIMAL + '[hostd]\nsocket = "hostd.sock"\n', "hostd.socket: 'hostd.sock' must be an absolute path"),
    (MINIMAL + '[hostd]\nmetrics_listen = "9470"\n', "hostd.metrics_listen"),
    (MINIMAL + '[hostd]\nlibvirt_uri = "system"\n', "hostd.libvirt_uri: 'system' is not a libvirt URI"),
    (MINIMAL + '[host]\nid = "host A"\n', "host.id: 'host A' is not a host name"),
    (MINIMAL + '[host]\nid = "admin"\n', "host.id: 'admin' is reserved"),
    ("host = 1\n" + MINIMAL, "[host] must be a table"),
    ("[pool\n", "not valid TOML"),
])
def test_invalid_configs_name_file_key_and_why(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigInvalid) as info:
        HostConfig.load(path)
    assert message in info.value.message
    assert str(path) in info.value.message
    assert info.value.code.value == "CONFIG_INVALID"


def test_missing_file(tmp_path):
    with pytest.raises(ConfigInvalid, match="nope.toml: file not found"):
        HostConfig.load(tmp_path / "nope.toml")


def test_default_path_is_used_when_none_is_given(monkeypatch, tmp_path):
    path = write(tmp_path, MINIMAL)
    monkeypatch.setattr(config_module, "DEFAULT_PATH", str(path))
    assert HostConfig.load().pool.endpoint == "10.88.0.1:7070"


# ---------------------------------------------------------------------------
# the secret


def with_secret(tmp_path, content: bytes | None, mode: int = 0o600) -> HostConfig:
    secret = tmp_path / "host.secret"
    if content is not None:
        secret.write_bytes(content)
        os.chmod(secret, mode)
    return load(tmp_path, MINIMAL + f'secret_file = "{secret}"\n')


def test_read_secret(tmp_path):
    cfg = with_secret(tmp_path, b"  0123456789abcdef-host-A \n")
    assert cfg.read_secret() == b"0123456789abcdef-host-A"


def test_group_readable_secret_is_allowed(tmp_path):
    assert with_secret(tmp_path, b"0123456789abcdef", 0o640).read_secret() == b"0123456789abcdef"


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o602, 0o666])
def test_world_accessible_secret_is_refused(tmp_path, mode):
    cfg = with_secret(tmp_path, b"0123456789abcdef", mode)
    with pytest.raises(ConfigInvalid, match=rf"accessible to everyone \(mode 0{mode:o}\); run: chmod 600"):
        cfg.read_secret()


def test_short_missing_and_odd_secrets(tmp_path):
    with pytest.raises(ConfigInvalid, match="the secret is 5 bytes; the pool needs 16 or more"):
        with_secret(tmp_path, b"short\n").read_secret()
    (tmp_path / "host.secret").unlink()
    with pytest.raises(ConfigInvalid, match="secret file not found"):
        with_secret(tmp_path, None).read_secret()
    (tmp_path / "host.secret").mkdir()
    os.chmod(tmp_path / "host.secret", 0o700)
    with pytest.raises(ConfigInvalid, match="not a regular file"):
        with_secret(tmp_path, None).read_secret()


def test_secret_file_must_be_absolute(tmp_path):
    with pytest.raises(ConfigInvalid, match="pool.secret_file: 'host.secret' must be an absolute path"):
        load(tmp_path, MINIMAL + 'secret_file = "host.secret"\n')


def test_a_fabric_gets_its_gateway_and_a_route_to_the_pool_by_default(tmp_path):
    f = load(tmp_path, '[pool]\nendpoint = "[fd00:88::1]:7070"\n'
                       '[fabric]\nmode = "direct"\ndevice = "eth1"\nguest_subnet = "fd00:89:1::/64"\n').fabric
    assert f.gateway == ipaddress.ip_address("fd00:89:1::1")
    assert f.routes == ("fd00:88::1/128",)
    with pytest.raises(ConfigInvalid, match="fabric.device: is required"):
        load(tmp_path, MINIMAL + '[fabric]\nmode = "direct"\n')
