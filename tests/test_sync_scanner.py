"""Finding committed checkpoints: a manifest in place, never a half-written checkpoint."""

from __future__ import annotations

from slurm_geo.ckpt import LocalDirStore, StoreUnavailable
from slurm_geo.sync.scanner import Found, RootScan, scan_root
from tests.kit.sync import Trainer, master_key


def test_only_checkpoints_with_a_manifest_in_place_are_found(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    _, key = master_key(tmp_path)
    trainer = Trainer(root, key, "run-1")
    trainer.train(2)
    trainer.save()
    trainer.train(2)
    trainer.save()
    # A save cut short: packs written, manifest not yet (or still a temporary file).
    manifest = root / "manifests" / "run-1" / f"{4:020d}"
    partial = manifest.with_name(f".{manifest.name}.x1y2.tmp")
    manifest.rename(partial)
    (root / "manifests" / "not a run").mkdir()
    (root / "manifests" / "run-1" / "latest-junk").write_bytes(b"")
    (root / "promoted" / "run-1").mkdir(parents=True)
    (root / "promoted" / "run-1" / f"{2:020d}").write_bytes(b"sealed marker")

    scan = scan_root("pfs", LocalDirStore(root))

    assert scan == RootScan("pfs", (Found("pfs", "run-1", 2, promoted=True),))
    partial.rename(manifest)                                    # the commit point
    assert [f.step for f in scan_root("pfs", LocalDirStore(root)).found] == [2, 4]


class Unreachable:
    def list(self, prefix):
        raise StoreUnavailable(prefix, "connection refused")


def test_a_store_failure_is_reported_not_raised():
    scan = scan_root("offsite-root", Unreachable())
    assert not scan.ok and scan.found == () and "connection refused" in (scan.error or "")


def test_a_scan_names_the_runs_whose_world_record_is_at_home(tmp_path):
    root = tmp_path / "root"
    (root / "worlds").mkdir(parents=True)
    (root / "worlds" / "run-1").write_bytes(b"sealed record")
    (root / "worlds" / ".run-2.x1y2.tmp").write_bytes(b"half written")
    assert scan_root("pfs", LocalDirStore(root)).worlds == frozenset({"run-1"})
    assert scan_root("pfs", LocalDirStore(tmp_path)).worlds == frozenset()
