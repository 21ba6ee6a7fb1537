"""The libvirt qemu hook: ``/etc/libvirt/hooks/qemu.d/50-accelmig``.

libvirt runs it as ``HOOK DOMAIN OPERATION SUB-OPERATION EXTRA`` with the
domain XML on stdin, for every domain and every lifecycle step (libvirt >=
6.5 runs every executable in qemu.d, in order, chaining their XML output).

Rules it lives by (docs/lab-notes.md measured why):
- it acts only on accelmig domains (its metadata or its agent channel, or,
  for a domain nobody marked such as a Nova instance, its UUID in hostd's
  ``accel-domains.json``: its guest holds sessions) and
  only at ``migrate begin`` and ``restore begin``: for every other domain
  and every other step it exits 0 at once, silently (the installed script
  does not even start Python for the other steps);
- it never calls libvirt (that deadlocks the daemon) and leaves no child
  behind; it talks only to hostd, over a unix socket, within a time budget;
- only ``migrate begin`` and ``restore begin`` may fail: in strict mode
  (default) when hostd or, through it, the pool is unreachable — a refused
  migration beats a VM that arrives without its accelerator.  Every other
  operation exits 0 whatever happens: a failing ``prepare``/``start`` stops
  a boot, a failing ``reconnect`` makes libvirt kill a running QEMU;
- at ``migrate begin``/``restore begin`` it prints the domain XML rewritten
  for this host, on a model, only where a host-bound part (the fabric NIC's
  bridge or macvtap device) differs; printing nothing keeps libvirt's XML.
  A domain nobody marked is never rewritten and gets no answer: libvirt keeps
  its XML as given, byte for byte (an answer would taint it "hook-script").

It imports little (no libvirt, no click): libvirt waits for it.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time

from accelmig.wire.localapi import GATED_HOOK_STEPS

#: the longest line the hook writes (libvirt relays it to the client)
MAX_LINE = 1000


class _Noted(logging.Handler):
    """Keeps what the libraries log (hostd answering garbage: "dropped
    input: not JSON ...") for the hook's one line, instead of Python's
    last-resort handler printing each on a stray line of its own."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.messages.append(record.getMessage())
        except Exception:  # a broken format must not print a traceback either
            pass


NOTED = _Noted()


def _one_line(text: str) -> str:
    """Whatever came from hostd as one printable line: newlines, escape
    sequences and other control characters would end up on the client's
    terminal."""
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return text if len(text) <= MAX_LINE else text[:MAX_LINE - 3] + "..."


def _log(message: str) -> None:
    # libvirt shows a failing hook's stderr to the client; keep it one line.
    if NOTED.messages:
        message += f" ({NOTED.messages[0]})"       # "hostd: dropped input: not JSON ..."
    print(_one_line(f"accelmig hook: {message}"), file=sys.stderr)


def main(argv=None, stdin=None, stdout=None) -> int:
    started = time.monotonic()
    root = logging.getLogger("accelmig")
    if NOTED not in root.handlers:
        root.addHandler(NOTED)
    NOTED.messages.clear()
    argv = sys.argv[1:] if argv is None else list(argv)
    stdin = stdin if stdin is not None else sys.stdin.buffer
    stdout = stdout if stdout is not None else sys.stdout
    # Always drain stdin: libvirt writes the XML whether we want it or not.
    try:
        xml = stdin.read()
    except OSError:
        xml = b""
    if len(argv) < 3:
        _log(f"expected DOMAIN OPERATION SUB-OPERATION [EXTRA], got {argv!r}; ignoring")
        return 0
    domain, operation, sub = argv[0], argv[1], argv[2]
    # Cheap filters first: hostd follows every other step through libvirt's
    # events, and most domains on a host are not ours.
    if (operation, sub) not in GATED_HOOK_STEPS:
        return 0
    # (a path or a kernel word may name accelmig in a domain nobody marked:
    # the model decides; this only skips the parse for most foreign domains)
    config = None
    if b"accelmig" not in xml:
        from accelmig.wire.errors import AccelmigError
        try:
            config = _load_config()
        except AccelmigError:
            return 0              # no config: no list of ours to be on
        if not _holds_sessions(xml, config):
            return 0
    try:
        return _run(domain, operation, sub, xml, started, stdout, config=config)
    except Exception as exc:
        _log(f"refusing {operation} of {domain}: internal error {type(exc).__name__}: {exc}")
        return 1


#: a domain's UUID, found without parsing its XML (most domains are not ours)
_UUID_ELEMENT = re.compile(rb"<uuid>\s*([0-9a-fA-F-]{36})\s*</uuid>")


def _load_config():
    from accelmig.plugin.config import HostConfig
    return HostConfig.load(os.environ.get("ACCELMIG_CONFIG"))


def _holds_sessions(xml: bytes, config) -> bool:
    """A domain with nothing of accelmig in its XML (Nova's) whose guest
    holds accelerator sessions: hostd keeps their UUIDs, learned from the
    pool, in ``accel-domains.json``, so this holds while hostd is down.
    A domain not listed, or no list to read, is not ours: it passes."""
    import json
    found = _UUID_ELEMENT.search(xml)
    if found is None:
        return False
    try:
        with open(config.hostd.accel_domains_file, "rb") as handle:
            listed = json.loads(handle.read(64 << 20)).get("domains") or []
    except (OSError, ValueError, AttributeError):
        return False
    return found.group(1).decode().lower() in listed


def _run(domain: str, operation: str, sub: str, xml: bytes, started: float, stdout, *, config=None) -> int:
    """``config``: loaded already when the domain was found on the list of
    those holding sessions (it is then known to be ours)."""
    from accelmig.plugin.domain.model import DomainXML, rewrite_for_host
    from accelmig.wire.localapi import LocalClient
    from accelmig.wire.errors import AccelmigError

    try:
        model = DomainXML.parse(xml)
    except AccelmigError as exc:
        _log(f"refusing {operation} of {domain}: its XML cannot be read: {exc}")
        return 1
    unmarked = not model.is_accelmig()
    if config is None:
        try:
            config = _load_config()
        except AccelmigError as exc:
            if unmarked:
                return 0          # no config: no list of ours to be on
            # Without a config there is no way to know this host's pool or
            # fabric: strict is the only safe default.
            _log(f"refusing {operation} of {domain}: {exc}")
            return 1
        if unmarked and not _holds_sessions(xml, config):
            return 0
    budget = config.hostd.hook_timeout
    client = LocalClient(config.hostd.socket, timeout=budget)

    rewritten, changes = None, []
    try:
        if not unmarked:      # what another system wrote (Nova's XML) is never rewritten
            rewritten, changes = rewrite_for_host(xml.decode("utf-8"), config.fabric)
    except AccelmigError as exc:
        if config.hostd.strict:
            _log(f"refusing {operation} of {domain} to host {config.host_id}: {exc}")
            return 1
        _log(f"{operation} of {domain}: the XML was not adapted to this host: {exc}")
    remaining = max(0.1, budget - (time.monotonic() - started))
    try:
        # the migration token the domain's host wrote into it: it came with the
        # migration, to this destination only, and vouches for it at the pool
        client.call("hook", timeout=remaining, op=operation, sub=sub, uuid=model.uuid, name=model.name,
                    changes=[str(c) for c in changes], budget=remaining * 0.8, token=model.migration_token())
    except AccelmigError as exc:
        if config.hostd.strict:
            _log(f"refusing {operation} of {domain} to host {config.host_id}: {exc} "
                 f"(strict mode: set [hostd] strict = false to migrate anyway and rehome later)")
            return 1
        _log(f"{operation} of {domain} goes ahead without accelmig (lenient mode): {exc}; "
             f"hostd will reconcile and rehome when it is back")
    if rewritten is not None:
        stdout.write(rewritten)
        stdout.flush()
    # A domain nobody marked gets no answer at all: libvirt then keeps the
    # caller's XML (Nova's destination XML) byte for byte, whereas any answer,
    # even the same bytes, is parsed again and taints the domain "hook-script"
    # (libvirt's qemu_migration.c, prepare).
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
