"""checkpoint-sync against the sandbox's real S3 endpoint: a checkpoint written during
training becomes verified; kill -9 at random points never loses or fakes a replica; an
unreachable store loses nothing; a corrupted replica is flagged and never offered."""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from slurm_geo.ckpt import Repository, load_master_key
from slurm_geo.ckpt.format.names import PACK_PREFIXES
from slurm_geo.ckpt.stores.open_store import open_store
from slurm_geo.ckpt.stores.s3store import S3Store
from slurm_geo.config.model import load_config
from slurm_geo.sandbox.layout import S3_BUCKET
from slurm_geo.sandbox.render import sync_metrics_port
from slurm_geo.sandbox.sites import Site
from slurm_geo.sync.daemon import Daemon
from slurm_geo.sync.metrics import Live, SyncCollector
from slurm_geo.sync.runtime import load_runtime
from slurm_geo.sync.state import StateDB, Status
from tests.helpers import pack_files
from tests.kit.sync import (
    MIB,
    TcpProxy,
    Trainer,
    all_verified,
    delete_prefix,
    free_port,
    master_key,
    rows,
    site_config,
    start_daemon,
    statuses,
    stop,
    wait_for,
)


@pytest.fixture
def aws_env(monkeypatch, s3_env):
    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)


def tensors_of(checkpoint):
    return [bytes(t.data) for t in checkpoint.tensors]


@pytest.mark.sandbox
def test_a_checkpoint_written_during_training_becomes_verified_at_the_remote_store(
        tmp_path, s3_endpoint, s3_env, s3_client, s3_prefix):
    (tmp_path / "root").mkdir()
    key_file, key = master_key(tmp_path)
    config = site_config(tmp_path / "site.toml", {"pfs": tmp_path / "root"},
                         f"s3://{S3_BUCKET}/{s3_prefix}", endpoint_url=s3_endpoint,
                         key_file=key_file, state=tmp_path / "state.db")
    trainer = Trainer(tmp_path / "root", key, "train-1", shape=(256, 256))
    daemon = start_daemon(config, log=tmp_path / "log", env=s3_env)
    saved: dict[int, tuple[float, list[bytes]]] = {}
    try:
        for _ in range(5):                       # training goes on while replication runs
            trainer.train(20)
            step = trainer.save()
            saved[step] = (time.time(), [bytes(t.data) for t in trainer.tensors()])
            time.sleep(0.3)
        newest = max(saved)
        wait_for(lambda: all_verified(tmp_path / "state.db", {("train-1", newest)}), 60,
                 "newest checkpoint verified")
        lag = time.time() - saved[newest][0]
    finally:
        assert stop(daemon) == 0
    remote = Repository(S3Store(S3_BUCKET, s3_prefix, s3_client), key)
    assert tensors_of(remote.read_checkpoint("train-1", newest)) == saved[newest][1]
    state = StateDB(tmp_path / "state.db", readonly=True)
    assert state.newest_verified("train-1", "offsite") == newest
    [row] = state.replicas("step = ?", [newest])
    state.close()
    assert row.lag_s is not None and row.manifest_sha256 and row.bytes > 0
    assert lag < 10, f"newest checkpoint verified {lag:.1f} s after it was saved"


