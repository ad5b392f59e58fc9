"""checkpoint-sync replicates every registered geo job's --geo-ckpt-dir, not only its
configured roots: the daemon in-process against directory stores and a real job registry
(written as PrologSlurmctld writes it), no sandbox."""

from __future__ import annotations

import json
import logging
import os
import pwd
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_geo.billing import lineage
from slurm_geo.billing.attribution import RegistryJob
from slurm_geo.ckpt import LocalDirStore, Repository
from slurm_geo.registry import Registry
from slurm_geo.sync.daemon import Daemon
from slurm_geo.sync.jobdirs import GIVE_UP_AFTER_S, RELEASE_AFTER_S, SourceStatus
from slurm_geo.sync.reader import SyncStateReader
from slurm_geo.sync.runtime import load_runtime
from slurm_geo.sync.sources import READ_MARK
from slurm_geo.sync.state import Source, StateDB
from tests.kit.sync import (
    Trainer,
    all_verified,
    master_key,
    site_config,
    start_daemon,
    statuses,
    stop,
    wait_for,
)

NOBODY = pwd.getpwnam("nobody")
as_root = pytest.mark.root(reason="the daemon reads users' directories as root")


class Site:
    """A configured root, a directory destination, a registry and the config naming them."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.root = tmp_path / "pfs"
        self.offsite = tmp_path / "offsite"
        self.registry = tmp_path / "registry.db"
        self.state = tmp_path / "state.db"
        self.root.mkdir()
        self.offsite.mkdir()
        self.key_file, self.key = master_key(tmp_path)
        self.config = site_config(tmp_path / "site.toml", {"pfs": self.root},
                                  f"file://{self.offsite}", key_file=self.key_file,
                                  state=self.state, registry=self.registry)

    def user_dir(self, name: str = "llm-7b", owner: pwd.struct_passwd = NOBODY) -> Path:
        """A job directory as the prolog leaves it: the user's own, mode 0700."""
        path = self.tmp / "home" / owner.pw_name / name
        path.mkdir(parents=True)
        path.chmod(0o700)
        os.chown(path, owner.pw_uid, owner.pw_gid)
        return path

    def train(self, directory: Path, run: str, saves: int, owner=NOBODY) -> list[int]:
        trainer = Trainer(directory, self.key, run, shape=(32, 32))
        steps = []
        for _ in range(saves):
            trainer.train(5)
            steps.append(trainer.save())
        self.give(directory, owner)
        return steps

    @staticmethod
    def give(directory: Path, owner: pwd.struct_passwd = NOBODY) -> None:
        """The user's files, as their training left them (the daemon reads no other)."""
        for path in [directory, *directory.rglob("*")]:
            os.chown(path, owner.pw_uid, owner.pw_gid)

    def register(self, job_id: int, directory: Path | str, user: str = "nobody",
                 ended_at: float | None = None, started_at: float | None = None,
                 **directives: str) -> None:
        options = {"geo-ckpt-dir": str(directory),
                   **{k.replace("_", "-"): v for k, v in directives.items()}}
        with Registry(self.registry) as registry:
            registry.job_started("onprem", job_id, 0, name="train", user=user, nodes="n1",
                                 directives=options, now=started_at or time.time())
            if ended_at is not None:
                registry.job_ended("onprem", job_id, 0, "0:0", now=ended_at)

    def run_once(self, clock=time.time) -> int:
        runtime = load_runtime(self.config)
        return Daemon(runtime, lambda: runtime, self.state, handle_signals=False,
                      set_priority=False, clock=clock).run(once=True)

    def read_registry_at(self, when: float) -> None:
        """As if the daemon last read the registry at `when` (then stopped)."""
        state = StateDB(self.state)
        state.set_mark(READ_MARK, repr(when))
        state.close()

    def sources(self) -> dict[str, Source]:
        state = StateDB(self.state, readonly=True)
        try:
            return {s.root: s for s in state.sources()}
        finally:
            state.close()

    def status(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "slurm_geo", "sync", "status",
                               "--state", str(self.state), *args], capture_output=True,
                              text=True, timeout=60)


def tree(directory: Path) -> dict[str, tuple[int, int, int, int]]:
    """Every entry under `directory`: mode, owner, size, mtime: what writing would change."""
    found = {}
    for path in [directory, *sorted(directory.rglob("*"))]:
        info = path.lstat()
        found[str(path.relative_to(directory))] = (info.st_mode, info.st_uid, info.st_size,
                                                   info.st_mtime_ns)
    return found


@pytest.fixture
def site(tmp_path) -> Site:
    return Site(tmp_path)


