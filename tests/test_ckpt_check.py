"""`slurm-geo ckpt check`: a whole store checked, damage named with the checkpoints it
affects, every pack read once however many checkpoints share it."""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_geo.ckpt import LocalDirStore, Repository
from slurm_geo.ckpt.format.keys import KeyFile, write_key_file
from slurm_geo.ckpt.format.manifest import with_bases
from slurm_geo.ckpt.format.names import (
    PACK_PREFIXES,
    key_name,
    latest_name,
    manifest_name,
    pack_name,
    promoted_name,
)
from slurm_geo.ckpt.ops.check import READ_ALL, PackSelection, check_store, parse_subset
from slurm_geo.ckpt.ops.usage import pack_sizes
from slurm_geo.cli import cli
from slurm_geo.errors import ConfigError
from tests.kit.check import KEY, RUNS, site_store


def users_of(repository: Repository, pack: str) -> list[str]:
    """The checkpoints whose reads need `pack`, from the manifests themselves."""
    return sorted(f"{run}@{step}" for run in repository.runs() for step in repository.steps(run)
                  if pack in packs_of(repository.manifest(run, step)))


def packs_of(manifest) -> set[str]:
    return {manifest.pack_object(r.pack) for r in with_bases(manifest.refs())}


def flip(path: Path, at: int) -> bytes:
    original = path.read_bytes()
    damaged = bytearray(original)
    damaged[at % len(damaged)] ^= 0x10
    path.write_bytes(bytes(damaged))
    return original


@pytest.fixture
def site(tmp_path) -> tuple[LocalDirStore, Repository]:
    return site_store(tmp_path / "store")


def test_a_sound_store_checks_clean_reading_each_pack_once(site):
    store, repository = site
    report = check_store(store, KEY, READ_ALL, threads=1)
    packs = pack_sizes(store)
    assert report.ok and report.damage == ()
    assert (report.runs, report.checkpoints) == (4, 10)
    assert report.packs == report.packs_read == len(packs)
    assert report.unreferenced_packs == 0
    # every pack once; the rest is keys, pointers and manifests
    assert sum(packs.values()) < report.bytes_read < sum(packs.values()) + 64 * 1024


def test_gets_of_each_pack_happen_once_even_with_deltas_and_dedup(site, monkeypatch):
    store, repository = site
    gets: Counter[str] = Counter()
    real_get = LocalDirStore.get

    def counting_get(self, name):
        gets[name] += 1
        return real_get(self, name)

    monkeypatch.setattr(LocalDirStore, "get", counting_get)
    assert check_store(store, KEY, READ_ALL, threads=1).ok
    assert {n: c for n, c in gets.items() if n.startswith(PACK_PREFIXES) and c != 1} == {}
    assert len([n for n in gets if n.startswith(PACK_PREFIXES)]) == len(pack_sizes(store))


def test_a_local_stores_delta_bases_are_read_by_ranges_not_kept_as_packs(site, monkeypatch):
    """Each pack is read whole once to be checked; the bases its deltas need are read
    blob by blob from a local store (no 16 MiB pack kept for them: less memory)."""
    store, repository = site
    ranged: list[tuple[str, int, int]] = []
    real_get_range = LocalDirStore.get_range

    def counting_get_range(self, name, start, length):
        ranged.append((name, start, length))
        return real_get_range(self, name, start, length)

    monkeypatch.setattr(LocalDirStore, "get_range", counting_get_range)
    monkeypatch.setattr("slurm_geo.ckpt.ops.check.CHECK_CACHED_PACKS", 0)
    assert check_store(store, KEY, READ_ALL, threads=1).ok
    manifests = [repository.manifest(run, step)
                 for run in repository.runs() for step in repository.steps(run)]
    bases = {(m.pack_object(r.base.pack), r.base.offset, r.base.length)
             for m in manifests for r in m.refs() if r.base is not None}
    blobs = {read for read in ranged if read[1] != 0}  # offset 0: a pack's header
    assert bases and blobs == bases


def test_a_bit_flip_in_any_pack_is_found_naming_the_checkpoints_it_affects(site, tmp_path):
    store, repository = site
    for i, name in enumerate(sorted(pack_sizes(store))):
        path = tmp_path / "store" / name
        original = flip(path, random.Random(i).randrange(path.stat().st_size))
        try:
            report = check_store(store, KEY, READ_ALL)
        finally:
            path.write_bytes(original)
        assert [d.object for d in report.damage] == [name], name
        assert list(report.damage[0].checkpoints) == users_of(repository, name)
        assert report.affected == users_of(repository, name)


