"""A run's data key rotates when the run leaves a rented cluster (docs/format.md §4.2):
the provider, whose jobs held the key, keeps what it saw, and cannot open what the run
saves afterwards, at home or in any store it can read (issue 28, finding 7: "the run key
never rotates, so a provider keeps it after failback").

The ring itself (payload, merge, rotation) table-driven; the repository under a ring, the
provider's view with the old key only, and the ring carried to a replica on directory
stores; the daemon's failback from a rented (slurmrestd) cluster through FakeSlurm."""

from __future__ import annotations

import os
import random
import struct

import pytest

from slurm_geo.ckpt import LocalDirStore, Metadata, Repository, Tensor, WriteOptions
from slurm_geo.ckpt.errors import CorruptObject, WrongKey
from slurm_geo.ckpt.format.keys import KEY_SIZE, MAX_RUN_KEYS, RunKeyRing
from slurm_geo.ckpt.ops.check import READ_ALL, check_store
from slurm_geo.ckpt.ops.replicate import copy_checkpoint
from slurm_geo.ckpt.repo.runkey import (
    NoControlKey,
    RunKeyRepository,
    carry_run_keys,
    rotate_run_keys,
    unwrap_run_keys,
)
from slurm_geo.config.model import ClusterConfig
from slurm_geo.federation.act.mover import rotates_run_key
from slurm_geo.lease.protocol import KeyReply
from tests.kit.federation import KEY, RUN, lose_home, rest_site

OPTIONS = WriteOptions(chunk_size=4096, pack_size=16 * 1024)
A, B, C = (bytes([n]) * KEY_SIZE for n in (1, 2, 3))


# --- the ring ------------------------------------------------------------------------------

@pytest.mark.parametrize(("keys", "rotated_with", "expected"), [
    ((A,), B, (B, A)),
    ((B, A), C, (C, B, A)),
])
def test_a_rotation_puts_the_new_key_in_front_and_keeps_the_old(keys, rotated_with, expected):
    ring = RunKeyRing.of(keys).rotated(rotated_with)
    assert ring.data_keys == expected and ring.current.data_key == rotated_with
    assert RunKeyRing.from_payload(ring.to_payload(), "keys/r") == ring


@pytest.mark.parametrize(("mine", "theirs", "holds", "merged"), [
    ((A,), (A,), True, (A,)),
    ((B, A), (A,), False, (B, A)),      # a replica that missed the rotation
    ((A,), (B, A), True, (A, B)),       # it holds mine already: left alone by carry
    ((C, A), (B, A), False, (C, A, B)),  # diverged: no key is lost, mine seals
])
def test_rings_merge_without_losing_a_key(mine, theirs, holds, merged):
    mine_ring, theirs_ring = RunKeyRing.of(mine), RunKeyRing.of(theirs)
    assert theirs_ring.holds(mine_ring) is holds
    assert mine_ring.merged(theirs_ring).data_keys == merged


@pytest.mark.parametrize("payload", [b"", A[:31], A + b"x", A + A,
                                     b"".join(bytes([n]) * 32 for n in range(MAX_RUN_KEYS + 1))])
def test_a_key_object_that_is_no_ring_is_corrupt(payload):
    with pytest.raises(CorruptObject, match="keys/r"):
        RunKeyRing.from_payload(payload, "keys/r")


def test_the_key_reply_carries_the_ring_and_reads_a_reply_of_one_key():
    reply = KeyReply("run-a", RunKeyRing.of((B, A)))
    body = reply.to_json()
    assert body["data_key"] == B.hex() and body["data_keys"] == [B.hex(), A.hex()]
    assert KeyReply.from_json(body) == reply
    assert KeyReply.from_json({"run": "r", "data_key": A.hex()}).data_keys.data_keys == (A,)
    with pytest.raises(ValueError, match="first of data_keys"):
        KeyReply.from_json(body | {"data_key": A.hex()})


# --- a repository under a ring ---------------------------------------------------------------

def save(repository: Repository, step: int, parent: int | None = None,
         seed: int | None = None) -> None:
    rng = random.Random(step if seed is None else seed)
    data = struct.pack("<4096f", *(rng.gauss(0, 1) for _ in range(4096)))
    repository.write_checkpoint(
        "run", [Tensor("w", "float32", (4096,), data)], b"extra",
        Metadata(step, step, 0, 1.0, "2026-12-06T00:00:00Z", "c", "1"), parent=parent)


def dirstore(path) -> LocalDirStore:
    path.mkdir(exist_ok=True)
    return LocalDirStore(path)


