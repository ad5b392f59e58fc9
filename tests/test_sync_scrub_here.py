"""Scrubbing where the bytes are: `slurm-geo sync scrub-here` reads a store's packs next to
it, holding no key, and writes `scrub/report`; checkpoint-sync (`[sync] scrub_at =
"destination"`) reads that report and a few KB of the replica's own objects instead of the
replica, and sends what the report finds damaged down the existing corrupted -> repair
path. A site that lies in its report can hide damage only until a job loads the
checkpoint: the load refuses it and falls back to the older one, never a wrong tensor."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_geo.ckpt import Tensor
from slurm_geo.ckpt.errors import CorruptObject
from slurm_geo.ckpt.format.names import manifest_name
from slurm_geo.ckpt.stores.pacing import TokenBucket
from slurm_geo.ckpt.stores.scrub_store import (
    REPORT_NAME,
    ScrubReport,
    parse_report,
    read_report,
    scrub_store,
    write_report,
)
from slurm_geo.ckpt.stores.store import LocalDirStore
from slurm_geo.sync.metrics import Live, SyncCollector
from slurm_geo.sync.scrub import judge_report, report_recheck_s
from slurm_geo.sync.scrub_remote import pack_needs
from slurm_geo.sync.state import StateDB, Status
from slurm_geo.sync.worker import Attempt, Guard, Limits, Outcome, Route
from tests.kit import fence, scrub
from tests.kit.fence import KEY
from tests.kit.scrub import Site
from tests.seaweed_server import DAEMONS, needs_weed

S = Status
A, B, C = "run-packs/r/" + "a" * 64, "run-packs/r/" + "b" * 64, "run-packs/r/" + "c" * 64


# --- the decision: pure, table-driven ---------------------------------------------------

@pytest.mark.parametrize("started, damaged, listed, expect", [
    # no report: nothing learnt about the bytes; the listing still counts
    (None, [], {A: 100, B: 100}, ((), (), "no scrub report")),
    (None, [], {A: 100}, ((), (B,), "no scrub report")),
    # a report from before the replica's last check (50) says nothing about it
    (40.0, [A], {A: 100, B: 100}, ((), (), "older than the replica's last check")),
    (50.0, [A], {A: 100, B: 100}, ((), (), "older than the replica's last check")),
    # a fresh one: its damaged packs the replica needs, and only those
    (60.0, [], {A: 100, B: 100}, ((), (), None)),
    (60.0, [A, C], {A: 100, B: 100}, ((A,), (), None)),
    (60.0, [C], {A: 100, B: 100, C: 9}, ((), (), None)),
    # missing or short counts whatever the report says
    (60.0, [], {A: 100}, ((), (B,), None)),
    (40.0, [], {A: 99, B: 100}, ((A,), (), "older than the replica's last check")),
    (60.0, [A], {A: 99, B: 100}, ((A,), (), None)),  # named once: short
])
def test_the_report_counts_only_when_newer_than_the_replicas_last_check(
        started, damaged, listed, expect):
    found = judge_report(started, damaged, 50.0, {A: 100, B: 80}, listed)
    names, missing, stale = expect
    assert tuple(n for n, _ in found.damaged) == names
    assert found.missing == missing
    assert (found.stale is None) == (stale is None)
    assert stale is None or stale in found.stale
    assert found.sound == (not names and not missing)


@pytest.mark.parametrize("raw", [
    b"", b"[]", b"{}", b"not json", b'{"started_at": 1}',
    json.dumps({"started_at": 1, "finished_at": 2, "store": "s", "packs_checked": 1,
                "bytes_read": 1, "damaged": "run-packs/x"}).encode(),
    json.dumps({"started_at": "x", "finished_at": 2, "store": "s", "packs_checked": 1,
                "bytes_read": 1, "damaged": []}).encode(),
    b" " * (5 << 20),
])
def test_what_is_not_a_report_is_refused_as_corrupt(raw):
    with pytest.raises(CorruptObject):
        parse_report(raw)


def test_a_report_round_trips():
    report = ScrubReport(1.5, 2.5, "file:///x", 3, 400, ["run-packs/r/" + "a" * 64])
    assert parse_report(report.to_json().encode()) == report
    assert not report.ok and ScrubReport(1, 2, "s", 0, 0).ok


# --- scrub-here over a directory store --------------------------------------------------

@pytest.fixture
def site(tmp_path) -> Site:
    return Site(tmp_path)


def replica_bytes(site: Site, step: int) -> int:
    sizes = site.away_store.sizes("run-packs/")
    return sum(sizes[n] for n in pack_needs(site.away.manifest("run", step)))


def test_scrub_here_names_a_flipped_pack_and_only_it(site):
    sound = scrub_store(site.away_store, "file:///away")
    assert sound.ok and sound.packs_checked > 1
    assert sound.bytes_read == sum(site.away_store.sizes("run-packs/").values())
    damaged = site.shared_pack()
    site.flip(damaged)
    seen: list[tuple[int, int]] = []
    report = scrub_store(site.away_store, "file:///away", on_bytes=lambda d, t: seen.append(
        (d, t)))
    assert report.damaged == [damaged] and not report.ok
    assert seen[-1][0] == seen[-1][1] == report.bytes_read  # progress reaches the total
    assert "sealed ones" in report.unchecked
    write_report(site.away_store, report)
    assert read_report(site.away_store) == report


def test_a_pack_deleted_while_scrubbing_is_not_damage(site):
    class Vanishing(LocalDirStore):
        def get(self, name):
            if name.startswith("run-packs/"):
                self.delete(name)
            return super().get(name)

    report = scrub_store(Vanishing(site.away_dir), "file:///away")
    assert report.ok and report.vanished > 0 and report.packs_checked == 0


# --- checkpoint-sync reading the report -------------------------------------------------

class Counting(LocalDirStore):
    """The destination as the daemon reaches it: every byte it reads counted."""

    read = 0

    def get(self, name):
        data = super().get(name)
        Counting.read += len(data)
        return data


def attempt(site: Site, clock: float = 3000.0, store=None) -> Attempt:
    route = Route("pfs", site.home_store, "home", "offsite", store or site.away_store, "eu",
                  scrub_at="destination")
    return Attempt(site.state, KEY, route, Guard(threading.Event(), float("inf")),
                   TokenBucket(0), Limits(max_attempts=3), clock=lambda: clock)


@pytest.fixture
def big_site(tmp_path, monkeypatch) -> Site:
    """Site with 1 MiB checkpoints: what a scrub turn reads is set against a replica."""
    from slurm_geo.ckpt import WriteOptions

    def tensors(step):
        frozen = random.Random(7).randbytes(1 << 20)  # incompressible, shared by both steps
        return [Tensor("frozen", "uint8", (len(frozen),), frozen),
                *(t for t in small(step) if t.path != "frozen")]

    small = scrub.tensors
    monkeypatch.setattr(scrub, "tensors", tensors)
    monkeypatch.setattr(fence, "OPTIONS", WriteOptions(chunk_size=64 << 10,
                                                        pack_size=256 << 10))
    return Site(tmp_path)


def test_a_flip_at_rest_is_found_by_scrub_here_and_repaired_reading_only_kb(big_site):
    site = big_site
    size = replica_bytes(site, 10)
    assert size > 1 << 20
    damaged = site.shared_pack()
    site.flip(damaged)
    write_report(site.away_store, scrub_store(site.away_store, "file:///away",
                                              clock=lambda: 2000.0))
    Counting.read = 0
    result = attempt(site, store=Counting(site.away_dir)).scrub(
        site.state.replica(site.ids[0]))
    assert result.outcome is Outcome.CORRUPTED and damaged in result.detail
    # KB, not the replica: the report, the run's key, the manifests
    # the report, the run's key and manifest (then the sharing one's, and the pointer)
    assert result.bytes_read < 16 << 10 and Counting.read < size / 20
    for replica_id in site.ids:  # both read the damaged pack: both out of reach, requeued
        found = site.state.replica(replica_id)
        assert (found.status, found.repairing, found.scrub_findings) == (S.PENDING, True, 1)
        assert not site.away_store.exists(manifest_name("run", found.step))
    assert not site.away_store.exists(damaged)
    for replica_id in site.ids:
        assert site.replicate(replica_id).outcome is Outcome.VERIFIED
    assert scrub_store(site.away_store, "file:///away").ok
    assert site.away.latest("run") == 20


def test_a_sound_report_scrubs_the_replica_as_of_the_reports_start(site, caplog):
    write_report(site.away_store, scrub_store(site.away_store, "file:///away",
                                              clock=lambda: 2000.0))
    result = attempt(site).scrub(site.state.replica(site.ids[0]))
    assert result.outcome is Outcome.SCRUBBED and 0 < result.bytes_read < 16 * 1024
    scrubbed = site.state.replica(site.ids[0])
    assert (scrubbed.status, scrubbed.scrubbed_at) == (S.VERIFIED, 2000.0)
    # the same report again is no news: nothing changes, an event says why
    with caplog.at_level(logging.INFO, logger="slurm_geo.sync"):
        again = attempt(site).scrub(site.state.replica(site.ids[0]))
    assert again.outcome is Outcome.STALE and "older" in again.detail
    assert "event=scrub_report_stale" in caplog.text
    assert site.state.replica(site.ids[0]).scrubbed_at == 2000.0
    samples = {(s.name, tuple(s.labels.items())): s.value
               for family in SyncCollector(site.state_path, Live, clock=lambda: 2500.0
                                           ).collect() for s in family.samples}
    assert samples[("slurm_geo_sync_scrub_report_age_seconds",
                    (("destination", "offsite"),))] == 500.0


def test_no_report_or_an_old_one_changes_nothing(site):
    replica = site.state.replica(site.ids[0])
    assert attempt(site).scrub(replica).outcome is Outcome.STALE  # none yet
    site.flip(site.shared_pack())
    old = scrub_store(site.away_store, "file:///away", clock=lambda: 900.0)  # before 1000
    write_report(site.away_store, old)
    result = attempt(site).scrub(replica)
    assert result.outcome is Outcome.STALE
    assert {site.state.replica(i).status for i in site.ids} == {S.VERIFIED}
    site.away_store.put(REPORT_NAME, b"garbage")
    assert attempt(site).scrub(replica).outcome is Outcome.STALE


def test_a_pack_missing_at_the_destination_is_found_without_any_report(site):
    missing = site.shared_pack()
    site.away_store.delete(missing)
    result = attempt(site).scrub(site.state.replica(site.ids[1]))
    assert result.outcome is Outcome.CORRUPTED and missing in result.detail
    assert {site.state.replica(i).status for i in site.ids} == {S.PENDING}


def test_a_damaged_manifest_is_found_by_the_daemon_itself(site):
    write_report(site.away_store, scrub_store(site.away_store, "file:///away",
                                              clock=lambda: 2000.0))  # all fine: no keys
    site.flip(manifest_name("run", 20))
    result = attempt(site).scrub(site.state.replica(site.ids[1]))
    assert result.outcome is Outcome.CORRUPTED
    assert site.state.replica(site.ids[0]).status is S.VERIFIED  # 10 reads nothing of it


# --- a site that lies ---------------------------------------------------------------------

def test_a_lying_report_keeps_the_replica_verified_but_the_load_falls_back(tmp_path):
    torch = pytest.importorskip("torch")
    from slurm_geo.ckpt import Repository
    from slurm_geo.torch.checkpointer import Checkpointer

    site = Site(tmp_path)  # the run "run" at 10 and 20; the job's run saved alongside
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())

    def steps(count: int) -> None:
        for _ in range(count):
            optimizer.zero_grad()
            model(torch.ones(1, 64)).sum().backward()
            optimizer.step()

    with Checkpointer(site.home, "job") as checkpointer:
        steps(2)
        checkpointer.save(2, model, optimizer)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        steps(2)
        checkpointer.save(4, model, optimizer)
    ids = site.state.add([{"root": "pfs", "run": "job", "step": step, "destination": "offsite",
                           "sequence": 10 + step, "status": S.PENDING.value}
                          for step in (2, 4)], now=0.0)
    for replica_id in ids:
        assert site.replicate(replica_id).outcome is Outcome.VERIFIED
    older = set(pack_needs(site.away.manifest("job", 2)))
    (only_newest, *_) = sorted(set(pack_needs(site.away.manifest("job", 4))) - older)
    site.flip(only_newest)
    honest = scrub_store(site.away_store, "file:///away", clock=lambda: 2000.0)
    assert only_newest in honest.damaged
    write_report(site.away_store, replace(honest, damaged=[]))  # the lie
    assert attempt(site).scrub(site.state.replica(ids[1])).outcome is Outcome.SCRUBBED
    assert site.state.replica(ids[1]).status is S.VERIFIED
    fresh = torch.nn.Linear(64, 64)
    resumed = Checkpointer(Repository(site.away_store, KEY), "job").resume(
        fresh, torch.optim.AdamW(fresh.parameters()))
    assert resumed is not None and resumed.step == 2  # step 4 refused: its AEAD check
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, saved[name])


# --- the command --------------------------------------------------------------------------

def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurm_geo", "sync", "scrub-here", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_cli_help_json_report_and_exit_codes(site, tmp_path):
    shown = cli("--help")
    assert shown.returncode == 0 and "--rate-mb-s" in shown.stdout and "no key" in shown.stdout
    url = f"file://{site.away_dir}"
    # no key anywhere near: one that is not a key file is never looked at
    nokey = {"SLURM_GEO_KEY_FILE": str(tmp_path / "absent.key")}
    sound = cli("--store", url, "--json", "--rate-mb-s", "1000", env=nokey)
    assert sound.returncode == 0, sound.stderr
    report = json.loads(sound.stdout)
    assert report["damaged"] == [] and report["packs_checked"] > 0 and report["store"] == url
    assert read_report(site.away_store) == parse_report(sound.stdout.encode())
    damaged = site.shared_pack()
    site.flip(damaged)
    site.away_store.delete(REPORT_NAME)
    found = cli("--store", url, "--no-report", env=nokey)
    assert found.returncode == 1 and damaged in found.stdout and "packs checked" in found.stdout
    assert found.stderr.count("\n") == 1 and "damaged" in found.stderr
    assert not site.away_store.exists(REPORT_NAME)
    for args, code, says in [(("--store", "ftp://x"), 3, "unknown scheme"),
                             (("--store", "file:///no/such/dir"), 25, "/no/such/dir"),
                             (("--store", url, "--rate-mb-s", "-1"), 2, "rate-mb-s")]:
        bad = cli(*args)
        assert bad.returncode == code and says in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("interval, retry_base, wait", [
    (86400.0, 30.0, 3600.0),  # a day between scrubs: an hour at most
    (600.0, 30.0, 600.0),     # never longer than a replica waits between scrubs
    (0.0, 30.0, 30.0),        # never shorter than a failed scrub waits
    (0.0, 1.0, 1.0),
])
def test_a_stale_report_is_looked_at_again_after_the_scrub_interval(interval, retry_base, wait):
    assert report_recheck_s(interval, retry_base) == wait


# --- a real S3 server (SeaweedFS) -------------------------------------------------------------

@needs_weed
@pytest.mark.slow
def test_scrub_here_on_s3_finds_a_flip_at_rest_and_the_daemon_repairs_reading_kb(
        tmp_path, weed):
    """The destination is a real S3 server: scrub-here (the CLI, S3 credentials from its
    environment, no key) reads its packs; checkpoint-sync's scrub turn reads KB."""
    from slurm_geo.ckpt.stores.s3store import S3Store
    from slurm_geo.sandbox.layout import S3_BUCKET, S3_PREFIX

    prefix = f"{S3_PREFIX}/scrub-here-{os.getpid()}"
    s3 = S3Store(S3_BUCKET, prefix, weed.client(DAEMONS))
    site = S3Site(tmp_path, s3)
    size = sum(s3.sizes("run-packs/").values())
    manifest = site.away.manifest("run", 10)  # a pack the scrubbed replica (run@10) needs
    damaged = sorted({manifest.pack_object(r.pack) for r in manifest.refs()})[0]
    rotten = bytearray(s3.get(damaged))
    rotten[len(rotten) // 2] ^= 0x01
    s3.put(damaged, bytes(rotten))  # bit rot at rest: the object no longer hashes to its name
    env = {"AWS_ENDPOINT_URL": weed.server.endpoint, "AWS_CA_BUNDLE": str(weed.ca_file),
           "AWS_ACCESS_KEY_ID": DAEMONS.access_key_id, "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_SECRET_ACCESS_KEY": DAEMONS.secret_access_key,
           "SLURM_GEO_KEY_FILE": str(tmp_path / "absent.key")}
    url = f"s3://{S3_BUCKET}/{prefix}"
    found = cli("--store", url, "--json", env=env)
    assert found.returncode == 1, found.stderr
    assert json.loads(found.stdout)["damaged"] == [damaged]

    counted = CountingS3(s3)
    result = attempt(site, store=counted).scrub(
        site.state.replica(site.ids[0]))
    assert result.outcome is Outcome.CORRUPTED and damaged in result.detail
    assert counted.read < size / 4  # the report, the key, the manifests: not the replica
    for replica_id in site.ids:
        assert site.replicate(replica_id).outcome is Outcome.VERIFIED
    again = cli("--store", url, "--json", env=env)
    assert again.returncode == 0 and json.loads(again.stdout)["damaged"] == []


class CountingS3:
    """An S3 destination as the daemon reaches it: every byte it reads counted."""

    def __init__(self, inner):
        self.inner, self.read = inner, 0

    def get(self, name):
        data = self.inner.get(name)
        self.read += len(data)
        return data

    def __getattr__(self, attribute):
        return getattr(self.inner, attribute)


class S3Site(Site):
    """Site's run@10 and run@20, replicated and verified at `destination` (S3)."""

    def __init__(self, tmp_path: Path, destination):
        from slurm_geo.ckpt import Repository
        from tests.kit.fence import OPTIONS, repo
        from tests.kit.scrub import save

        self.home_store, self.home = repo(tmp_path, "home")
        self.away_store, self.away = destination, Repository(destination, KEY, OPTIONS)
        self.state_path = tmp_path / "sync.db"
        self.state = StateDB(self.state_path)
        save(self.home, 10, None)
        save(self.home, 20, 10)
        self.ids = self.state.add([{"root": "pfs", "run": "run", "step": step,
                                    "destination": "offsite", "sequence": i,
                                    "status": S.PENDING.value}
                                   for i, step in enumerate((10, 20))], now=0.0)
        for replica_id in self.ids:
            assert self.replicate(replica_id).outcome is Outcome.VERIFIED
