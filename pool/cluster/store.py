"""The pool's one door to etcd: ``etcd3gw`` (the v3 JSON gateway) with every
answer bounded and every value checked.

etcd is shared by every pool node and its contents are input like any other:
a corrupted or hostile store must cost a node bounded memory and a clear
error, never a traceback.  So every answer is read at most
``MAX_ANSWER_BYTES``, a range at most ``limit`` keys, each value at most
``MAX_VALUE_BYTES`` of a JSON object; a value that is none of that is
skipped with a log line (``StoredValue`` checks the fields its reader needs).

``etcds://`` is TLS to etcd: etcd's certificate is verified against
``cluster_tls_ca`` and must name the endpoint's host, and the node presents
its client certificate (etcd ``--client-cert-auth``): only holders of a
certificate the etcd CA signed may write node records or quota reservations.
A handshake that fails is an ``Unavailable`` that says which side refused.

With ``cluster_user`` (``ClusterAuth``), etcd's own role-based access
control comes on top of the certificates: the node authenticates with a
user and password (``/v3/auth/authenticate``), sends the token it gets with
every request, and etcd lets that user touch only what its role grants
(the operator's: ``/accelmig/v1/`` read-write, nothing else of a shared
etcd).  etcd 3.4's JSON gateway refuses any request from a client
certificate with a CommonName once auth is on (it cannot carry the CN to
etcd as the user), so such a node's certificate has no CN; a token etcd no
longer knows (it restarted; an idle token expired) is renewed once, then
the request goes again.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import ssl
import threading

import requests
from etcd3gw.client import Etcd3Client
from etcd3gw import exceptions as etcd_errors

from accelmig.pool.cluster.keys import (MAX_ANSWER_BYTES, MAX_RANGE_KEYS, MAX_VALUE_BYTES, PREFIX,  # noqa: F401
                                        check_name, cluster_uses_tls, parse_cluster_url)
from accelmig.wire.errors import Unavailable

LOG = logging.getLogger("accelmig.pool.cluster")

@dataclasses.dataclass(frozen=True)
class ClusterTLS:
    """The files of ``etcds://``: the CA etcd's certificate must verify
    against, this node's client certificate and its key (``""``: in ``cert``)."""

    ca: str
    cert: str | None
    key: str = ""


@dataclasses.dataclass(frozen=True)
class ClusterAuth:
    """etcd's user and password for this node (``cluster_user``,
    ``cluster_password_file``)."""

    user: str
    password: str = dataclasses.field(repr=False)


class TLSRefused(etcd_errors.ConnectionFailedError):
    """A TLS handshake with etcd failed (``detail_text`` says why)."""


class AuthRefused(etcd_errors.Etcd3Exception):
    """etcd's access control refused this node (``detail_text`` says why and
    what to change); final: no other endpoint is tried."""


#: what etcd's gateway answers when auth is on and the client certificate has a CN
_GATEWAY_CN = "CommonName of client sending a request against gateway"