@as_root
def test_a_registered_directory_outside_the_roots_is_replicated_and_left_untouched(site):
    job_dir = site.user_dir()
    steps = site.train(job_dir, "llm-7b", 3)
    site.register(31, job_dir)
    before = tree(job_dir)

    assert site.run_once() == 0

    assert statuses(site.state) == {("llm-7b", s): "verified" for s in steps}
    for step in steps:  # byte for byte what training saved, restorable off-site
        local = Repository(LocalDirStore(job_dir), site.key).read_checkpoint("llm-7b", step)
        remote = Repository(LocalDirStore(site.offsite), site.key).read_checkpoint("llm-7b",
                                                                                 step)
        assert [bytes(t.data) for t in remote.tensors] == [bytes(t.data) for t in local.tensors]
    assert tree(job_dir) == before  # nothing written, nothing touched, in the user's tree
    root = f"file://{job_dir}"
    state = StateDB(site.state, readonly=True)
    assert {r.root for r in state.replicas()} == {root}
    sources = {r["source"] for r in state.query("SELECT source FROM transfers WHERE kind "
                                                "!= 'verify'")}
    state.close()
    assert sources == {root}  # billing charges the transfers to the job that owns them
    # Billing charges them through checkpoint-sync's own record of who named the directory
    # (the registry's job 31 was registered with another spelling of the path).
    owners = lineage.Owners(registry=[RegistryJob("onprem", 31, "onprem:31", "nobody", "ml",
                                                  "/elsewhere", 0.0)])
    owner = lineage.attribute({"run": "llm-7b", "source": root, "destination": "offsite",
                               "finished_at": 1.0}, owners,
                              SyncStateReader(site.state).job_directories())
    assert (owner.cluster, owner.job_id, owner.cost_center, owner.basis) == (
        "onprem", 31, "ml", "job directory")
    job = site.sources()[root]
    assert (job.kind, job.status, job.jobs, job.users) == ("job", SourceStatus.WATCHED,
                                                           ("onprem:31",), ("nobody",))

    result = site.status("--json")
    assert result.returncode == 0 and result.stderr == ""
    [row] = [r for r in json.loads(result.stdout) if r["run"] == "llm-7b"]
    assert (row["verified"], row["jobs"], row["roots"], row["source"]) == (
        steps[-1], ["onprem:31"], [root], "watched")
    table = site.status().stdout
    assert "onprem:31" in table.splitlines()[1]
    assert f"{job_dir}  job   watched  onprem:31" in table


@as_root
def test_a_new_checkpoint_in_a_watched_directory_is_replicated_on_the_next_run(site):
    job_dir = site.user_dir()
    first = site.train(job_dir, "r", 1)
    site.register(31, job_dir)
    assert site.run_once() == 0
    trainer = Trainer(job_dir, site.key, "r", shape=(32, 32), seed=3)
    trainer.step = 100
    later = trainer.save()
    site.give(job_dir)
    assert site.run_once() == 0
    assert statuses(site.state) == {("r", first[0]): "verified", ("r", later): "verified"}


def _missing(site: Site) -> tuple[Path, str]:
    path = site.tmp / "home" / "nobody" / "gone"
    return path, f"{path} does not exist, so none of its checkpoints can be replicated"


def _someone_elses(site: Site) -> tuple[Path, str]:
    path = site.user_dir("roots-own", owner=pwd.getpwnam("root"))
    site.train(path, "stolen", 1, owner=pwd.getpwnam("root"))
    return path, f"{path} belongs to uid 0, not to nobody, whose job named it"


def _a_file(site: Site) -> tuple[Path, str]:
    path = site.tmp / "a-file"
    path.write_text("")
    return path, f"{path} is not a directory"


@as_root
@pytest.mark.parametrize("make", [_missing, _someone_elses, _a_file])
def test_a_directory_that_cannot_be_replicated_is_loud_everywhere(site, caplog, make):
    path, message = make(site)
    site.register(32, path)

    with caplog.at_level(logging.INFO, logger="slurm_geo.sync"):
        assert site.run_once() == 1  # --once: behind, a replication cannot happen
    assert statuses(site.state) == {}
    [line] = [r for r in caplog.records if "event=job_dir_unreadable" in r.getMessage()]
    assert line.levelno == logging.ERROR and message in line.getMessage()
    source = site.sources()[f"file://{path}"]
    assert source.status is SourceStatus.UNREADABLE and source.detail.startswith(message)

    result = site.status()
    assert result.returncode == 0
    assert result.stderr.startswith(f"slurm-geo: warning: job onprem:32: {message}")
    assert "no checkpoints seen yet" in result.stdout and "unreadable" in result.stdout
    [row] = json.loads(site.status("--json").stdout)
    assert (row["run"], row["jobs"], row["source"]) == (None, ["onprem:32"], "unreadable")
    assert row["source_detail"].startswith(message)

    with caplog.at_level(logging.INFO, logger="slurm_geo.sync"):
        caplog.clear()
        assert site.run_once() == 1
    assert [r for r in caplog.records if "job_dir_unreadable" in r.getMessage()], \
        "a restarted daemon says it again"


