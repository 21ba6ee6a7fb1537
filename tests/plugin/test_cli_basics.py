"""What every ``accelmig`` command line owes an operator: ``--version``, the
exit codes in ``--help``, usage errors instead of tracebacks, a missing
extra named; and ``migrate``'s and ``status``'s reports.

The console script runs in a subprocess where the process matters (its
exit status, libvirt's own stderr, a library made unimportable); click's
runner elsewhere.  ``migrate`` runs against libvirt's test:///default driver
(real lookups, a real failing migrateToURI3: the driver has no migration)
and a stand-in hostd (hostd's real local API serving canned answers);
``status`` against a real hostd and a real pool."""

from __future__ import annotations

import importlib.metadata
import json
import uuid as uuid_module

import libvirt
import pytest
from click.testing import CliRunner

from accelmig.lab.poolthread import PoolThread
from accelmig.plugin.cli import main as cli
from accelmig.wire.localapi import LocalClient
from tests.conftest import TENANTS, run_cli
from tests.support.blocked import blocked_env
from tests.support.hostd import SECRET, HostdStub, HostdThread, write_config, write_host_config
from tests.support.wait import wait_for

VERSION = importlib.metadata.version("accelmig")
#: libvirt's test:///default driver has this domain from the start: not accelmig's
TEST_DOMAIN = "test"


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_version():
    out = run_cli("accelmig", "--version", timeout=60)
    assert (out.returncode, out.stdout) == (0, f"accelmig {VERSION}\n")


@pytest.mark.parametrize("command, codes", [
    ([], ["  0  success", "  1  failure", "  2  usage", "  3  hostd: another hostd"]),
    (["hostd"], ["  0  stopped by SIGTERM or SIGINT", "  2  usage, or a host config", "  3  another hostd"]),
    (["migrate"], ["  0  migrated, and every session resumed", "  1  the migration failed",
                   "  2  usage, a host config that does not load, no such domain"]),
    (["install"], ["  0  the hook is installed (a libvirt daemon that is not running reads it",
                   "  1  failure"]),
])
def test_help_documents_the_exit_codes(command, codes):
    text = invoke(*command, "--help").stdout
    assert "Exit status:" in text
    for code in codes:
        assert code in text, (code, text)


def test_install_help_says_what_happens_without_a_running_libvirtd():
    text = " ".join(invoke("install", "--help").stdout.split())
    assert "No libvirt daemon running is a warning, not an error" in text
    assert "'accelmig doctor' then verifies it" in text


def test_hostd_refuses_a_log_level_it_does_not_know():
    result = invoke("hostd", "--log-level", "LOUD")
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert errors == ["Error: Invalid value for '--log-level': 'LOUD' is not one of "
                      "'debug', 'info', 'warning', 'error'."]
    assert "Traceback" not in result.output


@pytest.mark.parametrize("blocked, args", [
    ("click", ["--help"]),                       # a base install: no extra at all
    ("jinja2", ["domain", "templates"]),         # a [pool] install has click, not jinja2
])
def test_a_missing_host_library_says_which_extra_to_install(tmp_path, blocked, args):
    out = run_cli("accelmig", *args, env=blocked_env(tmp_path, blocked), timeout=60)
    assert out.returncode == 1
    assert out.stderr == (f"accelmig: this command needs the 'host' extra: pip install "
                          f"'accelmig[host]' (missing module: {blocked})\n")


def test_a_missing_module_that_is_no_extras_is_a_bug_not_advice(tmp_path):
    """Only the extra's own libraries are blamed on the install."""
    out = run_cli("accelmig", "domain", "templates", env=blocked_env(tmp_path, "accelmig.plugin.domain"),
                  timeout=60)
    assert out.returncode == 1 and "Traceback" in out.stderr and "extra" not in out.stderr


# ---------------------------------------------------------------- migrate


@pytest.fixture
def stub_hostd(tmp_path):
    stub = HostdStub(tmp_path / "hostd.sock", {"intent": {"migration_id": "m-cli"},
                                               "sessions": {"sessions": []}})
    try:
        yield stub, write_host_config(tmp_path / "etc", socket=stub.path)
    finally:
        stub.close()