class _BoundedSession(requests.Session):
    """Every answer but a watch stream is read at most ``limit`` bytes;
    with ``tls``, every request verifies etcd and presents this node's
    certificate (etcd3gw ignores its own TLS arguments given a session)."""

    def __init__(self, limit: int, tls: ClusterTLS | None = None, auth: ClusterAuth | None = None):
        super().__init__()
        self.limit = limit
        self.etcd_auth = auth
        self._token: str | None = None
        self._token_lock = threading.Lock()   # the lease, ledger and placement threads share the session
        # no REQUESTS_CA_BUNDLE/CURL_CA_BUNDLE (they would replace cluster_tls_ca by a bundle of
        # public CAs), no proxy and no .netrc from the environment: etcd is reached as configured
        self.trust_env = False
        if tls is not None:
            self.verify = tls.ca
            if tls.cert:
                self.cert = (tls.cert, tls.key) if tls.key else tls.cert

    def request(self, method, url, **kwargs):
        if self.etcd_auth is None:
            return _refused_by_access_control(self._guarded(method, url, **kwargs), url, None)
        token = self._authenticated(url, kwargs.get("timeout"))
        response = self._guarded(method, url, **_with_token(kwargs, token))
        if response.status_code == 401:       # "invalid auth token": etcd restarted, or the token expired
            response.close()
            token = self._authenticated(url, kwargs.get("timeout"), stale=token)
            response = self._guarded(method, url, **_with_token(kwargs, token))
        return _refused_by_access_control(response, url, self.etcd_auth.user)

    def _authenticated(self, url: str, timeout, stale: str | None = None) -> str:
        """A token of this node's etcd user: the one held, unless it is ``stale``."""
        with self._token_lock:
            if self._token is not None and self._token != stale:
                return self._token
            self._token = None
            where = url.split("/v3/")[0]
            answer = self._guarded("POST", f"{where}/v3/auth/authenticate", timeout=timeout,
                                   json={"name": self.etcd_auth.user, "password": self.etcd_auth.password})
            text = answer.text[:300]
            if answer.status_code == 200:
                token = answer.json().get("token") if answer.text.startswith("{") else None
                if not isinstance(token, str) or not 0 < len(token) <= 4096:
                    raise AuthRefused(f"etcd at {where} answered an authentication without a token")
                self._token = token
                return token
            if "not enabled" in text:
                raise AuthRefused(
                    f"etcd at {where} has no authentication enabled, so cluster_user {self.etcd_auth.user!r} "
                    f"would protect nothing: enable it there (etcdctl auth enable) or drop cluster_user")
            if "authentication failed" in text:
                raise AuthRefused(
                    f"etcd at {where} refused user {self.etcd_auth.user!r}: no such user or a wrong password "
                    f"(cluster_user, cluster_password_file)")
            _refused_by_access_control(answer, url, self.etcd_auth.user)
            raise AuthRefused(f"etcd at {where} refused to authenticate user {self.etcd_auth.user!r}: "
                              f"HTTP {answer.status_code} {text}")

    def _guarded(self, method, url, **kwargs):
        try:
            return self._request(method, url, **kwargs)
        except requests.exceptions.ConnectionError as exc:
            reason = _tls_failure(exc, url)
            if reason is not None:
                raise TLSRefused(reason) from None
            if url.startswith("http:") and "Connection aborted" in str(exc):
                # an etcd that speaks only TLS hangs up on (or resets) plain HTTP
                raise etcd_errors.ConnectionFailedError(
                    f"{str(exc)[:200]}: etcd closed a plain HTTP request (one that serves only TLS? "
                    f"then etcds://)") from None
            raise

    def _request(self, method, url, **kwargs):
        if kwargs.get("stream"):            # a watch: etcd3gw reads it event by event
            return super().request(method, url, **kwargs)
        kwargs["stream"] = True
        response = super().request(method, url, **kwargs)
        try:
            body = response.raw.read(self.limit + 1, decode_content=True)
        finally:
            response.close()
        if len(body) > self.limit:
            raise Unavailable(what="etcd", reason=f"an answer of more than {self.limit} bytes from "
                                                  f"{url}: refused (a corrupted or hostile store?)")
        response._content = body
        response._content_consumed = True
        return response


def _with_token(kwargs: dict, token: str) -> dict:
    return {**kwargs, "headers": {**(kwargs.get("headers") or {}), "Authorization": token}}


def _refused_by_access_control(response, url: str, user: str | None):
    """``response``, unless it is etcd's access control refusing this node:
    then an ``AuthRefused`` that says what to change."""
    status = response.status_code
    if status not in (400, 403):
        return response
    where = url.split("/v3/")[0]
    if response._content_consumed:
        text = response.text[:300]
    else:                                  # a watch's stream: its first bytes say enough
        text = response.raw.read(300, decode_content=True).decode("utf-8", "replace")
    if status == 400 and _GATEWAY_CN in text:
        raise AuthRefused(
            f"etcd at {where} has authentication on and refuses, on its JSON gateway, a client "
            f"certificate that carries a CommonName: issue this node's cluster_tls_cert without a CN "
            f"(a subject such as /O=accelmig-pool; the node is known to etcd by cluster_user)")
    if status == 400 and "user name is empty" in text:
        raise AuthRefused(f"etcd at {where} has authentication on: give this node an etcd user "
                          f"(cluster_user, cluster_password_file)")
    if status == 403 and "permission denied" in text:
        raise AuthRefused(
            f"etcd at {where} denied user {user!r} {url.split('/v3/')[-1]}: its role must grant readwrite "
            f"on the prefix {PREFIX} (etcdctl role grant-permission ROLE --prefix readwrite {PREFIX})")
    return response


