"""accelmig's fleet: deploy, check and watch every node of a deployment
over SSH (paramiko), from an inventory.

The operator's side, run from a workstation or an admin node: it installs
nothing there but itself (``pip install 'accelmig[fleet]'``) and reaches
the pool node and the hypervisor hosts as an OpenSSH client would, host
keys checked against ``known_hosts``.  On the nodes it runs the sides' own
commands (``accelmig install``, ``accelmig-pool install``, ``accelmig
doctor``, ``accelmig status``): nothing here re-implements them.

- :mod:`.inventory`: the inventory file (TOML) as a model, checked up front.
- :mod:`.render`: the configuration files each node gets, checked by the
  sides' own loaders before anything is sent.
- :mod:`.remote`: one SSH connection to one node (commands, files).
- :mod:`.remote_ops`: the small standard-library script that runs on a node
  for what no command there does (probe, compare-and-write a file).
- :mod:`.deploy`, :mod:`.checks`: ``fleet deploy``; ``fleet doctor`` and
  ``fleet status``.
"""
