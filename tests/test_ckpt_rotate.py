"""Rotating the master key (docs/format.md §8.5): a first run writes the key ring and
seals nothing; the second seals every run's wrapped key, fence and promotion marker again
under the new key in every store. Run keys (so packs, manifests and running jobs) stay as
they were, and a rotation cut anywhere leaves every object readable through the key file
and finishes when run again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_geo.ckpt import LocalDirStore, Repository
from slurm_geo.ckpt.errors import (
    CorruptObject,
    KeyFileError,
    LegacyObject,
    StoreUnavailable,
    WrongKey,
)
from slurm_geo.ckpt.format.keys import (
    KeyFile,
    LiveKeyFile,
    fence_key,
    fingerprint,
    load_master_key,
    promotion_key,
    write_key_file,
)
from slurm_geo.ckpt.format.seal import Kind, seal
from slurm_geo.ckpt.ops.rotate import (
    MAX_PASSES,
    Outcome,
    RotationRefused,
    RotationReport,
    Verdict,
    judge,
    rotate_master_key,
)
from slurm_geo.ckpt.repo.fence import Fence, read_fence, write_fence
from slurm_geo.ckpt.repo.runkey import RunKeyRepository, unwrap_run_key
from slurm_geo.cli import ckpt as cli_ckpt
from slurm_geo.cli import cli
from tests.kit.fence import KEY, OPTIONS, fence, legacy_seal, save
from tests.kit.rotate import (  # noqa: F401 - key_file_fixture: the fixture key_file
    key_file_fixture,
    key_file_of,
    rotate_fully,
)

RUNS = ("run", "run-b", "run-c")
OTHER_KEY = bytes(range(64, 96))
SALT = bytes(16)


class Killed(BaseException):
    """The process dies here: nothing after it runs, no handler sees it."""


class DyingStore:
    """A store whose process is killed at its `lives`-th request (get, list, put, ...)."""

    def __init__(self, store: LocalDirStore, lives: int):
        self._store = store
        self.lives = lives

    def _live(self) -> None:
        self.lives -= 1
        if self.lives < 0:
            raise Killed

    def put(self, name, data):
        self._live()
        self._store.put(name, data)

    def get(self, name):
        self._live()
        return self._store.get(name)

    def list(self, prefix):
        self._live()
        return self._store.list(prefix)

    def delete(self, name):
        self._live()
        self._store.delete(name)

    def exists(self, name):
        self._live()
        return self._store.exists(name)


def site_store(root: Path) -> LocalDirStore:
    """A store as a site's daemons leave it: three runs, each fenced, two promoted."""
    root.mkdir()
    store = LocalDirStore(root)
    repository = Repository(store, KEY, OPTIONS)
    for run in RUNS:
        for step in (10, 20):
            save(repository, run, step, "onprem")
        write_fence(repository, fence_of(run))
    for run in RUNS[:2]:
        repository.promote(run, 10)
    return store


def fence_of(run: str) -> Fence:
    return replace(fence(), run=run)


def snapshot(store: LocalDirStore) -> dict[str, bytes]:
    return {name: store.get(name) for name in store.list("")}


def assert_everything_opens(store, master_keys) -> None:
    repository = Repository(store, master_keys, OPTIONS)
    for run in RUNS:
        assert repository.read_checkpoint(run, 20).manifest.step == 20
        assert repository.latest(run) == 20
        assert read_fence(repository, run) == fence_of(run)
        assert repository.is_promoted(run, 10) is (run in RUNS[:2])


def rotate_until_complete(stores, key_file: Path) -> RotationReport:
    """The command run again until the key file holds the new key alone."""
    for _ in range(2):
        report = rotate_master_key(stores, key_file)
        if report.outcome is Outcome.COMPLETE:
            return report
    raise AssertionError(f"not complete after two runs: {report}")


@pytest.fixture
def home(tmp_path) -> LocalDirStore:
    return site_store(tmp_path / "home")


def test_the_first_run_writes_the_key_ring_and_seals_nothing(home, key_file):
    before = snapshot(home)
    report = rotate_master_key({"home": home}, key_file)
    assert report.outcome is Outcome.RING_WRITTEN and len(report.stores[0].rewrapped) == 8
    ring = load_master_key(key_file)
    assert ring.previous == KEY and ring.rotating == ("home",)
    assert report.key == fingerprint(ring.current).hex()
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert snapshot(home) == before
    assert_everything_opens(home, ring)