def packs(store: LocalDirStore) -> set[str]:
    return {n for n in store.list("run-packs/")}


def test_after_a_rotation_the_old_key_opens_the_old_checkpoints_only(tmp_path):
    store = dirstore(tmp_path / "s")
    home = Repository(store, KEY, OPTIONS)
    save(home, 10)
    provider_key = unwrap_run_keys(store, KEY, "run").current.data_key
    before = packs(store)
    ring = rotate_run_keys(home, "run")
    assert len(ring.keys) == 2 and ring.keys[1].data_key == provider_key
    # The job at home holds the ring: it reads step 10 and saves step 20 under the new key.
    job = RunKeyRepository(store, "run", unwrap_run_keys(store, KEY, "run"))
    assert job.read_checkpoint("run", 10).extra_state == b"extra"
    save(job, 20, parent=10)
    new_packs = packs(store) - before
    assert new_packs, "the first save after a rotation shares no chunk with the old key's"
    assert not any(ref.pack in {p.rsplit("/", 1)[1] for p in before}
                   for ref in job.manifest("run", 20).refs())
    # The provider, holding the old key only, opens step 10 and nothing of step 20.
    provider = RunKeyRepository(store, "run", provider_key)
    assert provider.read_checkpoint("run", 10).extra_state == b"extra"
    with pytest.raises(WrongKey):
        provider.manifest("run", 20)
    with pytest.raises(WrongKey):
        provider.latest("run")  # the latest pointer is sealed under the new key too
    # Everyone with the ring (the daemons' master key, the job) reads both; check passes.
    assert Repository(store, KEY).steps("run") == [10, 20]
    assert Repository(store, KEY).verify("run", 20) == []
    assert check_store(store, KEY, READ_ALL).ok
    # A job cannot rotate: keys/<run> is sealed under the master key.
    with pytest.raises(NoControlKey):
        rotate_run_keys(job, "run")


def test_the_save_after_a_rotation_dedups_again_from_the_next_one(tmp_path):
    store = dirstore(tmp_path / "s")
    home = Repository(store, KEY, OPTIONS)
    save(home, 10, seed=1)
    rotate_run_keys(home, "run")
    home = Repository(store, KEY, OPTIONS)
    save(home, 20, parent=10, seed=1)  # the same tensor as 10's: stored again, new key
    after_20 = packs(store)
    save(home, 30, parent=20, seed=1)  # and as 20's, under one key: nothing new stored
    assert {r.pack for r in home.manifest("run", 20).refs()}.isdisjoint(
        r.pack for r in home.manifest("run", 10).refs())
    assert home.manifest("run", 30).tensors == home.manifest("run", 20).tensors
    assert home.manifest("run", 20).key == home.manifest("run", 30).key != \
        home.manifest("run", 10).key
    new = packs(store) - after_20
    assert len(new) <= 1, "only the extra state's pack, if any"


def test_a_replica_that_missed_the_rotation_gets_the_ring_with_the_next_copy(tmp_path):
    home_store, replica = dirstore(tmp_path / "home"), dirstore(tmp_path / "away")
    home = Repository(home_store, KEY, OPTIONS)
    save(home, 10)
    copy_checkpoint(home, home_store, replica, "run", 10)
    old = unwrap_run_keys(replica, KEY, "run")
    assert len(old.keys) == 1
    ring = rotate_run_keys(home, "run")
    save(home, 20, parent=10)
    copy_checkpoint(Repository(home_store, KEY), home_store, replica, "run", 20)
    assert unwrap_run_keys(replica, KEY, "run") == ring
    assert Repository(replica, KEY).read_checkpoint("run", 20).extra_state == b"extra"
    # A store that holds every key already keeps its object as it is.
    sealed = replica.get("keys/run")
    carry_run_keys(Repository(home_store, KEY), replica, "run")
    assert replica.get("keys/run") == sealed
    # Copied back from a store with the old ring alone, the newer ring is not undone.
    stale = dirstore(tmp_path / "stale")
    stale.put("keys/run", dirstore(tmp_path / "home").get("keys/run"))
    Repository(stale, KEY).put_run_keys("run", old)
    carry_run_keys(Repository(stale, KEY), home_store, "run")
    assert unwrap_run_keys(home_store, KEY, "run") == ring


# --- the daemon rotates when a run leaves a rented cluster --------------------------------------

def cluster(name: str, access: str) -> ClusterConfig:
    return ClusterConfig(name=name, region="r", access=access)


