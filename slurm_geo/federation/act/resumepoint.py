"""Where a moved job resumes: the newest checkpoint of its run that is verified in the
target store, and known not to have been rolled back (docs/format.md §8.6, §8.7).

A step is verified by its verification record (slurm_geo.ckpt.ops.verified: sealed by the
daemon that verified it as written, readable at any site) and a presence check of the
objects it names: no object is read, so a move costs the same whatever the checkpoint's
size. A step without a (trusted) record is read and verified in full, as before records
existed. The new incarnation's own load stays the last check (it falls back to an older
step if the chosen one does not read back intact: slurm_geo.torch.checkpointer).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from slurm_geo.ckpt import Repository
from slurm_geo.ckpt.errors import CkptError, StoreUnavailable
from slurm_geo.ckpt.format.rollback import high_water, rollback
from slurm_geo.ckpt.ops.verified import absent, read_record
from slurm_geo.ckpt.repo.fence import unadmitted_steps
from slurm_geo.federation.act.fencing import daemon_lookup, known_fence
from slurm_geo.federation.act.highwater import sync_marks
from slurm_geo.federation.model import LogicalJob
from slurm_geo.federation.wiring import Wiring

VERIFY_OLDER_LIMIT = 5  # checkpoints tried, newest first, before a move gives up


class Resume(Enum):
    AT_STEP = "at step"  # from the checkpoint `step`
    FROM_SCRATCH = "from scratch"  # the run has no checkpoint in the store
    REFUSED = "refused"  # checkpoints exist but none verifies, or the store rolled back


@dataclass(frozen=True)
class ResumePoint:
    """Where a moved job resumes in the target store; `step` is set for AT_STEP only."""

    resume: Resume
    step: int | None = None

    def __post_init__(self) -> None:
        if (self.step is not None) != (self.resume is Resume.AT_STEP):
            raise ValueError(f"{self.resume.value} with step {self.step!r}")

    @classmethod
    def at(cls, step: int) -> ResumePoint:
        return cls(Resume.AT_STEP, step)

    @property
    def refused(self) -> bool:
        """The move must not happen: it would resume from unverified or older data."""
        return self.resume is Resume.REFUSED


FROM_SCRATCH = ResumePoint(Resume.FROM_SCRATCH)
REFUSED = ResumePoint(Resume.REFUSED)


def newest_verified(w: Wiring, job: LogicalJob, store_name: str) -> ResumePoint:
    """The newest step the store's fence admits that is verified in `store_name` (of the
    VERIFY_OLDER_LIMIT newest); FROM_SCRATCH when the run has no such checkpoint there;
    REFUSED (and audited) when checkpoints exist but none is verified, or the store rolled
    back. A store that cannot be reached raises StoreUnavailable."""
    repository = w.repository(store_name, paced=True)
    listed = repository.steps(job.run)
    rolled_back = rollback(job.run, store_name, listed, high_water_in(w, job, store_name))
    if rolled_back is not None:  # never a silent resume from older data (format §8.6)
        w.say_once(("rolled_back", job.logical_job, store_name, str(rolled_back.newest)),
                   "verify", job.logical_job, f"{job.run} rolled back in {store_name}",
                   str(rolled_back), run=job.run, store=store_name,
                   newest=rolled_back.newest, high_water=rolled_back.high_water)
        return REFUSED
    stale = set(unadmitted_steps(repository, job.run, daemon_lookup(known_fence(job))))
    steps = [s for s in listed if s not in stale]
    if not steps:
        w.audit.append("verify", job.logical_job, f"no checkpoint of {job.run} in "
                       f"{store_name}", "the new incarnation starts from scratch",
                       store=store_name)
        return FROM_SCRATCH
    for step in reversed(steps[-VERIFY_OLDER_LIMIT:]):
        if resumable(w, job, repository, step, store_name):
            return ResumePoint.at(step)
    return REFUSED


def resumable(w: Wiring, job: LogicalJob, repository: Repository, step: int,
              store_name: str) -> bool:
    """Whether the move may resume from `run@step` in `store_name`, audited: from its
    verification record (slurm_geo.ckpt.ops.verified) and a presence check of what it
    names, reading nothing; a checkpoint without a record is read in full instead."""
    faults: list[str] | None
    try:
        record = read_record(repository, job.run, step)
        faults = None if record is None else absent(repository, record)
    except StoreUnavailable as exc:
        record, faults = None, [str(exc)]
    except CkptError as exc:  # altered, or not the daemons': trusted no more than none
        w.audit.append("verify", job.logical_job, f"{job.run}@{step}'s verification "
                       f"record in {store_name} is not trusted", str(exc),
                       run=job.run, step=step)
        record, faults = None, None
    if faults is None:
        faults = [str(f) for f in repository.verify(job.run, step)]
        how = "no verification record: read back, it verifies in full"
    else:
        how = (f"verified as written by {record.by if record else '-'}; all "
               f"{len(record.objects) if record else 0} objects it names are there "
               "(nothing read back)")
    if not faults:
        w.audit.append("verify", job.logical_job, f"{job.run}@{step} verified in "
                       f"{store_name}", how, run=job.run, step=step, store=store_name)
        return True
    w.audit.append("verify", job.logical_job, f"{job.run}@{step} failed "
                   f"verification in {store_name}", faults[0],
                   run=job.run, step=step, faults=len(faults))
    return False


def high_water_in(w: Wiring, job: LogicalJob, store_name: str) -> int | None:
    """The newest step of the run known, outside the store, to have been saved in it:
    the step this daemon last resumed the run from there, and the newest one
    checkpoint-sync verified there (docs/format.md §8.6)."""
    marks = [job.resume_step if w.store_of(job.cluster) == store_name else None]
    return high_water([*marks, *sync_marks(w, job.run, store_name)])