@pytest.mark.sandbox
@pytest.mark.slow
def test_kill_9_at_random_points_always_ends_verified_and_byte_identical(
        tmp_path, s3_endpoint, s3_env, s3_client, s3_prefix):
    """12 runs: start, kill -9 after a random delay, restart, check. A pack is one PUT (they
    are under the 64 MiB multipart threshold); a multipart upload cut off and resumed is
    tests/test_parallel_uploads.py's."""
    (tmp_path / "root").mkdir()
    key_file, key = master_key(tmp_path)
    trainer = Trainer(tmp_path / "root", key, "killed", shape=(2048, 2560))  # 21 MB
    trainer.train(1)
    expected = {trainer.save(): [bytes(t.data) for t in trainer.tensors()]}
    trainer.bias += 1            # the second checkpoint shares the big pack, adds a small one
    trainer.step += 1
    expected[trainer.save()] = [bytes(t.data) for t in trainer.tensors()]
    packs = [p.stat().st_size for p in pack_files(tmp_path / "root")]
    assert max(packs) >= 16 * MIB  # a copy long enough for kills to land inside

    def configured(i: int) -> tuple[Path, Path, str]:
        prefix = f"{s3_prefix}/kill{i}"
        state = tmp_path / f"state{i}.db"
        config = site_config(tmp_path / f"site{i}.toml", {"pfs": tmp_path / "root"},
                             f"s3://{S3_BUCKET}/{prefix}", endpoint_url=s3_endpoint,
                             key_file=key_file, state=state)
        return config, state, prefix

    began = time.monotonic()
    config, state, prefix = configured(0)
    assert start_daemon(config, "--once", log=tmp_path / "log0", env=s3_env).wait(60) == 0
    window = time.monotonic() - began          # start to all verified, uninterrupted
    delete_prefix(s3_client, prefix)
    chance = random.Random(20261129)
    at_kill: Counter[str] = Counter()
    for i in range(1, 13):
        config, state, prefix = configured(i)
        proc = start_daemon(config, log=tmp_path / f"log{i}", env=s3_env)
        time.sleep(chance.uniform(0.6, window))   # ~0.6 s is the interpreter starting
        proc.kill()
        proc.wait()
        seen = statuses(state)
        at_kill[",".join(seen.get(("killed", s), "-") for s in sorted(expected))] += 1
        replica_store = S3Store(S3_BUCKET, prefix, s3_client)
        for (run, step), status in seen.items():   # never verified unless it is
            if status == "verified":
                assert Repository(replica_store, key).verify(run, step) == []
        restarted = start_daemon(config, "--once", log=tmp_path / f"log{i}", env=s3_env)
        assert restarted.wait(60) == 0, (tmp_path / f"log{i}").read_text()
        assert all_verified(state, {("killed", s) for s in expected})
        puts = Counter(r["object"] for r in rows(state, "SELECT object FROM transfers "
                                                        "WHERE kind = 'packs'"))
        assert all(n == 1 for n in puts.values()), f"a pack went up twice: {puts}"
        remote = Repository(replica_store, key)
        for step, tensors in expected.items():
            assert tensors_of(remote.read_checkpoint("killed", step)) == tensors
        delete_prefix(s3_client, prefix)
    print(f"\nkill -9 points (status of steps {sorted(expected)} at the kill): "
          f"{dict(at_kill)}; "
          f"window {window:.1f} s; total {time.monotonic() - began:.0f} s")
    assert any("uploading" in k or "replicated" in k for k in at_kill), at_kill


@pytest.mark.sandbox
def test_an_unreachable_store_grows_the_queue_loses_nothing_and_catches_up(
        tmp_path, s3_endpoint, s3_env, s3_client, s3_prefix):
    endpoint = urlsplit(s3_endpoint)
    assert endpoint.hostname is not None and endpoint.port is not None
    proxy = TcpProxy(endpoint.port, target_host=endpoint.hostname)
    proxy.up()
    (tmp_path / "root").mkdir()
    key_file, key = master_key(tmp_path)
    state = tmp_path / "state.db"
    port = free_port()
    config = site_config(tmp_path / "site.toml", {"pfs": tmp_path / "root"},
                         f"s3://{S3_BUCKET}/{s3_prefix}",
                         endpoint_url=proxy.url.replace("http:", f"{endpoint.scheme}:"),
                         key_file=key_file, state=state, metrics_port=port)
    trainer = Trainer(tmp_path / "root", key, "outage", shape=(128, 128))
    trainer.train(5)
    first = trainer.save()
    daemon = start_daemon(config, log=tmp_path / "log", env=s3_env)
    try:
        wait_for(lambda: all_verified(state, {("outage", first)}), 30, "first verified")
        proxy.down()
        during = []
        for _ in range(3):
            trainer.train(5)
            during.append(trainer.save())
        wait_for(lambda: "event=outage" in (tmp_path / "log").read_text(), 60, "outage seen")
        wait_for(lambda: len([s for s in statuses(state).values() if s == "pending"]) == 3,
                 30, "queue of 3")
        metrics = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert 'slurm_geo_sync_destination_up{destination="offsite"} 0.0' in metrics
        assert 'slurm_geo_sync_queue_depth{destination="offsite"} 3.0' in metrics
        time.sleep(3)                              # more failed tries cost no attempts
        assert not {"failed", "corrupted"} & set(statuses(state).values())
        proxy.up()
        wait_for(lambda: all_verified(state, {("outage", s) for s in [first, *during]}), 90,
                 "caught up")
    finally:
        assert stop(daemon) == 0
        proxy.down()
    [charged] = rows(state, "SELECT MAX(charged) AS n, SUM(outages) AS o FROM replicas")
    assert charged["n"] == 0 and charged["o"] >= 1
    assert "event=destination_back" in (tmp_path / "log").read_text()
    remote = Repository(S3Store(S3_BUCKET, s3_prefix, s3_client), key)
    assert tensors_of(remote.read_checkpoint("outage", during[-1])) == [
        bytes(t.data) for t in trainer.tensors()]


