"""Example trainers wired to slurm_geo.torch, run by the sandbox, the drills, the benchmarks
and docs/training.md's walk-throughs; not part of the library (slurm_geo.torch never imports
them).

- `python -m slurm_geo.examples.train`: a small deterministic CPU trainer with Checkpointer
  and RequeueOnSignal, --federated to hold a training lease;
- `python -m slurm_geo.examples.sharded_train`: a federated FSDP2 trainer over gloo, one
  rank per Slurm task;
- `torchrun ... -m slurm_geo.examples.dcp_train`: FSDP2 + torch.distributed.checkpoint into
  a slurm-geo repository.
"""
