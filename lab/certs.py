"""A throwaway certificate authority for the lab, the demo and the tests:
a CA, the pool's server certificate (IP SANs: pool endpoints are
addresses) and one client certificate per host, made with the ``openssl``
command (EC P-256: quick to make).  Test rig only: a deployment brings its
own PKI (docs/deploy.md, "TLS")."""

from __future__ import annotations

import dataclasses
import ipaddress
import shutil
import subprocess
from pathlib import Path

DAYS = "30"


@dataclasses.dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


@dataclasses.dataclass(frozen=True)
class LabPKI:
    """What ``make_pki`` wrote: ``ca`` (the one CA file both sides trust),
    ``pool`` (the pool's certificate) and ``hosts`` (a client certificate each)."""

    ca: Path
    ca_key: Path
    pool: Issued
    hosts: dict


def _openssl(*args, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise RuntimeError("the openssl command is not installed (apt-get install openssl)")
    done = subprocess.run([exe, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {done.stderr.strip()[-500:]}")


def _key(path: Path, cwd: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", path, cwd=cwd)
    path.chmod(0o600)


def make_ca(directory: Path, name: str = "accelmig lab CA") -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "ca.crt", directory / "ca.key"
    _key(key, directory)
    _openssl("req", "-x509", "-new", "-key", key, "-out", cert, "-days", DAYS, "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory)
    return cert, key


def issue(directory: Path, ca: Path, ca_key: Path, name: str, *, addresses=(), dns=(),
          client: bool = False, server_and_client: bool = False, subject: str | None = None) -> Issued:
    """A certificate for ``name`` signed by the CA: a server's (SANs from
    ``addresses`` and ``dns``) or, with ``client``, a client's; with
    ``server_and_client``, both (etcd's own: with --client-cert-auth its
    gateway dials its gRPC server presenting that certificate).  ``subject``:
    other than ``/CN=name`` (an etcd client with a user and password needs
    one without a CN: etcd's gateway refuses a CN once auth is on)."""
    cert, key, csr = directory / f"{name}.crt", directory / f"{name}.key", directory / f"{name}.csr"
    ext = directory / f"{name}.ext"
    _key(key, directory)
    _openssl("req", "-new", "-key", key, "-out", csr, "-subj", subject or f"/CN={name}", cwd=directory)
    sans = [f"IP:{ipaddress.ip_address(a)}" for a in addresses] + [f"DNS:{d}" for d in dns]
    lines = ["basicConstraints=critical,CA:FALSE", "keyUsage=critical,digitalSignature",
             "extendedKeyUsage=" + ("serverAuth,clientAuth" if server_and_client
                                    else "clientAuth" if client else "serverAuth")]
    if sans:
        lines.append("subjectAltName=" + ",".join(sans))
    ext.write_text("\n".join(lines) + "\n")
    _openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
             "-days", DAYS, "-extfile", ext, cwd=directory)
    csr.unlink()
    ext.unlink()
    return Issued(cert, key)


def make_pki(directory: Path, *, pool_addresses=("127.0.0.1", "::1"), pool_dns=("localhost",),
             hosts=("hostA", "hostB")) -> LabPKI:
    """A CA, the pool's certificate for ``pool_addresses``, a client
    certificate for each of ``hosts``; all under ``directory``."""
    directory = Path(directory)
    ca, ca_key = make_ca(directory)
    pool = issue(directory, ca, ca_key, "pool", addresses=pool_addresses, dns=pool_dns)
    issued = {host: issue(directory, ca, ca_key, host, client=True) for host in hosts}
    return LabPKI(ca=ca, ca_key=ca_key, pool=pool, hosts=issued)
