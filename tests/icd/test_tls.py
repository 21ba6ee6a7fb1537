"""The driver under TLS, with the Python driver's rules (wire/tls.py): the
pool's certificate verified against the CA file and for the endpoint's
address (an IP SAN), a resume's proof bound to the channel; a wrong CA, a
certificate without the address, a plain driver at a TLS pool: refused,
each with a sentence that says why, and no device listed."""

from __future__ import annotations

import shutil

import pytest

from accelmig.lab.cutproxy import CutProxy
from accelmig.lab.poolthread import PoolThread
from tests.support import icd as icd_support

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="SKIPPED LOUDLY: the openssl command makes the test CA")

TOKEN = "alice-icd-tls-token-0001"
TENANTS = {"alice": (TOKEN, "256MiB")}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    from accelmig.lab.certs import issue, make_pki
    base = tmp_path_factory.mktemp("pki")
    made = make_pki(base / "ca")
    other = make_pki(base / "other")
    dns_only = issue(base / "ca", made.ca, made.ca_key, "dns-only", dns=("pool.example",))
    return {"pki": made, "other": other, "dns_only": dns_only}


@pytest.fixture(scope="module")
def tls_pool(pki):
    p = pki["pki"]
    with PoolThread(TENANTS, tls_cert=str(p.pool.cert), tls_key=str(p.pool.key), control_listen="") as pool:
        yield pool


def test_clinfo_over_tls_lists_the_device(icd, pki, tls_pool):
    env = icd_support.driver_env(icd, tls_pool.endpoint, TOKEN, cafile=str(pki["pki"].ca))
    params, output = icd_support.clinfo_raw(env)
    assert "#DEVICES                                          1" in output, output
    assert params["CL_DEVICE_AVAILABLE"] == "CL_TRUE"
    assert "INSECURE" not in output


def test_a_program_over_tls_resumes_after_a_cut_with_a_bound_proof(icd, pki, tls_pool):
    """A relay that only forwards bytes: the TLS session is the pool's, so
    the resume's proof (bound to the pool's certificate) is accepted."""
    with CutProxy(tls_pool.endpoint) as proxy:
        proxy.cut_after(4 << 20, "up")
        env = icd_support.driver_env(icd, proxy.endpoint, TOKEN, cafile=str(pki["pki"].ca), ACCELMIG_ICD_LOG="info")
        done = icd_support.run(icd.program("cl-checks"), env)
        assert proxy.tripped.is_set()
    assert "failures: 0" in done.stdout
    assert "resumed at" in done.stderr, done.stderr


@pytest.mark.parametrize("case, words", [
    ("other", "does not verify"),
    ("dns_only", "does not verify"),
    ("insecure", "this driver is insecure"),
])
def test_a_pool_the_driver_cannot_trust_gets_nothing(icd, pki, tls_pool, tmp_path, case, words):
    endpoint = tls_pool.endpoint
    if case == "other":
        env = icd_support.driver_env(icd, endpoint, TOKEN, cafile=str(pki["other"].ca))
        pool = None
    elif case == "dns_only":
        cert = pki["dns_only"]
        pool = PoolThread(TENANTS, tls_cert=str(cert.cert), tls_key=str(cert.key), control_listen="").start()
        env = icd_support.driver_env(icd, pool.endpoint, TOKEN, cafile=str(pki["pki"].ca))
    else:
        env = icd_support.driver_env(icd, endpoint, TOKEN)       # ACCELMIG_INSECURE=1
        pool = None
    try:
        done = icd_support.run("clinfo", env, timeout=60, check=False)
    finally:
        if pool is not None:
            pool.stop()
    assert "Number of devices                                 0" in done.stdout
    assert words in done.stderr, done.stderr


def test_a_reconnect_resumes_the_tls_session_of_the_last_connection(icd, pki, tls_pool, tmp_path, caplog):
    """Each reconnect offers the last connection's TLS session (the pool's
    ticket) to the same endpoint: the handshake resumes (no certificate
    chain, no signature), the resume's proof is still bound to the pool's
    certificate, and the pool's log says so, as the driver's does."""
    import logging
    caplog.set_level(logging.INFO, logger="accelmig.pool")
    script = ["step 3", "sum", "step 4", "sum", "step 5", "sum"]
    reference = icd_support.solver_reference(icd, tmp_path, script)
    with CutProxy(tls_pool.endpoint) as proxy:
        env = icd_support.driver_env(icd, proxy.endpoint, TOKEN, cafile=str(pki["pki"].ca), ACCELMIG_ICD_LOG="info")
        with icd_support.Solver(icd, env) as solver:
            out = []
            for command in script:
                out.append(solver.ask(command))
                if command == "sum" and len(out) < len(script):
                    assert proxy.cut() >= 1          # the connection goes, the next command resumes
            log = solver.finish()
    assert out == reference
    resumed = [line for line in log.splitlines() if " resumed at " in line]
    assert len(resumed) == 2 and all("(TLS session resumed)" in line for line in resumed), log
    said = [r.getMessage() for r in caplog.records if " resumed at epoch " in r.getMessage()]
    assert len(said) == 2 and all(line.endswith("TLS session resumed") for line in said), said
