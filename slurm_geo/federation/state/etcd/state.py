"""The federation state in etcd: the interface of federation.state.FederationState, for
daemons at two trusted sites of which one leads (federation.etcd.leadership).

Every write is one etcd transaction (federation.etcd.transaction): it holds only if the
records it read are as it read them, which makes the compare-and-set of the SQLite state
(a generation bump, a status move), and only if the leader key is still this replica's,
so a deposed leader's write is refused by etcd itself (NotLeader). Any replica reads; a
read is linearizable (etcd's default), so it sees every write acknowledged before it.

A replica keeps nothing on its own disk: one started on an empty machine reads the whole
state back from etcd. The key layout is federation.etcd.layout's; every value is sealed
(federation.etcd.kv). Finding a job by its Slurm job id reads every incarnation: the
state holds the incarnations of the jobs the federation knows, not an index of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from slurm_geo.federation.model import (
    LIFECYCLE,
    Health,
    Incarnation,
    IncarnationEnd,
    JobStatus,
    Lease,
    LeftHome,
    LogicalJob,
    StaleJob,
    UnknownLogicalJob,
)
from slurm_geo.federation.state.etcd import records
from slurm_geo.federation.state.etcd.identities import EtcdIdentities, change_job, forget_tokens
from slurm_geo.federation.state.etcd.kv import EtcdKV
from slurm_geo.federation.state.etcd.layout import Layout
from slurm_geo.federation.state.etcd.leadership import WriteGuard
from slurm_geo.federation.state.etcd.transaction import (
    MAX_TXN_OPS,
    Transaction,
    confirm_leading,
    write,
)

_ACTIVE = (JobStatus.RUNNING, JobStatus.MOVING)


class EtcdFederationState:
    """All reads and writes of the replicated state; writes need `leadership` to lead.
    Thread-safe, as the SQLite state is: the lease service and the daemon loop share it."""

    def __init__(self, kv: EtcdKV, layout: Layout, leadership: WriteGuard):
        self.kv, self.layout, self.leadership = kv, layout, leadership
        self.identities = EtcdIdentities(kv, layout, leadership)

    def close(self) -> None:
        self.kv.close()

    def confirm_leading(self) -> None:
        """NotLeader unless etcd confirms now that this replica leads."""
        confirm_leading(self.kv, self.leadership)

    def _record(self, key: str) -> dict[str, Any] | None:
        found = self.kv.get(key)
        return None if found is None else records.loads(found.value)

    def _records(self, prefix: str) -> list[dict[str, Any]]:
        return [records.loads(found.value) for found in self.kv.range(prefix)]

    def _job_in(self, tx: Transaction, logical_job: str) -> LogicalJob | None:
        record = tx.get(self.layout.job(logical_job))
        return None if record is None else records.job_from(record)

    def _put_job(self, tx: Transaction, job: LogicalJob) -> LogicalJob:
        tx.put(self.layout.job(job.logical_job), records.job_record(job))
        return job

    def _change_job(self, logical_job: str, stale_unless: str | None,
                    change: Callable[[LogicalJob], LogicalJob | None]) -> LogicalJob | None:
        return change_job(self.kv, self.layout, self.leadership, logical_job, change,
                          stale_unless=stale_unless)

    # --- logical jobs ---------------------------------------------------------------------

    def add_job(self, job: LogicalJob) -> bool:
        """Register `job` (generation 0 at home); False if it is already known."""
        def attempt(tx: Transaction) -> bool:
            if self._job_in(tx, job.logical_job) is not None:
                return False
            self._put_job(tx, job)
            incarnation = records.first_incarnation(job)
            tx.put(self.layout.incarnation(job.logical_job, job.generation),
                   records.incarnation_record(incarnation))
            return True
        return write(self.kv, self.leadership, attempt)

    def job(self, logical_job: str) -> LogicalJob:
        record = self._record(self.layout.job(logical_job))
        if record is None:
            raise UnknownLogicalJob(logical_job)
        return records.job_from(record)

    def _all_incarnations(self) -> list[Incarnation]:
        return [records.incarnation_from(r) for r in self._records(self.layout.incarnations)]

    def find_job(self, cluster: str, job_id: int) -> LogicalJob | None:
        """The logical job whose incarnation is Slurm job `job_id` on `cluster`."""
        for incarnation in self._all_incarnations():
            if (incarnation.cluster, incarnation.job_id) == (cluster, job_id):
                return self.job(incarnation.logical_job)
        return None

    def find_by_job_id(self, job_id: int) -> list[tuple[str, LogicalJob]]:
        """(cluster, logical job) of each incarnation that is Slurm job `job_id` anywhere."""
        pairs = {(i.cluster, i.logical_job) for i in self._all_incarnations()
                 if i.job_id == job_id}
        found = [(cluster, self.job(logical_job)) for cluster, logical_job in pairs]
        return sorted(found, key=lambda pair: (pair[0], pair[1].created_at,
                                               pair[1].logical_job))

    def find_by_run(self, run: str) -> list[LogicalJob]:
        return [job for job in self.jobs() if job.run == run]

    def jobs(self, active_only: bool = False) -> list[LogicalJob]:
        found = [records.job_from(r) for r in self._records(self.layout.jobs)]
        return sorted((job for job in found if not (active_only and job.status.is_final())),
                      key=lambda job: (job.created_at, job.logical_job))

    def name_run(self, logical_job: str, run: str, now: float) -> LogicalJob:
        """A job discovered while pending names its run with its first lease request."""
        named = self._change_job(logical_job, None, lambda job: replace(
            job, run=run, updated_at=now) if job.run == "" else None)
        if named is None:
            raise UnknownLogicalJob(logical_job)
        return named

    def move_status(self, logical_job: str, expected: JobStatus, wanted: JobStatus,
                    now: float) -> LogicalJob:
        """`expected` -> `wanted`, if that is a transition and the job is still `expected`;
        IllegalTransition or StaleJob otherwise, and nothing is written."""
        LIFECYCLE.check(logical_job, expected, wanted)

        def attempt(tx: Transaction) -> LogicalJob:
            job = self._job_in(tx, logical_job)
            if job is None:
                raise UnknownLogicalJob(logical_job)
            if job.status is not expected:
                raise StaleJob(logical_job, expected.value)
            return self._put_job(tx, replace(job, status=wanted, move_to=None,
                                             move_after_step=None, awaiting_approval=None,
                                             updated_at=now))
        return write(self.kv, self.leadership, attempt)

    def plan_move(self, logical_job: str, generation: int, target: str,
                  after_step: int | None, now: float) -> LogicalJob:
        """A move to `target` at the job's next checkpoint after `after_step` (a failback,
        or a person's approval), if the job is still at `generation`."""
        planned = self._change_job(
            logical_job, f"active at generation {generation}",
            lambda job: replace(job, move_to=target, move_after_step=after_step,
                                awaiting_approval=None, updated_at=now)
            if job.generation == generation and job.status in _ACTIVE else None)
        assert planned is not None
        return planned

    def await_approval(self, logical_job: str, target: str | None, now: float) -> None:
        self._change_job(logical_job, None, lambda job: replace(
            job, awaiting_approval=target, updated_at=now))

    def count_lost_restart(self, logical_job: str, now: float) -> None:
        self._change_job(logical_job, None, lambda job: replace(
            job, lost_restarts=job.lost_restarts + 1, updated_at=now))

    def reset_lost_restarts(self, logical_job: str, now: float) -> None:
        """A failed job resubmitted gets max_restarts afresh; StaleJob unless still failed."""
        self._change_job(logical_job, JobStatus.FAILED.value, lambda job: replace(
            job, lost_restarts=0, updated_at=now) if job.status is JobStatus.FAILED else None)

    def begin_generation(self, logical_job: str, expected_generation: int, cluster: str,
                         resume_step: int | None, now: float, *,
                         left_home: LeftHome | None = None, recovery: bool = False,
                         live_lease_ttl_s: float | None = None) -> LogicalJob:
        """Make generation `expected_generation + 1` current on `cluster` (status moving,
        no job id yet): from here on every lease request of an older generation is
        refused. A compare-and-set: StaleJob if the job is no longer at that generation,
        or (with `live_lease_ttl_s`) if its lease was renewed meanwhile."""
        def attempt(tx: Transaction) -> LogicalJob:
            job = self._job_in(tx, logical_job)
            if job is None:
                raise UnknownLogicalJob(logical_job)
            if job.generation != expected_generation:
                raise StaleJob(logical_job, f"at generation {expected_generation}")
            LIFECYCLE.check(logical_job, job.status, JobStatus.MOVING)
            if live_lease_ttl_s is not None:
                held = tx.get(self.layout.lease(logical_job))
                lease = None if held is None else records.lease_from(held)
                if lease is not None and lease.generation == expected_generation \
                        and not lease.expired(now, live_lease_ttl_s):
                    raise StaleJob(logical_job, "without a live lease")
            moved = records.moved_on(job, generation=expected_generation + 1,
                                     cluster=cluster, resume_step=resume_step,
                                     left_home=left_home, recovery=recovery, now=now)
            tx.put(self.layout.incarnation(logical_job, moved.generation),
                   records.incarnation_record(Incarnation(
                       logical_job, moved.generation, cluster, None, resume_step, now,
                       None, None, None)))
            forget_tokens(tx, self.layout, logical_job)
            return self._put_job(tx, moved)
        return write(self.kv, self.leadership, attempt)

    def submitted(self, logical_job: str, generation: int, job_id: int, token_sha256: str,
                  now: float) -> LogicalJob:
        """The moving generation runs as Slurm job `job_id`: status running. StaleJob if
        the job was cancelled (or moved on) meanwhile."""
        def attempt(tx: Transaction) -> LogicalJob:
            job = self._job_in(tx, logical_job)
            if job is None or job.generation != generation or job.status is not \
                    JobStatus.MOVING:
                raise StaleJob(logical_job, f"moving at generation {generation}")
            self._change_incarnation(tx, logical_job, generation, lambda i: replace(
                i, job_id=job_id))
            tx.put(self.layout.token(token_sha256), {
                "logical_job": logical_job, "generation": generation, "used_restart": None})
            return self._put_job(tx, replace(job, job_id=job_id, status=JobStatus.RUNNING,
                                             updated_at=now))
        return write(self.kv, self.leadership, attempt)

    # --- incarnations ---------------------------------------------------------------------

    def incarnations(self, logical_job: str) -> list[Incarnation]:
        return [records.incarnation_from(r)
                for r in self._records(self.layout.incarnations_of(logical_job))]

    def _change_incarnation(self, tx: Transaction, logical_job: str, generation: int,
                            change: Callable[[Incarnation], Incarnation | None]) -> None:
        key = self.layout.incarnation(logical_job, generation)
        record = tx.get(key)
        changed = None if record is None else change(records.incarnation_from(record))
        if changed is not None:
            tx.put(key, records.incarnation_record(changed))

    def end_incarnation(self, logical_job: str, generation: int, reason: IncarnationEnd,
                        now: float) -> None:
        def attempt(tx: Transaction) -> None:
            self._change_incarnation(tx, logical_job, generation, lambda i: replace(
                i, ended_at=now, end_reason=reason) if i.ended_at is None else None)
            forget_tokens(tx, self.layout, logical_job, generation)
        write(self.kv, self.leadership, attempt)

    # --- leases and tokens ----------------------------------------------------------------

    def lease(self, logical_job: str) -> Lease | None:
        record = self._record(self.layout.lease(logical_job))
        return None if record is None else records.lease_from(record)

    def put_lease(self, lease: Lease, first_for_generation: bool) -> None:
        def attempt(tx: Transaction) -> None:
            tx.put(self.layout.lease(lease.logical_job), records.lease_record(lease))
            if first_for_generation:
                self._change_incarnation(
                    tx, lease.logical_job, lease.generation, lambda i: replace(
                        i, training_at=lease.renewed_at) if i.training_at is None else None)
        write(self.kv, self.leadership, attempt)

    def release_lease(self, logical_job: str) -> None:
        self._change_lease(self.layout.lease(logical_job), released=True)

    def _change_lease(self, key: str, **changes: Any) -> None:
        def attempt(tx: Transaction) -> None:
            record = tx.get(key)
            if record is not None:
                tx.put(key, {**record, **changes})
        write(self.kv, self.leadership, attempt)

    def refresh_leases(self, now: float) -> None:
        """After a restart nobody knows who renewed while the daemon was down: every live
        lease counts as renewed now, so no move starts before it could have run out. In
        batches etcd takes in one transaction each (a lease is one job's, never two)."""
        live = [found.key for found in self.kv.range(self.layout.leases)
                if not records.loads(found.value)["released"]]
        batch = MAX_TXN_OPS - 1  # and the leadership guard
        for start in range(0, len(live), batch):
            keys = live[start:start + batch]

            def attempt(tx: Transaction, keys: list[str] = keys) -> None:
                for key in keys:
                    record = tx.get(key)
                    if record is not None and not record["released"]:
                        tx.put(key, {**record, "renewed_at": now})
            write(self.kv, self.leadership, attempt)

    # --- health, bandwidth and the daemon's own watermarks ----------------------------------

    def health(self) -> dict[str, Health]:
        found = [records.health_from(r) for r in self._records(self.layout.healths)]
        return {health.cluster: health for health in found}

    def put_health(self, health: Health) -> None:
        self._put(self.layout.health(health.cluster), records.health_record(health))

    def _put(self, key: str, record: dict[str, Any]) -> None:
        write(self.kv, self.leadership, lambda tx: tx.put(key, record))

    def bandwidth_snapshot(self) -> list[dict[str, Any]]:
        record = self._record(self.layout.bandwidth)
        return [] if record is None else list(record["snapshot"])

    def put_bandwidth_snapshot(self, rows: list[dict[str, Any]]) -> None:
        self._put(self.layout.bandwidth, {"snapshot": rows})

    def _watermark(self, name: str) -> Any:
        record = self._record(self.layout.daemon)
        return None if record is None else record.get(name)

    def _put_watermark(self, name: str, value: float) -> None:
        def attempt(tx: Transaction) -> None:
            tx.put(self.layout.daemon, {**(tx.get(self.layout.daemon) or {}), name: value})
        write(self.kv, self.leadership, attempt)

    def bandwidth_probe_at(self) -> float:
        return float(self._watermark("bandwidth_probe_at") or 0.0)

    def put_bandwidth_probe_at(self, when: float) -> None:
        self._put_watermark("bandwidth_probe_at", when)

    def sync_transfer_id(self) -> int:
        return int(self._watermark("sync_transfer_id") or 0)

    def put_sync_transfer_id(self, transfer_id: int) -> None:
        self._put_watermark("sync_transfer_id", transfer_id)
