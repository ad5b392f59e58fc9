"""Pure tests of what checkpoints cost (slurm_geo.ckpt.ops.usage), of the off-site status read
from checkpoint-sync's rows (slurm_geo.sync.offsite), and of how sizes are printed."""

from __future__ import annotations

import pytest

from slurm_geo.ckpt.format.manifest import BlobEntry, ChunkRef, Manifest, Metadata, TensorEntry
from slurm_geo.ckpt.format.names import pack_name
from slurm_geo.ckpt.ops.usage import checkpoint_usage, dedup_ratio, run_usage, store_usage
from slurm_geo.cli.ckpt_usage import human_ratio
from slurm_geo.cli.progress import human_bytes
from slurm_geo.sync.jobdirs import SourceStatus
from slurm_geo.sync.offsite import UNSEEN, offsite_status, offsite_statuses, place
from slurm_geo.sync.state import Replica, Source, Status

P1, P2, P3 = "1" * 64, "2" * 64, "3" * 64


def ref(pack: str, offset: int, length: int, size: int, base: ChunkRef | None = None
        ) -> ChunkRef:
    return ChunkRef(f"{offset:064x}", pack, offset, length, size, base)


A = ref(P1, 25, 60, 100)            # 100 bytes of tensor, 60 stored
B = ref(P1, 85, 110, 100)
C = ref(P2, 25, 90, 100)
DELTA_A = ref(P2, 115, 12, 100, A)  # a delta against A: A is read with it
X = ref(P1, 195, 30, 7)             # extra state


def manifest(run: str, step: int, *tensors: tuple[ChunkRef, ...],
             extra: tuple[ChunkRef, ...] = (), format: int = 2) -> Manifest:
    """uint8 tensors, each as long as its chunks say; format 2 by default, whose packs
    every run shares (so two runs may reference one), 4 for packs under the run."""
    entries = tuple(TensorEntry(f"t{i}", "uint8", (sum(r.size for r in chunks),), chunks)
                    for i, chunks in enumerate(tensors))
    return Manifest(run, Metadata(step, step, 0, None, "t", "c", "1"), None, 100, entries,
                    BlobEntry(sum(r.size for r in extra), extra), format=format)


@pytest.mark.parametrize("manifests, expected", [
    # (run, step, logical, referenced, added) per checkpoint
    ([manifest("r", 1, (A, B), extra=(X,))], [("r", 1, 207, 200, 200)]),
    # the second shares A and stores C: it added C only
    ([manifest("r", 1, (A, B)), manifest("r", 2, (A, C))],
     [("r", 1, 200, 170, 170), ("r", 2, 200, 150, 90)]),
    # a delta: its base is referenced (read with it) but was added by step 1
    ([manifest("r", 1, (A,)), manifest("r", 2, (DELTA_A,))],
     [("r", 1, 100, 60, 60), ("r", 2, 100, 72, 12)]),
    # the same stored copy named twice in one checkpoint (two equal tensors) counts once
    ([manifest("r", 1, (A,), (A,))], [("r", 1, 200, 60, 60)]),
    # the same checkpoint again adds nothing
    ([manifest("r", 1, (A,)), manifest("r", 2, (A,))],
     [("r", 1, 100, 60, 60), ("r", 2, 100, 60, 0)]),
    # order given does not matter: earlier means a lower step of the same run
    ([manifest("r", 2, (A, C)), manifest("r", 1, (A, B))],
     [("r", 1, 200, 170, 170), ("r", 2, 200, 150, 90)]),
    # a pruned step 2 stored C: step 3, the first survivor using it, adds it
    ([manifest("r", 1, (A,)), manifest("r", 3, (A, C))],
     [("r", 1, 100, 60, 60), ("r", 3, 200, 150, 90)]),
    # runs are apart, and listed sorted
    ([manifest("s", 1, (C,)), manifest("r", 1, (A,))],
     [("r", 1, 100, 60, 60), ("s", 1, 100, 90, 90)]),
    ([], []),
])
def test_checkpoint_usage(manifests, expected):
    got = [(u.run, u.step, u.logical_bytes, u.referenced_bytes, u.added_bytes)
           for u in checkpoint_usage(manifests)]
    assert got == expected


@pytest.mark.parametrize("logical, stored, ratio", [
    (200, 100, 2.0), (100, 400, 0.25), (100, 0, None), (0, 0, None),
])
def test_dedup_ratio_is_logical_over_stored(logical, stored, ratio):
    assert dedup_ratio(logical, stored) == ratio


def test_a_checkpoint_that_added_nothing_has_no_ratio():
    first, second = checkpoint_usage([manifest("r", 1, (A,)), manifest("r", 2, (A,))])
    assert first.dedup_ratio == 100 / 60 and second.dedup_ratio is None


SIZES = {pack_name(P1): 400, pack_name(P2): 300, pack_name(P3): 1000}


