"""Retention tiers as pure decisions, table-driven."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from slurm_geo.config.tables import parse_retention
from slurm_geo.errors import ConfigError
from slurm_geo.policy.retention import (
    CheckpointRef,
    RetentionPolicy,
    local_to_delete,
    remote_to_delete,
    to_replicate,
)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def series(n, promoted=(), days_apart=1.0):
    """n checkpoints at steps 100, 200, ...; the newest created now, older ones earlier."""
    return [CheckpointRef(step=100 * (i + 1), sequence=i,
                          created_at=NOW - timedelta(days=days_apart * (n - 1 - i)),
                          promoted=(100 * (i + 1)) in promoted)
            for i in range(n)]


def steps(refs):
    return [r.step for r in refs]


@pytest.mark.parametrize("every, replicated, expected", [
    (1, [], [500, 400, 300, 200, 100]),
    (2, [], [500, 300, 100]),
    (3, [], [500, 400, 100]),          # the newest always goes off-site
    (2, [100, 300], [500]),
    (2, [100, 300, 500], []),
])
def test_to_replicate_every_kth_and_the_newest_newest_first(every, replicated, expected):
    policy = RetentionPolicy(replicate_every=every)
    assert steps(to_replicate(policy, series(5), replicated)) == expected


def test_promoted_checkpoints_are_replicated_even_off_the_kth():
    policy = RetentionPolicy(replicate_every=4)
    assert steps(to_replicate(policy, series(5, promoted={200}), [])) == [500, 200, 100]


@pytest.mark.parametrize("keep, every, replicated, promoted, expected", [
    (3, 1, [100, 200, 300, 400, 500], (), [200, 100]),
    (3, 1, [300, 400, 500], (), []),                # 100 and 200 still owe their replica
    (2, 2, [100, 300, 500], (), [300, 200, 100]),
    (2, 2, [100, 300, 500], {200}, [300, 100]),
    (10, 1, [], (), []),
])
def test_local_to_delete_keeps_last_n_unreplicated_and_promoted(keep, every, replicated,
                                                                promoted, expected):
    policy = RetentionPolicy(keep_local=keep, replicate_every=every)
    assert steps(local_to_delete(policy, series(5, promoted), replicated)) == expected


@pytest.mark.parametrize("days, promoted, expected", [
    (2.5, (), [200, 100]),
    (2.5, {100}, [200]),
    (0.5, (), [400, 300, 200, 100]),
    (30, (), []),
])
def test_remote_to_delete_by_age_keeps_newest_and_promoted(days, promoted, expected):
    policy = RetentionPolicy(remote_days=days)
    assert steps(remote_to_delete(policy, series(5, promoted), NOW)) == expected


def test_newest_replica_stays_however_old():
    old = [CheckpointRef(100, 0, NOW - timedelta(days=400))]
    assert remote_to_delete(RetentionPolicy(remote_days=1), old, NOW) == []


@pytest.mark.parametrize("raw, message", [
    ({"keep_local": 0}, "keep_local must be a whole number >= 1"),
    ({"replicate_every": 1.5}, "replicate_every must be a whole number >= 1"),
    ({"remote_days": 0}, "remote_days must be a number > 0"),
    ({"keep": 3}, "unknown key(s) keep"),
])
def test_the_retention_table_rejects_mistakes(raw, message):
    with pytest.raises(ConfigError) as caught:
        parse_retention(raw, "[retention]")
    assert message in str(caught.value)


def test_the_retention_table_reads_values():
    assert parse_retention({"keep_local": 5, "remote_days": 7}, "[retention]") == RetentionPolicy(
        keep_local=5, replicate_every=1, remote_days=7)