def test_a_rotation_seals_every_run_key_fence_and_marker_again_and_nothing_else(
        home, key_file):
    before = snapshot(home)
    report = rotate_fully({"home": home}, key_file)
    assert report.outcome is Outcome.COMPLETE and report.refused == 0
    new = load_master_key(key_file)
    assert new.previous is None and new.current != KEY
    assert key_file.read_bytes() == new.current and key_file.stat().st_mode & 0o777 == 0o600
    assert report.key == fingerprint(new.current).hex()
    assert report.previous == fingerprint(KEY).hex()
    (store_report,) = report.stores
    assert store_report.rewrapped == sorted(
        [f"keys/{r}" for r in RUNS] + [f"fences/{r}" for r in RUNS]
        + ["promoted/run/00000000000000000010", "promoted/run-b/00000000000000000010"])
    after = snapshot(home)
    changed = {n for n in after if after[n] != before[n]}
    assert changed == set(store_report.rewrapped)  # packs, manifests, pointers: untouched
    assert after.keys() == before.keys()
    assert_everything_opens(home, new)
    old = Repository(home, KEY, OPTIONS)
    for opening in (lambda: old.manifest("run", 20), lambda: old.is_promoted("run", 10),
                    lambda: read_fence(old, "run")):
        with pytest.raises(WrongKey):
            opening()


def test_a_running_jobs_run_key_still_reads_and_writes(home, key_file):
    job = RunKeyRepository(home, "run", unwrap_run_key(home, KEY, "run"))
    rotate_fully({"home": home}, key_file)
    assert job.read_checkpoint("run", 20).manifest.step == 20
    save(job, "run", 30, "onprem")
    daemon = Repository(home, load_master_key(key_file), OPTIONS)
    assert daemon.latest("run") == 30 and daemon.verify("run", 30) == []


def test_two_stores_are_rotated_together(tmp_path, home, key_file):
    offsite = site_store(tmp_path / "offsite")
    report = rotate_fully({"home": home, "s3-offsite": offsite}, key_file)
    assert report.outcome is Outcome.COMPLETE
    assert [(s.store, len(s.rewrapped)) for s in report.stores] == [("home", 8),
                                                                    ("s3-offsite", 8)]
    for store in (home, offsite):
        assert_everything_opens(store, load_master_key(key_file))


def test_a_rotation_killed_at_any_request_leaves_every_object_open_and_a_rerun_finishes_it(
        tmp_path):
    counted = DyingStore(site_store(tmp_path / "count"), 10**6)
    rotate_fully({"home": counted}, key_file_of(tmp_path / "count"))
    requests = 10**6 - counted.lives
    for lives in range(requests):
        home = site_store(tmp_path / f"home-{lives}")
        key_file = key_file_of(tmp_path / f"home-{lives}")
        with pytest.raises(Killed):
            rotate_until_complete({"home": DyingStore(home, lives)}, key_file)
        held = load_master_key(key_file)
        assert_everything_opens(home, held)  # through the ring, or the old key before it
        rotate_until_complete({"home": home}, key_file)
        final = load_master_key(key_file)
        if held.previous is not None:
            assert final.current == held.current  # the same rotation, not another
        assert final.keys() == (final.current,) and final.current != KEY
        assert_everything_opens(home, final)


def test_a_store_down_mid_rotation_leaves_the_ring_and_says_to_run_again(tmp_path, home,
                                                                         key_file):
    class FailingPuts(DyingStore):
        puts_left = 2

        def put(self, name, data):
            if self.puts_left == 0:
                raise StoreUnavailable(name, "connection reset")
            self.puts_left -= 1
            self._store.put(name, data)

    rotate_master_key({"home": home}, key_file)
    report = rotate_master_key({"home": FailingPuts(home, 10**6)}, key_file)
    assert report.outcome is Outcome.UNFINISHED and "connection reset" in report.unfinished
    assert "connection reset" in report.stores[0].unfinished
    ring = load_master_key(key_file)
    assert ring.previous == KEY and ring.rotating == ("home",)
    assert_everything_opens(home, ring)


def old_run_key(run: str) -> bytes:
    """`keys/<run>` sealed under the old master key, as a store not yet rotated holds it."""
    return seal(KEY, Kind.DATA_KEY, SALT, bytes(range(32)), f"keys/{run}")


