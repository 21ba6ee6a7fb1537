"""What every side's process runs on: its command line, logs, systemd unit,
owned sockets, retries, files, state machines and dispatch tables.

- ``accelmig.runtime.cli``: the ``accelmig`` and ``accelmig-pool`` entry
  points (they tell an install without its extra what to install);
- ``accelmig.runtime.logs``: one logging setup for every daemon;
- ``accelmig.runtime.units``: systemd units and sysusers files, rendered;
- ``accelmig.runtime.sockets``: unix sockets a daemon owns (stale ones
  reclaimed, live ones refused);
- ``accelmig.runtime.backoff``: retry with capped, jittered backoff;
- ``accelmig.runtime.files``: the one atomic file write and the one TOML
  loader (a bad file is ``ConfigInvalid``);
- ``accelmig.runtime.statemachine``: the one way to write a state machine
  (named states, a class-level transition table, checked at import);
- ``accelmig.runtime.dispatch``: the one way to route a message by its kind
  (a table checked at class creation against the contract's kinds).

Standard library only, Python 3.9: it ships in the guest bundle beside
``accelmig.wire``.  It may import ``accelmig.wire`` (its errors); ``wire``,
which holds the contracts between sides only, never imports it.
"""
