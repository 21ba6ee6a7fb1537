"""TLS on both planes, with the standard library's ``ssl`` (the guest side
imports this too, so: standard library only, Python 3.9+).

- Data plane: the pool presents a certificate (``--tls-cert``/``--tls-key``);
  the driver verifies it against ``cafile`` (``ACCELMIG_CAFILE``; else the
  system's trust store) and checks that it names the endpoint's host.  Pool
  endpoints are usually IP addresses: the certificate needs an IP SAN
  (``subjectAltName = IP:10.88.0.1``), a DNS name does not match an address.
- Control plane: mutual TLS.  The pool verifies the host's certificate
  against ``--tls-client-ca``; the host verifies the pool's as drivers do.
  The host acts only as the name its certificate gives
  (``certificate_names``), and the per-host HMAC stays as a second factor
  (docs/DESIGN.md, "TLS").
- Plain TCP only where both ends say ``insecure`` explicitly (a warning in
  each log); a mismatch is a clear error, never a silent downgrade.

Ownership proofs are bound to the channel (``channel_binding``): a proof
made on a connection to anyone but the pool itself does not verify there.
"""

from __future__ import annotations

import hashlib
import os
import ssl

CAFILE_ENV = "ACCELMIG_CAFILE"
INSECURE_ENV = "ACCELMIG_INSECURE"

#: the first bytes of a TLS record (handshake 0x16 or alert 0x15, version 3.x)
_TLS_RECORD_TYPES = (0x14, 0x15, 0x16, 0x17)


def env_insecure() -> bool:
    """``ACCELMIG_INSECURE=1`` (or true/yes/on): the driver's explicit opt-out."""
    return os.environ.get(INSECURE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def looks_like_tls(data) -> bool:
    """True if ``data`` starts like a TLS record: a plain peer got TLS bytes."""
    head = bytes(data[:2])
    return len(head) == 2 and head[0] in _TLS_RECORD_TYPES and head[1] == 3


def client_context(cafile: str | None = None, certfile: str | None = None,
                   keyfile: str | None = None) -> ssl.SSLContext:
    """A context that verifies the pool (``cafile``, else the system's trust
    store) and its name; with ``certfile``, presents that certificate (a
    host's control-plane identity)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cafile)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if certfile:
        ctx.load_cert_chain(certfile, keyfile or None)
    return ctx


def server_context(certfile: str, keyfile: str | None = None,
                   client_ca: str | None = None) -> ssl.SSLContext:
    """The pool's context; with ``client_ca``, every peer must present a
    certificate signed by it (mutual TLS: the control plane)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile, keyfile or None)
    if client_ca:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=client_ca)
    return ctx


def certificate_names(peercert: dict | None) -> tuple[str, ...]:
    """The names a verified peer certificate gives its holder (what
    ``SSLSocket.getpeercert()`` decoded): its DNS subjectAltNames, or where
    it has none, its subject's CommonNames (RFC 6125's order for a
    service's name).  Empty for no certificate."""
    if not peercert:
        return ()
    dns = tuple(value for kind, value in peercert.get("subjectAltName", ()) if kind == "DNS")
    if dns:
        return dns
    return tuple(value for rdn in peercert.get("subject", ()) for key, value in rdn if key == "commonName")


def leaf_certificate_der(certfile: str) -> bytes:
    """The first certificate of a PEM file (the pool's own, for its binding)."""
    with open(certfile, "r", encoding="ascii", errors="replace") as handle:
        text = handle.read()
    end = "-----END CERTIFICATE-----"
    start = text.find("-----BEGIN CERTIFICATE-----")
    stop = text.find(end, start)
    if start < 0 or stop < 0:
        raise ValueError(f"{certfile}: no PEM certificate")
    return ssl.PEM_cert_to_DER_cert(text[start:stop + len(end)])


def channel_binding(ssl_object, server_cert_der: bytes | None = None) -> bytes:
    """What an ownership proof is bound to on this TLS connection (``b""``
    on plain TCP: there is nothing to bind to).

    ``tls-server-end-point`` (RFC 5929, SHA-256): the hash of the pool's
    certificate.  The driver takes it from what it verified, the pool from
    its own file (``server_cert_der``), so a relay that terminates TLS with
    any other certificate gets proofs the pool refuses.  Under TLS 1.2,
    ``tls-unique`` is added (bound to this very handshake; OpenSSL 3 uses
    the extended master secret).  TLS 1.3's binding, ``tls-exporter``
    (RFC 9266), needs a keying-material exporter that Python's ``ssl`` does
    not have: there the per-connection challenge and the certificate hash
    are what a proof is bound to (docs/DESIGN.md, "TLS")."""
    if ssl_object is None:
        return b""
    if server_cert_der is None:
        server_cert_der = ssl_object.getpeercert(binary_form=True) or b""
    binding = b"tls-server-end-point:" + hashlib.sha256(server_cert_der).digest()
    if ssl_object.version() == "TLSv1.2":
        unique = ssl_object.get_channel_binding("tls-unique")
        if unique:
            binding += b"|tls-unique:" + unique
    return binding


def describe_ssl_error(exc: Exception, endpoint: str) -> str:
    """An operator's sentence for a failed handshake."""
    reason = getattr(exc, "reason", None) or ""
    text = str(exc)
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (f"the certificate of {endpoint} does not verify ({exc.verify_message}): "
                f"wrong CA (cafile / {CAFILE_ENV}), or no SAN for that address or name")
    if reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG",
                  "HTTP_REQUEST", "UNKNOWN_PROTOCOL") or "wrong version number" in text:
        return (f"{endpoint} does not speak TLS (a pool started with --insecure?); "
                f"plain TCP needs insecure on both ends ({text})")
    if "CERTIFICATE_REQUIRED" in reason or "certificate required" in text:
        return f"{endpoint} requires a client certificate (cert_file, key_file)"
    if "UNKNOWN_CA" in reason or "unknown ca" in text or "BAD_CERTIFICATE" in reason:
        return f"{endpoint} refused this client's certificate ({reason or text})"
    return f"TLS with {endpoint} failed: {text}"