def test_a_copy_made_under_the_old_key_during_the_rotation_is_sealed_again(tmp_path, home,
                                                                          key_file):
    """checkpoint-sync may copy `keys/<run>` from a store not yet rotated into one whose
    keys a pass has just sealed again: the next pass finds it."""
    offsite = site_store(tmp_path / "offsite")

    class CopiedInto(DyingStore):
        listings = 0  # of fences/ while the key file holds the ring: the survey's, then

        def list(self, prefix):
            if prefix == "fences/" and load_master_key(key_file).previous is not None:
                self.listings += 1
                if self.listings == 2:  # the first pass has just sealed keys/ again
                    self._store.put("keys/run-late", old_run_key("run-late"))
            return self._store.list(prefix)

    report = rotate_fully({"home": CopiedInto(home, 10**6), "offsite": offsite}, key_file)
    assert report.outcome is Outcome.COMPLETE
    assert "keys/run-late" in report.stores[0].rewrapped
    assert unwrap_run_key(home, load_master_key(key_file), "run-late") == bytes(range(32))


def test_a_writer_that_keeps_the_old_key_leaves_the_rotation_unfinished(home, key_file):
    class StaleWriter(DyingStore):
        def list(self, prefix):
            if prefix == "keys/":
                self._store.put("keys/stale", old_run_key("stale"))
            return self._store.list(prefix)

    report = rotate_fully({"home": StaleWriter(home, 10**6)}, key_file)
    assert report.outcome is Outcome.UNFINISHED
    assert f"after {MAX_PASSES} passes" in report.unfinished
    assert load_master_key(key_file).previous == KEY  # the old key stays in the ring


def test_a_fence_set_during_the_rotation_is_not_put_back(home, key_file):
    """Read under the old key, then moved on by the daemon (under the new key) before the
    rotation puts it back: the rotation reads it again and leaves the newer one."""
    newer = Fence("run", 2, "onprem", 20, "2026-11-29T13:00:00+00:00")

    class FenceMoves(DyingStore):
        reads = 0  # of the fence while the key file holds the ring: the survey's, then

        def put(self, name, data):
            assert name != "fences/run", "the fence was put back"
            self._store.put(name, data)

        def get(self, name):
            data = self._store.get(name)
            ring = load_master_key(key_file)
            if name == "fences/run" and ring.previous is not None:
                self.reads += 1
                if self.reads == 2:  # the pass has read it under the old key
                    write_fence(Repository(self._store, ring), newer)
            return data

    moving = FenceMoves(home, 10**6)
    report = rotate_fully({"home": moving}, key_file)
    assert moving.reads > 2 and report.outcome is Outcome.COMPLETE
    assert "fences/run" in report.stores[0].current
    assert read_fence(Repository(home, load_master_key(key_file)), "run") == newer


def test_a_dry_run_writes_nothing(tmp_path, home, key_file):
    offsite = site_store(tmp_path / "offsite")
    before = snapshot(home), snapshot(offsite), key_file.read_bytes()
    report = rotate_master_key({"home": home, "offsite": offsite}, key_file, dry_run=True)
    assert report.outcome is Outcome.DRY_RUN and report.key is None
    assert [len(s.rewrapped) for s in report.stores] == [8, 8]
    assert (snapshot(home), snapshot(offsite), key_file.read_bytes()) == before


def test_a_dry_run_of_a_rotation_in_progress_names_its_key_and_what_is_left(home, key_file):
    rotate_master_key({"home": home}, key_file)
    with pytest.raises(Killed):
        rotate_master_key({"home": DyingStore(home, 20)}, key_file)
    ring = load_master_key(key_file)
    report = rotate_master_key({"home": home}, key_file, dry_run=True)
    assert report.outcome is Outcome.DRY_RUN and report.key == fingerprint(ring.current).hex()
    (store_report,) = report.stores
    assert store_report.current and store_report.rewrapped  # some done, some left
    assert load_master_key(key_file) == ring


def test_refused_when_the_key_file_is_too_open(home, key_file):
    key_file.chmod(0o640)
    before = snapshot(home)
    with pytest.raises(KeyFileError, match="chmod 600"):
        rotate_master_key({"home": home}, key_file)
    assert snapshot(home) == before and key_file.read_bytes() == KEY


def test_the_wrong_key_file_is_refused_before_anything_changes(tmp_path, home):
    wrong = key_file_of(tmp_path, OTHER_KEY)
    with pytest.raises(KeyFileError, match="opens none of the 8 objects of store 'home'"):
        rotate_master_key({"home": home}, wrong)
    assert wrong.read_bytes() == OTHER_KEY


