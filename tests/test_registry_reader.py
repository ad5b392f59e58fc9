"""The job registry read from outside the hooks (RegistryReader): rows in, frozen
dataclasses out; a registry that cannot be read is RegistryUnreadable, never no jobs."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path

import pytest

from slurm_geo.registry import (
    ActiveJob,
    LineageLink,
    RegisteredJob,
    Registry,
    RegistryReader,
    RegistryUnreadable,
)

NOW = 1_800_000_000.0
DIRECTIVES = {"geo-ckpt-dir": "/pfs/ckpt/it's \"quoted\"", "geo-cost-center": "ml-research"}


@pytest.fixture
def path(tmp_path) -> Path:
    path = tmp_path / "registry.db"
    with Registry(path) as registry:
        registry.job_started("onprem", 3, 0, name="llm", user="alice", nodes="n1",
                             directives=DIRECTIVES, now=NOW)
        registry.job_started("rented", 5, 0, name="llm", user="alice", nodes="r1",
                             directives={}, now=NOW + 50)
        registry.link("rented", 5, "onprem", 3, now=NOW + 50)
    return path


def test_lineage_and_jobs_are_the_rows_as_the_hooks_wrote_them(path):
    reader = RegistryReader(path)
    assert reader.lineage() == [LineageLink("onprem", 3, "onprem:3"),
                                LineageLink("rented", 5, "onprem:3")]
    assert reader.jobs() == [
        RegisteredJob("onprem", 3, "onprem:3", "alice", DIRECTIVES, NOW),
        RegisteredJob("rented", 5, "onprem:3", "alice", {}, NOW + 50)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        reader.jobs()[0].user = "mallory"  # type: ignore[misc]


def test_a_registry_not_created_yet_is_no_jobs_only_when_the_caller_says_so(tmp_path):
    absent = tmp_path / "registry.db"
    assert RegistryReader(absent, missing_ok=True).jobs() == []
    assert RegistryReader(absent, missing_ok=True).lineage() == []
    with pytest.raises(RegistryUnreadable, match=r"there is no such file; .*\[registry\] path"):
        RegistryReader(absent).jobs()
    assert not absent.exists()


def test_active_jobs_are_those_running_or_seen_since_and_those_asked_for(tmp_path):
    """checkpoint-sync reads this every scan: what runs, what ran lately, and the jobs of
    the directories it still watches, never the whole history."""
    path = tmp_path / "registry.db"
    with Registry(path) as registry:
        for job_id, started, ended in ((1, NOW, None),          # running since long ago
                                       (2, NOW, NOW + 10),     # ended long ago
                                       (3, NOW, NOW + 500),    # ended lately
                                       (4, NOW, NOW + 20)):    # ended long ago, asked for
            registry.job_started("onprem", job_id, 0, name="t", user="alice", nodes="n1",
                                 directives={"geo-ckpt-dir": f"/pfs/{job_id}"}, now=started)
            if ended is not None:
                registry.job_ended("onprem", job_id, 0, "0:0", now=ended)
        registry.job_started("onprem", 5, 0, name="t", user="bob", nodes="n1",
                             directives={}, now=NOW)
        registry.job_ended("onprem", 5, 1, "0:0", now=NOW + 5)          # requeued ...
        registry.job_started("onprem", 5, 1, name="t", user="bob", nodes="n2",
                             directives={}, now=NOW + 450)              # ... and running
    reader = RegistryReader(path)
    active = reader.active_jobs(NOW + 400, also=[("onprem", 4), ("rented", 99)])
    assert [(a.job.job_id, a.running, a.last_seen) for a in active] == [
        (1, True, NOW), (3, False, NOW + 500), (4, False, NOW + 20), (5, True, NOW + 450)]
    assert active[0] == ActiveJob(RegisteredJob("onprem", 1, "onprem:1", "alice",
                                                {"geo-ckpt-dir": "/pfs/1"}, NOW), True, NOW)
    assert RegistryReader(tmp_path / "absent.db", missing_ok=True).active_jobs(0.0) == []


def _damaged(path: Path) -> None:
    path.write_bytes(b"not a database\n" * 300)


def _no_lineage(path: Path) -> None:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE jobs (cluster, job_id, logical_id, user, directives, "
                   "first_seen)")


def _renamed_column(path: Path) -> None:
    Registry(path).close()
    with sqlite3.connect(path) as db:
        db.execute("ALTER TABLE jobs RENAME COLUMN directives TO flags")
        db.execute("ALTER TABLE lineage RENAME COLUMN logical_id TO logical")


def _bad_directives(path: Path) -> None:
    with Registry(path) as registry:
        registry.job_started("onprem", 3, 0, name="x", user="u", nodes="n1", directives={},
                             now=NOW)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE jobs SET directives = '[1, 2'")
        db.execute("DROP TABLE lineage")


@pytest.mark.parametrize("make, read, message", [
    (_damaged, "jobs", "file is not a database"),
    (_damaged, "lineage", "file is not a database"),
    (_no_lineage, "lineage", "no such table: lineage"),
    (_renamed_column, "jobs", "no such column: directives"),
    (_renamed_column, "lineage", "no such column: logical_id"),
    (_bad_directives, "jobs", "job onprem:3 has directives that are not a JSON object"),
    (_bad_directives, "lineage", "no such table: lineage"),
])
def test_an_unreadable_registry_raises_never_returns_nothing(tmp_path, make, read, message):
    path = tmp_path / "registry.db"
    make(path)
    with pytest.raises(RegistryUnreadable) as caught:
        getattr(RegistryReader(path, missing_ok=True), read)()
    text = str(caught.value)
    assert text.startswith(f"cannot read the job registry {path}: ")
    assert message in text and "\n" not in text
    assert caught.value.exit_code == 42
