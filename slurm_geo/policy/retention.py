"""Retention tiers of GPU disaster-recovery practice, as pure decisions.

Tier 1: keep the last `keep_local` checkpoints of a run on the on-prem filesystem.
Tier 2: replicate every `replicate_every`-th checkpoint (and always the newest) off-site,
        and keep replicas `remote_days` days.
Tier 3: promoted checkpoints are immutable: no tier ever deletes them.

Callers pass what exists; these functions say what to do. Nothing here touches a store.
The `[retention]` table is read into a RetentionPolicy by slurm_geo.config.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta


@dataclass(frozen=True)
class RetentionPolicy:
    keep_local: int = 3
    replicate_every: int = 1
    remote_days: float = 14.0


@dataclass(frozen=True)
class CheckpointRef:
    """What retention needs to know of one checkpoint of a run."""

    step: int
    sequence: int  # 0 for a run's first checkpoint, +1 for each after it
    created_at: datetime
    promoted: bool = False


def to_replicate(policy: RetentionPolicy, local: Iterable[CheckpointRef],
                 replicated_steps: Iterable[int]) -> list[CheckpointRef]:
    """Checkpoints tier 2 wants off-site that are not there yet, newest first."""
    local = list(local)
    done = set(replicated_steps)
    newest = max(local, key=lambda c: c.step, default=None)
    wanted = [c for c in local
              if c.sequence % policy.replicate_every == 0 or c is newest or c.promoted]
    return sorted((c for c in wanted if c.step not in done), key=lambda c: -c.step)


def local_to_delete(policy: RetentionPolicy, local: Iterable[CheckpointRef],
                    replicated_steps: Iterable[int]) -> list[CheckpointRef]:
    """Local checkpoints past tier 1, never one still waiting to go off-site."""
    ordered = sorted(local, key=lambda c: -c.step)
    pending = {c.step for c in to_replicate(policy, ordered, replicated_steps)}
    return [c for c in ordered[policy.keep_local:]
            if not c.promoted and c.step not in pending]


def remote_to_delete(policy: RetentionPolicy, remote: Iterable[CheckpointRef],
                     now: datetime) -> list[CheckpointRef]:
    """Replicas past tier 2's age; the newest replica always stays, so a run can resume."""
    ordered = sorted(remote, key=lambda c: -c.step)
    cutoff = now - timedelta(days=policy.remote_days)
    return [c for c in ordered[1:] if not c.promoted and c.created_at < cutoff]
