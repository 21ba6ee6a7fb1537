"""``accelmig-pool``'s command line: its version, option types that refuse
bad endpoints and levels with a usage error (exit 2, no traceback), the exit
codes in its help, and an install without the 'pool' extra told what to
install.  click's runner for the option types; the real console script in a
subprocess where the process matters (its exit status, a missing library)."""

from __future__ import annotations

import importlib.metadata

import pytest
from click.testing import CliRunner

from accelmig.pool.cli import main as cli
from tests.conftest import run_cli
from tests.support.blocked import blocked_env

VERSION = importlib.metadata.version("accelmig")


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_version():
    out = run_cli("accelmig-pool", "--version", timeout=60)
    assert (out.returncode, out.stdout) == (0, f"accelmig-pool {VERSION}\n")


@pytest.mark.parametrize("args, why", [
    (["--listen", "nonsense"], "endpoint 'nonsense' has no port"),
    (["--listen", ":99999"], "endpoint ':99999' has no host"),
    (["--listen", "0.0.0.0:99999"], "port 99999 is not in 0-65535"),
    (["--listen", "127.0.0.1:7070,fd00::1:7070"], "an IPv6 address goes in brackets"),
    (["--control-listen", "h:x"], "port 'x' is not a number"),
    (["--metrics-listen", "[nope]:9470"], "'nope' is not an IPv6 address"),
    (["--log-level", "LOUD"], "'LOUD' is not one of"),
])
def test_bad_option_values_are_usage_errors(args, why):
    result = invoke("serve", *args)
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and why in errors[0], result.stderr
    assert "Traceback" not in result.output


def test_the_issues_cases_from_the_real_script(tmp_path):
    for listen in ("nonsense", ":99999"):
        out = run_cli("accelmig-pool", "serve", "--listen", listen, "--admin-socket", "",
                      "--tokens", str(tmp_path / "none.toml"), timeout=60)
        assert out.returncode == 2, out.stderr
        assert out.stderr.splitlines()[-1].startswith("Error: Invalid value for '--listen': endpoint")
        assert "Traceback" not in out.stderr
    # a free port (0), several addresses and '' (off) are accepted: it gets as
    # far as the tenants file, which does not exist
    out = run_cli("accelmig-pool", "serve", "--listen", "127.0.0.1:0,[::1]:0", "--control-listen", "",
                  "--metrics-listen", "", "--log-level", "debug", "--admin-socket", "",
                  "--tokens", str(tmp_path / "none.toml"), timeout=60)
    assert out.returncode == 2 and "none.toml" in out.stderr and "file not found" in out.stderr
    assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr


@pytest.mark.parametrize("key, value, why", [
    ("listen", '":99999"', "has no host"),
    ("control_listen", '"pool:70000"', "port 70000 is not in 0-65535"),
    ("log_level", '"LOUD"', "'LOUD' is not one of DEBUG, INFO, WARNING, ERROR"),
])
def test_the_config_file_is_held_to_the_same_rules(tmp_path, key, value, why):
    config = tmp_path / "pool.toml"
    config.write_text(f"[pool]\n{key} = {value}\n")
    out = run_cli("accelmig-pool", "serve", "--config", str(config), "--admin-socket", "", timeout=60)
    assert out.returncode == 2
    assert out.stderr.startswith("accelmig-pool: ") and why in out.stderr and str(config) in out.stderr
    assert len(out.stderr.splitlines()) == 1


def test_help_documents_the_exit_codes():
    text = invoke("--help").stdout
    assert "Exit status:" in text
    assert "  0  success" in text and "  2  usage" in text and "  3  serve: another pool" in text


@pytest.mark.parametrize("blocked, args", [("numpy", ["devices"]), ("click", ["--help"])])
def test_a_missing_pool_library_says_which_extra_to_install(tmp_path, blocked, args):
    """A [host] install has no numpy (pyopencl needs it); a base install no click."""
    out = run_cli("accelmig-pool", *args, env=blocked_env(tmp_path, blocked), timeout=60)
    assert out.returncode == 1
    assert out.stderr == (f"accelmig-pool: this command needs the 'pool' extra: pip install "
                          f"'accelmig[pool]' (missing module: {blocked})\n")
    assert out.stdout == ""