@as_root
def test_a_directory_that_comes_back_is_replicated_and_said_so(site, caplog):
    path = site.tmp / "home" / "nobody" / "later"
    site.register(33, path)
    assert site.run_once() == 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir(mode=0o700)
    steps = site.train(path, "later", 1)
    with caplog.at_level(logging.INFO, logger="slurm_geo.sync"):
        assert site.run_once() == 0
    assert statuses(site.state) == {("later", steps[0]): "verified"}
    assert site.sources()[f"file://{path}"].status is SourceStatus.WATCHED
    assert any("event=job_dir_watched" in r.getMessage() for r in caplog.records)


@as_root
def test_a_residency_without_the_destinations_region_keeps_the_directory_home(site, caplog):
    job_dir = site.user_dir()
    site.train(job_dir, "secret", 2)
    site.register(34, job_dir, geo_residency="home")
    with caplog.at_level(logging.INFO, logger="slurm_geo.sync"):
        assert site.run_once() == 0  # by the job's own choice: nothing is behind
    assert statuses(site.state) == {}
    assert list(site.offsite.iterdir()) == []
    source = site.sources()[f"file://{job_dir}"]
    assert source.status is SourceStatus.KEPT_HOME
    assert "--geo-residency=home excludes the destination's region 'remote'" in source.detail
    assert any("event=job_dir_kept_home" in r.getMessage() for r in caplog.records)
    assert "kept_home" in site.status().stdout


@as_root
def test_a_run_name_another_directory_replicates_is_refused_loudly(site, caplog):
    """Two users' directories, each with a run "trainer" under its own key: the second
    would replace the first's replicas off-site and fail verification there."""
    first, second = site.user_dir("a"), site.user_dir("b")
    mine = site.train(first, "trainer", 1)
    site.register(41, first)
    assert site.run_once() == 0
    site.train(second, "trainer", 2)
    own = site.train(second, "other", 1)
    site.register(42, second)
    with caplog.at_level(logging.INFO, logger="slurm_geo.sync"):
        assert site.run_once() == 1
    assert statuses(site.state) == {("trainer", mine[0]): "verified",
                                    ("other", own[0]): "verified"}
    restored, local = (Repository(LocalDirStore(d), site.key).read_checkpoint(
        "trainer", mine[0]) for d in (site.offsite, first))  # the first's replica is intact
    assert [bytes(t.data) for t in restored.tensors] == [bytes(t.data) for t in local.tensors]
    source = site.sources()[f"file://{second}"]
    assert source.status is SourceStatus.CONFLICT
    assert f"run 'trainer' is already replicated from {first}" in source.detail
    assert any("event=job_dir_conflict" in r.getMessage() and r.levelno == logging.ERROR
               for r in caplog.records)
    assert "another --run name" in site.status().stderr


def test_the_directory_of_a_root_is_replicated_once_as_that_root(site):
    steps = site.train(site.root, "shared", 2, owner=pwd.getpwuid(os.getuid()))
    link = site.tmp / "pfs-link"
    link.symlink_to(site.root)
    site.register(35, link, user=pwd.getpwuid(os.getuid()).pw_name)
    assert site.run_once() == 0
    state = StateDB(site.state, readonly=True)
    assert {(r.root, r.step) for r in state.replicas()} == {("pfs", s) for s in steps}
    state.close()
    covered = site.sources()[f"file://{site.root}"]
    assert covered.status is SourceStatus.COVERED and "[sync] root 'pfs'" in covered.detail


