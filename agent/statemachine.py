"""Explicit state machines for the guest side.

A machine holds one state and a table of the states each state may go to.
Every change goes through ``to()``, which raises ``IllegalTransition`` for a
change the table does not list: a state cannot drift where no one meant it
to go.  The driver's connection (``accelmig.agent.driver.session``) and the
agent's host channel (``accelmig.agent.daemon.channel``) are such machines.

A machine holds no lock: its owner serialises the changes (the driver under
its condition's lock, the agent on its polling thread).  Reading ``state``
needs no lock.
"""

from __future__ import annotations


class IllegalTransition(RuntimeError):
    """A state change the table does not allow: a bug in accelmig, never
    something a peer can cause (so it is no AccelmigError)."""


class StateMachine:
    #: every state -> the states it may go to (an empty set: final)
    TRANSITIONS: dict = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # A table that names a state it does not describe is wrong at import.
        for state, targets in cls.TRANSITIONS.items():
            unknown = set(targets) - set(cls.TRANSITIONS)
            if unknown:
                raise TypeError(f"{cls.__name__}: {state} may go to undescribed {sorted(map(str, unknown))}")

    def __init__(self, initial) -> None:
        if initial not in self.TRANSITIONS:
            raise ValueError(f"{type(self).__name__}: unknown state {initial!r}")
        self._state = initial

    @property
    def state(self):
        return self._state

    def allows(self, new) -> bool:
        return new in self.TRANSITIONS[self._state]

    def to(self, new):
        """Go to ``new``; returns the state left."""
        if not self.allows(new):
            raise IllegalTransition(f"{type(self).__name__}: {self._state.name} -> "
                                    f"{getattr(new, 'name', new)} is not a legal transition")
        old, self._state = self._state, new
        return old

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._state.name}>"
