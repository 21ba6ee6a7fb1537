"""accelmig's user-space driver: what an application imports to compute on
a pooled accelerator.  Standard library only (numpy is welcome, not needed).

::

    from accelmig.agent.driver import connect, f32, i32

    with connect("10.88.0.1:7070", token) as dev:
        prog = dev.build(SOURCE)
        x = dev.upload(numpy_array)
        y = dev.alloc(x.size)
        prog.launch("saxpy", n, None, f32(2.0), x, y)
        result = dev.read(y)

The driver is stateful on purpose: it holds the session (its id and its
secret, which never leaves the guest), the handles, and every command not
yet answered.  That state lives in guest memory and moves with the VM, so
after a live migration ``resume()`` continues the session on a new
connection — from a new host — without losing or repeating any command.

This package is the façade; inside it:

- ``device``: ``Device``, ``Buffer``, ``Program``, ``connect`` (the API);
- ``args``: kernel-argument types (``Scalar``, ``LocalMemory``, ``i8`` … ``f64``);
- ``session``: the connection's state machine, resume, tickets, housekeeping;
- ``link``: the socket, corking, the reader, replies to the window;
- ``window``: the commands not yet answered, kept for replay;
- ``transfer``: writes and reads of any size, as chunks of one frame each;
- ``registry``: the driver's side of the guest agent's socket.
"""

from __future__ import annotations

from accelmig.agent.driver.args import LocalMemory, Scalar, f32, f64, i8, i16, i32, i64, u8, u16, u32, u64
from accelmig.agent.driver.device import Buffer, Device, Program, connect
from accelmig.agent.driver.session import LinkState

__all__ = ["connect", "Device", "Buffer", "Program", "Scalar", "LocalMemory", "LinkState",
           "i8", "u8", "i16", "u16", "i32", "u32", "i64", "u64", "f32", "f64"]