def migrate(config, *args):
    return run_cli("accelmig", "migrate", *args, "test:///default", "--connect", "test:///default",
                   "--config", str(config), timeout=60)


def test_a_failed_migration_is_reported_once(stub_hostd):
    stub, config = stub_hostd
    out = migrate(config, TEST_DOMAIN)
    assert out.returncode == 1
    # libvirt's own error printer is off: its message comes once, with what it means
    assert out.stderr.count("p2p migration is not supported") == 1, out.stderr
    assert out.stderr.splitlines() == [
        f"accelmig migrate: the migration of {TEST_DOMAIN} failed: argument unsupported: p2p migration "
        f"is not supported by the source host (the VM goes on at the source)"]
    assert out.stdout == ""
    assert [m["policy"] for m in stub.received("intent")] == ["none"]


def test_a_failed_migration_with_json_prints_a_json_error(stub_hostd):
    stub, config = stub_hostd
    out = migrate(config, TEST_DOMAIN, "--json")
    assert out.returncode == 1
    answer = json.loads(out.stdout)
    assert answer["ok"] is False and "p2p migration is not supported" in answer["error"]
    assert out.stderr.count("p2p migration is not supported") == 1
    assert "migrating" not in out.stderr          # no progress bar: stderr is no terminal


@pytest.mark.parametrize("as_json", [False, True])
def test_no_such_domain(stub_hostd, as_json):
    stub, config = stub_hostd
    name = "nosuchvm"
    out = migrate(config, name, *(["--json"] if as_json else []))
    assert out.returncode == 2
    assert out.stderr == f"accelmig migrate: no such domain: {name} (on test:///default)\n"
    if as_json:
        assert json.loads(out.stdout) == {"ok": False, "error": f"no such domain: {name} (on test:///default)"}
    # a UUID that names no domain says the same (it is looked up as one)
    ghost = str(uuid_module.uuid4())
    out = migrate(config, ghost)
    assert out.returncode == 2 and out.stderr == f"accelmig migrate: no such domain: {ghost} (on test:///default)\n"
    assert stub.received("intent") == []          # nothing registered for a domain that is not there


# ---------------------------------------------------------------- status


def accel_domain_xml(name: str, uuid: str) -> str:
    return f"""<domain type='test'>
  <name>{name}</name><uuid>{uuid}</uuid><memory>65536</memory><vcpu>1</vcpu>
  <metadata><accelmig:domain xmlns:accelmig="http://accelmig.dev/xmlns/domain/1"/></metadata>
  <os><type arch='x86_64'>hvm</type></os>
</domain>"""


def test_status_counts_accelmig_domains_and_not_the_others(tmp_path):
    """test:///default's own domain is foreign; one accelmig domain beside it."""
    with PoolThread(TENANTS, {"hostA": (SECRET, ["127.0.0.0/8"])}) as pool:
        config = write_config(tmp_path, pool)
        conn = libvirt.open("test:///default")
        uuid = str(uuid_module.uuid4())
        dom = conn.defineXML(accel_domain_xml("accel-counted", uuid))
        hostd = HostdThread(config).start()
        try:
            dom.create()
            socket_path = str(tmp_path / "hostd.sock")
            wait_for(lambda: any(d["uuid"] == uuid and d["phase"] == "running"
                                 for d in LocalClient(socket_path).call("status")["domains"]),
                     what="hostd watches the accelmig domain")
            result = invoke("status", "--config", config)
            assert result.exit_code == 0, result.output
            lines = result.stdout.splitlines()
            foreign = len(conn.listAllDomains(0)) - 1
            assert f"domains   1 accelmig domain(s), {foreign} other domain(s) not accelmig's" in lines
            assert any(line.startswith(f"  accel-counted  {uuid}  running  ") for line in lines), lines
            assert not any(f"  {TEST_DOMAIN}  " in line for line in lines)
        finally:
            hostd.stop()
            for step in (dom.destroy, dom.undefine):
                try:
                    step()
                except libvirt.libvirtError:
                    pass
            conn.close()
