"""Rollback detection for a job that resumes by itself (docs/format.md §8.6): a home job,
or a requeued incarnation, takes its own store's newest checkpoint, so the daemon hands it
the run's high-water mark with its lease grant and the job keeps its own mark in its run
record; a store (its provider, or a co-tenant holding write access to it) that rolled
the run back below either is refused with one line and exit code 35, never resumed
from. The decisions' tables, then the attack against the real lease service and client
(HTTP, directory stores), as the store's controller makes it."""

from __future__ import annotations

import struct
from types import SimpleNamespace

import lease_site
import pytest

from slurm_geo.ckpt import Metadata, Repository, Tensor
from slurm_geo.ckpt.format.names import latest_name, manifest_name
from slurm_geo.ckpt.format.rollback import RolledBack, resume_rollback
from slurm_geo.federation.act.highwater import lease_marks
from slurm_geo.federation.model import JobStatus, Lease
from slurm_geo.lease import places
from slurm_geo.lease.client import FederatedRun, Placement
from slurm_geo.lease.munge import FakeMunge
from slurm_geo.lease.protocol import LeaseReply, Verdict
from slurm_geo.lease.signing import MungeSigner
from tests.kit.builders import logical_job as job

MUNGED = FakeMunge()


# --- the decisions ---------------------------------------------------------------------------

@pytest.mark.parametrize("steps, pointer, mark, refused, pointer_named", [
    ([10, 20, 40], 40, 40, None, False),   # the store holds the mark
    ([10, 20, 40, 60], 60, 40, None, False),  # and newer
    ([10, 20, 40], None, 40, None, False),  # no pointer (a crash after a commit): listing
    ([10, 20], 20, 40, 20, False),         # newest deleted, older pointer put back
    ([10, 20, 40], 20, 40, 20, True),      # only the pointer replayed: a trainer resuming
                                           # from latest would take step 20
    ([], None, 40, -1, False),             # everything gone
    ([10, 20], 20, None, None, False),     # no mark known: nothing to compare with
])
def test_what_a_job_resuming_by_itself_refuses(steps, pointer, mark, refused, pointer_named):
    found = resume_rollback("r", "pfs", steps, pointer, mark)
    if refused is None:
        assert found is None
        return
    assert isinstance(found, RolledBack) and found.high_water == mark
    assert found.newest == (None if refused == -1 else refused)
    assert found.exit_code == 35 and "\n" not in str(found)
    assert ("latest pointer naming step" in str(found)) is pointer_named


def _job(name, cluster, generation, resume_step, status=JobStatus.RUNNING):
    from dataclasses import replace

    return replace(job(), logical_job=name, cluster=cluster, generation=generation,
                   resume_step=resume_step, status=status)


STORE_OF = {"onprem": "pfs", "rented": "away"}.__getitem__


@pytest.mark.parametrize("jobs, store, marks", [
    # A home job: its lease's last reported step in its cluster's store.
    ([(_job("a", "onprem", 0, None), Lease("a", 0, "onprem", 5, 0, 1.0, 40, False))], "pfs",
     [None, 40]),
    ([(_job("a", "onprem", 0, None), Lease("a", 0, "onprem", 5, 0, 1.0, 40, False))], "away", []),
    # Moved: the generation's resume step where it runs; the old generation's lease
    # (another store, or the same before it was replaced) says nothing.
    ([(_job("a", "rented", 1, 30), Lease("a", 0, "onprem", 5, 0, 1.0, 40, False))], "away", [30]),
    ([(_job("a", "rented", 1, 30), Lease("a", 0, "onprem", 5, 0, 1.0, 40, False))], "pfs", []),
    # A run continued in a new job: the earlier (final) job's last report counts.
    ([(_job("a", "onprem", 0, None, JobStatus.COMPLETED),
       Lease("a", 0, "onprem", 5, 0, 1.0, 40, True)),
      (_job("b", "onprem", 0, None), None)], "pfs", [None, 40, None]),
])
def test_the_daemons_marks_of_a_run_in_a_store(jobs, store, marks):
    assert lease_marks(jobs, store, STORE_OF) == marks


def record(run="r", store_url="file:///pfs", step=40):
    return places.RunRecord(run, "onprem", 5, 0, "pfs", store_url, step, True, "root")


@pytest.mark.parametrize("found, mark", [
    (record(), 40),
    (record(step=None), None),              # it never saved
    (record(run="other"), None),            # another run
    (record(store_url="file:///x"), None),  # another store
    (None, None),                           # no record (first start, or not one)
])
def test_a_jobs_own_mark_is_its_records_for_the_same_run_and_store(found, mark):
    assert places.own_mark(found, "r", "file:///pfs") == mark


@pytest.mark.parametrize("body, mark", [
    ({"verdict": "grant", "reason": "", "high_water": 40}, 40),
    ({"verdict": "grant", "reason": ""}, None),  # an older daemon: no mark
])
def test_the_grant_carries_the_mark(body, mark):
    reply = LeaseReply.from_json(body)
    assert reply.high_water == mark
    assert LeaseReply.from_json(reply.to_json()) == reply


@pytest.mark.parametrize("bad", [-1, "40", 40.0, True, [40]])
def test_a_malformed_mark_is_no_reply(bad):
    with pytest.raises(ValueError, match="high_water"):
        LeaseReply.from_json({"verdict": "grant", "reason": "", "high_water": bad})


# --- the job's side, without a daemon ------------------------------------------------------

KEY = lease_site.KEY


def save(repository: Repository, run: str, step: int) -> None:
    data = struct.pack("<64f", *([float(step)] * 64))
    repository.write_checkpoint(run, [Tensor("w", "float32", (64,), data)], b"",
                                Metadata(step, step, 0, 1.0, "2026-12-01T00:00:00Z",
                                         "onprem", "5"), parent=None)


