"""Who pays: the cost center, CPU and GPU counts, and which job a checkpoint transfer served.

All pure. A job's cost center comes from the `--geo-cost-center` directive, which
job_submit.lua records in the admin comment as "geo:cost_center=NAME" (sacct and slurmrestd
do not show the environment); else the Slurm account; else none, and the job is flagged.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache

COST_CENTER_TAG = re.compile(r"(?:^|\s)geo:cost_center=([A-Za-z0-9][A-Za-z0-9._-]{0,63})(?=\s|$)")
NO_COST_CENTER = "(none)"

# TRES billing understands; any other is flagged (counted nowhere, shown in the report).
KNOWN_TRES = frozenset({"cpu", "mem", "node", "billing", "energy", "vmem", "pages",
                        "fs/disk", "fs/lustre", "ic/ofed", "gres/gpumem", "gres/gpuutil"})


def cost_center_of(admin_comment: str, comment: str, account: str) -> tuple[str, str]:
    """(cost center, where it came from: "directive", "account" or "none")."""
    for text in (admin_comment, comment):
        if match := COST_CENTER_TAG.search(text or ""):
            return match[1], "directive"
    if account:
        return account, "account"
    return "", "none"


def gpu_count(tres: Mapping[str, int]) -> int:
    """GPUs allocated: "gres/gpu", else the sum of typed "gres/gpu:MODEL" entries (Slurm
    reports both for typed GPUs, so the untyped total wins when present)."""
    if "gres/gpu" in tres:
        return tres["gres/gpu"]
    return sum(n for key, n in tres.items() if key.startswith("gres/gpu:"))


def unknown_tres(tres: Mapping[str, int]) -> list[str]:
    return sorted(key for key in tres
                  if key not in KNOWN_TRES and key != "gres/gpu"
                  and not key.startswith(("gres/gpu:", "gres/gpumem:", "gres/gpuutil:")))


def tres_facts(tres: Mapping[str, int]) -> tuple[str, int, tuple[str, ...]]:
    """(sacct's spelling, GPUs, unknown TRES) of an allocation; a month of accounting holds
    few distinct allocations, so the answers are remembered."""
    return _tres_facts(tuple(tres.items()))


@lru_cache(maxsize=4096)
def _tres_facts(items: tuple[tuple[str, int], ...]) -> tuple[str, int, tuple[str, ...]]:
    tres = dict(items)
    return tres_string(tres), gpu_count(tres), tuple(unknown_tres(tres))


def tres_string(tres: Mapping[str, int]) -> str:
    """sacct's own spelling: "cpu=2,gres/gpu=1,mem=2000,node=1"."""
    return ",".join(f"{key}={value}" for key, value in sorted(tres.items()))


@dataclass(frozen=True)
class RegistryJob:
    """A job the controller's registry knows, with its --geo-* directives."""

    cluster: str
    job_id: int
    logical_id: str
    user: str
    cost_center: str
    ckpt_dir: str
    first_seen: float


def job_for_run(run: str, source: str, jobs: Iterable[RegistryJob]) -> RegistryJob | None:
    """The job whose checkpoints a transfer of `run` (from root `source`) carried.

    A job's --geo-ckpt-dir names its checkpoint directory; a run is matched when that
    directory is the transfer's root or ends in the run's name. The latest such job wins
    (a run continued after a move keeps its name). None: nobody is known to own it.
    """
    root = source.removeprefix("file://").rstrip("/")
    found = [j for j in jobs if j.ckpt_dir and (
        j.ckpt_dir.rstrip("/") == root or j.ckpt_dir.rstrip("/").rsplit("/", 1)[-1] == run)]
    return max(found, key=lambda j: j.first_seen) if found else None