def _tls_failure(exc: BaseException, url: str) -> str | None:
    """An operator's sentence for a failed TLS handshake with etcd, or None:
    ``exc`` is no TLS failure (requests buries the ``ssl`` error in its chain)."""
    seen, todo, found = set(), [exc], None
    while todo and found is None:
        item = todo.pop()
        if id(item) in seen or not isinstance(item, BaseException):
            continue
        seen.add(id(item))
        if isinstance(item, ssl.SSLError):
            found = item
            break
        todo.extend([item.__cause__, item.__context__, getattr(item, "reason", None), *item.args])
    if found is None:
        return None
    where = url.split("/v3/")[0].split("/version")[0]
    text = str(found)
    if isinstance(found, ssl.SSLCertVerificationError):
        return (f"etcd's certificate at {where} does not verify ({found.verify_message}): not signed by "
                f"cluster_tls_ca, or it names no such host (an IP SAN is needed for an address)")
    if isinstance(found, ssl.SSLEOFError):     # Go's TLS server hangs up on a certificate it refuses
        return (f"etcd at {where} closed the TLS handshake: it refused this node's client certificate "
                f"(none given, or cluster_tls_cert is not signed by a CA etcd trusts: its "
                f"--trusted-ca-file)")
    if "CERTIFICATE_REQUIRED" in text.upper().replace(" ", "_"):
        return f"etcd at {where} requires a client certificate (cluster_tls_cert) and got none"
    if any(word in text.upper().replace(" ", "_") for word in ("UNKNOWN_CA", "BAD_CERTIFICATE",
                                                               "CERTIFICATE_UNKNOWN")):
        return (f"etcd at {where} refused this node's client certificate (none given, or "
                f"cluster_tls_cert is not signed by a CA etcd trusts: its --trusted-ca-file): {text[:200]}")
    if "WRONG_VERSION_NUMBER" in text.upper().replace(" ", "_"):
        return f"etcd at {where} does not speak TLS (use etcd:// for a plain etcd): {text[:200]}"
    return f"TLS with etcd at {where} failed: {text[:300]}"


