"""A scrub turn with `[sync] scrub_at = "destination"`: no replica read back.

`slurm-geo sync scrub-here` (slurm_geo.ckpt.stores.scrub_store), run next to the destination
store, has read its packs and written `scrub/report`. The turn reads that report (a few
KB), opens the replica's own sealed objects (the run's key ring and its manifest: KB, and
only checkpoint-sync holds the key), lists its packs with their sizes (one listing per
pack directory), and judges (`slurm_geo.sync.scrub.judge_report`). Damage goes the way a
read-back's does (slurm_geo.sync.worker, `Attempt._scrub`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from slurm_geo.ckpt.errors import CkptError, CorruptObject, ObjectMissing, StoreUnavailable
from slurm_geo.ckpt.format.keys import MasterKeys
from slurm_geo.ckpt.format.manifest import Manifest, with_bases
from slurm_geo.ckpt.repo.repository import Repository
from slurm_geo.ckpt.stores.pacing import PacedStore
from slurm_geo.ckpt.stores.scrub_store import ScrubReport, read_report
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.daemon.events import event
from slurm_geo.sync.scrub import NO_REPORT, REPORT_MARK, Findings, judge_report, last_checked
from slurm_geo.sync.state import Replica, StateDB

log = logging.getLogger("slurm_geo.sync")
Turn = tuple[Repository, list[CkptError], float, str | None]



@dataclass(frozen=True)
class RemoteScrub:
    """The turn's faults (as a read-back reports them); `checked_at`, the moment the
    replica's packs were last read whole at the destination (the report's start) when the
    report counts; `stale`, why it does not."""

    repository: Repository
    faults: list[CkptError]
    report: ScrubReport | None
    checked_at: float | None = None
    stale: str | None = None


def scrub_here_report(state: StateDB, destination: PacedStore, keys: MasterKeys,
                      replica: Replica, record_read: Callable[[float], None],
                      clock: Callable[[], float] = time.time) -> Turn:
    """`scrub_by_report` as a scrub turn uses it: the repository, the faults, when the
    packs were last read whole (the report's start; now, when the report is no news) and
    why the report is no news (None when it counts). Its reads are counted
    (`destination.bytes_read`, recorded as the turn's read-back by `record_read(started)`),
    the report's age kept for the metrics (`REPORT_MARK`), a stale report said so in an
    event."""
    started = clock()
    destination.bytes_read = 0
    remote = scrub_by_report(destination, keys, replica)
    record_read(started)
    state.set_mark(report_mark(replica.destination),
                   NO_REPORT if remote.report is None else repr(remote.report.finished_at))
    if remote.stale:
        event(log, "scrub_report_stale", run=replica.run, step=replica.step,
              destination=replica.destination, reason=remote.stale,
              report_started_at=None if remote.report is None else remote.report.started_at)
    checked_at = started if remote.checked_at is None else remote.checked_at
    return remote.repository, remote.faults, checked_at, remote.stale


def report_mark(destination: str) -> str:
    return f"{REPORT_MARK}:{destination}"


def scrub_by_report(destination: Store, keys: MasterKeys, replica: Replica) -> RemoteScrub:
    """Judge `replica` from the destination's report and a few KB of its own objects. An
    outage raises `StoreUnavailable`: what cannot be read is not known to be damaged."""
    repository = Repository(destination, keys)
    try:
        report = read_report(destination)
        unreadable = None
    except CorruptObject as exc:
        report, unreadable = None, f"the scrub report is unreadable ({exc.detail})"
    try:
        manifest = repository.manifest(replica.run, replica.step)
    except StoreUnavailable:
        raise
    except CkptError as exc:  # the run's key or the manifest is damaged or gone
        return RemoteScrub(repository, [exc], report)
    needed = pack_needs(manifest)
    listed: dict[str, int] = {}
    for directory in sorted({n.rpartition("/")[0] + "/" for n in needed}):
        listed.update(destination.sizes(directory))
    findings = judge_report(None if report is None else report.started_at,
                            () if report is None else report.damaged,
                            last_checked(replica), needed, listed)
    faults = faults_of(findings)
    stale = unreadable or findings.stale
    checked_at = report.started_at if report is not None and stale is None else None
    return RemoteScrub(repository, faults, report, checked_at, stale)


def pack_needs(manifest: Manifest) -> dict[str, int]:
    """Each pack the checkpoint reads (delta bases included) and the byte its entries reach."""
    needs: dict[str, int] = {}
    for ref in with_bases(manifest.refs()):
        name = manifest.pack_object(ref.pack)
        needs[name] = max(needs.get(name, 0), ref.offset + ref.length)
    return needs


def faults_of(findings: Findings) -> list[CkptError]:
    return [*(CorruptObject(name, why) for name, why in findings.damaged),
            *(ObjectMissing(name) for name in findings.missing)]
