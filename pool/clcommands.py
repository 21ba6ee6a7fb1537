"""The pool's side of data-plane protocol 3 (``wire.opencl``): the device
listing a connection may ask for before it opens, the new sequenced
commands on a session's worker, and profiled commands.

``pool.dataplane`` hands ``list_devices`` here; ``pool.session.execute``
hands the commands of ``dp.OPENCL_OPS`` (``execute``) and every command
with ``"prof": true`` (``profiled``). Everything the commands name is
checked by ``wire.opencl`` before, and by the device context against its
buffers (``pool.devices.clops``).
"""

from __future__ import annotations

import logging
import time

from accelmig.pool.devices import deviceinfo
from accelmig.pool.devices.clops import RectSpec
from accelmig.wire import opencl as wcl
from accelmig.wire.dataplane import Op
from accelmig.wire.errors import AuthFailed, OutOfRange

LOG = logging.getLogger(__name__)


# -- the device listing ---------------------------------------------------------------
def list_devices(pool, header: dict) -> dict:
    """``list_devices``' answer: every device of the node with its
    parameters, for a valid tenant token (``AUTH_FAILED`` otherwise)."""
    token = header.get("token")
    tenant = pool.tenants.get(token) if isinstance(token, str) else None
    if tenant is None:
        raise AuthFailed(reason="unknown tenant token")
    devices = []
    for device in pool.devices:
        if device.cl_params is None:
            # read once per device, on first asking (~100 runtime queries, ~1 ms)
            try:
                device.cl_params = deviceinfo.params_of_spec(device.info.get("spec", ""))
            except OSError as exc:        # no ICD loader in this process: no parameters
                LOG.warning("device %s: its OpenCL parameters cannot be read: %s", device.id, exc)
                device.cl_params = {}
        view = device.view()
        described = {key: view[key] for key in ("id", "type", "name", "vendor", "platform", "global_mem_size",
                                                 "max_mem_alloc_size")}
        described["cl"] = device.cl_params
        devices.append(described)
    return {"op": Op.DEVICES.value, "devices": devices}


# -- the new commands ----------------------------------------------------------------
def execute(session, command) -> tuple[dict, bytes]:
    """One of ``dp.OPENCL_OPS`` on the session's context: (reply fields, payload)."""
    ctx, h, op = session.context, command.header, command.op
    if op is Op.FILL:
        ctx.fill(h["buf"], h["offset"], h["size"], wcl.fill_pattern(h))
        return {}, b""
    if op is Op.WRITE_RECT:
        spec = RectSpec.of(wcl.rect(h, op.value))
        ctx.write_rect(h["buf"], spec, command.payload)
        session.counters.bytes_uploaded += len(command.payload)
        return {}, b""
    if op is Op.READ_RECT:
        spec = RectSpec.of(wcl.rect(h, op.value))
        # the range first: a read of a rectangle past a small buffer must not
        # cost a reply buffer the size it claims
        limit = ctx.buffer_size(h["buf"])
        if spec.extent > limit:
            raise OutOfRange(what=f"read_rect of buffer {h['buf']}", offset=spec.extent - spec.packed_size,
                             size=spec.packed_size, limit=limit)
        from accelmig.pool.session import refuse_oversized_read   # (that module imports this one)
        refuse_oversized_read(session, spec.packed_size)
        out = bytearray(spec.packed_size)
        ctx.read_rect(h["buf"], spec, out)
        session.counters.bytes_downloaded += len(out)
        return {}, out
    if op is Op.COPY_RECT:
        ctx.copy_rect(h["src"], h["dst"], RectSpec.of(wcl.rect(h, op.value, "src_")),
                      RectSpec.of(wcl.rect(h, op.value, "dst_")))
        return {}, b""
    if op is Op.ALLOC_SUB:
        from accelmig.pool.session import _check_object_limit     # (that module imports this one)
        _check_object_limit(session, "sub-buffer")
        ctx.alloc_sub(h["buf"], h["parent"], h["origin"], h["size"])
        session.objects += 1
        return {}, b""
    if op is Op.KERNEL_INFO:
        return {"kernel": ctx.kernel_info(h["prog"], h["kernel"])}, b""
    raise AssertionError(f"no protocol-3 executor for {op.value}")   # pragma: no cover


# -- profiling -----------------------------------------------------------------------
def profiled(session, command, run):
    """A command with ``"prof": true``: run alone (the queue drained before
    and after it), its reply with ``times`` [queued, submit, start, end] in
    ns of the pool's monotonic clock. ``run(command)``: the command's own
    execution (``pool.session.execute`` without profiling)."""
    from accelmig.pool.session import PendingReply   # (the session module imports this one)
    ctx = session.context
    queued = time.monotonic_ns()
    try:
        ctx.finish()
    except Exception:
        pass      # an earlier command's failure is its own reply's; this one runs all the same
    submitted = time.monotonic_ns()
    reply = run(command)
    if isinstance(reply, PendingReply):
        reply = reply.settle()
        if reply.header.get("ok"):
            session.counters.launches += 1
    if reply.header.get("ok"):
        try:
            ctx.finish()
        except Exception as exc:        # the command's own failure, found as it completed
            from accelmig.pool.session import _error_reply
            return _error_reply(session, command.seq, command.op, exc)
        reply.header["times"] = [queued, submitted, submitted, time.monotonic_ns()]
    return reply
