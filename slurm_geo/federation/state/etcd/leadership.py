"""One leader among the federation daemons that share a state in etcd.

A replica leads while it holds the leader key (`<prefix>/leader`, its Replica as JSON),
bound to an etcd lease of `ttl_s` seconds. It wins the key only where there is none (a
transaction on create_revision == 0); the key's create_revision is then its *term*: every
write it makes compares the leader key's create_revision with its term
(federation.etcd.transaction), so once its lease has run out and another replica won the
key, etcd itself refuses the old leader's writes.

Timing (`next_step`, pure, on the replica's monotonic clock): the leader renews its lease
every third of the TTL and steps down once a whole TTL has passed since the last renewal
etcd answered was sent (etcd may have let the lease go from then on); a follower
campaigns every third of the TTL. With `[federation] leader_ttl_s`'s default 5 s a
follower leads at most about TTL + TTL/3 = 6.7 s after the leader stopped renewing.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from enum import Enum
from typing import Protocol

from slurm_geo.federation.model import NotLeader, Replica, StateUnavailable
from slurm_geo.federation.state.etcd.kv import ABSENT, EtcdKV, Found, Request, created_at, read
from slurm_geo.federation.state.etcd.layout import Layout
from slurm_geo.federation.state.etcd.version import LayoutTooNew, check_layout, settle_layout

log = logging.getLogger(__name__)

RENEWALS_PER_TTL = 3


class Step(Enum):
    CAMPAIGN = "campaign"
    KEEPALIVE = "keepalive"
    STEP_DOWN = "step down"
    WAIT = "wait"


@dataclass(frozen=True)
class Standing:
    """What a replica knows of its own leadership. `renewed_at`: when the campaign it won,
    or the last keepalive etcd answered, was sent; `tried_at`: its last campaign."""

    leading: bool = False
    renewed_at: float = 0.0
    tried_at: float | None = None


def next_step(standing: Standing, now: float, ttl_s: float) -> Step:
    interval = ttl_s / RENEWALS_PER_TTL
    if standing.leading:
        if now >= standing.renewed_at + ttl_s:
            return Step.STEP_DOWN
        # A keepalive that failed left renewed_at alone: the next tick tries again.
        return Step.KEEPALIVE if now >= standing.renewed_at + interval else Step.WAIT
    if standing.tried_at is None or now >= standing.tried_at + interval:
        return Step.CAMPAIGN
    return Step.WAIT


def replica_from_json(value: bytes) -> Replica:
    fields = json.loads(value)
    return Replica(str(fields["name"]), str(fields["site"]), str(fields["url"]))


class WriteGuard(Protocol):
    """What a write to the state in etcd carries besides its own compares
    (federation.etcd.transaction): `guard`, the compare that it holds only while its
    writer leads (None: a writer that leads nothing), and how a refusal is read."""

    me: Replica

    def guard(self) -> Request | None: ...

    def read_leader(self) -> Request: ...

    def check_refusal(self, leader_key: list[Found]) -> None: ...


class Leadership:
    """This replica's campaign for the leader key. Thread-safe: the daemon's threads ask
    `is_leader` and `guard` while `run` (or the caller's own loop of `tick`) keeps the
    lease."""

    def __init__(self, kv: EtcdKV, layout: Layout, me: Replica, *,
                 ttl_s: int, clock: Callable[[], float] = time.monotonic):
        self.kv, self.key, self.me = kv, layout.leader, me
        self.layout = layout
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._standing = Standing()
        self.lease: int | None = None
        self.term: int | None = None  # the leader key's create_revision while we hold it

    def leader(self) -> Replica | None:
        """Who leads, as etcd says now (any replica may ask: followers redirect there)."""
        found = self.kv.get(self.key)
        return None if found is None else replica_from_json(found.value)

    def is_leader(self) -> bool:
        with self._lock:
            return self._leading()

    def current_term(self) -> int | None:
        """The term this replica leads in now; None while it does not lead."""
        with self._lock:
            return self.term if self._leading() else None

    def _leading(self) -> bool:
        return self._standing.leading and next_step(
            self._standing, self._clock(), self.ttl_s) is not Step.STEP_DOWN

    def campaign(self) -> bool:
        """Take the leader key if nobody holds it; True if this replica leads now."""
        if self.is_leader():
            return True
        sent = self._clock()
        with self._lock:
            self._standing = replace(self._standing, tried_at=sent)
        if self.kv.get(self.key) is not None or self._layout_too_new():
            return False
        lease = self.kv.grant(self.ttl_s)
        outcome = self.kv.commit([created_at(self.key, 0)],
                                 [self.kv.put(self.key, json.dumps(asdict(self.me)).encode(),
                                              lease, at=ABSENT)], [])
        if not outcome.succeeded:
            self.kv.revoke(lease)
            return False
        with self._lock:
            self.lease, self.term = lease, outcome.revision
            self._standing = Standing(True, renewed_at=sent, tried_at=sent)
        try:  # the new leader writes the layout's version, or migrates an older one
            settle_layout(self.kv, self.layout, created_at(self.key, outcome.revision))
        except LayoutTooNew as exc:  # a newer replica wrote it since the check above
            log.error("%s", exc)
            self.resign()
            return False
        return True

    def _layout_too_new(self) -> bool:
        """A state a newer slurm-geo laid out is never led by this one (one line each
        campaign: the replica stays a follower until it is upgraded)."""
        try:
            check_layout(self.kv, self.layout)
        except LayoutTooNew as exc:
            log.error("%s", exc)
            return True
        return False

    def keepalive(self) -> bool:
        """Renew the lease; False (and no longer leading) when etcd has let it go."""
        with self._lock:
            lease = self.lease if self._standing.leading else None
        if lease is None:
            return False
        sent = self._clock()
        if self.kv.keepalive(lease) == 0:
            self._forget(lease)
            return False
        with self._lock:
            if self.lease == lease:
                self._standing = replace(self._standing, renewed_at=sent)
        return True

    def resign(self) -> None:
        """Give the key up now (revoking the lease deletes it): a follower need not wait
        for the TTL."""
        with self._lock:
            lease = self.lease
        if lease is not None:
            self._forget(lease)
            self.kv.revoke(lease)

    def tick(self) -> Step:
        """One round of `next_step`, applied; etcd not answering counts as a failed try."""
        with self._lock:
            step = next_step(self._standing, self._clock(), self.ttl_s)
        try:
            if step is Step.CAMPAIGN:
                self.campaign()
            elif step is Step.KEEPALIVE:
                self.keepalive()
            elif step is Step.STEP_DOWN:
                self.resign()
        except StateUnavailable:
            pass  # the lease runs out on its own; the next tick tries again
        return step

    def run(self, stop: threading.Event) -> None:
        """Tick ten times a renewal interval until `stop` is set (a daemon's thread)."""
        while not stop.is_set():
            self.tick()
            stop.wait(self.ttl_s / RENEWALS_PER_TTL / 10)

    # --- what transactions need --------------------------------------------------------

    def guard(self) -> Request:
        """The compare every write carries: the leader key is still the one we created.
        NotLeader, naming who leads, when this replica does not think it leads."""
        with self._lock:
            term = self.term if self._leading() else None
        if term is None:
            raise NotLeader(self.me.name, self.leader())
        return created_at(self.key, term)

    def read_leader(self) -> Request:
        """The read a refused write's failure branch makes, for `check_refusal`."""
        return read(self.key)

    def check_refusal(self, leader_key: list[Found]) -> None:
        """etcd refused a write: NotLeader if it was for the leader key (another replica
        holds it now, or nobody), so this replica stops leading at once."""
        with self._lock:
            term, lease = self.term, self.lease
        if term is not None and leader_key and leader_key[0].create_revision == term:
            return
        if lease is not None:
            self._forget(lease)
        raise NotLeader(self.me.name, replica_from_json(leader_key[0].value)
                        if leader_key else None)

    def _forget(self, lease: int) -> None:
        with self._lock:
            if self.lease == lease:
                self._standing = Standing(tried_at=self._standing.tried_at)
                self.lease = self.term = None


class Bystander:
    """A writer that leads nothing: a person's command (`slurm-geo cancel`, `approve`,
    `resubmit`) on the state in etcd. Its writes hold by their own compare-and-set on
    what they read, whoever leads, as the commands' writes to the SQLite state do beside
    the daemon: a command and the leader that change one job make one change each, the
    second decided again on the first."""

    def __init__(self, layout: Layout, me: Replica):
        self.key, self.me = layout.leader, me

    def guard(self) -> Request | None:
        return None

    def read_leader(self) -> Request:
        return read(self.key)

    def check_refusal(self, leader_key: list[Found]) -> None:
        """Something read changed meanwhile: the write is decided again on what is there."""
