"""`ckpt push` and `ckpt pull` of files: torch.save and safetensors files (without torch),
and multi-rank checkpoints pulled to files torch reads (with torch)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import click

from slurm_geo.cli.progress import progress
from slurm_geo.errors import ConfigError
from slurm_geo.jobenv import JobEnv


def push_tensor_file(path: Path, repository, run: str, step: int, as_json: bool) -> dict:
    """Without torch: the file is read through a restricted unpickler, mapped."""
    from slurm_geo.ckpt import Metadata
    from slurm_geo.ckpt.files import pushpull

    job = JobEnv.from_environ()
    metadata = Metadata(global_step=step, optimizer_step=step, epoch=0, loss=None,
                        created_at=datetime.now(UTC).isoformat(),
                        cluster=job.cluster, job_id=job.job_id)
    with progress(f"push {run}@{step}", as_json) as bar:
        manifest, nbytes = pushpull.push_tensor_file(repository, path, run, metadata, on_bytes=bar)
    return {"run": run, "step": step, "parent": manifest.parent_step,
            "tensors": len(manifest.tensors), "bytes": nbytes}


def pull_tensor_file(repository, run: str, step: int, path: Path, as_json: bool) -> dict:
    """Without torch, streaming: a file torch.load(weights_only=True) reads, or a
    safetensors file."""
    from slurm_geo.ckpt.files import pushpull

    with progress(f"pull {run}@{step}", as_json) as bar:
        left_out = pushpull.pull_tensor_file(repository, run, step, path, on_bytes=bar)
    if left_out and not as_json:
        click.echo(f"slurm-geo: note: {path.name} holds the model's weights only (safetensors "
                   f"holds tensors); left out: {', '.join(left_out)}; pull to FILE.pt for "
                   "the whole training state", err=True)
    return {"run": run, "step": step, "to": str(path), "bytes": bar.done,
            **({"left_out": left_out} if left_out else {})}


def pull_multi_rank(store_url: str, key_file: Path, run: str, step: int, path: Path) -> dict:
    """A DCP checkpoint directory, or FILE.pt: files torch reads without slurm-geo."""
    if path.suffix == ".safetensors":
        raise ConfigError(f"{run}@{step} is a multi-rank checkpoint: pull it to FILE.pt or a "
                          "directory, not to a safetensors file")
    try:
        from slurm_geo.torch.dcp_export import (
            load_whole_state,
            write_dcp_directory,
            write_torch_file,
        )
    except ImportError as exc:
        raise ConfigError(f"{run}@{step} is a multi-rank checkpoint (saved through "
                          f"torch.distributed.checkpoint); pulling it needs PyTorch ({exc}): "
                          "pip install torch") from None
    state = load_whole_state(store_url, run=run, step=step, key_file=key_file)
    if path.suffix == ".pt":
        write_torch_file(state, path)
        return {"run": run, "step": step, "to": str(path), "as": "torch.save",
                "bytes": path.stat().st_size}
    write_dcp_directory(state, path)
    return {"run": run, "step": step, "to": str(path), "as": "dcp",
            "bytes": sum(f.stat().st_size for f in path.rglob("*") if f.is_file())}
