"""One SSH connection to a node (fleet/remote.py) against paramiko's own
server over an in-memory socket pair, as paramiko's tests do: host keys
checked (a changed key refused), stdin and exit status carried, and a node
that floods its output or never ends costs one failed command, bounded in
memory and time."""

from __future__ import annotations

import socket
import threading

import paramiko
import pytest
import tomli_w

from accelmig.fleet import remote as remote_module
from accelmig.fleet.inventory import Inventory
from accelmig.fleet.remote import Remote, RemoteFailed
from accelmig.wire.errors import ConfigInvalid, Unavailable


class Node(paramiko.ServerInterface):
    """A node's sshd: accepts ``client_key``, runs a few canned commands."""

    def __init__(self, client_key):
        self.client_key = client_key
        self.stop = threading.Event()

    def check_auth_publickey(self, username, key):
        return paramiko.AUTH_SUCCESSFUL if key == self.client_key else paramiko.AUTH_FAILED

    def get_allowed_auths(self, username):
        return "publickey"

    def check_channel_request(self, kind, chanid):
        return paramiko.OPEN_SUCCEEDED if kind == "session" else paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED

    def check_channel_exec_request(self, channel, command):
        threading.Thread(target=self.run, args=(channel, command.decode()), daemon=True).start()
        return True

    def run(self, channel, command):
        if command == "echo-upper":                  # stdin back, upper-cased, exit 3
            data = b""
            while True:
                chunk = channel.recv(65536)
                if not chunk:
                    break
                data += chunk
            channel.sendall(data.upper())
            channel.sendall_stderr(b"said it\n")
            channel.send_exit_status(3)
        elif command == "flood":
            block = b"x" * 65536
            while not self.stop.is_set():
                try:
                    channel.sendall(block)
                except (OSError, EOFError, paramiko.SSHException):
                    return
        elif command == "hang":
            self.stop.wait(30)
        channel.close()


@pytest.fixture
def keys(tmp_path):
    client = paramiko.ECDSAKey.generate()
    client.write_private_key_file(str(tmp_path / "id"))
    host = paramiko.ECDSAKey.generate()
    return client, host


def inventory_for(tmp_path, host_key, name="memory", known_as="memory") -> Inventory:
    (tmp_path / "known_hosts").write_text(f"{known_as} {host_key.get_name()} {host_key.get_base64()}\n")
    data = {"ssh": {"key": "id", "known_hosts": "known_hosts", "command_timeout": 2},
            "tls": {"insecure": True}, "tenants": {"t": {"quota": "1GiB"}},
            "pool": {"address": "pool.example", "listen": "10.0.0.1:7070", "control_listen": "10.0.0.1:7071"},
            "hosts": {"hostA": {"address": name}}}
    (tmp_path / "fleet.toml").write_bytes(tomli_w.dumps(data).encode())
    return Inventory.load(tmp_path / "fleet.toml")


def _serve(transport, server):
    try:
        transport.start_server(server=server)
    except (paramiko.SSHException, EOFError, OSError):
        pass                      # the client went away (a refused host key, the test's end)


@pytest.fixture
def node_server(keys):
    client_key, host_key = keys
    servers = []

    def start():
        ours, theirs = socket.socketpair()
        transport = paramiko.Transport(theirs)
        transport.add_server_key(host_key)
        server = Node(client_key)
        # start_server blocks until the client has negotiated: its own thread
        threading.Thread(target=lambda: _serve(transport, server), daemon=True).start()
        servers.append((transport, server))
        return ours
    yield start
    for transport, server in servers:
        server.stop.set()
        transport.close()


def test_commands_carry_stdin_stdout_stderr_and_the_exit_status(tmp_path, keys, node_server):
    inventory = inventory_for(tmp_path, keys[1])
    remote_node = Remote(inventory, inventory.node("hostA")).connect(sock=node_server())
    try:
        result = remote_node.run(["echo-upper"], stdin=b"hello " * 100000)
        assert result.status == 3 and result.stdout == b"HELLO " * 100000 and result.stderr == b"said it\n"
        with pytest.raises(RemoteFailed, match=r"saying failed \(exit status 3\): said it"):
            remote_node.run(["echo-upper"], stdin=b"x", check="saying")
    finally:
        remote_node.close()


def test_a_flood_and_a_hang_are_each_one_bounded_failure(tmp_path, keys, node_server, monkeypatch):
    monkeypatch.setattr(remote_module, "MAX_OUTPUT", 1 << 20)
    inventory = inventory_for(tmp_path, keys[1])
    for command, words in (("flood", "more than 1 MiB of output: stopped"), ("hang", "no end after 2 s: stopped")):
        remote_node = Remote(inventory, inventory.node("hostA")).connect(sock=node_server())
        try:
            with pytest.raises(RemoteFailed, match=words):
                remote_node.run([command])
        finally:
            remote_node.close()


def test_a_host_key_other_than_the_known_one_is_refused(tmp_path, keys, node_server):
    inventory = inventory_for(tmp_path, paramiko.ECDSAKey.generate())       # known_hosts says another key
    with pytest.raises(Unavailable, match="is not the one known_hosts has for memory"):
        Remote(inventory, inventory.node("hostA")).connect(sock=node_server())
    inventory = inventory_for(tmp_path, keys[1], known_as="elsewhere")      # not known at all
    with pytest.raises(Unavailable, match="not in known_hosts"):
        Remote(inventory, inventory.node("hostA")).connect(sock=node_server())


def test_a_key_the_node_refuses_and_a_key_that_cannot_be_read(tmp_path, keys, node_server):
    inventory = inventory_for(tmp_path, keys[1])
    paramiko.ECDSAKey.generate().write_private_key_file(str(tmp_path / "id"))   # not the accepted one
    with pytest.raises(Unavailable, match="the node refused the key"):
        Remote(inventory, inventory.node("hostA")).connect(sock=node_server())
    paramiko.ECDSAKey.generate().write_private_key_file(str(tmp_path / "id"), password="pass phrase")
    with pytest.raises(ConfigInvalid, match="protected by a passphrase: leave ssh.key out and load it into ssh-agent"):
        Remote(inventory, inventory.node("hostA")).connect(sock=node_server())
    (tmp_path / "id").write_text("not a key\n")
    with pytest.raises(ConfigInvalid, match="ssh.key: cannot read"):
        Remote(inventory, inventory.node("hostA")).connect(sock=node_server())