class CorruptFirstPack:
    """A destination that flips one bit of the first pack put into it, after the upload
    checks of the transport (S3's SHA-256 is computed over the flipped bytes): only the
    digest the destination then reports shows it."""

    def __init__(self, inner):
        self.inner = inner
        self.corrupted: str | None = None

    def put(self, name, data):
        if name.startswith(PACK_PREFIXES) and self.corrupted is None:
            data = bytearray(data)
            data[len(data) // 2] ^= 0x01
            self.corrupted = name
        self.inner.put(name, data)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("where", ["dir", pytest.param("s3", marks=pytest.mark.sandbox)])
def test_a_corrupted_replica_is_flagged_never_offered_and_repaired_by_retry(
        tmp_path, request, where):
    (tmp_path / "root").mkdir()
    key_file, key = master_key(tmp_path)
    if where == "s3":
        request.getfixturevalue("aws_env")
        prefix = request.getfixturevalue("s3_prefix")
        url, endpoint = f"s3://{S3_BUCKET}/{prefix}", request.getfixturevalue("s3_endpoint")
    else:
        (tmp_path / "offsite").mkdir()
        url, endpoint = f"file://{tmp_path / 'offsite'}", ""
    config = site_config(tmp_path / "site.toml", {"pfs": tmp_path / "root"}, url,
                         endpoint_url=endpoint, key_file=key_file, state=tmp_path / "state.db")
    trainer = Trainer(tmp_path / "root", key, "rot", shape=(256, 256))
    trainer.train(3)
    step = trainer.save()
    wrapped: list[CorruptFirstPack] = []

    def corrupting(store_url, endpoint_url=None, **options):
        store = open_store(store_url, endpoint_url=endpoint_url, **options)
        if store_url == url:
            wrapped.append(CorruptFirstPack(store))
            return wrapped[-1]
        return store

    runtime = load_runtime(config, open_store=corrupting)
    daemon = Daemon(runtime, lambda: runtime, tmp_path / "state.db", handle_signals=False,
                    set_priority=False)
    assert daemon.run(once=True) == 1

    state = StateDB(tmp_path / "state.db")
    [replica] = state.replicas()
    # Verified as written: the destination's digest differs from the bytes sent, so the
    # pack is deleted there and the attempt fails (a retry after a backoff), counted
    assert replica.status is Status.PENDING and replica.corruptions == 1
    assert wrapped[0].corrupted in (replica.last_error or "")
    assert state.newest_verified("rot", "offsite") is None           # never offered
    destination = open_store(url, endpoint_url=endpoint or None)
    assert Repository(destination, key).steps("rot") == []          # nor findable there
    assert not destination.exists(wrapped[0].corrupted)              # the bad pack is gone
    collector = SyncCollector(tmp_path / "state.db", Live)
    failures = {s.labels["reason"]: s.value for family in collector.collect()
                if family.name == "slurm_geo_sync_failures" for s in family.samples}
    assert failures["corruption"] == 1

    state.update(replica.id, Status.PENDING, time.time(), next_attempt_at=0.0)  # no backoff
    state.close()
    clean = load_runtime(config)
    assert Daemon(clean, lambda: clean, tmp_path / "state.db", handle_signals=False,
                  set_priority=False).run(once=True) == 0
    assert statuses(tmp_path / "state.db") == {("rot", step): "verified"}
    restored = Repository(destination, key).read_checkpoint("rot", step)
    assert tensors_of(restored) == [bytes(t.data) for t in trainer.tensors()]


@pytest.mark.sandbox
def test_the_sandbox_runs_checkpoint_sync_from_pfs_to_offsite(sandbox, aws_env):
    [row] = [r for r in sandbox.status() if r.name == "checkpoint-sync"]
    home = sandbox.layout.address(Site.HOME)
    assert row.up and row.endpoint == f"{home}:{sync_metrics_port(sandbox.layout)}"
    site = load_config(sandbox.layout.site_config)
    assert site.sync is not None
    key = load_master_key(sandbox.layout.master_key)
    run = f"sandbox-sync-{time.time_ns()}"
    trainer = Trainer(sandbox.layout.pfs_dir, key, run, shape=(32, 32))
    trainer.train(2)
    step = trainer.save()
    try:
        wait_for(lambda: all_verified(site.sync.state, {(run, step)}), 60,
                 "verified by the sandbox's checkpoint-sync")
    finally:
        offsite = site.stores["offsite"]
        for store in (trainer.repository, Repository(
                open_store(offsite.url, endpoint_url=offsite.endpoint_url), key)):
            _remove_run(store, run, step)


def _remove_run(repository: Repository, run: str, step: int) -> None:
    store = repository._store  # noqa: SLF001 - test cleanup of one run's objects
    try:
        packs = {f"packs/{r.pack[:2]}/{r.pack}" for r in repository.manifest(run, step).refs()}
    except Exception:  # noqa: BLE001 - nothing there to clean
        packs = set()
    for name in [*packs, *store.list(f"manifests/{run}/"), f"latest/{run}", f"keys/{run}"]:
        store.delete(name)
