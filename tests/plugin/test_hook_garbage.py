"""The hook, run as libvirt runs it, against a hostd stub that answers
garbage (issue 14, low items): whatever comes back, libvirt gets exactly one
line on stderr (its client shows it), printable, naming what was wrong, and
nothing on stdout but the XML; strict mode refuses."""

from __future__ import annotations

import socket
import threading

import pytest

from tests.plugin.test_hook import FABRIC_B, REWRITTEN, run_hook
from tests.support.hostd import write_config

GARBAGE = [
    (b"not json at all\n", "hostd: dropped input: not JSON"),
    (b"\xff\xfe\x00 binary\n", "hostd: dropped input: not JSON"),
    (b"[" * 100000 + b"\n", "hostd: dropped input: JSON nested too deeply"),
    (b"x" * 300000 + b"\n", "hostd: dropped input: line longer than"),
    (b'{"type":"result","id":1,"ok":false,"error":"boom"}\n',
     "PROTOCOL_ERROR: protocol error: a failed answer without a valid error: 'boom'"),
    (b'{"type":"result","id":1,"ok":false}\n', "a failed answer without a valid error"),
    (b'{"type":"result","id":1,"ok":false,"error":{"code":"CONFLICT","message":'
     b'"line one\\nline two\\r\\n\\u001b[31mred"}}\n', "CONFLICT: line one line two [31mred"),
]


class GarbageHostd:
    """A unix socket where hostd's would be: reads the request, answers ``answer``, closes."""

    def __init__(self, path: str, answer: bytes):
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(path)
        self.listener.listen(4)
        self.answer = answer
        self.requests: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn:
            self.requests.append(conn.recv(65536))
            try:
                conn.sendall(self.answer)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()
        self.thread.join(10)


@pytest.mark.parametrize("answer, words", GARBAGE, ids=["text", "binary", "nested", "long", "error-str",
                                                        "no-error", "multiline"])
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "lenient"])
def test_hostd_answering_garbage_gets_one_line_on_stderr(tmp_path, pool_a, answer, words, strict):
    config = write_config(tmp_path, pool_a, fabric=FABRIC_B, strict=strict)
    stub = GarbageHostd(str(tmp_path / "hostd.sock"), answer)
    try:
        code, out, err, _ = run_hook(config, "accel-vm1", "migrate", "begin", "-")
    finally:
        stub.close()
    assert b'"type":"hook"' in stub.requests[0]          # it did ask hostd
    assert err.endswith("\n") and err.count("\n") == 1, repr(err)   # exactly one line ...
    assert err.startswith("accelmig hook: ") and words in err, err
    assert err[:-1].isprintable() and len(err) <= 1001, repr(err)   # ... printable, bounded
    if strict:
        assert (code, out) == (1, "") and "refusing migrate of accel-vm1 to host hostA" in err
    else:
        assert (code, out) == (0, REWRITTEN) and "goes ahead without accelmig (lenient mode)" in err
