"""What Slurm tells a Prolog/Epilog (node or controller) about its job, read from the env.

Slurm 22.05 gives every hook SLURM_JOB_ID, SLURM_CLUSTER_NAME, SLURM_JOB_RESTART_COUNT
(already counted up when an epilog follows a requeue), SLURM_JOB_UID/GID, and the
directives the SPANK plugin handed over as SPANK_GEO_<NAME>. Node hooks also get
SLURMD_NODENAME; epilogs SLURM_JOB_EXIT_CODE2 ("exit:signal"); the controller's hooks
SLURM_JOB_COMMENT, where a job marks a requeue it planned (slurm_geo.policy.restarts).

A uid or gid that is missing or not a plain id is None, never a default: the hooks run as
root and act as the job's user, so with no user to act as they do nothing (hooks.entry).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from slurm_geo.jobenv import JobEnv
from slurm_geo.policy.directives import (
    DIRECTIVES,
    SPANK_PREFIX,
    DirectiveError,
    Directives,
    from_environment,
)

log = logging.getLogger("slurm_geo.hooks")


@dataclass(frozen=True)
class JobContext:
    cluster: str
    job_id: int
    restart: int
    uid: int | None  # None: missing or not an id; see `ids_known`
    gid: int | None
    user: str
    name: str
    node: str
    nodes: str
    exit_code: str
    directives: Directives
    comment: str = ""
    raw_directives: dict[str, str] = field(default_factory=dict)

    @property
    def ids_known(self) -> bool:
        return self.uid is not None and self.gid is not None

    @property
    def tag(self) -> str:
        """`<cluster>-<job id>`: names this job's files in its checkpoint directory."""
        return f"{self.cluster}-{self.job_id}"


def _int(text: str, default: int = 0) -> int:
    try:
        return int(text or default)
    except ValueError:
        return default


# (uid_t)-1 tells set*id(2) "leave this id unchanged": as the job's uid it would mean root.
_NO_ID = 2**32 - 1


def _id(text: str) -> int | None:
    """A uid or gid as Slurm writes it (decimal digits), or None."""
    if not (text.isascii() and text.isdigit()) or int(text) >= _NO_ID:
        return None
    return int(text)


def raw_directives(env: Mapping[str, str]) -> dict[str, str]:
    return {spec.option: env[SPANK_PREFIX + spec.env] for spec in DIRECTIVES
            if SPANK_PREFIX + spec.env in env}


def job_context(env: Mapping[str, str]) -> JobContext:
    """The job of this hook. Directives were checked at submission; one that no longer
    parses (a config change since) is logged and dropped, never fatal here."""
    raw = raw_directives(env)
    slurm = JobEnv.from_environ(env)
    try:
        directives = from_environment(env, SPANK_PREFIX)
    except DirectiveError as exc:
        log.warning("job %s: %s; keeping only the checkpoint directory", slurm.job_id or None,
                    exc)
        directives = Directives(ckpt_dir=raw.get("geo-ckpt-dir"))
    return JobContext(
        cluster=slurm.cluster,
        job_id=_int(slurm.job_id),
        restart=_int(slurm.job_restart_count),
        uid=_id(slurm.uid),
        gid=_id(slurm.gid),
        user=slurm.user,
        name=slurm.name,
        node=slurm.node,
        nodes=slurm.nodes,
        exit_code=slurm.exit_code2,
        directives=directives,
        comment=slurm.comment,
        raw_directives=raw,
    )
