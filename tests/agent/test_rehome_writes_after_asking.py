"""A rehome writes nothing until the guest's drivers have resumed: its log
lines and the identity's file come once they answered.  Right after a move under
TCG every kernel path a write takes (the console's tty and serial driver,
the file system's) is translated anew, on the accelerator's blackout path
(docs/DESIGN.md, the blackout's timeline: measured there).  The agent's
own ``identity`` is the new one already when the drivers are asked: a
driver's ``where`` then answers the new host."""

from __future__ import annotations

import logging
import os
import threading

from accelmig.agent.driver.registry import agent_connection
from accelmig.wire import channel as ch
from tests.support.wait import wait_for


def test_the_log_and_the_identity_file_are_written_once_the_drivers_resumed(agent, caplog):
    caplog.set_level(logging.INFO, logger="accelmig.agent.daemon.agent")
    seen = {}
    conn = agent_connection(agent.socket_path, timeout=10)
    try:
        conn.send({"type": "register", "id": conn.next_id(), "sid": "s-1", "endpoint": "10.0.0.1:7070"})
        assert conn.recv()["result"] == {"registered": "s-1"}

        def driver():
            # a driver: asked to resume, it looks at what the agent has written so far
            asked = conn.recv()
            seen["asked"] = asked.get("type")
            seen["logged"] = [r.getMessage() for r in caplog.records if "rehome m-1" in r.getMessage()]
            seen["file"] = os.path.exists(agent.identity_file)
            conn.send({"type": "where", "id": conn.next_id()})
            seen["where"] = conn.recv()["result"]["endpoint"]
            # and still nothing as it answers: the writes wait for every driver's answer
            seen["still"] = (any("rehome m-1" in r.getMessage() for r in caplog.records),
                             os.path.exists(agent.identity_file))
            conn.send(ch.result(asked["id"], result={"epoch": 2, "times": {"connected": 1.0}}))
        thread = threading.Thread(target=driver, daemon=True)
        thread.start()
        outcome = agent.rehome({"migration_id": "m-1", "tickets": {"s-1": "t-1"},
                                "identity": {"host_id": "hostB", "pool_endpoint": "10.0.0.2:7070"}})
        thread.join(10)
    finally:
        conn.close()
    assert outcome["ok"] and outcome["sessions"]["s-1"]["ok"]
    # when the driver was asked: nothing written yet, the new identity already the agent's
    assert seen == {"asked": "resume", "logged": [], "file": False, "where": "10.0.0.2:7070",
                    "still": (False, False)}
    # and afterwards both are there
    assert os.path.exists(agent.identity_file)
    wait_for(lambda: any("rehome m-1: host hostB, pool at 10.0.0.2:7070, 1 ticket(s)" in r.getMessage()
                         for r in caplog.records), what="the rehome's log line")
