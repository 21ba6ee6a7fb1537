"""This pool node joining the pool's cluster: what ``accelmig-pool serve
--cluster etcds://...`` (or plain ``etcd://``) adds to a single node (its registration and its part
of the quota ledger), and nothing else."""

from __future__ import annotations

import ipaddress
import logging
import socket

from accelmig.pool.cluster.keys import check_name
from accelmig.pool.cluster.placement import Placement
from accelmig.pool.cluster.quotas import QuotaLedger
from accelmig.pool.cluster.records import EtcdRecords
from accelmig.pool.cluster.registry import NodeRegistration, NodeView, device_summary
from accelmig.pool.cluster.store import ClusterStore
from accelmig.pool.ledger.cluster import EtcdFollower
from accelmig.wire.dataplane import parse_endpoint
from accelmig.wire.errors import ConfigInvalid

LOG = logging.getLogger("accelmig.pool.cluster")


class ClusterNode:
    def __init__(self, store: ClusterStore, registration: NodeRegistration, ledger: QuotaLedger):
        self.store, self.registration, self.ledger = store, registration, ledger

    @property
    def name(self) -> str:
        return self.registration.view.name

    @classmethod
    def join(cls, config, server, store: ClusterStore | None = None) -> "ClusterNode":
        """Register ``server`` (started: its endpoints are known) in etcd
        (``store``: the one ``serve`` probed before listening).  Blocking:
        run it off the pool's loop."""
        pool = server.pool
        try:
            name = check_name(config.node_name or socket.gethostname().split(".")[0], "node_name")
        except ValueError as exc:
            raise ConfigInvalid(source="node_name", reason=str(exc)) from None
        data = config.cluster_advertise or server.endpoints["data"]
        host, _ = parse_endpoint(data)
        if _is_address(host) and ipaddress.ip_address(host).is_unspecified:
            raise ConfigInvalid(source="cluster_advertise", reason=(
                f"the data plane listens on {data}, which no driver can dial: give cluster_advertise "
                f"(--cluster-advertise HOST:PORT), the address drivers reach this node at"))
        store = store or ClusterStore.from_config(config)
        # every device the node serves: placement picks a node one of whose devices fits
        view = NodeView(name=name, instance=pool.instance, data=data,
                        control=server.endpoints.get("control"),
                        devices=tuple(device_summary(d) for d in pool.devices.describe()), sessions=0)
        ledger = QuotaLedger(store, name)
        # read from the lease thread: the devices' counters are plain ints
        registration = NodeRegistration(store, view, int(config.cluster_ttl),
                                        load=pool.live_session_count,
                                        on_lease=ledger.follow_lease)
        registration.start()
        # tenants' device memory counts pool-wide from now on (joined before ready: none is held yet)
        pool.quota_ledger = ledger
        for tenant in list(pool.tenants.values()):
            tenant.ledger = ledger
        pool.placement = Placement(store, view)     # opens are placed from now on
        # migration records follow etcd's from now on
        pool.ledger.follow(EtcdFollower(EtcdRecords(store, name), loop=pool.loop))
        return cls(store, registration, ledger)

    def leave(self) -> None:
        self.registration.stop()          # its reservations go with its lease
        self.ledger.close()


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
