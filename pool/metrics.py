"""Prometheus metrics of one pool (its own registry: several pools can live
in one process, as they do in tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from accelmig.wire.dataplane import Op


class PoolMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.sessions = Gauge("accelmig_sessions", "Sessions by state", ["state"], registry=r)
        self.commands = Counter("accelmig_commands_total", "Commands executed", ["op"], registry=r)
        self.bytes = Counter("accelmig_bytes_total", "Buffer bytes moved", ["direction"], registry=r)
        self.builds = Counter("accelmig_program_builds_total", "Programs built", registry=r)
        self.duplicates = Counter("accelmig_duplicate_commands_total",
                                  "Re-sent commands answered from the reply log", registry=r)
        self.resumes = Counter("accelmig_resumes_total", "Session resumes", ["result"], registry=r)
        self.migrations = Counter("accelmig_migrations_total", "Migration records by outcome",
                                  ["outcome"], registry=r)
        self.blackout = Histogram(
            "accelmig_blackout_seconds",
            "Accelerator blackout of a migrated session: from the pause (or switchover) to the resume",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)
        self.device_bytes = Gauge("accelmig_device_bytes", "Device memory allocated, per tenant",
                                  ["tenant"], registry=r)
        self.device_in_use = Gauge("accelmig_device_memory_in_use_bytes",
                                   "Device memory allocated by sessions, per device of the node",
                                   ["device", "type"], registry=r)
        self.device_sessions = Gauge("accelmig_device_sessions", "Live sessions placed on each device",
                                     ["device", "type"], registry=r)
        self._by_op: dict = {}
        self.refused_connections = Counter(
            "accelmig_refused_connections_total",
            "Connections (either plane) refused at accept: too many from their address not yet "
            "authenticated, or the pool full of authenticated ones", registry=r)
        self.evicted_connections = Counter(
            "accelmig_evicted_connections_total",
            "Unauthenticated connections closed to make room for a newcomer", registry=r)
        self.idle_connections = Counter(
            "accelmig_idle_connections_total",
            "Authenticated connections closed for sending nothing for idle_timeout", registry=r)
        self.connections = Gauge("accelmig_connections", "Open connections of both planes",
                                 ["state"], registry=r)
        self.frame_errors = Counter("accelmig_frame_errors_total", "Connections closed for bad frames",
                                    ["code"], registry=r)

    def _op_counter(self, op: Op):
        child = self._by_op.get(op)
        if child is None:      # labels() costs microseconds: once per op
            child = self._by_op[op] = self.commands.labels(op.value)
        return child

    def count_command(self, session, command, read_bytes: int) -> None:
        self._op_counter(command.op).inc()
        if command.op is Op.WRITE:
            self.bytes.labels("up").inc(len(command.payload))
        elif command.op is Op.READ:
            self.bytes.labels("down").inc(read_bytes)
        elif command.op in (Op.BUILD, Op.BUILD_BINARY):
            self.builds.inc()
        elif command.op is Op.ALLOC or command.op is Op.FREE:
            self.device_bytes.labels(session.tenant.name).set(session.tenant.used)

    def count_launches(self, count: int) -> None:
        """``count`` launches that ran (a run of them counted at once: a
        counter's lock per launch was 5 % of the pool's launch loop)."""
        self._op_counter(Op.LAUNCH).inc(count)

    def text(self) -> str:
        return generate_latest(self.registry).decode()
