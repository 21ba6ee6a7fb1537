"""One application process of the storm bench's guest: it opens sessions,
each registered with the guest agent, and answers the bench on stdin/stdout
(JSON lines).  Not a benchmark of its own: ``bench/storm.py`` starts a few.

    python -m bench.guest ENDPOINT TOKEN AGENT_SOCKET COUNT STATE_BYTES FIRST_TAG DOMAIN

(DOMAIN: the UUID its drivers say this guest is, as a VM's SMBIOS would
tell them: they prove their sessions for it and no other.)

It says ``{"ready": true}`` once started (its first connect made); then
commands (one per line on stdin), each answered with one JSON line:
``open`` (open COUNT sessions one after the other: their sids and each
``connect``'s seconds), ``check`` (read every session's state back: what
differs, and each session's resumes), ``close``.
"""

from __future__ import annotations

import json
import os
import sys
import time


def state_of(tag: int, size: int) -> bytes:
    word = tag.to_bytes(4, "little")
    return (word * (size // 4 + 1))[:size]


def main(argv: list[str]) -> int:
    endpoint, token, agent, count, size, first_tag = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4]), \
        int(argv[5])
    domain = argv[6]
    os.environ.setdefault("ACCELMIG_INSECURE", "1")
    from accelmig.agent.driver import connect
    devs, bufs = [], []

    def say(obj) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    # one session opened and closed first: the process's first connect pays
    # for imports and caches, not for the pool's population
    connect(endpoint, token, agent=agent, timeout=120, connect_timeout=30, domain=domain).close()
    say({"ready": True})
    for line in sys.stdin:
        command = line.strip()
        if command == "open":
            opened = []
            for k in range(count):
                started = time.perf_counter()
                dev = connect(endpoint, token, agent=agent, timeout=120, connect_timeout=30, domain=domain)
                opened.append(time.perf_counter() - started)
                devs.append(dev)
            # (the state after every open: an open is measured on its own)
            bufs += [dev.upload(state_of(first_tag + k, size)) for k, dev in enumerate(devs)]
            for dev in devs:
                dev.finish()
            # (connect returns once the session is registered with the agent)
            say({"sids": [d.sid for d in devs], "open_s": opened})
        elif command == "check":
            bad = [d.sid for k, (d, b) in enumerate(zip(devs, bufs))
                   if d.read(b) != state_of(first_tag + k, size)]
            say({"bad": bad, "resumes": [d.stats["resumes"] for d in devs]})
        elif command == "close":
            for dev in devs:
                dev.close()
            say({"closed": len(devs)})
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
