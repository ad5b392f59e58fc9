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
from slurm_geo.ckpt.format.keys import RandomBytes
from slurm_geo.ckpt.format.names import lock_name
from slurm_geo.ckpt.stores.store import Store

# Longer than any push; a lock older than this is a crashed writer's.
LOCK_TTL = timedelta(hours=6)
Clock = Callable[[], datetime]


@dataclass(frozen=True)
class Lock:
    name: str
    created_at: datetime | None  # None: unreadable (see `problem`)
    problem: str | None = None   # why it is no lock a writer wrote


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
            found.append(parse_lock(name, store.get(name)))
        except ObjectMissing:
            continue  # released while we listed
    return found


def parse_lock(name: str, body: bytes) -> Lock:
    """A lock as its body says. A writer puts its lock whole, in one atomic put, so one
    that does not parse, or carries no time with its zone, is no writer's: garbage, or
    planted, and reported as such (`problem`), never waited for."""
    try:
        created = datetime.fromisoformat(json.loads(body)["created_at"])
    except (ValueError, KeyError, TypeError) as exc:
        return Lock(name, None, f"its content is not a push lock's ({type(exc).__name__})")
    if created.tzinfo is None:
        return Lock(name, None, "its time has no time zone")
    return Lock(name, created)


def is_fresh(lock: Lock, now: datetime) -> bool:
    """Whether gc must wait for the lock's writer: a readable lock younger than `LOCK_TTL`.
    One dated further ahead than that is no writer's either (clocks are kept within
    seconds), lest a lock dated in the year 9999 hold gc off forever."""
    return lock.created_at is not None and abs(now - lock.created_at) < LOCK_TTL


def why_stale(lock: Lock, now: datetime) -> str:
    """One line saying why gc removes a lock that is not fresh."""
    if lock.created_at is None:
        return f"removed lock '{lock.name}': {lock.problem}, so no push wrote it"
    if lock.created_at > now:
        return (f"removed lock '{lock.name}': dated {lock.created_at.isoformat()}, more than "
                f"{LOCK_TTL} ahead of this clock, so no push wrote it")
    return (f"removed lock '{lock.name}': taken at {lock.created_at.isoformat()}, more than "
            f"{LOCK_TTL} ago, by a push that did not finish")
