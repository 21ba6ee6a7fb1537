"""What the OpenCL driver's sessions must never do (issue 30, milestone 2):
let an idle connection be cut by the pool (the keepalive its welcome asks
for), nor write the session secret anywhere (its output, its files, the
guest agent's, the wire under TLS)."""

from __future__ import annotations

import logging
import os
import shutil
import uuid

import pytest

from accelmig.lab.cutproxy import CutProxy
from accelmig.lab.poolthread import PoolThread
from accelmig.plugin.channel import GuestChannel
from tests.support import icd as icd_support
from tests.support.tenants import ALICE, TENANTS
from tests.support.twohosts import Raw
from tests.support.wait import wait_for


def test_an_idle_driver_keeps_its_connection_with_the_keepalive_the_pool_asks_for(icd):
    """A pool that cuts connections quiet for a second: a hand-driven peer
    that goes quiet is cut; the driver, idle for longer than that, sends
    its keepalive and is not (no reconnect, no resume)."""
    with PoolThread(TENANTS, idle_timeout=1.0) as pool:
        env = icd_support.driver_env(icd, pool.endpoint, ALICE, ACCELMIG_ICD_LOG="info")
        with icd_support.Solver(icd, env) as solver:
            assert solver.ask("step 2").endswith(" 0 0")
            quiet = Raw(pool.endpoint)
            try:
                witness = quiet.open()["sid"]
                with pytest.raises((EOFError, ConnectionError)):
                    while True:              # until the pool cuts it: idle_timeout went by
                        quiet.recv()
            finally:
                quiet.close()
            sessions = pool.call(lambda: {sid: s.state.value for sid, s in pool.pool.sessions.items()})
            assert sessions.pop(witness) == "detached"
            assert list(sessions.values()) == ["attached"]      # the driver's
            assert solver.ask("step 1").endswith(" 0 0")
            log = solver.finish()
    assert "connection lost" not in log and "resumed at" not in log, log


@pytest.mark.skipif(shutil.which("openssl") is None, reason="SKIPPED LOUDLY: the openssl command makes the test CA")
def test_the_session_secret_is_written_nowhere(icd, tmp_path, guest_agent, caplog):
    """The driver logging all it says (debug), registered with the guest
    agent, proving its binding, cut and resumed (the proof over the pool's
    challenge): its secret is in none of its output, none of the files
    under its home, its working and temporary directories or the agent's,
    nothing the agent logged, and not on the wire under TLS."""
    from accelmig.lab.certs import make_pki
    caplog.set_level(logging.DEBUG)
    pki = make_pki(tmp_path / "pki")
    agent = guest_agent(str(uuid.uuid4()))
    home, work, temp = tmp_path / "home", tmp_path / "work", tmp_path / "tmp"
    for directory in (home, work, temp):
        directory.mkdir()
    with PoolThread(TENANTS, {"hostA": ("hostA-secret-hygiene-01", ["127.0.0.0/8"])}, tls_cert=str(pki.pool.cert),
                    tls_key=str(pki.pool.key), tls_client_ca=str(pki.ca)) as pool, \
            CutProxy(pool.endpoint, record=True) as proxy:
        env = icd_support.driver_env(icd, proxy.endpoint, ALICE, cafile=str(pki.ca), ACCELMIG_ICD_LOG="debug",
                                     ACCELMIG_AGENT_SOCKET=agent.socket_path, HOME=str(home), TMPDIR=str(temp))
        with icd_support.Solver(icd, env, cwd=work) as solver:
            out = [solver.ask("step 2"), solver.ask("sum")]
            sid = wait_for(lambda: next(iter(agent.sessions()), None), 10, "the session registered")["sid"]
            proxy.cut()
            out.append(solver.ask("sum"))                        # resumed: the proof made
            challenge = "ab" * 16
            instance = pool.pool.instance
            with GuestChannel(agent.port_path) as channel:
                channel.connect()
                proven = channel.request("prove", host="hostA", challenges={instance: challenge}, sids=[sid])
            assert set(proven["proofs"]) == {sid}
            secret = pool.call(lambda: pool.pool.sessions[sid].secret)
            log = solver.finish()
        wire = bytes(proxy.recorded)
    assert "resumed at" in log and len(secret) == 32
    forms = [secret.hex().encode(), secret.hex().upper().encode(), secret]
    places = {"stdout": "\n".join(out).encode(), "stderr": log.encode(), "the agent's log": caplog.text.encode(),
              "the wire (TLS)": wire}
    for directory in (home, work, temp, tmp_path / "agent"):
        for root, _, files in os.walk(directory):
            for name in files:
                path = os.path.join(root, name)
                if os.path.isfile(path):
                    with open(path, "rb") as handle:
                        places[path] = handle.read()
    assert len(wire) > 0 and any(places[p] for p in places if p.startswith(str(tmp_path / "agent")))
    for place, data in places.items():
        assert not any(form in data for form in forms), f"the session secret is in {place}"
