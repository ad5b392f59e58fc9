"""Who pays: the cost center of an accounting record, and its CPU and GPU counts. Pure.

A job's cost center comes from the `--geo-cost-center` directive, which job_submit.lua
records in the admin comment as "geo:cost_center=NAME" (sacct and slurmrestd do not show
the environment); else the directive its logical job was registered with (a leg the
federation daemon submitted on a cluster whose job_submit.lua does not tag it); else the
Slurm account; else none, and the job is flagged. Which logical job a Slurm job or a
checkpoint transfer belongs to is `billing.lineage`'s.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

COST_CENTER_TAG = re.compile(r"(?:^|\s)geo:cost_center=([A-Za-z0-9][A-Za-z0-9._-]{0,63})(?=\s|$)")
NO_COST_CENTER = "(none)"

# TRES billing understands; any other is flagged (counted nowhere, shown in the report).
KNOWN_TRES = frozenset({"cpu", "mem", "node", "billing", "energy", "vmem", "pages",
                        "fs/disk", "fs/lustre", "ic/ofed", "gres/gpumem", "gres/gpuutil"})


def cost_center_of(admin_comment: str, comment: str, account: str, recorded: str = ""
                   ) -> tuple[str, str]:
    """(cost center, where it came from: "directive", "logical job", "account" or "none").
    `recorded`: the --geo-cost-center the job's logical job was registered with."""
    for text in (admin_comment, comment):
        if match := COST_CENTER_TAG.search(text or ""):
            return match[1], "directive"
    if recorded:
        return recorded, "logical job"
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
