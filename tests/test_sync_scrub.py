"""The scrub: verified replicas read back again at a paced rate; damage found is marked
corrupted and repaired from the source while it still holds the checkpoint."""

from __future__ import annotations

import sqlite3

import pytest
from sqlite_utils import Database

from slurm_geo.ckpt.format.names import manifest_name
from slurm_geo.ckpt.ops.check import READ_ALL, check_store
from slurm_geo.sync.daemon import _parse_last_scrub
from slurm_geo.sync.metrics import Live, SyncCollector
from slurm_geo.sync.scrub import DAY_S, LastScrub, pick_scrub, scrub_due_at
from slurm_geo.sync.state import _REPLICA_COLUMNS, Replica, StateDB
from slurm_geo.sync.worker import Outcome
from tests.kit.fence import KEY
from tests.kit.scrub import S, Site

GB = 1e9


# --- pacing and choice: pure, table-driven ---------------------------------------------

@pytest.mark.parametrize("rate, last, due", [
    (0, None, None),                                  # off
    (0, LastScrub(100.0, 10**9), None),
    (100 * GB, None, 0.0),                            # never scrubbed: at once
    (100 * GB, LastScrub(1000.0, 0), 1000.0),         # read nothing: no wait
    (100 * GB, LastScrub(1000.0, 10**9), 1000.0 + DAY_S / 100),  # 1 GB of 100 a day
    (1 * GB, LastScrub(0.0, 10**9), DAY_S),           # a day's worth: a day
    (2 * GB, LastScrub(50.0, 3 * 10**9), 50.0 + 1.5 * DAY_S),
])
def test_the_next_scrub_waits_what_the_last_read_at_the_rate(rate, last, due):
    assert scrub_due_at(rate, last) == due


def row(id, status=S.VERIFIED, *, verified_at=None, scrubbed_at=None):
    return Replica(
        id=id, root="pfs", run="r", step=id, destination="offsite", sequence=id,
        status=status, promoted=False, manifest_sha256=None, bytes=0, attempts=0,
        failures=0, charged=0, outages=0, corruptions=0, created_at=None, discovered_at=0.0,
        started_at=None, replicated_at=None, verified_at=verified_at, next_attempt_at=0.0,
        lag_s=None, last_error=None, scrubbed_at=scrubbed_at)


@pytest.mark.parametrize("rows, picked", [
    ([], None),
    ([row(1, verified_at=60), row(2, verified_at=20, scrubbed_at=70)], None),  # too recent
    ([row(1, verified_at=50), row(2, verified_at=60)], 1),       # only 1 is 50 s old
    ([row(1, S.PENDING), row(2, S.CORRUPTED), row(3, S.SKIPPED)], None),  # only verified
    ([row(1, verified_at=50), row(2, verified_at=10)], 2),       # read longest ago first
    ([row(1, verified_at=10, scrubbed_at=90), row(2, verified_at=40)], 2),  # scrubs count
    ([row(1, verified_at=90, scrubbed_at=10), row(2, verified_at=40)], 2),  # so do repairs
    ([row(2, verified_at=10), row(1, verified_at=10)], 1),       # ties: the oldest row
    ([row(1, S.UPLOADING, verified_at=0), row(2, verified_at=55)], 2),
])
def test_the_replica_read_longest_ago_is_scrubbed_next(rows, picked):
    chosen = pick_scrub(rows, now=100.0, interval_s=45.0)
    assert (chosen.id if chosen else None) == picked


@pytest.mark.parametrize("mark, parsed", [
    (None, None), ("", None), ("junk", None), ("12.5 300", LastScrub(12.5, 300)),
])
def test_the_pacing_mark_survives_restarts(mark, parsed):
    assert _parse_last_scrub(mark) == parsed


# --- the scrub against directory stores -------------------------------------------------


@pytest.fixture
def site(tmp_path) -> Site:
    return Site(tmp_path)


