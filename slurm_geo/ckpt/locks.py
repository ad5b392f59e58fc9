"""Push locks (docs/format.md §8.1): what keeps garbage collection off packs in flight.

A writer puts `locks/<token>` before its first pack and deletes it after its manifest;
gc refuses to delete anything while a lock younger than `LOCK_TTL` exists. Locks are not
secret (they name a host, a pid and a time), so they are plain JSON.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta

from slurm_geo.ckpt.errors import ObjectMissing
from slurm_geo.ckpt.keys import RandomBytes
from slurm_geo.ckpt.names import lock_name
from slurm_geo.ckpt.store import Store

# Longer than any push; a lock older than this is a crashed writer's.
LOCK_TTL = timedelta(hours=6)
Clock = Callable[[], datetime]


@dataclass(frozen=True)
class Lock:
    name: str
    created_at: datetime | None  # None: unreadable, so treated as fresh


@contextmanager
def push_lock(store: Store, random_bytes: RandomBytes, clock: Clock) -> Iterator[str]:
    name = lock_name(random_bytes(16).hex())
    body = {"created_at": clock().isoformat(), "host": socket.gethostname(), "pid": os.getpid()}
    store.put(name, json.dumps(body).encode())
    try:
        yield name
    finally:
        store.delete(name)


def locks(store: Store) -> list[Lock]:
    found = []
    for name in store.list("locks/"):
        try:
            created = json.loads(store.get(name))["created_at"]
            found.append(Lock(name, datetime.fromisoformat(created)))
        except ObjectMissing:
            continue  # released while we listed
        except (ValueError, KeyError, TypeError):
            found.append(Lock(name, None))
    return found


def is_fresh(lock: Lock, now: datetime) -> bool:
    return lock.created_at is None or now - lock.created_at < LOCK_TTL
