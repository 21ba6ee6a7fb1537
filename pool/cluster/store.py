"""The pool's one door to etcd: ``etcd3gw`` (the v3 JSON gateway) with every
answer bounded and every value checked.

etcd is shared by every pool node and its contents are input like any other:
a corrupted or hostile store must cost a node bounded memory and a clear
error, never a traceback.  So every answer is read at most
``MAX_ANSWER_BYTES``, a range at most ``limit`` keys, each value at most
``MAX_VALUE_BYTES`` of a JSON object; a value that is none of that is
skipped with a log line (``StoredValue`` checks the fields its reader needs).
"""

from __future__ import annotations

import base64
import json
import logging

import requests
from etcd3gw.client import Etcd3Client
from etcd3gw import exceptions as etcd_errors

from accelmig.pool.cluster.keys import MAX_ANSWER_BYTES, MAX_RANGE_KEYS, MAX_VALUE_BYTES, PREFIX, check_name, parse_cluster_url  # noqa: F401
from accelmig.wire.errors import Unavailable

LOG = logging.getLogger("accelmig.pool.cluster")

class _BoundedSession(requests.Session):
    """Every answer but a watch stream is read at most ``limit`` bytes."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def request(self, method, url, **kwargs):
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


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def prefix_end(prefix: str) -> str:
    """The end of the range of keys that start with ``prefix``."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class ClusterStore:
    """A few etcd operations, bounded; ``Unavailable`` when no endpoint answers."""

    def __init__(self, endpoints: list[tuple[str, int]], *, timeout: float = 5.0):
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self._current = 0
        self._clients = [Etcd3Client(host, port, timeout=timeout, api_path="/v3/",
                                     session=_BoundedSession(MAX_ANSWER_BYTES))
                         for host, port in self.endpoints]

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
                errors.append(f"{self.endpoints[index][0]}:{self.endpoints[index][1]}: {exc}"[:300])
                continue
            except etcd_errors.Etcd3Exception as exc:
                raise Unavailable(what="etcd", reason=f"{what}: {exc}"[:500]) from None
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
    def op_delete(key: str) -> dict:
        return {"request_delete_range": {"key": _b64(key)}}

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