def test_a_sound_replica_is_read_back_and_stays_verified(site):
    result = site.attempt().scrub(site.state.replica(site.ids[0]))
    assert result.outcome is Outcome.SCRUBBED and result.bytes_read > 0
    scrubbed = site.state.replica(site.ids[0])
    assert scrubbed.status is S.VERIFIED
    assert (scrubbed.scrubbed_at, scrubbed.scrubbed_bytes) == (1000.0, result.bytes_read)
    reads = [t for t in site.state.transfers(site.ids[0]) if t["kind"] == "verify"]
    assert reads[-1]["bytes"] == result.bytes_read  # billed as a read-back, as verification


def test_a_flipped_replica_is_found_marked_corrupted_and_repaired_from_the_source(site):
    damaged = site.shared_pack()
    site.flip(damaged)
    result = site.attempt().scrub(site.state.replica(site.ids[0]))
    assert result.outcome is Outcome.CORRUPTED and damaged in result.detail
    # both checkpoints read the damaged pack: both are taken out of reach and queued again
    for replica_id in site.ids:
        found = site.state.replica(replica_id)
        assert (found.status, found.repairing, found.scrub_findings) == (S.PENDING, True, 1)
        assert not site.away_store.exists(manifest_name("run", found.step))
    assert site.state.newest_verified("run", "offsite") is None
    assert not site.away_store.exists("latest/run")
    for replica_id in site.ids:
        assert site.replicate(replica_id).outcome is Outcome.VERIFIED
        repaired = site.state.replica(replica_id)
        assert (repaired.status, repaired.repairs, repaired.repairing) == (S.VERIFIED, 1, False)
    assert check_store(site.away_store, KEY, READ_ALL).ok
    assert site.away.latest("run") == 20


def test_a_replica_whose_source_is_gone_stays_corrupted(site):
    site.home_store.delete(manifest_name("run", 10))
    site.home_store.delete(manifest_name("run", 20))
    site.flip(site.shared_pack())
    assert site.attempt().scrub(site.state.replica(site.ids[1])).outcome is Outcome.CORRUPTED
    assert {site.state.replica(i).status for i in site.ids} == {S.CORRUPTED}


def test_metrics_show_scrub_progress_and_findings(site):
    site.attempt().scrub(site.state.replica(site.ids[0]))
    site.flip(site.shared_pack())
    site.attempt().scrub(site.state.replica(site.ids[1]))
    site.replicate(site.ids[0])
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in SyncCollector(site.state_path, Live).collect()
               for s in family.samples}
    dest = (("destination", "offsite"),)
    assert samples[("slurm_geo_sync_scrubbed_bytes_total", dest)] > 0
    assert samples[("slurm_geo_sync_scrub_findings_total",
                    (*dest, ("result", "corrupted")))] == 2
    assert samples[("slurm_geo_sync_scrub_findings_total",
                    (*dest, ("result", "repaired")))] == 1
    assert samples[("slurm_geo_sync_scrub_full_pass_timestamp_seconds", dest)] == 1000.0


def test_a_version_1_state_database_gains_the_scrub_columns(tmp_path):
    path = tmp_path / "old.db"
    old = {c: t for c, t in _REPLICA_COLUMNS.items()
           if c not in ("scrubbed_at", "scrubbed_bytes", "scrub_findings", "repairs",
                        "repairing")}
    Database(sqlite3.connect(path))["replicas"].create(old, pk="id")
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO replicas (root, run, step, destination, sequence, status, "
                     "promoted, discovered_at, next_attempt_at, bytes, attempts, failures, "
                     "charged, outages, corruptions) VALUES "
                     "('pfs', 'r', 1, 'offsite', 0, 'verified', 0, 0, 0, 0, 0, 0, 0, 0, 0)")
    state = StateDB(path)
    (replica,) = state.replicas()
    assert (replica.scrubbed_at, replica.scrubbed_bytes, replica.repairing) == (None, 0, False)
