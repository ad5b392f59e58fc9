"""A write to the federation state in etcd: read, decide, write, as one etcd transaction
that holds only if nothing it read has changed and this replica still leads.

A `Transaction` remembers the mod_revision of every key an attempt reads (0 for a key
that is not there) and buffers what it writes; a key written is read first, if the
attempt did not, so that its value is sealed for the version etcd will give it
(federation.etcd.kv.sealed_name) and the commit holds only if that is still so. `write`
commits it with one compare per
key read plus the leadership guard (federation.etcd.leadership): the compare-and-set
that BEGIN IMMEDIATE and WHERE clauses make in the SQLite state. When etcd refuses because
something read has changed, the attempt runs again on what is there now, so of two
writers that saw the same generation only one moves it (the other sees the move and
raises StaleJob). When it refuses because the leader key is no longer this replica's,
NotLeader, and nothing was written.

Records are JSON objects. A range read guards the keys it found, not the ones that
appear after it: each writer of a job's tokens also writes the job's record, which every
reader of them reads too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TypeVar

from slurm_geo.federation.model import StateUnavailable
from slurm_geo.federation.state.etcd.kv import ABSENT, At, EtcdKV, delete, modified_at
from slurm_geo.federation.state.etcd.leadership import WriteGuard
from slurm_geo.federation.state.etcd.records import Record, loads

T = TypeVar("T")

MAX_ATTEMPTS = 50
# etcd refuses a transaction of more than 128 compares or writes (--max-txn-ops).
MAX_TXN_OPS = 128


class Transaction:
    def __init__(self, kv: EtcdKV):
        self._kv = kv
        self.read_at: dict[str, int] = {}
        self.standing: dict[str, At] = {}  # where each key read stood in its history
        self.writes: dict[str, bytes | None] = {}  # None: delete

    def get(self, key: str) -> Record | None:
        if key in self.writes:
            written = self.writes[key]
            return None if written is None else loads(written)
        found = self._kv.get(key)
        if key not in self.read_at:
            self.read_at[key] = 0 if found is None else found.mod_revision
            self.standing[key] = ABSENT if found is None else found.at
        return None if found is None else loads(found.value)

    def range(self, prefix: str) -> list[tuple[str, Record]]:
        """Every record under `prefix`, in key order."""
        found = self._kv.range(prefix)
        for item in found:
            if item.key not in self.read_at:
                self.read_at[item.key] = item.mod_revision
                self.standing[item.key] = item.at
        return [(item.key, loads(item.value)) for item in found]

    def put(self, key: str, record: Record) -> None:
        if key not in self.read_at:
            self.get(key)  # its version, and a compare that it is still there
        self.writes[key] = json.dumps(record, sort_keys=True).encode()

    def delete(self, key: str) -> None:
        self.writes[key] = None


def confirm_leading(kv: EtcdKV, leadership: WriteGuard) -> None:
    """NotLeader unless etcd says, now, that the leader key is still this replica's: a
    transaction of the leadership guard alone, before an act etcd cannot guard (a fence
    in a store, a Slurm submission, a run key handed out). A bystander has nothing to
    confirm."""
    guard = leadership.guard()
    if guard is None:
        return
    outcome = kv.commit([guard], [], [leadership.read_leader()])
    if not outcome.succeeded:
        leadership.check_refusal(outcome.reads[0])


def write(kv: EtcdKV, leadership: WriteGuard, attempt: Callable[[Transaction], T]) -> T:
    """Run `attempt` until etcd takes what it wrote (or it writes nothing): its result.
    Whatever `attempt` raises (StaleJob...) leaves etcd as it was."""
    for _ in range(MAX_ATTEMPTS):
        guard = leadership.guard()  # NotLeader before anything is read for a write
        guards = [] if guard is None else [guard]
        tx = Transaction(kv)
        result = attempt(tx)
        if not tx.writes:
            return result
        if len(tx.read_at) + 1 > MAX_TXN_OPS or len(tx.writes) > MAX_TXN_OPS:
            raise ValueError(f"one etcd transaction holds at most {MAX_TXN_OPS} operations")
        outcome = kv.commit(
            [*guards, *(modified_at(key, at) for key, at in tx.read_at.items())],
            [kv.put(key, value, at=tx.standing[key]) if value is not None else delete(key)
             for key, value in tx.writes.items()],
            [leadership.read_leader()])
        if outcome.succeeded:
            return result
        leadership.check_refusal(outcome.reads[0])
    raise StateUnavailable(f"{MAX_ATTEMPTS} attempts in a row found what they read changed "
                           "by another writer before they could write")