def test_run_and_store_totals_count_each_stored_copy_once_and_whole_packs():
    manifests = [manifest("r", 1, (A, B)), manifest("r", 2, (DELTA_A, B)),
                 manifest("s", 5, (C,))]
    r, s = run_usage(manifests, SIZES)
    assert (r.run, r.checkpoints, r.logical_bytes, r.stored_bytes, r.pack_bytes) == (
        "r", 2, 400, 60 + 110 + 12, 400 + 300)
    assert r.stored_bytes == sum(u.added_bytes for u in checkpoint_usage(manifests[:2]))
    assert r.dedup_ratio == 400 / 182
    assert (s.checkpoints, s.logical_bytes, s.stored_bytes, s.pack_bytes) == (1, 100, 90, 300)
    store = store_usage(manifests, SIZES)
    assert store.runs == (r, s)
    assert (store.checkpoints, store.logical_bytes, store.stored_bytes) == (3, 500, 272)
    assert (store.pack_bytes, store.unreferenced_pack_bytes) == (1700, 1000)  # P3: garbage
    assert store.dedup_ratio == 500 / 272


def test_packs_under_the_run_are_counted_under_their_own_names():
    manifests = [manifest("r", 1, (A, B), format=4), manifest("s", 5, (C,), format=4)]
    sizes = {pack_name(P1, "r"): 400, pack_name(P2, "s"): 300,
             pack_name(P1): 999}                    # an older layout's copy: garbage here
    r, s = run_usage(manifests, sizes)
    assert (r.pack_bytes, s.pack_bytes) == (400, 300)
    assert store_usage(manifests, sizes).unreferenced_pack_bytes == 999


def test_a_pack_missing_from_the_listing_counts_nothing_and_an_empty_store_is_zero():
    (r,) = run_usage([manifest("r", 1, (A, C))], {pack_name(P1): 400})
    assert (r.stored_bytes, r.pack_bytes) == (150, 400)
    empty = store_usage([], SIZES)
    assert (empty.runs, empty.checkpoints, empty.stored_bytes, empty.dedup_ratio) == (
        (), 0, 0, None)
    assert empty.unreferenced_pack_bytes == empty.pack_bytes == 1700


# --- off-site --------------------------------------------------------------------------

@pytest.mark.parametrize("statuses, shown", [
    ([Status.VERIFIED], Status.VERIFIED),
    ([Status.FAILED, Status.VERIFIED], Status.VERIFIED),      # an old destination failed
    ([Status.CORRUPTED, Status.PENDING], Status.PENDING),     # being repaired
    ([Status.REPLICATED], Status.REPLICATED),                 # copied, not yet verified
    ([Status.CORRUPTED], Status.CORRUPTED),
    ([Status.FAILED, Status.SKIPPED], Status.FAILED),
    ([Status.SKIPPED], Status.SKIPPED),
    ([], UNSEEN),
])
def test_offsite_status_is_the_row_furthest_along(statuses, shown):
    assert offsite_status(statuses) is shown


def replica(root: str, run: str, step: int, status: Status, destination: str = "offsite"
            ) -> Replica:
    return Replica(id=step, root=root, run=run, step=step, destination=destination,
                   sequence=step, status=status, promoted=False, manifest_sha256=None,
                   bytes=0, attempts=0, failures=0, charged=0, outages=0, corruptions=0,
                   created_at=None, discovered_at=0.0, started_at=None, replicated_at=None,
                   verified_at=None, next_attempt_at=0.0, lag_s=None, last_error=None)


def links(path: str) -> str:
    return path.replace("/link", "/real")


ROWS = [replica("pfs", "r", 10, Status.VERIFIED), replica("pfs", "r", 20, Status.PENDING),
        replica("pfs", "r", 20, Status.FAILED, "old"),
        replica("file:///real/job", "j", 1, Status.VERIFIED),
        replica("s3://other/x", "r", 10, Status.CORRUPTED)]
SOURCES = [Source("pfs", "root", "file:///real/pfs", SourceStatus.WATCHED),
           Source("file:///real/job", "job", "/real/job", SourceStatus.WATCHED)]


@pytest.mark.parametrize("names, expected", [
    (["pfs"], {("r", 10): Status.VERIFIED, ("r", 20): Status.PENDING}),
    (["file:///link/pfs"], {("r", 10): Status.VERIFIED, ("r", 20): Status.PENDING}),
    (["file:///link/job"], {("j", 1): Status.VERIFIED}),
    (["/real/job"], {("j", 1): Status.VERIFIED}),
    (["s3://other/x"], {("r", 10): Status.CORRUPTED}),
    (["s3://unknown/y"], None),             # not a root of checkpoint-sync
    (["file:///real/offsite"], None),
])
def test_offsite_statuses_of_the_rows_whose_root_is_the_store(names, expected):
    assert offsite_statuses(ROWS, SOURCES, names, resolve=links) == expected


def test_a_root_known_only_from_sources_is_watched_with_nothing_seen_yet():
    assert offsite_statuses([], SOURCES, ["file:///real/pfs"], resolve=links) == {}


@pytest.mark.parametrize("name, placed", [
    ("file:///link/a", "file:///real/a"), ("/link/a", "file:///real/a"),
    ("s3://b/p", "s3://b/p"), ("pfs", "pfs"),
])
def test_place(name, placed):
    assert place(name, resolve=links) == placed


@pytest.mark.parametrize("count, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
    (1288490189, "1.2 GiB"), (5 * 1024**4, "5.0 TiB"), (2**70, "1024.0 EiB"),
])
def test_human_bytes(count, text):
    assert human_bytes(count) == text


def test_human_ratio():
    assert (human_ratio(20.24), human_ratio(1.0), human_ratio(None)) == ("20.2x", "1.0x", None)