@pytest.mark.parametrize(("left", "target", "rotates"), [
    (cluster("rented", "rest"), cluster("onprem", "cli"), True),    # failback
    (cluster("rented", "rest"), cluster("other", "rest"), True),    # provider to provider
    (cluster("onprem", "cli"), cluster("rented", "rest"), False),   # failover: home held it
    (cluster("onprem", "cli"), cluster("second", "cli"), False),    # the site's own clusters
    (cluster("rented", "rest"), cluster("rented", "rest"), False),  # again where it was
])
def test_a_run_gets_a_new_key_when_it_leaves_a_cluster_someone_else_runs(left, target, rotates):
    assert rotates_run_key(left, target) is rotates


def test_failback_from_a_rented_cluster_rotates_and_the_provider_cannot_read_on(tmp_path):
    site = rest_site(tmp_path, {"alice": {"account": "geo-alice", "token_file": "/t"}})
    site.home_job_training()
    site.checkpoint("away", 40)
    provider_key = unwrap_run_keys(site.stores["away"], KEY, RUN).current.data_key
    lose_home(site)
    site.tick()
    assert not any("rotated" in k for k in site.kinds()), "no rotation on the way out"
    (away_id, _), = site.rented.submitted
    site.rented.start(away_id)
    assert site.lease("rented", away_id, generation=1)["verdict"] == "grant"
    site.checkpoint("away", 60)
    site.onprem.come_back()
    site.tick(rounds=8)
    site.lease("rented", away_id, generation=1, last_step=60, release=True)
    site.tick()
    job = site.job()
    assert (job.cluster, job.generation, job.resume_step) == ("onprem", 2, 60)
    rotated = [k for k in site.kinds() if k.startswith("key: rotated run run-a")]
    assert rotated == ["key: rotated run run-a's data key in pfs (2 keys in its ring)"]
    # The home incarnation is given the ring: it resumes from 60 and saves 80 under the
    # new key; the provider, with the key it held, opens 60 and not 80.
    ring = unwrap_run_keys(site.stores["pfs"], KEY, RUN)
    assert ring.data_keys[1] == provider_key and ring.current.data_key != provider_key
    job_repo = RunKeyRepository(site.stores["pfs"], RUN, ring)
    rng = random.Random(80)
    job_repo.write_checkpoint(
        RUN, [Tensor("w", "float32", (1024,), struct.pack(
            "<1024f", *(rng.gauss(0, 1) for _ in range(1024))))], b"",
        Metadata(80, 80, 0, 1.0, "2026-12-06T00:00:00Z", "onprem", str(job.job_id)), parent=60)
    provider = RunKeyRepository(site.stores["pfs"], RUN, provider_key)
    assert provider.read_checkpoint(RUN, 60).manifest.step == 60
    with pytest.raises(WrongKey):
        provider.manifest(RUN, 80)
    # Replicated to the provider's store, step 80 stays closed to the provider there.
    copy_checkpoint(Repository(site.stores["pfs"], KEY), site.stores["pfs"],
                    site.stores["away"], RUN, 80)
    with pytest.raises(WrongKey):
        RunKeyRepository(site.stores["away"], RUN, provider_key).manifest(RUN, 80)
    assert Repository(site.stores["away"], KEY).verify(RUN, 80) == []


def test_a_run_never_rotated_keeps_the_key_object_every_release_reads(tmp_path):
    """Until its first rotation `keys/<run>` holds one 32-byte key, as releases before
    rings wrote and read it: only a rotated run needs readers that know rings."""
    store = dirstore(tmp_path / "s")
    save(Repository(store, KEY, OPTIONS), 10)
    assert len(unwrap_run_keys(store, KEY, "run").to_payload()) == KEY_SIZE


def test_a_key_reply_carries_the_tree_grants_of_the_jobs_world_and_refuses_bad_ones():
    from slurm_geo.lease.protocol import KeyReply, TreeGrant

    grant = TreeGrant("input", "/home/alice/data", "a" * 32, "b" * 32,
                      RunKeyRing.of([os.urandom(32), os.urandom(32)]))
    reply = KeyReply("run-1", RunKeyRing.of(os.urandom(32)), {}, (grant,))
    again = KeyReply.from_json(reply.to_json())
    assert again.trees == (grant,)
    assert "trees" not in KeyReply("run-1", reply.data_keys).to_json()  # older readers
    assert KeyReply.from_json(KeyReply("run-1", reply.data_keys).to_json()).trees == ()
    for bad in ({**grant.to_json(), "tree": "../x"}, {**grant.to_json(), "keys": []},
                {"what": "input"}):
        with pytest.raises(ValueError):
            KeyReply.from_json({**reply.to_json(), "trees": [bad]})
