"""Many pool nodes as one pool, on etcd (docs/DESIGN.md, "Pool: many nodes").

``store`` (the bounded etcd client), ``registry`` (this node under a lease),
``quotas`` (tenant quotas across nodes), ``placement`` (which live node a new
session goes to).  Imported only when ``cluster`` is configured: a single node
needs neither etcd nor its client.
"""
