"""Jobs run as their owner: who that is, which of their directives count, what of their
environment later incarnations get, and where they can run. Pure.

The owner is whom Slurm's job record names (user, uid, gid) when the daemon registers the
job, never a field of a request. Every incarnation the daemon submits runs as them:
through slurm-geo-submit-as on a CLI cluster (slurm_geo.slurm.submit_as), as the account
`[clusters.NAME.users]` maps them to on a REST cluster; a user mapped to none cannot run
there (`owner_refusal`).

The directives are what Slurm validated: PrologSlurmctld's record in the registry, else,
for a job that has not started yet, what the SPANK plugin handed Slurm, as sbatch puts it
in the job's stored environment (`SLURM_SPANK_GEO_<NAME>`), or the `SLURM_GEO_<NAME>`
variables job_submit.lua reads when there are none (`accepted_directives`). Never the
script: sbatch ignores an indented `#SBATCH` line, and so does the daemon.

A submission's environment has four parts, a later one winning a name:
  1. the owner's own, from Slurm's copy of what they submitted with (sacct --env-vars),
     allow-listed (`owner_environment`): OWNER_NAMES and names starting with one of
     OWNER_PREFIXES; HOME, USER and LOGNAME only where the job runs as that same account
     (a CLI cluster), not under another account's name on a REST cluster;
  2. the store credentials federation.credentials scopes for the job's store;
  3. the job's directives as SLURM_GEO_<NAME>;
  4. what the new incarnation is told (SLURM_GEO_LOGICAL_JOB, _GENERATION, ...).
Nothing else of the daemon's environment reaches a job.
"""

from __future__ import annotations

from collections.abc import Mapping

from slurm_geo.config.model import ClusterConfig
from slurm_geo.policy.directives import CONTROL_PREFIX, DIRECTIVES, JOB_PREFIX
from slurm_geo.slurm.models import Owner

# What the owner's environment may pass on: their paths, locale, Python, modules, conda.
OWNER_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR",
    "PYTHONPATH", "PYTHONUNBUFFERED", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "MANPATH",
    "OMP_NUM_THREADS", "MODULEPATH", "MODULESHOME", "LOADEDMODULES", "_LMFILES_",
    "BASH_FUNC_module%%", "BASH_FUNC_ml%%",
})
OWNER_PREFIXES = ("LC_", "CONDA_", "LMOD_")
IDENTITY_NAMES = frozenset({"HOME", "USER", "LOGNAME"})

# sbatch copies every entry of the SPANK plugin's job-control environment (GEO_<NAME>)
# into the job's environment as SLURM_SPANK_<entry> (sbatch.c, _set_spank_env).
BATCH_SPANK_PREFIX = "SLURM_SPANK_" + CONTROL_PREFIX


def owner_environment(env: Mapping[str, str], same_account: bool = True) -> dict[str, str]:
    """The part of the owner's environment a later incarnation gets again."""
    return {name: value for name, value in env.items()
            if (name in OWNER_NAMES or name.startswith(OWNER_PREFIXES))
            and (same_account or name not in IDENTITY_NAMES)}


def accepted_directives(batch_env: Mapping[str, str]) -> dict[str, str]:
    """`{option: value}` (options without "--") of the directives Slurm accepted for a job
    that has no registry record yet, from its stored environment; {} if it has none."""
    for prefix in (BATCH_SPANK_PREFIX, JOB_PREFIX):
        found = {spec.option: batch_env[prefix + spec.env] for spec in DIRECTIVES
                 if prefix + spec.env in batch_env}
        if found:
            return found
    return {}


def owner_refusal(cluster: ClusterConfig, owner: Owner | None) -> str:
    """Why a job of `owner` cannot run on `cluster` ('' when it can)."""
    if owner is None:
        return "the job's owner is unknown (registered before slurm-geo recorded owners)"
    if cluster.access == "rest" and owner.user not in cluster.users:
        return (f"no account for {owner.user} on {cluster.name} "
                f"([clusters.{cluster.name}.users] maps none)")
    return ""


def own_dir(cluster: ClusterConfig, owner: Owner | None) -> str | None:
    """Where `owner`'s jobs run on `cluster` when it has none of home's files: the
    `work_dir` of the account `[clusters.NAME.users]` maps them to; None when it names
    none (the cluster shares home's filesystem)."""
    if owner is None or cluster.access != "rest" or owner.user not in cluster.users:
        return None
    found = cluster.users[owner.user].work_dir
    return None if found is None else str(found)