def test_each_copy_of_a_chunk_stored_by_several_ranks_is_checked(site, tmp_path):
    store, repository = site
    manifest = repository.manifest("run", 5)
    copies = Counter(r.id for r in manifest.refs())
    twice = next(i for i, n in copies.items() if n > 1)
    packs = sorted({manifest.pack_object(r.pack) for r in manifest.refs() if r.id == twice})
    assert len(packs) == 2
    for name in packs:
        path = tmp_path / "store" / name
        original = flip(path, path.stat().st_size - 20)
        try:
            report = check_store(store, KEY, READ_ALL)
        finally:
            path.write_bytes(original)
        assert [(d.object, d.checkpoints) for d in report.damage] == [(name, ("run@5",))]


def test_a_plain_check_finds_missing_and_truncated_packs_without_reading_any(site, tmp_path):
    store, repository = site
    missing, truncated = sorted(pack_sizes(store))[:2]
    store.delete(missing)
    path = tmp_path / "store" / truncated
    path.write_bytes(path.read_bytes()[:-1])
    report = check_store(store, KEY)
    assert report.packs_read == 0
    found = {d.object: d for d in report.damage}
    assert set(found) == {missing, truncated}
    assert "does not exist" in found[missing].error
    assert "truncated" in found[truncated].error
    for name in (missing, truncated):
        assert list(found[name].checkpoints) == users_of(repository, name)


def test_a_flip_in_the_middle_of_a_pack_is_unseen_without_read_data(site, tmp_path):
    store, _repository = site
    name = sorted(pack_sizes(store))[0]
    flip(tmp_path / "store" / name, 100)
    assert check_store(store, KEY).ok
    assert not check_store(store, KEY, READ_ALL).ok


def test_damaged_manifests_keys_and_pointers_are_named(site, tmp_path):
    store, _repository = site
    flip(tmp_path / "store" / manifest_name("alpha", 2), 40)
    flip(tmp_path / "store" / key_name("beta"), 40)
    store.put(latest_name("gamma"), b"junk")
    report = check_store(store, KEY)
    assert {d.object: d.checkpoints for d in report.damage} == {
        manifest_name("alpha", 2): ("alpha@2",),
        key_name("beta"): ("beta@1", "beta@2", "beta@3"),
        latest_name("gamma"): (),
    }


def test_promotion_markers_are_checked(site, tmp_path):
    """Issue 28: check said ok with a corrupt marker; a marker that does not open, names
    another checkpoint, or marks one that is gone protects nothing, and is damage."""
    store, repository = site
    alpha, beta, gamma = RUNS
    repository.promote(alpha, 1)
    repository.promote(beta, 1)
    repository.promote(gamma, 1)
    assert check_store(store, KEY).ok  # sound markers are no damage
    flip(tmp_path / "store" / promoted_name(alpha, 1), 40)                # altered
    store.put(promoted_name(beta, 2), store.get(promoted_name(beta, 1)))  # another's, moved
    store.put(promoted_name(gamma, 2), b"junk")
    store.put("promoted/gamma/not-a-step", b"junk")
    store.delete(manifest_name(gamma, 1))  # the checkpoint the marker kept is gone
    report = check_store(store, KEY)
    damaged = {d.object: (d.checkpoints, d.error) for d in report.damage}
    assert set(damaged) == {promoted_name(alpha, 1), promoted_name(beta, 2),
                            promoted_name(gamma, 1), promoted_name(gamma, 2),
                            "promoted/gamma/not-a-step"}
    assert damaged[promoted_name(alpha, 1)][0] == (f"{alpha}@1",)
    assert "is corrupt" in damaged[promoted_name(beta, 2)][1]  # sealed under its own name
    assert not report.ok
    assert "which has no manifest" in damaged[promoted_name(gamma, 1)][1]
    assert all("\n" not in error for _c, error in damaged.values())


def test_packs_no_checkpoint_references_are_counted_not_damage(site):
    store, _repository = site
    store.put(pack_name("ab" * 32), b"left by an interrupted push")
    report = check_store(store, KEY, READ_ALL)
    assert report.ok and report.unreferenced_packs == 1


