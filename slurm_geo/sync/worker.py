"""One replication attempt: copy a checkpoint to the destination, verified as written.

The copy is `copy_checkpoint` (key, missing packs, manifest, latest pointer, in the order
of docs/format.md §8); packs already at the destination are skipped, and an S3 multipart
put resumes the parts an interrupted one left. Each object put is checked against the
digest the destination keeps of it, so the replica is verified without being read back
(docs/checkpoint-sync.md, "What verified proves"), and a verification record is left next
to it for the federation daemon's moves (slurm_geo.ckpt.ops.verified). Each status change is
written as it happens, so a kill at any point leaves the state one step behind the truth,
never ahead of it.

Stores are wrapped by `slurm_geo.ckpt.stores.open_store.paced`: a token bucket caps the bytes
sent to (and read from) the destination, and before every object the attempt's
`Guard` checks whether it must stop (SIGTERM) or has run out of time. The copy puts up to
`Route.streams` packs at once, from threads of its own: what they put is queued and
written to the state database by the attempt's thread, whose connection it is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import TypeVar

from slurm_geo.ckpt.errors import CkptError, CorruptObject, StoreUnavailable
from slurm_geo.ckpt.format.keys import MasterKeys
from slurm_geo.ckpt.format.manifest import with_bases
from slurm_geo.ckpt.format.names import PACK_PREFIXES, key_name, manifest_name, promoted_name
from slurm_geo.ckpt.ops.replicate import CopyReport, DamagedAtSource, copy_checkpoint
from slurm_geo.ckpt.ops.verified import record_of, write_record
from slurm_geo.ckpt.repo.repository import Repository
from slurm_geo.ckpt.stores.open_store import paced
from slurm_geo.ckpt.stores.pacing import TokenBucket
from slurm_geo.ckpt.stores.retry import is_permanent
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.daemon.events import event
from slurm_geo.sync.planner import retry_delay_s
from slurm_geo.sync.scrub_remote import scrub_here_report
from slurm_geo.sync.state import Replica, StaleStatus, StateDB, Status
from slurm_geo.sync.transfers import TransferLog

log = logging.getLogger("slurm_geo.sync")
T = TypeVar("T")


class Interrupted(Exception):
    """The daemon is stopping: the attempt ends before its next object."""


class AttemptTimedOut(Exception):
    """The attempt ran past its timeout."""


class Guard:
    """Answers "may the attempt go on?" before each object, and sleeps interruptibly."""

    def __init__(self, stop: threading.Event, deadline: float,
                 monotonic: Callable[[], float] = time.monotonic):
        self.stop = stop
        self.deadline = deadline
        self._monotonic = monotonic

    def check(self) -> None:
        if self.stop.is_set():
            raise Interrupted()
        if self._monotonic() > self.deadline:
            raise AttemptTimedOut()

    def sleep(self, seconds: float) -> None:
        self.stop.wait(max(0.0, min(seconds, self.deadline - self._monotonic())))
        self.check()


@dataclass(frozen=True)
class Route:
    """Where a replica's checkpoint comes from and goes to, and how many packs go at once
    (the link's TransferPlan)."""

    root: str
    root_store: Store
    root_region: str
    destination: str
    destination_store: Store
    destination_region: str
    streams: int = 1
    scrub_at: str = "here"  # [sync] scrub_at: "destination" reads scrub-here's report


@dataclass(frozen=True)
class Limits:
    """How often and how long a replica is tried ([sync]: max_attempts, attempt_timeout_s,
    retry_base_s, retry_max_s), the retries backing off from the base to the max."""

    max_attempts: int = 5
    timeout_s: float = 1800.0
    retry_base_s: float = 30.0
    retry_max_s: float = 900.0


class Outcome(Enum):
    VERIFIED = "verified"
    SCRUBBED = "scrubbed"        # re-read by the scrub, and sound
    CORRUPTED = "corrupted"
    OUTAGE = "outage"            # a store was unreachable: try again when it is back
    RETRY = "retry"              # failed; tried again after a backoff
    STALE = "stale"              # the scrub report is no news: looked at again later
    FAILED = "failed"            # failed, and no attempts are left
    INTERRUPTED = "interrupted"  # the daemon is stopping


@dataclass(frozen=True)
class Result:
    replica_id: int
    outcome: Outcome
    detail: str = ""
    side: str = ""  # for an outage: "root" or "destination"
    bytes_read: int = 0  # from the destination, by verification or the scrub


class Attempt:
    """One attempt on one replica, in the calling thread, writing through `state`."""

    def __init__(self, state: StateDB, master_keys: MasterKeys, route: Route, guard: Guard,
                 bucket: TokenBucket, limits: Limits, clock: Callable[[], float] = time.time):
        self._state = state
        self._keys = master_keys
        self._route = route
        self._guard = guard
        self._limits = limits
        self._clock = clock
        self._transfers = TransferLog(state, route, clock)
        self._source = paced(route.root_store, "root", guard=guard, clock=clock)
        self._destination = paced(route.destination_store, "destination", bucket, guard=guard,
                                  on_put=self._transfers.put, clock=clock)
        self._replica: Replica | None = None
        self._copy_started = 0.0

    def run(self, replica: Replica) -> Result:
        """Copy (when UPLOADING) and verify (always) `replica`; never raises."""
        self._replica = replica
        try:
            return self._run(replica)
        finally:
            self._write_transfers()

    def _run(self, replica: Replica) -> Result:
        try:
            report = self._copy(replica)
            replica = self._state.replica(replica.id)
            return self._verify(replica, report)
        except Interrupted:
            return self._interrupted(replica)
        except AttemptTimedOut:
            return self._failed(replica, f"timed out after {self._limits.timeout_s:g} s")
        except StoreUnavailable as exc:
            if is_permanent(exc):
                return self._failed(replica, str(exc))
            return self._outage(replica, str(exc), exc.side or "destination")
        except DamagedAtSource as exc:
            return self._corrupted(replica, str(exc))
        except CorruptObject as exc:  # a put the destination holds otherwise: never counted
            return self._failed(replica, str(exc), corrupted=True)
        except CkptError as exc:
            return self._failed(replica, str(exc))
        except Exception as exc:  # a bug must cost one attempt, not the daemon
            log.exception("event=attempt_crashed run=%s step=%d", replica.run, replica.step)
            return self._failed(replica, f"{type(exc).__name__}: {exc}")

    def scrub(self, replica: Replica) -> Result:
        """Re-read the VERIFIED `replica` whole; on damage mark it (and the verified
        replicas of its run sharing a damaged pack) CORRUPTED and queue each again while
        the source still has it. Never raises; a failed scrub changes no status."""
        self._replica = replica
        try:
            return self._scrub(replica)
        except Interrupted:
            return Result(replica.id, Outcome.INTERRUPTED)
        except StoreUnavailable as exc:
            return Result(replica.id, Outcome.OUTAGE, str(exc), exc.side or "destination")
        except (AttemptTimedOut, CkptError, StaleStatus) as exc:
            event(log, "scrub_failed", logging.WARNING, run=replica.run, step=replica.step,
                  destination=replica.destination, error=exc or type(exc).__name__)
            return Result(replica.id, Outcome.RETRY, str(exc))
        finally:
            self._write_transfers()

    def _scrub(self, replica: Replica) -> Result:
        now = self._clock()
        replica_repo, faults, checked_at, stale = scrub_here_report(
            self._state, self._destination, self._keys, replica, self._record_read, self._clock
        ) if self._route.scrub_at == "destination" else (*self._read_back(replica), now, None)
        read = self._destination.bytes_read
        if stale and not faults:  # scrub-here has not run since the replica's last check
            return Result(replica.id, Outcome.STALE, stale, bytes_read=read)
        scrubbed = {"scrubbed_at": checked_at, "scrubbed_bytes": ("+", read)}
        if not faults:
            self._state.update(replica.id, Status.VERIFIED, now, **scrubbed)
            event(log, "scrubbed", run=replica.run, step=replica.step,
                  destination=replica.destination, bytes=read)
            return Result(replica.id, Outcome.SCRUBBED, bytes_read=read)
        damaged = {f.name for f in faults}
        sharing = [r for r in self._state.replicas(
            "run = ? AND destination = ? AND status = ? AND id != ?",
            [replica.run, replica.destination, Status.VERIFIED.value, replica.id])
            if self._needs_any(replica_repo, r, damaged)]
        detail = "; ".join(str(f) for f in faults[:3])
        self._drop_damaged(faults)
        for found in [replica, *sharing]:
            self._destination.delete(manifest_name(found.run, found.step))
            self._state.move(found.id, Status.VERIFIED, Status.CORRUPTED, now,
                             corruptions=("+", 1), scrub_findings=("+", 1), last_error=detail,
                             **(scrubbed if found is replica else {}))
            event(log, "scrub_corrupted", logging.ERROR, run=found.run, step=found.step,
                  destination=found.destination, error=detail)
        for found in [replica, *sharing]:  # once none of them counts as verified
            self._repoint_latest(found, replica_repo)
            self._repair(found)
        return Result(replica.id, Outcome.CORRUPTED, detail, bytes_read=read)

    def _needs_any(self, replica_repo: Repository, other: Replica, names: set[str]) -> bool:
        """Whether `other`'s checkpoint at the destination reads one of the objects `names`."""
        try:
            manifest = replica_repo.manifest(other.run, other.step)
        except StoreUnavailable:
            raise
        except CkptError:
            return True  # its manifest is damaged too: it needs repair as well
        needed = {manifest.pack_object(r.pack) for r in with_bases(manifest.refs())}
        return bool(needed & names) or key_name(other.run) in names

    def _repair(self, replica: Replica) -> None:
        """Queue a corrupted replica again, fresh attempts and all, while its source still
        holds the checkpoint (an unreachable source is taken to: the planner skips the
        replica if the next scan does not find it)."""
        try:
            held = self._source.exists(manifest_name(replica.run, replica.step))
        except StoreUnavailable:
            held = True
        if not held:
            event(log, "unrepairable", logging.ERROR, run=replica.run, step=replica.step,
                  destination=replica.destination, reason="the source no longer has it")
            return
        now = self._clock()
        self._state.move(replica.id, Status.CORRUPTED, Status.PENDING, now, charged=0,
                         next_attempt_at=now, repairing=1)
        event(log, "repairing", logging.WARNING, run=replica.run, step=replica.step,
              destination=replica.destination)

    # --- copy and verify ----------------------------------------------------------------

    def _copy(self, replica: Replica) -> CopyReport:
        """Copy the checkpoint, verified as written (slurm_geo.ckpt.ops.replicate): each object
        put is checked against the digest the destination then keeps, none is read back. A
        replica found REPLICATED (the daemon stopped before it was marked verified) is
        copied again: what is there already costs a digest's comparison, not a transfer."""
        source = Repository(self._source, self._keys)
        self._copy_started = self._clock()
        self._destination.bytes_read = 0
        try:
            report = copy_checkpoint(source, self._source, self._destination, replica.run,
                                     replica.step, on_pack=lambda _d, _n: self._write_transfers(),
                                     streams=self._route.streams)
        finally:
            self._write_transfers()  # what was put before a failure was sent all the same
        if replica.status is not Status.UPLOADING:
            return report
        now = self._clock()
        moved = self._state.transferred_bytes(replica.id)
        self._state.move(replica.id, Status.UPLOADING, Status.REPLICATED, now,
                         replicated_at=now, bytes=moved)
        event(log, "replicated", run=replica.run, step=replica.step,
              destination=replica.destination, packs_copied=report.packs_copied,
              packs_present=report.packs_present, bytes=report.bytes_copied)
        return report

    def _verify(self, replica: Replica, report: CopyReport) -> Result:
        """Mark the replica verified from its copy's checks, and leave the verification
        record next to it (slurm_geo.ckpt.ops.verified) for any daemon that later moves the
        run there: the record, not a read, is what a move trusts."""
        if report.bytes_read_back:  # a destination that keeps no digests
            self._record_read(self._copy_started)
        self._carry_promotion(replica)
        now = self._clock()
        write_record(Repository(self._destination, self._keys),
                     record_of(report, now, "checkpoint-sync"))
        created = _timestamp(report.created_at) or replica.discovered_at
        repaired = {"repairs": ("+", 1), "repairing": 0} if replica.repairing else {}
        self._state.move(replica.id, Status.REPLICATED, Status.VERIFIED, now, verified_at=now,
                         created_at=created, lag_s=max(0.0, now - created),
                         manifest_sha256=report.manifest_sha256, last_error=None, **repaired)
        event(log, "verified", run=replica.run, step=replica.step,
              destination=replica.destination, lag_s=round(max(0.0, now - created), 3),
              read_back=report.bytes_read_back)
        return Result(replica.id, Outcome.VERIFIED)

    def _carry_promotion(self, replica: Replica) -> None:
        """Tier 3 holds off-site too: a promoted checkpoint's marker follows its replica,
        once it opens under the promotion key and names the checkpoint (a marker that is
        there but does not open fails the attempt, naming it)."""
        name = promoted_name(replica.run, replica.step)
        if not Repository(self._source, self._keys).is_promoted(replica.run, replica.step):
            return
        sealed = self._source.get(name)
        # A marker already there may be a version 1 one or a job's: the good one replaces it.
        if not self._destination.exists(name) or self._destination.get(name) != sealed:
            self._destination.put(name, sealed)

    def _corrupted(self, replica: Replica, detail: str) -> Result:
        """The checkpoint is damaged at its source: nothing of it reached the destination
        past the damage, and no retry can mend it (`sync retry` once it is restored)."""
        current = self._state.replica(replica.id)
        self._state.move(replica.id, current.status, Status.CORRUPTED, self._clock(),
                         corruptions=("+", 1), last_error=detail)
        event(log, "corrupted", logging.ERROR, run=replica.run, step=replica.step,
              destination=replica.destination, faults=1, error=detail)
        return Result(replica.id, Outcome.CORRUPTED, detail)

    def _drop_damaged(self, faults: list[CkptError]) -> None:
        """Delete damaged packs and keys, so that the next copy puts good ones in place."""
        for fault in faults:
            if isinstance(fault, CorruptObject) and \
                    fault.name.startswith((*PACK_PREFIXES, "keys/")):
                self._destination.delete(fault.name)

    def _repoint_latest(self, replica: Replica, replica_repo: Repository) -> None:
        try:
            latest = replica_repo.latest(replica.run)
        except StoreUnavailable:
            raise
        except CkptError:
            latest = replica.step  # an unreadable pointer goes too
        if latest != replica.step:
            return
        fallback = self._state.newest_verified(replica.run, replica.destination)
        if fallback is not None and fallback != replica.step:
            replica_repo.point_latest(replica.run, fallback)
        else:
            self._destination.delete(f"latest/{replica.run}")

    # --- failures -----------------------------------------------------------------------

    def _interrupted(self, replica: Replica) -> Result:
        current = self._state.replica(replica.id)
        if current.status is Status.UPLOADING:
            self._state.move(replica.id, Status.UPLOADING, Status.PENDING, self._clock(),
                             next_attempt_at=self._clock())
        event(log, "interrupted", run=replica.run, step=replica.step,
              destination=replica.destination)
        return Result(replica.id, Outcome.INTERRUPTED)

    def _outage(self, replica: Replica, detail: str, side: str) -> Result:
        """An unreachable store costs no attempt: the replica waits for it to return (the
        daemon backs off from an unreachable destination as a whole)."""
        current = self._state.replica(replica.id)
        now = self._clock()
        retry_at = now if side == "destination" else now + self._limits.retry_base_s
        changes = {"outages": ("+", 1), "last_error": detail, "next_attempt_at": retry_at}
        if current.status is Status.UPLOADING:
            self._state.move(replica.id, Status.UPLOADING, Status.PENDING, now, **changes)
        else:
            self._state.update(replica.id, current.status, now, **changes)
        return Result(replica.id, Outcome.OUTAGE, detail, side)

    def _failed(self, replica: Replica, detail: str, corrupted: bool = False) -> Result:
        current = self._state.replica(replica.id)
        now = self._clock()
        charged = current.charged + 1
        exhausted = charged >= self._limits.max_attempts
        delay = retry_delay_s(charged, self._limits.retry_base_s, self._limits.retry_max_s)
        changes = {"failures": ("+", 1), "charged": charged, "last_error": detail,
                   "next_attempt_at": now + delay,
                   **({"corruptions": ("+", 1)} if corrupted else {})}
        if exhausted:
            self._state.move(replica.id, current.status, Status.FAILED, now, **changes)
        elif current.status is Status.UPLOADING:
            self._state.move(replica.id, Status.UPLOADING, Status.PENDING, now, **changes)
        else:
            self._state.update(replica.id, current.status, now, **changes)
        outcome = Outcome.FAILED if exhausted else Outcome.RETRY
        event(log, outcome.value, logging.ERROR if exhausted else logging.WARNING,
              run=replica.run, step=replica.step, destination=replica.destination,
              attempt=charged, retry_in_s=None if exhausted else round(delay, 1), error=detail)
        return Result(replica.id, outcome, detail)

    # --- transfers ----------------------------------------------------------------------

    def _write_transfers(self) -> None:
        assert self._replica is not None
        self._transfers.write(self._replica)

    def _read_back(self, replica: Replica) -> tuple[Repository, list[CkptError]]:
        """Read the replica back from the destination in full: its damage, if any. An
        outage raises instead: what cannot be read is not known to be damaged."""
        started = self._clock()
        self._destination.bytes_read = 0
        replica_repo = Repository(self._destination, self._keys)
        faults = replica_repo.verify(replica.run, replica.step)
        for fault in faults:
            if isinstance(fault, StoreUnavailable):
                raise fault
        self._record_read(started)
        return replica_repo, faults

    def _record_read(self, started: float) -> None:
        """What was read from the destination since `started` (PacedStore.bytes_read)."""
        assert self._replica is not None
        self._transfers.read(self._replica, self._destination.bytes_read, started)


def _timestamp(text: str) -> float | None:
    try:
        moment = datetime.fromisoformat(text)
    except (TypeError, ValueError):
        return None
    return moment.timestamp() if moment.tzinfo else None
