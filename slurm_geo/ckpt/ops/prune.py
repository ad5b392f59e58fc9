"""Apply the retention tiers (slurm_geo.policy.retention) to a run's stores.

The decisions are pure; this module gathers what they need from the repositories and
deletes what they say. Deleting drops manifests only; packs go at the next `gc`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

from slurm_geo.ckpt.repo.repository import Repository
from slurm_geo.policy.retention import (
    CheckpointRef,
    RetentionPolicy,
    local_to_delete,
    remote_to_delete,
    to_replicate,
)


@dataclass
class PruneReport:
    run: str
    local_deleted: list[int] = field(default_factory=list)
    remote_deleted: list[int] = field(default_factory=list)
    awaiting_replication: list[int] = field(default_factory=list)


def prune_run(run: str, local: Repository, remote: Repository | None, policy: RetentionPolicy,
              now: datetime, dry_run: bool = False) -> PruneReport:
    local_steps = local.steps(run)
    remote_steps = remote.steps(run) if remote is not None else []
    # Ordinals over every step either side holds, so pruning one side does not shift them.
    ordinal = {step: i for i, step in enumerate(sorted(set(local_steps) | set(remote_steps)))}
    local_refs = [_ref(local, run, s, ordinal[s], now) for s in local_steps]
    report = PruneReport(run)
    report.awaiting_replication = [c.step for c in to_replicate(policy, local_refs,
                                                                remote_steps)]
    report.local_deleted = [c.step for c in local_to_delete(policy, local_refs, remote_steps)]
    if remote is not None:
        remote_refs = [_ref(remote, run, s, ordinal[s], now) for s in remote_steps]
        report.remote_deleted = [c.step for c in remote_to_delete(policy, remote_refs, now)]
    if not dry_run:
        for step in report.local_deleted:
            local.delete_checkpoint(run, step)
        for step in report.remote_deleted:
            assert remote is not None
            remote.delete_checkpoint(run, step)
    return report


def _ref(repository: Repository, run: str, step: int, ordinal: int,
         now: datetime) -> CheckpointRef:
    return CheckpointRef(step=step, sequence=ordinal,
                         created_at=_created(repository.manifest(run, step).metadata.created_at,
                                             now),
                         promoted=repository.is_promoted(run, step))


def _created(text: str, now: datetime) -> datetime:
    """When a checkpoint was made; an unreadable time counts as now, so age never drops it."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return now
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