@pytest.mark.parametrize("text, selection", [
    ("10%", PackSelection(percent=10.0)),
    ("2.5%", PackSelection(percent=2.5)),
    ("100%", PackSelection(percent=100.0)),
    ("1/5", PackSelection(group=1, groups=5)),
    ("5/5", PackSelection(group=5, groups=5)),
])
def test_subsets_parse(text, selection):
    assert parse_subset(text) == selection


@pytest.mark.parametrize("text", ["0%", "101%", "0/5", "6/5", "1/0", "half", "10"])
def test_bad_subsets_are_refused_with_the_forms_accepted(text):
    with pytest.raises(ConfigError, match=r"10%.*1/5"):
        parse_subset(text)


def test_groups_of_a_subset_cover_every_pack_once_and_the_same_every_time():
    ids = [random.Random(i).randbytes(32).hex() for i in range(200)]
    groups = [PackSelection(group=n, groups=7).choose(ids, random.Random(n)) for n in
              range(1, 8)]
    assert sorted(p for g in groups for p in g) == sorted(ids)
    assert PackSelection(group=3, groups=7).choose(ids, random.Random(42)) == groups[2]


@pytest.mark.parametrize("percent, count", [(10, 20), (0.1, 1), (50, 100), (100, 200)])
def test_a_percentage_reads_that_share_of_the_packs(percent, count):
    ids = [f"{i:064x}" for i in range(200)]
    chosen = PackSelection(percent=percent).choose(ids, random.Random(1))
    assert len(chosen) == count and len(set(chosen)) == count


@pytest.fixture
def key_file(tmp_path) -> Path:
    path = tmp_path / "master.key"
    write_key_file(path, KeyFile(KEY))
    return path


def test_the_command_names_damage_and_checkpoints_and_exits_1(site, tmp_path, key_file):
    store, repository = site
    name = sorted(pack_sizes(store))[3]
    flip(tmp_path / "store" / name, 60)
    url = f"file://{tmp_path / 'store'}"
    runner = CliRunner()
    result = runner.invoke(cli, ["ckpt", "check", "--store", url, "--read-data",
                                 "--key-file", str(key_file), "--json"])
    assert result.exit_code == 1, result.output
    document = json.loads(result.stdout)
    assert document["ok"] is False and document["packs_read"] == document["packs"]
    assert [d["object"] for d in document["damaged"]] == [name]
    assert document["affected_checkpoints"] == users_of(repository, name)
    assert {"bytes_read", "seconds"} <= set(document)
    result = runner.invoke(cli, ["ckpt", "check", "--store", url, "--read-data-subset",
                                 "100%", "--key-file", str(key_file)])
    assert result.exit_code == 1
    assert f"damaged: {name}" in result.stderr
    assert ", ".join(users_of(repository, name)) in result.stderr


def test_the_command_says_ok_and_refuses_two_read_options(site, tmp_path, key_file):
    url = f"file://{tmp_path / 'store'}"
    runner = CliRunner()
    result = runner.invoke(cli, ["ckpt", "check", "--store", url, "--key-file", str(key_file)])
    assert result.exit_code == 0 and "ok, 4 run(s), 10 checkpoint(s)" in result.stdout
    result = runner.invoke(cli, ["ckpt", "check", "--store", url, "--read-data",
                                 "--read-data-subset", "1/2", "--key-file", str(key_file)])
    assert isinstance(result.exception, ConfigError) and "not both" in str(result.exception)


def test_a_chunk_that_is_not_the_one_its_manifest_names_is_found_only_by_reading(site):
    store, repository = site
    manifest = repository.manifest("alpha", 1)
    first, second = manifest.tensors[0].chunks[:2]
    wrong = dataclasses.replace(manifest.tensors[0], chunks=(
        dataclasses.replace(first, id=second.id), *manifest.tensors[0].chunks[1:]))
    repository.commit(dataclasses.replace(manifest, tensors=(wrong, *manifest.tensors[1:])),
                      lambda: None)
    assert check_store(store, KEY).ok  # every pack is there, whole
    report = check_store(store, KEY, READ_ALL)
    assert [d.object for d in report.damage] == [manifest.pack_object(first.pack)]
    assert "alpha@1" in report.damage[0].checkpoints