def _reason(exc: Exception) -> str:
    """etcd3gw's exceptions keep their text in ``detail_text``, not in ``str()``."""
    return " ".join(str(part) for part in (getattr(exc, "detail_text", None), *exc.args) if part) \
        or type(exc).__name__


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def prefix_end(prefix: str) -> str:
    """The end of the range of keys that start with ``prefix``."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class ClusterStore:
    """A few etcd operations, bounded; ``Unavailable`` when no endpoint answers."""

    def __init__(self, endpoints: list[tuple[str, int]], *, timeout: float = 5.0,
                 tls: ClusterTLS | None = None, auth: ClusterAuth | None = None):
        if auth is not None and tls is None:
            raise ValueError("an etcd password goes over TLS only (etcds://)")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.tls = tls
        self._current = 0
        self._clients = [Etcd3Client(host, port, protocol="https" if tls else "http", timeout=timeout,
                                     api_path="/v3/", session=_BoundedSession(MAX_ANSWER_BYTES, tls, auth))
                         for host, port in self.endpoints]

    @classmethod
    def from_config(cls, config) -> "ClusterStore":
        """The store a pool's ``cluster`` and ``cluster_tls_*`` keys name."""
        tls = auth = None
        if cluster_uses_tls(config.cluster):
            tls = ClusterTLS(config.cluster_tls_ca, config.cluster_tls_cert, config.cluster_tls_key)
        if config.cluster_user:
            auth = ClusterAuth(config.cluster_user, config.cluster_password())
        return cls(parse_cluster_url(config.cluster, "cluster"), tls=tls, auth=auth)

    def probe(self) -> int:
        """One read, to learn before serving that etcd answers and accepts
        this node (TLS, client certificate); the store's revision."""
        return self.range(PREFIX + "nodes/", limit=MAX_RANGE_KEYS)[1]

    @property
    def client(self) -> Etcd3Client:
        return self._clients[self._current]

    def _call(self, what: str, fn):
        """``fn(client)`` on the endpoint that answered last, then the others."""
        errors = []
        for step in range(len(self._clients)):
            index = (self._current + step) % len(self._clients)
            try:
                result = fn(self._clients[index])
            except (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError) as exc:
                errors.append(f"{self.endpoints[index][0]}:{self.endpoints[index][1]}: {_reason(exc)}"[:400])
                continue
            except etcd_errors.Etcd3Exception as exc:
                raise Unavailable(what="etcd", reason=f"{what}: {_reason(exc)}"[:500]) from None
            except (ValueError, KeyError, TypeError) as exc:      # an answer that is no gateway's
                raise Unavailable(what="etcd", reason=f"{what}: a malformed answer ({exc})"[:500]) from None
            self._current = index
            return result
        raise Unavailable(what="etcd", reason=f"{what}: no endpoint answered: {'; '.join(errors)}")

    def _post(self, path: str, body: dict) -> dict:
        def call(client):
            answer = client.post(client.get_url(path), json=body)
            if not isinstance(answer, dict):
                raise ValueError("not a JSON object")
            return answer
        return self._call(path, call)

    # -- leases ---------------------------------------------------------------------
    def grant(self, ttl: int) -> int:
        answer = self._post("/lease/grant", {"TTL": int(ttl)})
        return _int(answer.get("ID"), "lease id")

    def keepalive(self, lease: int) -> int:
        """The lease's remaining TTL, or -1: it expired (its keys are gone)."""
        answer = self._post("/lease/keepalive", {"ID": lease})
        result = answer.get("result")
        if not isinstance(result, dict) or "TTL" not in result:
            return -1
        return _int(result["TTL"], "ttl")

    def revoke(self, lease: int) -> None:
        self._post("/kv/lease/revoke", {"ID": lease})

    # -- keys -----------------------------------------------------------------------
    def put(self, key: str, value: dict, lease: int | None = None) -> int:
        """Put a JSON value; the store's revision after it."""
        body = {"key": _b64(key), "value": _b64(_encode_value(value))}
        if lease:
            body["lease"] = lease
        return _revision(self._post("/kv/put", body))

    def range(self, prefix: str, *, limit: int = MAX_RANGE_KEYS) -> tuple[list[tuple[str, dict, dict]], int]:
        """Keys under ``prefix``: ([(key, value, meta)], revision).  A value
        that is not a bounded JSON object is skipped and logged; more than
        ``limit`` keys is an error (nobody of ours writes that many)."""
        answer = self._post("/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                          "limit": limit + 1})
        revision = _revision(answer)
        kvs = answer.get("kvs") or []
        if not isinstance(kvs, list):
            raise Unavailable(what="etcd", reason=f"range {prefix}: kvs is not a list")
        if len(kvs) > limit or answer.get("more"):
            raise Unavailable(what="etcd", reason=f"range {prefix}: more than {limit} keys "
                                                  f"(a store nobody of ours wrote?)")
        out = []
        for item in kvs:
            decoded = _decode_kv(item)
            if decoded is not None:
                out.append(decoded)
        return out, revision

    def read_together(self, ranges: list[tuple[str, bool]], *, limit: int = MAX_RANGE_KEYS) -> tuple[list, int]:
        """Several reads at one revision in one round trip (a transaction
        of ranges): ``ranges`` of (key, is_prefix); ([kvs of each], revision)."""
        ops = [{"request_range": {"key": _b64(key), "limit": limit + 1,
                                  **({"range_end": _b64(prefix_end(key))} if prefix else {})}}
               for key, prefix in ranges]
        ok, answer = self.txn([], ops)
        responses = answer.get("responses") or []
        if not ok or not isinstance(responses, list) or len(responses) != len(ranges):
            raise Unavailable(what="etcd", reason="a read of several ranges answered no ranges")
        out = []
        for (key, _), response in zip(ranges, responses):
            found = response.get("response_range") if isinstance(response, dict) else None
            kvs = (found or {}).get("kvs") or [] if isinstance(found, dict) else None
            if not isinstance(kvs, list) or len(kvs) > limit or (found or {}).get("more"):
                raise Unavailable(what="etcd", reason=f"range {key[:120]}: not a list of at most {limit} keys")
            out.append([decoded for decoded in map(_decode_kv, kvs) if decoded is not None])
        return out, _revision(answer)

    def get(self, key: str) -> tuple[dict, dict] | None:
        """One key: (value, meta), or None when it is absent (or does not decode)."""
        answer = self._post("/kv/range", {"key": _b64(key)})
        kvs = answer.get("kvs") or []
        if not isinstance(kvs, list) or len(kvs) > 1:
            raise Unavailable(what="etcd", reason=f"get {key[:120]}: not one key")
        decoded = _decode_kv(kvs[0]) if kvs else None
        return None if decoded is None else decoded[1:]

    def delete(self, key: str) -> None:
        self._post("/kv/deleterange", {"key": _b64(key)})

    def txn(self, compare: list, success: list, failure: list | None = None) -> tuple[bool, dict]:
        answer = self._post("/kv/txn", {"compare": compare, "success": success, "failure": failure or []})
        return bool(answer.get("succeeded")), answer

    # -- the pieces of a transaction (the gateway's JSON) ---------------------------------
    @staticmethod
    def op_put(key: str, value: dict, lease: int | None = None) -> dict:
        body = {"key": _b64(key), "value": _b64(_encode_value(value))}
        if lease:
            body["lease"] = lease
        return {"request_put": body}

    @staticmethod
    def absent(key: str) -> dict:
        return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}

    @staticmethod
    def unchanged_since(prefix: str, revision: int) -> dict:
        """No key under ``prefix`` was created or changed after ``revision``
        (a compare over the whole range: etcd 3.3+)."""
        return {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)), "target": "MOD",
                "result": "LESS", "mod_revision": str(revision + 1)}

    # -- watches ----------------------------------------------------------------------
    def watch_prefix(self, prefix: str, start_revision: int | None = None):
        """(events, cancel): etcd3gw's event iterator over keys under ``prefix``."""
        return self._call("watch", lambda client: client.watch_prefix(prefix, start_revision=start_revision))


