"""A move that carries and verifies a large checkpoint over a slow link holds no lock
other jobs' trainers need: their lease renewals are answered at once all along.

Before the daemon was rebuilt, `_move` held the daemon's single lock while it copied and
verified; with a 100 GB checkpoint every federated trainer of the site stopped training
until the move ended. Here: 1 GiB of incompressible state, stores paced at 200 MB/s (the
bandwidth cap every daemon copy goes through), so the move takes about 10 s."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from test_federation_daemon import KEY, RUN, Site

from slurm_geo.ckpt import Metadata, Repository, Tensor
from slurm_geo.ckpt.open_store import paced
from slurm_geo.ckpt.pacing import TokenBucket
from slurm_geo.federation.model import JobStatus

pytestmark = pytest.mark.slow

CHECKPOINT_BYTES = 1 << 30
TENSORS = 16
LINK_BYTES_S = 200e6


def write_large_checkpoint(site: Site, step: int) -> None:
    rng = np.random.default_rng(step)
    size = CHECKPOINT_BYTES // TENSORS
    tensors = [Tensor(f"layer{i}.weight", "uint8", (size,), rng.bytes(size))
               for i in range(TENSORS)]
    Repository(site.stores["pfs"], KEY).write_checkpoint(
        RUN, tensors, b"", Metadata(step, step, 0, 1.0, "2026-12-01T00:00:00Z", "onprem", "1"))


def test_lease_renewals_are_answered_while_a_move_copies_and_verifies_1_gib(tmp_path):
    site = Site(tmp_path)
    bucket = TokenBucket(LINK_BYTES_S)
    site.federation.wiring.paced_stores = {name: paced(store, name, bucket)
                                           for name, store in site.stores.items()}
    mover_id = site.home_job_training(failover="manual")
    other_id = site.submit_home()
    site.start_home(other_id)
    site.tick()
    write_large_checkpoint(site, 100)
    mover = site.state.find_job("onprem", mover_id)
    assert mover is not None
    site.federation.approve(mover.logical_job, "rented", "operator")
    site.lease("onprem", mover_id, last_step=100, release=True)  # it stops at a checkpoint

    move = threading.Thread(target=site.federation.tick, name="move")
    started = time.monotonic()
    move.start()
    latencies = []
    while move.is_alive():
        asked = time.monotonic()
        reply = site.lease("onprem", other_id, run="run-b")  # MUNGE-authenticated
        latencies.append(time.monotonic() - asked)
        assert reply["verdict"] == "grant"
        time.sleep(0.05)
    move.join()
    moving_s = time.monotonic() - started

    moved = site.state.job(mover.logical_job)
    assert (moved.cluster, moved.generation, moved.resume_step, moved.status) == (
        "rented", 1, 100, JobStatus.RUNNING)
    # The move really was long (copy and verification over the paced link) ...
    assert moving_s > 2 * CHECKPOINT_BYTES / LINK_BYTES_S * 0.8
    assert len(latencies) > 50
    # ... and no renewal waited for it.
    assert max(latencies) < 1.0, f"slowest renewal {max(latencies):.2f} s"
