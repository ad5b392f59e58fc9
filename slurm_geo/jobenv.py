"""What Slurm tells a job, and the hooks it runs for a job, in the environment: the one
reader of Slurm's own `SLURM_*` variables (tests/test_layers.py holds every other module
to it; slurm-geo's own `SLURM_GEO_*` are read where they are used, and the Slurm layer,
slurm_geo.slurm, builds the environments it submits).

Each field is the text Slurm set, "" where it set none; callers keep their own defaults.
Imports nothing of slurm_geo: the srun shim and the hooks read it on every start.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class JobEnv:
    job_id: str = ""             # SLURM_JOB_ID
    cluster: str = ""            # SLURM_CLUSTER_NAME
    restart_count: str = ""      # SLURM_RESTART_COUNT: in the job (batch script, steps)
    job_restart_count: str = ""  # SLURM_JOB_RESTART_COUNT: in the prologs and epilogs
    user: str = ""               # SLURM_JOB_USER
    uid: str = ""                # SLURM_JOB_UID
    gid: str = ""                # SLURM_JOB_GID
    name: str = ""               # SLURM_JOB_NAME
    node: str = ""               # SLURMD_NODENAME: the node a step or node hook runs on
    job_nodelist: str = ""       # SLURM_JOB_NODELIST
    nodelist: str = ""           # SLURM_NODELIST (older name, and slurmctld's hooks)
    job_num_nodes: str = ""      # SLURM_JOB_NUM_NODES
    nnodes: str = ""             # SLURM_NNODES (older name)
    exit_code2: str = ""         # SLURM_JOB_EXIT_CODE2: "exit:signal", in the epilogs
    comment: str = ""            # SLURM_JOB_COMMENT
    slurm_conf: str = ""         # SLURM_CONF: the slurm.conf Slurm's commands read

    @classmethod
    def from_environ(cls, env: Mapping[str, str] = os.environ) -> JobEnv:
        """The job's variables out of `env` (default: this process's environment)."""
        return cls(**{f.name: env.get(VARIABLES[f.name], "") for f in dataclasses.fields(cls)})

    @property
    def nodes(self) -> str:
        """The job's nodes, as Slurm writes a host list ("" outside a job)."""
        return self.job_nodelist or self.nodelist

    @property
    def num_nodes(self) -> str:
        return self.job_num_nodes or self.nnodes


VARIABLES = {
    "job_id": "SLURM_JOB_ID", "cluster": "SLURM_CLUSTER_NAME",
    "restart_count": "SLURM_RESTART_COUNT", "job_restart_count": "SLURM_JOB_RESTART_COUNT",
    "user": "SLURM_JOB_USER", "uid": "SLURM_JOB_UID", "gid": "SLURM_JOB_GID",
    "name": "SLURM_JOB_NAME", "node": "SLURMD_NODENAME",
    "job_nodelist": "SLURM_JOB_NODELIST", "nodelist": "SLURM_NODELIST",
    "job_num_nodes": "SLURM_JOB_NUM_NODES", "nnodes": "SLURM_NNODES",
    "exit_code2": "SLURM_JOB_EXIT_CODE2", "comment": "SLURM_JOB_COMMENT",
    "slurm_conf": "SLURM_CONF",
}
