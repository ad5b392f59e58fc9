"""srun's entry to tests/dcp_ranks.py's workers, for the sandbox:
`srun python dcp_srun.py WORKER 'JSON list of arguments'`. Every task joins the job's
process group (rank SLURM_PROCID of SLURM_NTASKS, rank 0 on srun's launch node, a port
from the job id), runs WORKER(rank, world, *arguments) and ends as the product's trainers
end (slurm_geo.torch.exit.run_rank)."""

from __future__ import annotations

import json
import os
import sys

import dcp_ranks

from slurm_geo.torch.exit import run_rank


def main() -> int:
    worker = getattr(dcp_ranks, sys.argv[1])
    port = 20000 + int(os.environ["SLURM_JOB_ID"]) % 20000
    os.environ["MASTER_ADDR"] = os.environ.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")
    dcp_ranks.join(int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"]), port,
                   worker, tuple(json.loads(sys.argv[2])))
    return 0


if __name__ == "__main__":
    run_rank(main)