def test_a_rotation_in_progress_is_finished_naming_all_its_stores(tmp_path, home, key_file):
    offsite = site_store(tmp_path / "offsite")
    rotate_master_key({"home": home, "offsite": offsite}, key_file)
    with pytest.raises(RotationRefused, match="missing: offsite"):
        rotate_master_key({"home": home}, key_file)
    third = site_store(tmp_path / "third")
    report = rotate_master_key({"home": home, "offsite": offsite, "third": third}, key_file)
    assert report.outcome is Outcome.COMPLETE
    for store in (home, offsite, third):
        assert_everything_opens(store, load_master_key(key_file))


def test_one_rotation_at_a_time(home, key_file):
    class SecondRotation(DyingStore):
        def list(self, prefix):
            with pytest.raises(RotationRefused, match="another `slurm-geo keys rotate`"):
                rotate_master_key({"home": home}, key_file)
            return self._store.list(prefix)

    report = rotate_master_key({"home": SecondRotation(home, 10**6)}, key_file)
    assert report.outcome is Outcome.RING_WRITTEN


def test_objects_that_open_under_neither_key_are_refused_and_left(home, key_file):
    forged = seal(OTHER_KEY, Kind.FENCE, SALT, b"{}", "fences/forged")
    home.put("fences/forged", forged)
    report = rotate_fully({"home": home}, key_file)
    assert report.outcome is Outcome.COMPLETE
    assert list(report.stores[0].refused) == ["fences/forged"]
    assert "sealed with key" in report.stores[0].refused["fences/forged"]
    assert home.get("fences/forged") == forged


def test_a_daemon_following_the_key_file_keeps_working_through_a_rotation(home, key_file):
    followed = LiveKeyFile(key_file)
    daemon = Repository(home, followed, OPTIONS)
    rotate_master_key({"home": home}, key_file)
    ring = load_master_key(key_file)
    assert followed.keys() == ring.keys()
    save(daemon, "run-new", 10, "onprem")  # a new run's key, sealed under the new key
    assert home.get("keys/run-new")[10:18] == fingerprint(ring.current)
    with pytest.raises(Killed):
        rotate_master_key({"home": DyingStore(home, 25)}, key_file)
    assert_everything_opens(home, followed)
    rotate_master_key({"home": home}, key_file)
    assert followed.keys() == (ring.current,)
    assert Repository(home, followed, OPTIONS).latest("run-new") == 10


N = bytes(range(32, 64))
F_N, F_O = fence_key(N), fence_key(KEY)


@pytest.mark.parametrize("sealed, verdict, error", [
    (seal(F_N, Kind.FENCE, SALT, b"{}", "fences/r"), Verdict.CURRENT, None),
    (seal(F_O, Kind.FENCE, SALT, b"{}", "fences/r"), Verdict.RESEAL, None),
    (seal(fence_key(OTHER_KEY), Kind.FENCE, SALT, b"{}", "fences/r"), Verdict.REFUSED,
     WrongKey),
    (seal(F_O, Kind.FENCE, SALT, b"{}", "fences/other"), Verdict.REFUSED, CorruptObject),
    (seal(F_O, Kind.FENCE, SALT, b"{}", "fences/r")[:-1], Verdict.REFUSED, CorruptObject),
    (seal(promotion_key(KEY), Kind.PROMOTED, SALT, b"{}", "fences/r"), Verdict.REFUSED,
     CorruptObject),  # another kind
    (legacy_seal(OTHER_KEY, Kind.FENCE, b"{}", "fences/r"), Verdict.REFUSED, LegacyObject),
    (b"not sealed", Verdict.REFUSED, CorruptObject),
])
def test_what_a_rotation_does_with_each_object(sealed, verdict, error):
    judgement = judge(sealed, "fences/r", Kind.FENCE, F_N, F_O)
    assert judgement.verdict is verdict
    assert type(judgement.error) is error if error else judgement.error is None
    assert judgement.payload == (b"{}" if error is None else b"")


# --- the command -------------------------------------------------------------------------

def slurm_geo(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurm_geo", *args], capture_output=True,
                          text=True, timeout=120, check=False, env={**os.environ, **(env or {})})


