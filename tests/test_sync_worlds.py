"""checkpoint-sync copies a run's world off-site (issue 31 item 2), behind its checkpoints:
the world record and every snapshot it pins reach the destination and verify there; a
second run on the same dataset sends no new pack; a cut pass resumes with what is missing;
and a checkpoint written while a big tree copies goes first (the order of the puts, never
the wall time). Moved jobs' outputs come home the other way (item 6)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_geo.ckpt.format.keys import KeyFile
from slurm_geo.ckpt.repo.repository import Repository
from slurm_geo.ckpt.stores.store import LocalDirStore
from slurm_geo.ckpt.stores.transfer_plan import DEFAULT_PLAN
from slurm_geo.cli import cli
from slurm_geo.stage.keys import MasterTreeKeys
from slurm_geo.stage.outputs import read_log, ship
from slurm_geo.stage.record import (
    PinnedTree,
    WorldRecord,
    manifest_digest,
    world_record_name,
    write_world_record,
)
from slurm_geo.stage.residency import TreeResidency, write_residency
from slurm_geo.stage.trees import Trees
from slurm_geo.stage.walk import LocalOpener
from slurm_geo.sync import worldpass
from slurm_geo.sync.daemon import Daemon
from slurm_geo.sync.metrics import Live, SyncCollector
from slurm_geo.sync.runtime import load_runtime
from slurm_geo.sync.state import StateDB
from slurm_geo.sync.worker import Guard
from slurm_geo.sync.worldpass import PassGuard, run_pass
from slurm_geo.sync.worlds import WorldCopy
from slurm_geo.sync.worldstate import (
    WorldQueue,
    WorldRow,
    read_worlds,
    synced_runs,
    world_offsite,
    world_rows,
)
from tests.kit.sync import Trainer, master_key, site_config
from tests.kit.trees import OPTIONS, CountingStore, listing
from tests.kit.worlds import dataset, trained

TREE = "d" * 32


def stage_world(store: LocalDirStore, key: bytes, run: str, source: Path,
                tree: str = TREE) -> WorldRecord:
    """What the home job does: stage the root, pin it in the run's world record (and the
    daemon's part: the domain's residency, anywhere, as its grant writes it)."""
    write_residency(store, KeyFile(key), TreeResidency(tree, ("internal",),
                                                       ("home", "remote")))
    trees = Trees(store, MasterTreeKeys(store, KeyFile(key)), OPTIONS)
    staged = trees.stage(tree, LocalOpener(source), f"home:{source}")
    snapshot = staged.manifest.snapshot
    pin = PinnedTree("input", str(source), tree, tree, snapshot,
                     manifest_digest(store, tree, snapshot))
    record = WorldRecord(run, (pin,), 1.0)
    ring = Repository(store, key).run_keys(run)
    write_world_record(store, ring, record, os.urandom)
    return record


def copy_world(home, away, key, run: str, sound: set[str] | None = None,
               read: list[int] | None = None) -> WorldRow:
    copier = WorldCopy(home, away, KeyFile(key), verified_packs=set() if sound is None
                       else sound, on_read=([] if read is None else read).append)
    return copier.copy(WorldRow("pfs", run, "offsite"), lambda _row: None)


def test_a_world_reaches_the_offsite_store_and_materialises_byte_identical(tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "away").mkdir()
    _, key = master_key(tmp_path)
    trained(tmp_path / "home", key, "run-a")
    home, away = CountingStore(tmp_path / "home"), CountingStore(tmp_path / "away")
    source = dataset(tmp_path / "data")
    stage_world(home, key, "run-a", source)

    row = copy_world(home, away, key, "run-a")
    assert row.complete and row.trees == 1 and row.bytes_total > 0
    assert row.bytes_there == row.bytes_total and row.bytes_copied == row.bytes_total
    name = world_record_name("run-a")
    assert away.get(name) == home.get(name)  # the record crossed as it is, sealed
    assert row.record_sha256 == hashlib.sha256(home.get(name)).hexdigest()
    there = Trees(away, MasterTreeKeys(away, KeyFile(key)))
    there.materialise(TREE, 1, tmp_path / "out")
    assert {k: v[:3] for k, v in listing(tmp_path / "out").items()} == \
        {k: v[:3] for k, v in listing(source).items()}

    away.puts.clear()
    again = WorldCopy(home, away, KeyFile(key)).copy(row, lambda _row: None)
    assert again.complete and away.puts == {}  # complete: nothing is put again


def test_a_second_run_on_the_same_dataset_copies_no_new_pack(tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "away").mkdir()
    _, key = master_key(tmp_path)
    home, away = CountingStore(tmp_path / "home"), CountingStore(tmp_path / "away")
    source = dataset(tmp_path / "data")
    for run in ("run-a", "run-b"):
        trained(tmp_path / "home", key, run)
    stage_world(home, key, "run-a", source)
    sound: set[str] = set()
    first_reads: list[int] = []
    copy_world(home, away, key, "run-a", sound, first_reads)
    assert sum(first_reads) > 0 and sound  # each pack read back once
    home.puts.clear()
    stage_world(home, key, "run-b", source)  # the same root: the same tree, no new chunk
    assert not [n for n in home.puts if n.startswith("tree-packs/")]
    away.puts.clear()
    reads: list[int] = []
    row = copy_world(home, away, key, "run-b", sound, reads)
    assert row.complete and row.bytes_copied == 0 and reads == []  # nor read back again
    assert not [n for n in away.puts if n.startswith("tree-packs/")]
    assert world_record_name("run-b") in away.puts and "keys/run-b" in away.puts


def test_a_damaged_pack_offsite_is_deleted_and_copied_again(tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "away").mkdir()
    _, key = master_key(tmp_path)
    trained(tmp_path / "home", key, "run-a")
    home, away = LocalDirStore(tmp_path / "home"), LocalDirStore(tmp_path / "away")
    stage_world(home, key, "run-a", dataset(tmp_path / "data"))

    class Flipping(LocalDirStore):
        def put(self, name, data):
            if name.startswith("tree-packs/") and not getattr(self, "flipped", False):
                self.flipped = True
                data = bytes(data[:-1]) + bytes([data[-1] ^ 1])
            super().put(name, data)

    flipping = Flipping(tmp_path / "away")
    try:
        copy_world(home, flipping, key, "run-a")
        raise AssertionError("a damaged pack verified")
    except Exception as exc:  # CorruptObject, naming the pack
        assert "tree-packs/" in str(getattr(exc, "name", ""))
    assert not away.exists(world_record_name("run-a"))  # the record waits for its pins
    row = copy_world(home, away, key, "run-a")
    assert row.complete


def test_a_pass_cut_by_its_budget_resumes_with_what_is_missing(tmp_path):
    config, state_path, _home, away, _key = daemon_site(tmp_path, files=6)  # two packs
    # one stream (as a link of unknown rate had before issue 32): the budget cuts between them
    runtime = dataclasses.replace(load_runtime(config), transfer_plan=DEFAULT_PLAN)
    state = StateDB(state_path)
    state.add([{"root": "pfs", "run": "run-a", "step": 2, "destination": "offsite",
                "sequence": 0, "status": "verified"}], 0.0)
    stop, give_way = threading.Event(), threading.Event()
    first = run_pass(state, [("pfs", "run-a")], runtime,
                     PassGuard(Guard(stop, float("inf")), give_way, budget=100_000), None)
    assert first.yielded == "the pass's byte budget is spent"
    [row] = world_rows(state, "offsite")
    assert not row.complete and 0 < row.bytes_there < row.bytes_total  # staged, pending
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for m in SyncCollector(state_path, Live).collect() for s in m.samples}
    offsite = ("destination", "offsite")
    assert samples[("slurm_geo_sync_world_bytes", (offsite, ("state", "staged")))] == \
        row.bytes_there
    assert samples[("slurm_geo_sync_world_bytes", (offsite, ("state", "pending")))] == \
        row.bytes_total - row.bytes_there
    assert samples[("slurm_geo_sync_worlds", (offsite, ("state", "incomplete")))] == 1
    assert not away.exists(world_record_name("run-a"))
    sent_first = first.bytes_sent
    second = run_pass(state, [("pfs", "run-a")], runtime,
                      PassGuard(Guard(stop, float("inf")), give_way, budget=1 << 40), None)
    [row] = world_rows(state, "offsite")
    assert second.yielded is None and row.complete and row.bytes_there == row.bytes_total
    packs = sum(os.path.getsize(p) for p in (tmp_path / "away" / "tree-packs").rglob("*")
                if p.is_file())
    assert sent_first + second.bytes_sent < 2 * packs + 200_000  # put once, read once
    state.close()
    assert world_offsite(read_worlds(state_path), "run-a") is True
    shown = CliRunner().invoke(cli, ["sync", "status", "--state", str(state_path), "--json"])
    [listed] = [r for r in json.loads(shown.stdout) if r["run"] == "run-a"]
    assert listed["world"] == {"world": "complete", "trees": 1, "pending_bytes": 0,
                               "staged_bytes": row.bytes_total, "lag_s": 0.0, "error": None}
    table = CliRunner().invoke(cli, ["sync", "status", "--state", str(state_path)]).stdout
    assert "run-a  offsite      complete  1" in table
    assert world_offsite(read_worlds(state_path), "run-x") is None


def daemon_site(tmp_path: Path, files: int = 3):
    (tmp_path / "home").mkdir()
    (tmp_path / "away").mkdir()
    key_file, key = master_key(tmp_path)
    trained(tmp_path / "home", key, "run-a")
    home = LocalDirStore(tmp_path / "home")
    stage_world(home, key, "run-a", dataset(tmp_path / "data", files))
    config = site_config(tmp_path / "site.toml", {"pfs": tmp_path / "home"},
                         f"file://{tmp_path / 'away'}", key_file=key_file,
                         state=tmp_path / "state.db")
    return config, tmp_path / "state.db", home, LocalDirStore(tmp_path / "away"), key


def test_a_checkpoint_written_while_a_big_tree_copies_goes_first(tmp_path):
    """The world of run-a is copying when a new checkpoint is saved: the pass gives way
    before its next object, the checkpoint's manifest is put before the world's last pack
    and before its record, and the world then completes."""
    config, state_path, _home, _away, key = daemon_site(tmp_path, files=20)
    trainer = Trainer(tmp_path / "home", key, "run-a")
    trainer.step = 2  # run-a@2 is there already
    trainer.train(3)
    order: list[str] = []
    holder: dict[str, Daemon] = {}
    saving = threading.Lock()

    class Watching(LocalDirStore):
        """The off-site store: logs each put; at the world's first pack, saves a new
        checkpoint at home and holds the pack until the daemon has asked the pass to give
        way (so the order does not hang on timing)."""

        def put(self, name, data):
            super().put(name, data)
            order.append(name)
            if not name.startswith("tree-packs/"):
                return
            with saving:
                if trainer.last_saved is not None:
                    return
                trainer.save()
                worlds = holder["daemon"]._worlds.passes
                assert worlds._give_way.wait(30), "the pass was never asked to give way"

    def open_store(url, **_kwargs):
        return Watching(Path(url.removeprefix("file://")))

    runtime = load_runtime(config, open_store=open_store)
    daemon = Daemon(runtime, lambda: runtime, state_path, handle_signals=False,
                    set_priority=False, world_pass_bytes=1 << 40)
    holder["daemon"] = daemon
    # The first checkpoint is off-site before any world: run-a@2 goes, then its world.
    assert daemon.run(once=True) == 0
    step = trainer.last_saved
    assert step == 5
    world_packs = [i for i, n in enumerate(order) if n.startswith("tree-packs/")]
    checkpoint = order.index(f"manifests/run-a/{step:020d}")
    assert order.index("manifests/run-a/00000000000000000002") < world_packs[0]
    assert world_packs[0] < checkpoint < world_packs[-1]
    assert checkpoint < order.index(world_record_name("run-a"))
    [row] = read_worlds(state_path, "run-a")
    assert row.complete and row.bytes_there == row.bytes_total


def test_the_world_queue_looks_at_new_runs_first_then_retries_then_rechecks():
    queue = WorldQueue(recheck_s=60)
    runs = [("pfs", "a"), ("pfs", "b"), ("pfs", "c")]
    assert queue.due(runs, [], 100.0) == runs
    queue.seen.update(runs)
    rows = [WorldRow("pfs", "a", "x", "s", complete=True, checked_at=90.0),
            WorldRow("pfs", "b", "x", "s", next_attempt_at=50.0),
            WorldRow("pfs", "c", "x", None, checked_at=10.0)]  # no world staged
    assert queue.due(runs, rows, 100.0) == [("pfs", "b"), ("pfs", "c")]
    assert queue.due(runs, rows, 100.0, once=True) == [("pfs", "b")]
    assert queue.due(runs, rows, 200.0) == [("pfs", "b"), ("pfs", "c"), ("pfs", "a")]
    assert queue.next_due(runs[:1], rows) == 150.0
    assert queue.next_due(runs[:1], rows, once=True) is None


@pytest.mark.parametrize("row, scanned_at, now, due", [
    # Looked at at 10 with no record; a scan at 12 lists it: due at once, not at 70.
    (WorldRow("pfs", "c", "x", None, checked_at=10.0), 12.0, 13.0, True),
    # The scan that lists it came before the look that found none: not again.
    (WorldRow("pfs", "c", "x", None, checked_at=10.0), 9.0, 13.0, False),
    # A failed look backs off even so; a record read already is the retry's business.
    (WorldRow("pfs", "c", "x", None, checked_at=10.0, next_attempt_at=20.0), 12.0, 13.0,
     False),
    (WorldRow("pfs", "c", "x", "s", checked_at=10.0, next_attempt_at=20.0), 12.0, 13.0,
     False),
    # Residency keeps it out: rechecked as before.
    (WorldRow("pfs", "c", "x", None, checked_at=10.0, refused="restricted"), 12.0, 13.0,
     False),
])
def test_a_world_record_a_scan_finds_is_copied_at_once(row, scanned_at, now, due):
    queue = WorldQueue(recheck_s=60)
    queue.seen.add(("pfs", "c"))
    recorded = {("pfs", "c"): scanned_at}
    assert queue.due([("pfs", "c")], [row], now, recorded=recorded) == \
        ([("pfs", "c")] if due else [])
    assert queue.due([("pfs", "c")], [row], now) == []
    if due:
        assert queue.next_due([("pfs", "c")], [row], recorded=recorded) == 0.0


def test_the_run_checkpointing_now_has_its_world_looked_at_first(tmp_path):
    """A run cancelled with its world half copied (`a-old`) no longer holds up the world
    of the job training now (`b-new` sorts after it by name)."""
    state = StateDB(tmp_path / "state.db")

    def found(run: str, step: int, now: float) -> None:
        state.add([{"root": "pfs", "run": run, "step": step, "destination": "x",
                    "sequence": step, "status": "pending"}], now)
    found("a-old", 1, 10.0)
    found("b-new", 1, 20.0)
    found("c-other", 1, 15.0)
    assert synced_runs(state, "x") == [("pfs", "b-new"), ("pfs", "c-other"), ("pfs", "a-old")]
    found("a-old", 2, 30.0)  # it checkpoints again
    assert synced_runs(state, "x")[0] == ("pfs", "a-old")
    queue = WorldQueue(recheck_s=60)
    assert queue.due(synced_runs(state, "x"), [], 40.0) == synced_runs(state, "x")
    state.close()


def test_a_moved_incarnations_outputs_come_home_parts_before_index(tmp_path, monkeypatch):
    config, state_path, home, away, key = daemon_site(tmp_path)
    ring = Repository(home, key).run_keys("run-a")
    job = tmp_path / "rented-job"
    (job / "results").mkdir(parents=True)
    (job / "results" / "metrics.json").write_text("{}\n")
    (job / "log.out").write_text("step 3\n")
    ship(away, ring, "run-a", "rented-7", job / "log.out", {"/home/alice/r": job / "results"})
    order: list[str] = []

    class Watching(LocalDirStore):
        def put(self, name, data):
            order.append(name)
            super().put(name, data)

    runtime = load_runtime(config)
    monkeypatch.setattr(worldpass, "LocalDirStore", Watching)  # the home store's writer
    state = StateDB(state_path)
    state.add([{"root": "pfs", "run": "run-a", "step": 2, "destination": "offsite",
                "sequence": 0, "status": "verified"}], 0.0)
    guard = PassGuard(Guard(threading.Event(), float("inf")), threading.Event(), 1 << 40)
    run_pass(state, [("pfs", "run-a")], runtime, guard, None)
    [row] = world_rows(state, "offsite")
    state.close()
    assert row.outputs_home == 3 and row.complete
    assert [n.split("/")[3] for n in order] == ["parts", "parts", "index"]
    assert read_log(home, ring, "run-a", "rented-7") == b"step 3\n"
