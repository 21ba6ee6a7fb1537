"""``accelmig hostd``: the host daemon, one per hypervisor host.

It follows libvirt's domain events, talks to the pool's control plane, and
is the only process that opens the guests' agent channels.  Its parts:

- ``events``: libvirt's lifecycle events as typed values, made once;
- ``libvirt``: the one libvirt connection (events, reconnection, calls);
- ``watch``: one domain's phase and the one table of how phases change;
- ``migration``: the steps of a migration on each side, and rehome retries;
- ``reconcile``: what hostd missed, and which records it vouches for;
- ``delivery``: how a rehome reaches the guest (its channel, or guest-exec);
- ``api`` / ``client``: the local API the hook and the CLI use;
- ``metrics``: its Prometheus metrics;
- ``daemon``: ``HostDaemon``, the parts put together.

Nothing is imported here: the hook imports ``client`` and must start fast.
"""