def _encode_value(value: dict) -> str:
    text = json.dumps(value, separators=(",", ":"), sort_keys=True)
    if len(text) > MAX_VALUE_BYTES:
        raise ValueError(f"a value of {len(text)} bytes: at most {MAX_VALUE_BYTES}")
    return text


def _int(value, what: str) -> int:
    # the gateway writes int64 as strings
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise Unavailable(what="etcd", reason=f"{what} {value!r:.40} is not an integer") from None
    if not -(1 << 63) <= number < (1 << 63):
        raise Unavailable(what="etcd", reason=f"{what} out of range")
    return number


def _revision(answer: dict) -> int:
    header = answer.get("header")
    return _int(header.get("revision") if isinstance(header, dict) else None, "revision")


def _decode_kv(item) -> tuple[str, dict, dict] | None:
    try:
        key = base64.b64decode(item["key"], validate=True).decode()
        raw = item.get("value", "")
        if not isinstance(raw, str) or len(raw) > MAX_VALUE_BYTES * 4 // 3 + 4:
            raise ValueError("value too large")
        value = json.loads(base64.b64decode(raw, validate=True) or b"null")
        if not isinstance(value, dict):
            raise ValueError("not a JSON object")
        meta = {"lease": _int(item.get("lease", 0), "lease"),
                "mod_revision": _int(item.get("mod_revision", 0), "mod_revision"),
                "create_revision": _int(item.get("create_revision", 0), "create_revision")}
    except (KeyError, TypeError, ValueError, UnicodeError, RecursionError, Unavailable) as exc:
        LOG.warning("etcd: skipping a stored value that does not decode: %s", str(exc)[:200],
                    extra={"key": str(item.get("key") if isinstance(item, dict) else "?")[:120]})
        return None
    return key, value, meta
