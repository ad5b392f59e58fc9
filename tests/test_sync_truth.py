"""The epilog's "replicated" is checkpoint-sync's truth (issue 29): a directory meant to be
replicated whose checkpoints keep failing (a run sealed under the user's own key failed 18
times while the epilog said `replicated: true`) is recorded `replicated: false`, with
why; so is one whose source row is a problem. Pure: slurm_geo.sync.truth."""

from __future__ import annotations

import pytest

from slurm_geo.sync.jobdirs import Protection, SourceStatus
from slurm_geo.sync.state import Replica, Source
from slurm_geo.sync.state import Status as S
from slurm_geo.sync.truth import failing_runs, sync_verdict

MEANT = Protection("file:///pfs/a", True, "job directory")
ROOT = "file:///pfs/a"


def replica(step, status, failures=0, run="r", error=None):
    return Replica(id=step, root=ROOT, run=run, step=step, destination="offsite", sequence=0,
                   status=status, promoted=False, manifest_sha256=None, bytes=0, attempts=0,
                   failures=failures, charged=0, outages=0, corruptions=0, created_at=None,
                   discovered_at=0.0, started_at=None, replicated_at=None, verified_at=None,
                   next_attempt_at=0.0, lag_s=None, last_error=error)


def source(status, detail=None):
    return Source(ROOT, "job", "/pfs/a", status, ("onprem:1",), ("alice",), detail)


KEY = "sealed under another key"


@pytest.mark.parametrize(("source_row", "replicas", "run", "replicated", "why"), [
    (None, [], None, True, None),                                    # nothing seen yet
    (source(SourceStatus.WATCHED), [replica(10, S.VERIFIED)], "r", True, None),
    (None, [replica(10, S.PENDING), replica(5, S.VERIFIED)], "r", True, None),  # on its way
    (None, [replica(10, S.PENDING, 18, error=KEY)], "r", False,      # her own key
     f"run r: checkpoint-sync has not replicated step 10 to offsite (retrying after 18 "
     f"failed attempts: {KEY})"),
    (None, [replica(10, S.FAILED, 3, error="denied")], None, False,
     "run r: checkpoint-sync has not replicated step 10 to offsite (gave up after 3 failed "
     "attempts: denied)"),
    (None, [replica(10, S.CORRUPTED, 1)], "r", False,
     "run r: checkpoint-sync has not replicated step 10 to offsite (found it damaged after "
     "1 failed attempt: -)"),
    (None, [replica(10, S.FAILED, 3), replica(20, S.VERIFIED)], "r", True, None),  # past it
    (None, [replica(10, S.FAILED, 3, run="old")], "r", True, None),  # another run's
    (source(SourceStatus.UNREADABLE, "permission denied"), [], None, False,
     "checkpoint-sync finds the directory unreadable: permission denied"),
    (source(SourceStatus.CONFLICT, "run r is also in pfs"), [], "r", False,
     "checkpoint-sync finds the directory conflict: run r is also in pfs"),
    (source(SourceStatus.KEPT_HOME, "residency home"), [], "r", False,
     "checkpoint-sync finds the directory kept_home: residency home"),
])
def test_the_verdict_is_the_states(source_row, replicas, run, replicated, why):
    verdict = sync_verdict(MEANT, source_row, replicas, run)
    assert verdict.replicated is replicated
    assert verdict == (MEANT if replicated else Protection(None, False, why))


def test_a_directory_not_meant_to_be_replicated_stays_so():
    home = Protection(None, False, "its --geo-residency=home excludes 'remote'")
    assert sync_verdict(home, None, [replica(1, S.VERIFIED)], None) == home


def test_failing_runs_names_each_run_and_destination_once():
    found = failing_runs([replica(1, S.FAILED, 2, run="a"), replica(2, S.PENDING, 1, run="a"),
                          replica(3, S.PENDING, 0, run="b"), replica(4, S.SKIPPED, 9, run="b")])
    assert [(f.run, f.step, f.failures) for f in found] == [("a", 2, 1)]
