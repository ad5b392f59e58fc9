"""Moves read nothing back (issue 32): the federation daemon resumes a moved job from the
newest checkpoint whose verification record (slurm_geo.ckpt.ops.verified) it trusts and whose
objects are all there, without reading the checkpoint; a missing object sends it to the
previous one; a checkpoint without a (trusted) record is read in full, as before."""

from __future__ import annotations

import pytest

from slurm_geo.ckpt import Repository
from slurm_geo.ckpt.format.manifest import with_bases
from slurm_geo.ckpt.format.names import verified_name
from slurm_geo.ckpt.ops.replicate import copy_checkpoint
from slurm_geo.ckpt.ops.verified import read_record, record_of, write_record
from slurm_geo.federation.act.resumepoint import (
    FROM_SCRATCH,
    REFUSED,
    Resume,
    ResumePoint,
    newest_verified,
)
from slurm_geo.federation.model import JobStatus
from tests.kit.federation import KEY, RUN, TTL, Site


@pytest.fixture
def site(tmp_path) -> Site:
    return Site(tmp_path)


class Counting:
    """The away store, counting the bytes read from it."""

    def __init__(self, inner):
        self.inner = inner
        self.bytes_read = 0

    def get(self, name: str) -> bytes:
        data = self.inner.get(name)
        if name.startswith(("run-packs/", "packs/")):
            self.bytes_read += len(data)
        return data

    def __getattr__(self, attribute: str):
        return getattr(self.inner, attribute)


def replicated(site: Site, *steps: int) -> None:
    """Home saves each step and checkpoint-sync replicates it away, verified as written."""
    for step in steps:
        site.checkpoint("pfs", step)
        report = copy_checkpoint(Repository(site.stores["pfs"], KEY), site.stores["pfs"],
                                 site.stores["away"], RUN, step)
        write_record(Repository(site.stores["away"], KEY),
                     record_of(report, site.clock(), "checkpoint-sync"))


def counted(site: Site) -> Counting:
    site.stores["away"] = Counting(site.stores["away"])
    site.restart()
    return site.stores["away"]


def lose_home(site: Site) -> None:
    site.onprem.go_down()
    site.tick(rounds=2)
    site.clock.advance(TTL + 1)
    site.tick()


def own_packs(site: Site, step: int) -> list[str]:
    manifest = Repository(site.stores["away"], KEY).manifest(RUN, step)
    return sorted({manifest.pack_object(r.pack) for r in with_bases(manifest.refs())})


def verify_lines(site: Site) -> list[str]:
    """The audit's verify entries, what and why."""
    return [f"{e.what}: {e.why}" for e in site.federation.audit.entries() if e.kind == "verify"]


def test_a_move_resumes_from_the_verified_record_reading_no_pack(site):
    site.home_job_training()
    replicated(site, 20, 40)
    away = counted(site)

    lose_home(site)

    job = site.job()
    assert (job.cluster, job.resume_step, job.status) == ("rented", 40, JobStatus.RUNNING)
    assert away.bytes_read == 0  # the record and a listing: no pack crossed back
    assert any("run-a@40 verified in away: verified as written by checkpoint-sync" in k
               and "nothing read back" in k for k in verify_lines(site))
    record = read_record(Repository(site.stores["away"], KEY), RUN, 40)
    assert record is not None and record.by == "checkpoint-sync"


def test_a_missing_object_blocks_the_step_and_the_move_takes_the_one_before(site):
    site.home_job_training()
    replicated(site, 20, 40)
    site.stores["away"].delete(own_packs(site, 40)[0])
    away = counted(site)

    lose_home(site)

    assert site.job().resume_step == 20
    assert away.bytes_read == 0
    assert any("run-a@40 failed verification in away" in k for k in verify_lines(site))


def test_a_record_the_provider_forged_is_not_trusted_and_the_checkpoint_is_read(site):
    """A provider can write bytes under verified/ but cannot seal them: the record is not
    trusted, the checkpoint is read in full, and a damaged one is refused."""
    site.home_job_training()
    replicated(site, 20, 40)
    away = site.stores["away"]
    away.put(verified_name(RUN, 40), b'{"run": "run-a", "step": 40, "objects": {}}')
    pack = own_packs(site, 40)[0]
    damaged = bytearray(away.get(pack))
    damaged[len(damaged) // 2] ^= 0x01
    away.put(pack, bytes(damaged))

    lose_home(site)

    assert site.job().resume_step == 20
    lines = verify_lines(site)
    assert any("run-a@40's verification record in away is not trusted" in k for k in lines)
    assert any("run-a@40 failed verification in away" in k for k in lines)


def test_a_checkpoint_without_a_record_is_read_in_full_as_before(site):
    site.home_job_training()
    site.checkpoint("away", 20)  # written there by a job: no daemon verified it as written
    away = counted(site)

    lose_home(site)

    assert site.job().resume_step == 20
    assert away.bytes_read > 0
    assert any("no verification record" in k for k in verify_lines(site))


@pytest.mark.parametrize("resume, step, valid", [
    (Resume.AT_STEP, 40, True), (Resume.AT_STEP, None, False),
    (Resume.FROM_SCRATCH, None, True), (Resume.FROM_SCRATCH, 40, False),
    (Resume.REFUSED, None, True), (Resume.REFUSED, 40, False),
])
def test_a_resume_point_has_a_step_exactly_when_it_resumes_at_one(resume, step, valid):
    if not valid:
        with pytest.raises(ValueError):
            ResumePoint(resume, step)
        return
    point = ResumePoint(resume, step)
    assert (point.step, point.refused) == (step, resume is Resume.REFUSED)


@pytest.mark.parametrize("saved, lost, expected", [
    ((), (), FROM_SCRATCH),
    ((20, 40), (), ResumePoint.at(40)),
    ((20, 40), (40,), ResumePoint.at(20)),
    ((20,), (20,), REFUSED),
])
def test_the_resume_point_in_a_store_is_its_newest_verified_step(site, saved, lost, expected):
    site.home_job_training()
    replicated(site, *saved)
    for step in lost:
        site.stores["away"].delete(own_packs(site, step)[0])
    site.restart()
    job = site.state.jobs()[0]
    assert newest_verified(site.federation.wiring, job, "away") == expected


@pytest.mark.parametrize("paced", [False, True])
def test_the_wiring_gives_the_repository_of_a_named_store(site, paced):
    wiring = site.federation.wiring
    repository = wiring.repository("away", paced=paced)
    assert repository.store is (wiring.paced_stores if paced else wiring.stores)["away"]
    assert repository.master_keys.keys() == (KEY,)
