"""The federation daemon's word on fences (docs/format.md §8.3, §8.4): a fence a job forged
under its run key blocks no move, a fence its state knows counts where a store lost it,
and the stores' fences are written again (a version 1 one after the upgrade, a deleted one
at the next check), so checkpoint-sync, which knows only the store, sees them too."""

from __future__ import annotations

import json
import random
import struct

import pytest

from slurm_geo.ckpt import Metadata, Repository, Tensor
from slurm_geo.ckpt.errors import LegacyObject, WrongKey
from slurm_geo.ckpt.format.seal import Kind, seal
from slurm_geo.ckpt.repo.fence import read_fence, unadmitted_steps
from slurm_geo.ckpt.repo.runkey import unwrap_run_key
from slurm_geo.federation.act.fencing import RECHECK_S, daemon_lookup, known_fence
from tests.kit.federation import KEY, OPTIONS, RUN, Site
from tests.kit.fence import legacy_seal

FENCE = f"fences/{RUN}"


@pytest.fixture
def site(tmp_path) -> Site:
    return Site(tmp_path)


def away_and_training(site: Site) -> int:
    """The home job failed over to `rented` (generation 1, resuming at 40), training."""
    _, away_id = site.moved_away()
    site.rented.start(away_id)
    assert site.lease("rented", away_id, generation=1)["verdict"] == "grant"
    return away_id


def forged(site: Site, store: str, version: int) -> bytes:
    """What a job holding the run's data key can write at `fences/<run>`."""
    data_key = unwrap_run_key(site.stores["away"], KEY, RUN)
    payload = json.dumps({"run": RUN, "generation": 999, "holder": "rented",
                          "resume_step": None, "set_at": "2026-12-01T00:00:00+00:00"}).encode()
    if version == 1:
        return legacy_seal(data_key, Kind.FENCE, payload, FENCE)
    return seal(data_key, Kind.FENCE, bytes(16), payload, FENCE)


def stale_checkpoint(site: Site, store: str, step: int) -> None:
    """A checkpoint the partitioned home incarnation got into `store`."""
    data = struct.pack("<1024f", *(random.Random(step).gauss(0, 1) for _ in range(1024)))
    Repository(site.stores[store], KEY, OPTIONS).write_checkpoint(
        RUN, [Tensor("w", "float32", (1024,), data)], b"",
        Metadata(step, step, 0, 1.0, "2026-12-01T00:00:00Z", "onprem", "1"))


@pytest.mark.parametrize("version", [1, 2])
def test_a_generation_999_fence_a_job_forged_blocks_no_move(site, version):
    away_id = away_and_training(site)
    site.checkpoint("away", 60)
    for store in ("pfs", "away"):
        site.stores[store].put(FENCE, forged(site, store, version))
    site.onprem.come_back()
    site.tick(rounds=8)
    site.lease("rented", away_id, generation=1, last_step=60, release=True)
    site.tick()
    job = site.job()
    assert (job.cluster, job.generation, job.resume_step) == ("onprem", 2, 60)
    for store in ("pfs", "away"):
        fence = read_fence(Repository(site.stores[store], KEY), RUN)
        assert fence is not None and (fence.generation, fence.holder) == (2, "onprem")


def test_a_fence_the_daemon_set_counts_where_a_store_lost_it_and_is_written_again(site):
    away_and_training(site)
    away = Repository(site.stores["away"], KEY)
    site.stores["away"].delete(FENCE)  # e.g. by a job: its store credentials allow it
    stale_checkpoint(site, "away", 50)
    assert read_fence(away, RUN) is None
    assert unadmitted_steps(away, RUN) == []  # the store alone admits the stale one
    job = site.job()
    assert unadmitted_steps(away, RUN, daemon_lookup(known_fence(job))) == [50]
    site.tick()
    assert read_fence(away, RUN) is None  # checked in this hour already
    site.clock.advance(RECHECK_S)
    site.tick()
    fence = read_fence(away, RUN)
    assert fence is not None and (fence.generation, fence.holder, fence.resume_step) == (
        1, "rented", 40)
    assert unadmitted_steps(away, RUN) == [50]
    assert any(k == f"fence: rewrote {FENCE} in away at generation 1" for k in site.kinds())


def test_after_the_upgrade_the_daemon_rewrites_the_version_1_fences_it_knows(site):
    away_and_training(site)
    site.stores["away"].put(FENCE, forged(site, "away", 1))
    away = Repository(site.stores["away"], KEY)
    with pytest.raises(LegacyObject):
        read_fence(away, RUN)  # checkpoint-sync copies nothing meanwhile
    site.restart()  # the upgraded daemon starts
    site.tick()
    assert read_fence(away, RUN).generation == 1


def test_a_job_cannot_make_a_fence_the_daemon_trusts(site):
    away_and_training(site)
    site.stores["away"].put(FENCE, forged(site, "away", 2))
    with pytest.raises(WrongKey):
        read_fence(Repository(site.stores["away"], KEY), RUN)
    job = site.job()
    lookup = daemon_lookup(known_fence(job))
    assert lookup(Repository(site.stores["away"], KEY), RUN).generation == 1


def test_a_marker_a_job_forged_on_a_stale_checkpoint_does_not_stop_the_move(site):
    away_and_training(site)
    stale_checkpoint(site, "away", 50)  # got in just before the fence
    data_key = unwrap_run_key(site.stores["away"], KEY, RUN)
    marker = f"promoted/{RUN}/{50:020d}"
    body = json.dumps({"run": RUN, "step": 50, "promoted_at": "x"}).encode()
    site.stores["away"].put(marker, seal(data_key, Kind.PROMOTED, bytes(16), body, marker))
    moved = site.federation.mover.complete(site.job(), "a move repeated after a crash")
    assert (moved.cluster, moved.generation) == ("rented", 1)
    assert f"fence: kept {RUN}@50 in away" in site.kinds()
    assert Repository(site.stores["away"], KEY).steps(RUN) == [40, 50]
