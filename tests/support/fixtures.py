"""pytest fixtures of tests/support, registered by ``pytest_plugins`` in tests/conftest.py.

``netns_factory``: a ``tests.support.netns.NetnsFactory`` (on the lab's
netns toolkit, ``accelmig.lab.netns``) for one test;
``netns_factory_module``: one shared by a test module.  Both remove every
namespace, link and process they made, whatever the test did, and skip
loudly where this is not root.

``lab_pki``: a throwaway CA with the pool's certificate (``accelmig.lab.certs``)
for the whole run; ``tls_pool_process``: starts real ``accelmig-pool serve``
processes serving TLS with it (``start(tenants_toml, *flags, config=TOML,
wrapper=...)``), each stopped at the end of the test whatever it did.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.support.netns import NetnsFactory
from tests.support.processes import PoolProcess


def _need_root():
    if os.geteuid() != 0:
        pytest.skip("SKIPPED LOUDLY: network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("SKIPPED LOUDLY: iproute2's ip is not installed")


@pytest.fixture
def netns_factory():
    _need_root()
    factory = NetnsFactory()
    try:
        yield factory
    finally:
        factory.cleanup()


@pytest.fixture(scope="module")
def netns_factory_module():
    _need_root()
    factory = NetnsFactory()
    try:
        yield factory
    finally:
        factory.cleanup()


@pytest.fixture(scope="session")
def lab_pki(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("SKIPPED LOUDLY: the openssl command makes the test CA")
    from accelmig.lab.certs import make_pki
    return make_pki(tmp_path_factory.mktemp("pki") / "ca")


@pytest.fixture
def tls_pool_process(tmp_path, lab_pki):
    started = []

    def start(tenants: str, *flags, config: str = "", wrapper=()) -> PoolProcess:
        directory = tmp_path / f"pool{len(started)}"
        directory.mkdir()
        if config:
            (directory / "pool.toml").write_text("[pool]\n" + config)
            flags = ("--config", directory / "pool.toml", *flags)
        pool = PoolProcess(directory, tenants, tls=lab_pki, extra=flags, wrapper=wrapper)
        started.append(pool)
        return pool
    try:
        yield start
    finally:
        for pool in started:
            pool.stop()