@as_root
def test_a_finished_jobs_directory_is_replicated_to_its_end_then_let_go(site, caplog):
    """It ended while the daemon was down: its checkpoints are still replicated, the
    directory is let go only after a scan well after the end, and never before."""
    job_dir = site.user_dir()
    now = time.time()
    site.read_registry_at(now - 3600)
    steps = site.train(job_dir, "done", 2)
    site.register(36, job_dir, started_at=now - 1800, ended_at=now - 1200)

    assert site.run_once(clock=lambda: now) == 0
    assert statuses(site.state) == {("done", s): "verified" for s in steps}
    assert site.sources()[f"file://{job_dir}"].status is SourceStatus.WATCHED
    with caplog.at_level(logging.INFO, logger="slurm_geo.sync"):
        assert site.run_once(clock=lambda: now + 10) == 0  # cron's next --once
    released = site.sources()[f"file://{job_dir}"]
    assert released.status is SourceStatus.RELEASED
    assert "every checkpoint seen in it is settled" in released.detail
    assert any("event=job_dir_released" in r.getMessage() for r in caplog.records)
    runs, *listed = site.status().stdout.split("\n\n")
    assert "onprem:36" in runs and listed == []  # its run keeps its job; the directory goes

    assert site.run_once(clock=lambda: now + 20) == 0  # nor read again
    assert site.sources()[f"file://{job_dir}"].status is SourceStatus.RELEASED


@as_root
def test_a_directory_unreadable_since_its_job_ended_is_let_go_after_a_day(site):
    path = site.tmp / "home" / "nobody" / "deleted"
    now = time.time()
    site.read_registry_at(now - 3600)
    site.register(37, path, started_at=now - 600, ended_at=now - 500)
    assert site.run_once(clock=lambda: now) == 1
    assert site.run_once(clock=lambda: now + GIVE_UP_AFTER_S) == 0
    source = site.sources()[f"file://{path}"]
    assert source.status is SourceStatus.RELEASED and "could not be read" in source.detail


@as_root
def test_the_running_daemon_picks_up_a_job_that_starts_while_it_runs(site):
    proc = start_daemon(site.config, log=site.tmp / "log")
    try:
        wait_for(lambda: site.state.exists() and "registry" in site.sources(), 30,
                 "the first scan")
        job_dir = site.user_dir()
        steps = site.train(job_dir, "live", 2)
        site.register(40, job_dir)
        wait_for(lambda: all_verified(site.state, {("live", s) for s in steps}), 30,
                 "the new job's checkpoints verified")
    finally:
        assert stop(proc) == 0
    log = (site.tmp / "log").read_text()
    assert "event=registry_unreadable" in log and "event=registry_back" in log
    assert f"event=job_dir_watched root=file://{job_dir}" in log
    assert "Traceback" not in log


def test_history_from_before_checkpoint_sync_is_not_backfilled(site):
    old = site.tmp / "old"
    old.mkdir()
    now = time.time()
    site.register(38, old, user=pwd.getpwuid(os.getuid()).pw_name, started_at=now - 7200,
                  ended_at=now - RELEASE_AFTER_S - 600)
    assert site.run_once(clock=lambda: now) == 0
    assert f"file://{old}" not in site.sources()


@as_root
def test_a_registry_that_cannot_be_read_keeps_what_was_watched(site, caplog):
    job_dir = site.user_dir()
    first = site.train(job_dir, "r", 1)
    site.register(39, job_dir)
    assert site.run_once() == 0
    site.registry.write_bytes(b"not a database\n" * 300)
    trainer = Trainer(job_dir, site.key, "r", shape=(32, 32), seed=5)
    trainer.step = 50
    later = trainer.save()
    site.give(job_dir)
    with caplog.at_level(logging.INFO, logger="slurm_geo.sync"):
        assert site.run_once() == 0  # a new process, the registry damaged: still replicated
    assert statuses(site.state) == {("r", first[0]): "verified", ("r", later): "verified"}
    sources = site.sources()
    assert sources[f"file://{job_dir}"].status is SourceStatus.WATCHED
    assert sources["registry"].status is SourceStatus.UNREADABLE
    assert "file is not a database" in sources["registry"].detail
    assert any("event=registry_unreadable" in r.getMessage() for r in caplog.records)
    assert "slurm-geo: warning: the job registry: cannot read the job registry" in \
        site.status().stderr


def test_no_registry_yet_is_said_once_and_replicates_the_roots(site, caplog):
    steps = site.train(site.root, "r", 1, owner=pwd.getpwuid(os.getuid()))
    with caplog.at_level(logging.INFO, logger="slurm_geo.sync"):
        assert site.run_once() == 0
    assert statuses(site.state) == {("r", steps[0]): "verified"}
    [line] = [r for r in caplog.records if "event=registry_unreadable" in r.getMessage()]
    assert "there is no job registry at" in line.getMessage()
    assert "registry" in site.status().stderr
    assert not site.registry.exists()  # read-only: never created by checkpoint-sync
