"""srun's entry to tests/dcp_ranks.py's workers, for the sandbox:
`srun python dcp_srun.py WORKER 'JSON list of arguments'`. Every task joins the job's
process group (rank SLURM_PROCID of SLURM_NTASKS, rank 0 on srun's launch node, a port
from the job id) and runs WORKER(rank, world, *arguments)."""

from __future__ import annotations

import json
import os
import sys

import dcp_ranks


def main() -> None:
    worker = getattr(dcp_ranks, sys.argv[1])
    port = 20000 + int(os.environ["SLURM_JOB_ID"]) % 20000
    os.environ["MASTER_ADDR"] = os.environ.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")
    dcp_ranks.join(int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"]), port,
                   worker, tuple(json.loads(sys.argv[2])))


if __name__ == "__main__":
    main()
