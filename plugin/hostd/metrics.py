"""hostd's Prometheus metrics (its own registry; HTTP when [hostd]
metrics_listen is set, and ``metrics`` on the local API)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from accelmig.plugin.hostd.watch import Phase


class HostMetrics:
    def __init__(self, daemon):
        self.registry = CollectorRegistry()
        r = self.registry
        self.rehomes = Counter("accelmig_host_rehomes_total", "Rehomes delivered to guests on this host",
                               ["result"], registry=r)
        self.rehome_seconds = Histogram("accelmig_host_rehome_seconds",
                                        "From the guest resuming here to every session resumed",
                                        buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30), registry=r)
        self.record_steps = Counter("accelmig_host_record_steps_total",
                                    "Migration record transitions this host asked for", ["step"], registry=r)
        self.hook_notes = Counter("accelmig_host_hook_notes_total", "libvirt hook notes received",
                                  ["operation"], registry=r)
        self.events = Counter("accelmig_host_libvirt_events_total", "libvirt lifecycle events of accelmig domains",
                              ["event"], registry=r)
        Gauge("accelmig_host_libvirt_connected", "1 while hostd's libvirt connection is up",
              registry=r).set_function(lambda: float(daemon.libvirt.conn is not None))
        Gauge("accelmig_host_libvirt_reconnects", "libvirt reconnections since start",
              registry=r).set_function(lambda: float(daemon.libvirt.reconnects))
        Gauge("accelmig_host_pool_reachable", "1 while the pool's control plane answers",
              registry=r).set_function(lambda: float(daemon.pool_reachable))
        domains = Gauge("accelmig_host_domains", "accelmig domains by phase", ["phase"], registry=r)
        for phase in Phase:
            domains.labels(phase.value).set_function(
                lambda phase=phase: float(sum(1 for w in daemon.watches if w.phase is phase)))
        Gauge("accelmig_host_foreign_domains", "other domains seen here (remembered by UUID only)",
              registry=r).set_function(lambda: float(daemon.watches.foreign_count))

    def text(self) -> str:
        return generate_latest(self.registry).decode()