def test_the_command_rotates_two_stores_one_named_in_the_config(tmp_path, home, key_file):
    offsite = site_store(tmp_path / "offsite")
    config = tmp_path / "site.toml"
    config.write_text(f'[stores.offsite]\nurl = "file://{tmp_path / "offsite"}"\n'
                      'region = "eu"\n')
    args = ["keys", "rotate", "--store", f"file://{tmp_path / 'home'}", "--store", "offsite",
            "--key-file", str(key_file)]
    env = {"SLURM_GEO_CONFIG": str(config)}
    dry = slurm_geo(*args, "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    assert "dry run: would seal 16 object(s) again under a new key" in dry.stdout
    assert key_file.read_bytes() == KEY
    started = slurm_geo(*args, env=env)  # the first run: the table, and what to do next
    assert started.returncode == 0, started.stderr
    lines = started.stdout.splitlines()
    assert lines[0].split() == ["STORE", "TO_RESEAL", "CURRENT", "REFUSED"]
    assert lines[2].split() == ["offsite", "8", "0", "0"]
    assert "Copy it to the control site (docs/runbook.md), then run this command again" \
        in lines[3]
    assert load_master_key(key_file).previous == KEY
    done = slurm_geo(*args, "--json", env=env)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["outcome"] == "complete" and summary["previous"] == fingerprint(KEY).hex()
    assert [(s["store"], len(s["rewrapped"]), s["current"], s["refused"])
            for s in summary["stores"]] == [(f"file://{tmp_path / 'home'}", 8, [], {}),
                                            ("offsite", 8, [], {})]
    assert summary["key"] == fingerprint(load_master_key(key_file).current).hex()
    for store in (home, offsite):
        assert_everything_opens(store, load_master_key(key_file))


@pytest.mark.parametrize("mistake, code, message", [
    ("no-such-store", 3, "store 'no-such-store' is neither a URL"),
    ("too-open", 28, "mode 0644 lets others in; chmod 600 it"),
    ("wrong-key", 28, "opens none of the 8 objects of store"),
    ("not-a-key-file", 28, "neither a 32-byte master key nor a key ring"),
])
def test_a_mistake_is_one_line_and_changes_nothing(tmp_path, home, key_file, mistake, code,
                                                   message):
    store = f"file://{tmp_path / 'home'}"
    if mistake == "no-such-store":
        store = "no-such-store"
    elif mistake == "too-open":
        key_file.chmod(0o644)
    elif mistake == "wrong-key":
        key_file.write_bytes(OTHER_KEY)
    else:
        key_file.write_text("hello\n")
    config = tmp_path / "site.toml"
    config.write_text("[site]\n")
    before = snapshot(home), key_file.read_bytes()
    result = slurm_geo("keys", "rotate", "--store", store, "--key-file", str(key_file),
                       env={"SLURM_GEO_CONFIG": str(config)})
    assert result.returncode == code, result.stderr
    assert message in result.stderr and result.stderr.strip().count("\n") == 0
    assert "Traceback" not in result.stderr
    assert (snapshot(home), key_file.read_bytes()) == before


def test_the_command_exits_1_naming_a_refused_object_and_an_unfinished_rotation(
        home, key_file):
    home.put("fences/forged", seal(OTHER_KEY, Kind.FENCE, SALT, b"{}", "fences/forged"))
    rotate = ["keys", "rotate", "--store", f"file://{home.root}", "--key-file", str(key_file)]
    assert slurm_geo(*rotate).returncode == 1  # the ring is written; the refusal is said
    result = slurm_geo(*rotate)
    assert result.returncode == 1
    assert f"slurm-geo: refused fences/forged in file://{home.root}:" in result.stderr
    assert "rotated the master key" in result.stdout
    write_key_file(key_file, KeyFile(KEY, OTHER_KEY, ("elsewhere",)))
    result = slurm_geo(*rotate)
    assert result.returncode == 32
    assert "the rotation in progress re-seals elsewhere" in result.stderr


def test_the_command_says_an_unfinished_rotation_on_one_line_and_exits_1(
        monkeypatch, home, key_file):
    class PutsRefused(DyingStore):
        def put(self, name, data):
            raise StoreUnavailable(name, "Read-only file system")

    rotate_master_key({"home": home}, key_file)
    monkeypatch.setattr(cli_ckpt, "_open",
                        lambda _spec, _config=None: PutsRefused(home, 10**6))
    result = CliRunner().invoke(cli, ["keys", "rotate", "--store", "home", "--key-file",
                                      str(key_file)])
    # an exception escaping the command also reads as exit 1: only sys.exit(1) counts
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1, result.output
    (said,) = result.stderr.splitlines()
    assert said.startswith("slurm-geo: rotation to ") and "Read-only file system" in said
    assert said.endswith("run the same command again to finish")
    assert result.stdout.splitlines()[0].split() == ["STORE", "REWRAPPED", "CURRENT",
                                                     "REFUSED", "UNFINISHED"]
    assert load_master_key(key_file).previous == KEY
