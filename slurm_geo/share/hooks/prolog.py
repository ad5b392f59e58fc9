#!/usr/bin/env python3
"""slurm-geo Prolog (node): prepares a geo job's checkpoint directory and, for a resumed
incarnation, stages the checkpoint it resumes from. Install as slurm.conf's Prolog=.

Jobs without --geo-ckpt-dir exit here at once, before anything is imported: this runs
before every job on the node (docs/benchmarks.md: the fast path), and a failing Prolog
would drain the node. For geo jobs the work is in slurm_geo.hooks, which never fails the
job for slurm-geo's own trouble (docs/admin-slurm.md).
"""
import os
import sys

if "SPANK_GEO_CKPT_DIR" not in os.environ:
    sys.exit(0)

from slurm_geo.hooks.entry import run_hook  # noqa: E402

sys.exit(run_hook("prolog"))
