"""PyTorch Distributed Checkpoint into the slurm-geo store, with real gloo process groups
of up to 4 ranks on this host (tests/dcp_ranks.py): resharded loads, all-or-nothing
saves, damage named, async saves, dedup across saves. The same writer and reader on 2
Slurm nodes through srun: tests/test_dcp_sandbox.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from dcp_ranks import (
    RUN,
    async_save_gated,
    load_and_compare,
    reports,
    save,
    save_then_die_mid_write,
    spawn,
)

from slurm_geo.ckpt import LocalDirStore, Repository, create_master_key_file, load_master_key
from slurm_geo.ckpt.names import manifest_name

pytestmark = pytest.mark.slow


@pytest.fixture
def site(tmp_path: Path) -> tuple[str, str, Repository]:
    (tmp_path / "store").mkdir()
    key_file = tmp_path / "master.key"
    create_master_key_file(key_file)
    repository = Repository(LocalDirStore(tmp_path / "store"), load_master_key(key_file))
    return f"file://{tmp_path / 'store'}", str(key_file), repository


def loaded(tmp_path: Path, world: int, store: str, key_file: str, step: int | None,
           seed: int, columns: bool) -> dict[int, dict]:
    out = tmp_path / f"load-{world}-{columns}-{step}"
    out.mkdir()
    spawn(world, load_and_compare, store, key_file, step, seed, columns, str(out))
    return reports(out)


def test_saved_on_4_ranks_it_loads_on_2_and_on_4_with_another_sharding(tmp_path, site):
    store, key_file, repository = site
    spawn(4, save, store, key_file, 10, 1)

    manifest = repository.manifest(RUN, 10)
    assert manifest.format == 3 and manifest.sharded is not None
    assert manifest.sharded.ranks == 4
    weight = next(i for i in manifest.sharded.items if i.fqn == "model.layer.weight")
    assert [s.offsets for s in weight.shards] == [(0, 0), (24, 0), (48, 0), (72, 0)]
    assert repository.verify(RUN, 10) == []

    for world, columns in ((2, True), (4, True), (2, False)):
        seen = loaded(tmp_path, world, store, key_file, None, 1, columns)
        assert sorted(seen) == list(range(world))
        for rank, result in seen.items():
            assert "error" not in result, result
            assert all(result["equal"].values()), (world, columns, rank, result)
            assert result["trainer"] == {"step": 10, "note": "saved by 4 ranks"}
        if columns:  # really resharded: each rank holds a column block now
            assert seen[0]["local_shapes"]["layer.weight"] == [96, 40 // world]


def test_a_save_interrupted_by_a_killed_rank_is_never_listed_and_the_previous_stays(
        tmp_path, site):
    store, key_file, repository = site
    spawn(4, save, store, key_file, 10, 1)
    with pytest.raises(Exception, match="exit code 9|process 2 terminated"):
        spawn(4, save_then_die_mid_write, store, key_file, 20, 2)

    assert repository.steps(RUN) == [10]
    assert repository.latest(RUN) == 10
    assert not repository.store.exists(manifest_name(RUN, 20))
    assert repository.verify(RUN, 10) == []
    seen = loaded(tmp_path, 4, store, key_file, None, 1, False)
    assert all(all(r["equal"].values()) for r in seen.values()), seen


def test_a_flipped_bit_in_any_ranks_data_fails_the_load_naming_the_object(tmp_path, site):
    store, key_file, repository = site
    spawn(4, save, store, key_file, 10, 1)
    manifest = repository.manifest(RUN, 10)
    # The pack holding the last rank's rows of the weight (offset 72): not the coordinator's.
    stored = next(t for t in manifest.tensors if t.path == "model.layer.weight@72,0")
    pack = f"packs/{stored.chunks[0].pack[:2]}/{stored.chunks[0].pack}"
    path = Path(store.removeprefix("file://")) / pack
    data = bytearray(path.read_bytes())
    data[stored.chunks[0].offset + 40] ^= 0x01
    path.write_bytes(bytes(data))

    seen = loaded(tmp_path, 4, store, key_file, 10, 1, False)
    assert seen and all("error" in r for r in seen.values()), seen
    assert any(pack in r["error"] for r in seen.values()), seen
    assert {f.name for f in repository.verify(RUN, 10)} == {pack}


def test_async_save_returns_before_the_data_is_durable_and_commits_after(tmp_path, site):
    store, key_file, repository = site
    out = tmp_path / "async"
    out.mkdir()
    spawn(4, async_save_gated, store, key_file, 30, 3, str(tmp_path / "gate"), str(out))
    seen = reports(out)
    assert sorted(seen) == [0, 1, 2, 3]
    assert all(r == {"committed_on_return": False, "committed_after": True}
               for r in seen.values()), seen
    assert repository.steps(RUN) == [30]
    assert all(all(r["equal"].values())
               for r in loaded(tmp_path, 2, store, key_file, 30, 3, True).values())


def test_a_second_save_of_a_partly_frozen_model_writes_only_the_changed_shards(tmp_path, site):
    store, key_file, repository = site
    spawn(4, save, store, key_file, 1, 1)
    packs_before = _pack_sizes(store)
    spawn(4, _save_with_changed_counts, store, key_file, 2)  # the same state but one buffer
    packs_after = _pack_sizes(store)

    first, second = repository.manifest(RUN, 1), repository.manifest(RUN, 2)
    assert second.parent_step == 1
    old_refs = {r.id: r for r in first.refs()}
    changed = {t.path for t in second.tensors if any(r.id not in old_refs for r in t.chunks)}
    assert changed == {"model.counts@0", "trainer.step"}  # the buffer; the step DCP pickles
    kept = [t for t in second.tensors if t.path not in changed]
    assert kept and all(old_refs[r.id] == r for t in kept for r in t.chunks)
    new_packs = {name: size for name, size in packs_after.items() if name not in packs_before}
    assert {r.pack for t in second.tensors if t.path in changed for r in t.chunks} == {
        Path(name).name for name in new_packs}
    assert sum(new_packs.values()) < 0.05 * sum(packs_before.values())


def _save_with_changed_counts(rank: int, world: int, store: str, key_file: str, step: int
                              ) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from dcp_ranks import full_state, sharded, writer

    state = full_state(1)
    state["counts"] = torch.arange(48, dtype=torch.int64) * 2
    dcp.save({"model": sharded(state, world, False),
              "trainer": {"step": step, "note": f"saved by {world} ranks"}},
             storage_writer=writer(store, key_file, step))


def _pack_sizes(store: str) -> dict[str, int]:
    root = Path(store.removeprefix("file://")) / "packs"
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}
