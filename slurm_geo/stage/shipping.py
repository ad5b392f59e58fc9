"""A moved job's log and outputs shipped home while it runs and when it ends (issue 31
item 6): what the preamble (stage.run) plugs into `enter_world`'s hooks.

`at_start` (right before the job's script starts) starts a `stage.outputs.PeriodicShipper`
of the job's log (the file the preamble's own standard output is: Slurm's `--output`,
which the script shares) and of each `--geo-outputs` root where it lies on the node (the
presentation's; at its home path in no mode the preamble sees, since the preamble runs
outside the job's namespace). `at_exit` stops it, which ships once more, final, before
the workspace is removed. Everything is put into the site's store under the run's key,
as the job's owner; checkpoint-sync brings it home. A failure to ship is one line on the
job's error output and never changes the job's exit code.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

from slurm_geo.ckpt.format.keys import RunKeyRing
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.jobenv import JobEnv
from slurm_geo.stage.outputs import PeriodicShipper, incarnation_name
from slurm_geo.stage.preamble import Finished
from slurm_geo.stage.present import Presentation

ENV_SHIP_INTERVAL = "SLURM_GEO_SHIP_INTERVAL_S"
DEFAULT_SHIP_INTERVAL_S = 60.0


def log_file(fd: int = 1) -> Path | None:
    """The regular file `fd` writes to (Slurm's --output for a batch step), else None."""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return Path(target) if target.startswith("/") else None


def output_roots(presentation: Presentation | None) -> dict[str, Path]:
    """Each `--geo-outputs` home path and where it lies on the node."""
    if presentation is None:
        return {}
    return {root.home: root.at for root in presentation.roots if root.what == "output"}


def ship_interval(env: Mapping[str, str]) -> float:
    try:
        return max(1.0, float(env.get(ENV_SHIP_INTERVAL, DEFAULT_SHIP_INTERVAL_S)))
    except ValueError:
        return DEFAULT_SHIP_INTERVAL_S


class OutputsUploader:
    """`start` and `finish`: `enter_world`'s `at_start` and `at_exit`."""

    def __init__(self, store: Store, ring: RunKeyRing, run: str, cluster: str, job: str,
                 log: Path | None, every_s: float = DEFAULT_SHIP_INTERVAL_S,
                 err: TextIO = sys.stderr):
        self._args = (store, ring, run, incarnation_name(cluster, job), log)
        self._every_s = every_s
        self._err = err
        self._shipper: PeriodicShipper | None = None

    @classmethod
    def from_environment(cls, store: Store, ring: RunKeyRing, run: str,
                         env: Mapping[str, str], job: str) -> OutputsUploader | None:
        """The uploader of the incarnation these variables describe; None where Slurm
        named no cluster (nothing to name its objects by)."""
        cluster = JobEnv.from_environ(env).cluster
        if not cluster:
            return None
        return cls(store, ring, run, cluster, job, log_file(), ship_interval(env))

    def start(self, presentation: Presentation | None) -> None:
        store, ring, run, incarnation, log = self._args
        self._shipper = PeriodicShipper(store, ring, run, incarnation, log,
                                        output_roots(presentation), self._every_s).start()

    def finish(self, finished: Finished) -> None:
        if self._shipper is None:
            self.start(finished.presentation)
        assert self._shipper is not None
        try:
            report = self._shipper.stop()
        except Exception as exc:  # the job's result stands: its outputs stay in the store
            print(f"slurm-geo: error: shipping the job's log and outputs home: {exc}",
                  file=self._err, flush=True)
            return
        if report.skipped:
            print(f"slurm-geo: outputs: not shipped (links or special files): "
                  f"{', '.join(report.skipped)}", file=self._err, flush=True)
