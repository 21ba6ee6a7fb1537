"""One handshake with a lab pool node, run inside a lab namespace: what the
node answers a ``resume`` of a session id (``python -m accelmig.lab.probe``).

A test asks it whether a node takes a session of an instance that died
for its own (it must answer ``SESSION_LOST``): the lab's pool addresses
exist only in the lab's namespaces, so the lab runs this there and reads
the one JSON line it prints: the node's first frame after ``welcome``
(``{"op": "error", "error": {"code": ..., "message": ...}}`` for a refusal),
with the welcome's ``instance`` added as ``node_instance``.  It proves
nothing of the session's secret: the node must refuse before it looks.
"""

from __future__ import annotations

import argparse
import json
import socket
import ssl
import sys
import subprocess

from . import netns


def resume_answer(endpoint: str, sid: str, cafile: str | None, timeout: float = 10.0) -> dict:
    from accelmig.agent.driver.link import read_answer
    from accelmig.wire.dataplane import parse_endpoint
    from accelmig.wire.errors import AccelmigError
    from accelmig.wire.frames import FrameReader, Limits, encode_frame
    host, port = parse_endpoint(endpoint)
    sock = socket.create_connection((host, port), timeout=timeout)
    if cafile:
        sock = ssl.create_default_context(cafile=cafile).wrap_socket(sock, server_hostname=host)
    try:
        sock.sendall(encode_frame({"op": "hello", "versions": [1]})
                     + encode_frame({"op": "resume", "sid": sid, "epoch": 0, "last_seen": 0, "proof": "x"}))
        reader = FrameReader(Limits(max_header=65536, max_payload=0))
        welcome, rest = read_answer(sock, reader)
        try:
            answer = rest[0].header if rest else read_answer(sock, reader)[0]
        except AccelmigError as exc:          # an error frame: read_answer raises it
            answer = {"op": "error", "error": exc.to_wire()}
        return {**answer, "node_instance": welcome.get("instance")}
    finally:
        sock.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m accelmig.lab.probe", description=__doc__.split("\n")[0])
    parser.add_argument("--endpoint", required=True, help="the node's data endpoint, HOST:PORT")
    parser.add_argument("--sid", required=True, help="the session id to ask the node to resume")
    parser.add_argument("--cafile", help="the lab's CA (a lab run with TLS); without it, plain TCP")
    args = parser.parse_args(argv)
    print(json.dumps(resume_answer(args.endpoint, args.sid, args.cafile), sort_keys=True))
    return 0


def resume_in(ns: str, endpoint: str, sid: str, cafile: str | None, timeout: float = 30.0) -> dict:
    """:func:`resume_answer`, run inside namespace ``ns``."""
    argv = [sys.executable, "-m", "accelmig.lab.probe", "--endpoint", endpoint, "--sid", sid,
            *(["--cafile", cafile] if cafile else [])]
    out = subprocess.run(netns.exec_argv(ns, argv), capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"resume probe of {endpoint} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


if __name__ == "__main__":
    sys.exit(main())
