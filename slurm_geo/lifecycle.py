"""A lifecycle: one enum's states, the table of transitions allowed between them, checked
on every change, with an error that names the refused one.

Three records have one: a replica of checkpoint-sync (slurm_geo.sync.state), a logical job
of the federation (slurm_geo.federation.model) and an incarnation in a cluster's job
registry (slurm_geo.registry.db). Each keeps its states, its table and its error (their
exit codes and wording differ); this is the mechanism they share. A table must name every
state, a final one with no way out included, so that a state added to the enum and
forgotten in the table fails when the module is imported, not at the first change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from enum import Enum
from types import MappingProxyType
from typing import Generic, TypeVar

S = TypeVar("S", bound=Enum)
K = TypeVar("K")  # what names the record in the error: a replica id, a job's name


class Lifecycle(Generic[S, K]):
    """`allowed[a]`: the states a record in state `a` may move to. `refused(key, a, b)`
    builds the error `check` raises for a move `a -> b` the table does not allow."""

    def __init__(self, states: type[S], allowed: Mapping[S, Iterable[S]],
                 refused: Callable[[K, S, S], Exception]) -> None:
        missing = [s.name for s in states if s not in allowed]
        if missing:
            raise ValueError(f"the {states.__name__} lifecycle names no transitions out of "
                             f"{', '.join(missing)}")
        self.states = states
        self.allowed: Mapping[S, frozenset[S]] = MappingProxyType(
            {s: frozenset(allowed[s]) for s in states})
        self._refused = refused

    def allows(self, current: S, wanted: S) -> bool:
        return wanted in self.allowed[current]

    def check(self, key: K, current: S, wanted: S) -> None:
        """Raise the lifecycle's error, naming `key`, `current` and `wanted`, unless the
        table allows `current -> wanted`."""
        if not self.allows(current, wanted):
            raise self._refused(key, current, wanted)