def roll_back(store, run: str) -> None:
    """The store's controller: step 40's manifest deleted, the pointer of step 20 back."""
    repository = Repository(store, KEY)
    for step in (10, 20):
        save(repository, run, step)
    old_pointer = store.get(latest_name(run))
    save(repository, run, 40)
    store.delete(manifest_name(run, 40))
    store.put(latest_name(run), old_pointer)


def test_a_requeued_job_refuses_a_store_behind_its_own_record(tmp_path):
    from slurm_geo.ckpt import LocalDirStore

    (tmp_path / "pfs").mkdir()
    store = LocalDirStore(tmp_path / "pfs")
    url = f"file://{tmp_path / 'pfs'}"
    roll_back(store, "r")
    ckpt = tmp_path / "job"
    (ckpt / places.META_DIR).mkdir(parents=True)
    places.write_record(ckpt, places.RunRecord("r", "onprem", 5, 0, "pfs", url, 40, True,
                                               "root"))  # its first start saved step 40

    def started(generation: int, restart: int) -> FederatedRun:
        return FederatedRun(Placement("r", "onprem", 5, restart, generation, None,
                                      "https://d", url, ""), signer=object(),  # type: ignore[arg-type]
                            env={places.CKPT_DIR_ENV: str(ckpt)})

    repository = Repository(store, KEY)
    with pytest.raises(RolledBack, match="step 40 was saved") as refused:
        started(0, 1).checked(repository, "r")
    assert refused.value.exit_code == 35 and refused.value.newest == 20
    # A generation the daemon placed starts where the daemon verified: not checked again.
    assert started(1, 0).checked(repository, "r") is repository
    # Another run's record is no mark for this one.
    assert started(0, 1).checked(repository, "other") is repository


# --- the attack, against the real lease service --------------------------------------------

@pytest.fixture
def site(tmp_path):
    site = lease_site.start(tmp_path, munged=MUNGED)
    # A home job of alice's, registered (generation 0, onprem:9), training run-h in pfs.
    from slurm_geo.federation.model import LogicalJob

    now = 1.0
    site.federation.state.add_job(LogicalJob(
        logical_job="onprem-9", run="run-h", home="onprem", script="#!/bin/bash\n", spec={},
        directives={}, generation=0, cluster="onprem", job_id=9, resume_step=None,
        status=JobStatus.RUNNING, created_at=now, updated_at=now, owner=lease_site.ALICE))
    yield site
    site.close()


def home_job(site, restart: int) -> FederatedRun:
    placement = Placement("run-h", "onprem", 9, restart, 0, None, site.url,
                          f"file://{site.stores['pfs'].root}", "")
    return FederatedRun(placement, signer=MungeSigner(MUNGED.as_uid(lease_site.ALICE.uid)))


class Requeued:
    def job(self, job_id: int) -> SimpleNamespace:
        return SimpleNamespace(restart_count=1)


def trains_to_40_then_is_requeued(site, rolled_back: bool) -> FederatedRun:
    """Alice's home job saves steps 10, 20 and 40, reporting each; Slurm requeues it.
    Meanwhile the store's controller rolls run-h back to step 20, or does not."""
    first = home_job(site, 0)
    first.acquire(give_up_after_s=10)
    assert first.high_water is None  # a brand-new run: no mark yet
    repository = first.repository()
    for step in (10, 20, 40):
        if step == 40 and rolled_back:
            old_pointer = site.stores["pfs"].get(latest_name("run-h"))
        save(repository, "run-h", step)
        first.checkpointed(step)
    assert site.federation.state.lease("onprem-9").last_step == 40
    first._stop.set()  # noqa: SLF001  # killed by the requeue
    if rolled_back:
        site.stores["pfs"].delete(manifest_name("run-h", 40))
        site.stores["pfs"].put(latest_name("run-h"), old_pointer)
    site.federation.wiring.clients["onprem"] = Requeued()
    second = home_job(site, 1)
    second.acquire(give_up_after_s=10)  # waits out the first start's lease
    return second


def test_a_requeued_home_job_refuses_a_store_rolled_back_under_it(site):
    second = trains_to_40_then_is_requeued(site, rolled_back=True)
    assert second.high_water == 40  # the daemon's mark, from the lease's last report
    stored = sorted(site.stores["pfs"].list(""))
    with pytest.raises(RolledBack) as refused:
        second.repository()
    assert refused.value.exit_code == 35 and "\n" not in str(refused.value)
    assert "holds checkpoints up to step 20 of run run-h, but step 40 was saved" \
        in str(refused.value)
    assert sorted(site.stores["pfs"].list("")) == stored  # nothing written, nothing resumed
    second.release(None)


def test_a_requeued_home_job_resumes_from_a_store_that_kept_its_checkpoints(site):
    second = trains_to_40_then_is_requeued(site, rolled_back=False)
    assert second.high_water == 40
    assert second.repository().steps("run-h") == [10, 20, 40]
    second.release(None)


def test_renewals_after_the_first_save_carry_no_mark(site):
    first = home_job(site, 0)
    first.acquire(give_up_after_s=10)
    reply = first._ask(release=False)  # noqa: SLF001
    assert reply is not None and reply.verdict is Verdict.GRANT
    first.checkpointed(10)
    body = first._call("/v1/lease", {**first_request(first, 10)})  # noqa: SLF001
    assert body[0] == 200 and "high_water" not in body[1]
    first.release(10)


def first_request(run: FederatedRun, last_step: int) -> dict:
    from slurm_geo.lease.protocol import LeaseRequest

    p = run.placement
    return LeaseRequest(p.run, p.cluster, p.job_id, p.restart, p.generation,
                        last_step).to_json()
