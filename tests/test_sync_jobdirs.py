"""Which registered job directories checkpoint-sync replicates: the pure decisions of
slurm_geo.sync.jobdirs, table-driven."""

from __future__ import annotations

import pytest

from slurm_geo.policy.directives import Directives
from slurm_geo.policy.geo import GeoPolicy
from slurm_geo.sync.jobdirs import (
    GIVE_UP_AFTER_S,
    RELEASE_AFTER_S,
    DirPlan,
    JobDir,
    Probe,
    Protection,
    SourceStatus,
    SyncSite,
    conflict_detail,
    directory_problem,
    file_roots,
    plan_job_dirs,
    protection,
    residency_keeps_home,
    run_conflicts,
    sync_site,
)

S = SourceStatus
NOW = 1_800_000_000.0
POLICY = GeoPolicy(data_classes={"restricted": ("home",)})
SITE = SyncSite(home_cluster="onprem", roots={"pfs": "/lustre/ckpt"}, destination="offsite",
                destination_path="/backup/offsite", destination_region="remote", policy=POLICY)


def job(job_id=31, path="/pfs/ckpt/llm-7b", *, real=None, cluster="onprem", user="alice",
        running=True, last_seen=NOW - 60, **directives):
    options = {"geo-ckpt-dir": path, **{k.replace("_", "-"): v for k, v in directives.items()}}
    return JobDir(f"{cluster}:{job_id}", cluster, user, path, real or path, options, running,
                  last_seen)


ROOT = "file:///pfs/ckpt/llm-7b"
ENDED = NOW - 1000


@pytest.mark.parametrize("name, jobs, owed, scanned, expected", [
    ("a running job's directory is watched",
     [job()], (), {}, [("/pfs/ckpt/llm-7b", S.WATCHED, ("onprem:31",))]),
    ("the directory of a root is that root's, not replicated twice",
     [job(path="/pfs/ckpt", real="/lustre/ckpt")], (), {},
     [("/lustre/ckpt", S.COVERED, ("onprem:31",))]),
    ("a directory inside a root is a repository the root never lists",
     [job(path="/lustre/ckpt/llm-7b")], (), {},
     [("/lustre/ckpt/llm-7b", S.WATCHED, ("onprem:31",))]),
    ("the destination's directory is never replicated into itself",
     [job(path="/backup/offsite")], (), {}, [("/backup/offsite", S.INVALID, ("onprem:31",))]),
    ("a residency without the destination's region keeps it home",
     [job(geo_residency="home")], (), {}, [("/pfs/ckpt/llm-7b", S.KEPT_HOME, ("onprem:31",))]),
    ("so does a data class the site keeps home",
     [job(geo_data_class="restricted")], (), {},
     [("/pfs/ckpt/llm-7b", S.KEPT_HOME, ("onprem:31",))]),
    ("a residency with the destination's region is replicated",
     [job(geo_residency="home,remote", geo_data_class="internal")], (), {},
     [("/pfs/ckpt/llm-7b", S.WATCHED, ("onprem:31",))]),
    ("two jobs in one directory: the stricter holds, newest job first",
     [job(31, last_seen=NOW - 500), job(32, geo_residency="home", last_seen=NOW - 5)], (), {},
     [("/pfs/ckpt/llm-7b", S.KEPT_HOME, ("onprem:32", "onprem:31"))]),
    ("two paths, one real directory: one plan",
     [job(31, "/pfs/ckpt/a"), job(32, "/home/alice/link", real="/pfs/ckpt/a")], (), {},
     [("/pfs/ckpt/a", S.WATCHED, ("onprem:31", "onprem:32"))]),
    ("a job ended and a scan read its directory well after: released",
     [job(running=False, last_seen=ENDED)], (), {ROOT: ENDED + RELEASE_AFTER_S},
     [("/pfs/ckpt/llm-7b", S.RELEASED, ("onprem:31",))]),
    ("... but not while a replica of it is owed",
     [job(running=False, last_seen=ENDED)], (ROOT,), {ROOT: NOW},
     [("/pfs/ckpt/llm-7b", S.WATCHED, ("onprem:31",))]),
    ("... nor before a scan began well after the end (a final checkpoint, clock skew)",
     [job(running=False, last_seen=ENDED)], (), {ROOT: ENDED + 10},
     [("/pfs/ckpt/llm-7b", S.WATCHED, ("onprem:31",))]),
    ("... nor when it was never read since, however long ago (the daemon was down)",
     [job(running=False, last_seen=ENDED)], (), {},
     [("/pfs/ckpt/llm-7b", S.WATCHED, ("onprem:31",))]),
    ("... unless that was more than a day ago: then it is let go",
     [job(running=False, last_seen=NOW - GIVE_UP_AFTER_S)], (), {},
     [("/pfs/ckpt/llm-7b", S.RELEASED, ("onprem:31",))]),
    ("a requeued job waiting in the queue is let go too, and watched again when it runs",
     [job(running=False, last_seen=ENDED)], (), {ROOT: NOW},
     [("/pfs/ckpt/llm-7b", S.RELEASED, ("onprem:31",))]),
    ("a released job's directives no longer matter",
     [job(running=False, last_seen=ENDED, geo_residency="x,,y")], (), {ROOT: NOW},
     [("/pfs/ckpt/llm-7b", S.RELEASED, ("onprem:31",))]),
    ("jobs of another cluster that shares the registry: not this host's",
     [job(cluster="rented"), job(32, "/pfs/ckpt/b")], (), {},
     [("/pfs/ckpt/b", S.WATCHED, ("onprem:32",))]),
    ("directives that no longer parse: not replicated, loudly",
     [job(geo_residency="home,,remote")], (), {},
     [("/pfs/ckpt/llm-7b", S.INVALID, ("onprem:31",))]),
    ("a relative path (never accepted at submission)",
     [job(path="ckpt")], (), {}, [("ckpt", S.INVALID, ("onprem:31",))]),
])
def test_which_directories_are_watched(name, jobs, owed, scanned, expected):
    plans = plan_job_dirs(jobs, SITE, NOW, owed, scanned)
    assert [(p.path, p.status, p.jobs) for p in plans] == expected, name
    for plan in plans:
        assert plan.root == f"file://{plan.path}"
        assert (plan.detail is None) == (plan.status is S.WATCHED)
        assert plan.detail is None or "\n" not in plan.detail


def test_the_reasons_name_the_job_and_the_rule():
    [kept] = plan_job_dirs([job(geo_residency="home")], SITE, NOW, (), {})
    assert kept.detail == ("job onprem:31: its --geo-residency=home excludes the "
                           "destination's region 'remote'; its checkpoints stay on the home "
                           "cluster")
    [covered] = plan_job_dirs([job(real="/lustre/ckpt")], SITE, NOW, (), {})
    assert covered.detail == "it is the directory of [sync] root 'pfs', which replicates it"
    [bad] = plan_job_dirs([job(geo_residency="home,,remote")], SITE, NOW, (), {})
    assert bad.detail.startswith("job onprem:31: geo: --geo-residency: 'home,,remote'")


def test_a_site_without_a_home_cluster_treats_every_job_as_home():
    site = SyncSite("", {}, "offsite", None, "remote", GeoPolicy())
    plans = plan_job_dirs([job(cluster="a"), job(2, "/b", cluster="b")], site, NOW, (), {})
    assert [p.status for p in plans] == [S.WATCHED, S.WATCHED]


@pytest.mark.parametrize("directives, policy, expected", [
    (Directives(), GeoPolicy(), None),
    (Directives(residency=("home", "remote")), GeoPolicy(), None),
    (Directives(residency=("home",)), GeoPolicy(), "--geo-residency=home excludes"),
    (Directives(data_class="restricted"), POLICY, "data class 'restricted' may not reside"),
    (Directives(), GeoPolicy(default_data_class="restricted",
                             data_classes={"restricted": ("home",)}), "'restricted'"),
    (Directives(data_class="public"), POLICY, None),          # unlisted: anywhere
    (Directives(data_class="restricted", residency=("home", "remote")),
     GeoPolicy(data_classes={"restricted": ("home", "remote")}), None),
])
def test_residency_keeps_home(directives, policy, expected):
    found = residency_keeps_home(directives, policy, "remote")
    assert (found is None) if expected is None else (expected in (found or ""))


PLAN = DirPlan("file:///pfs/a", "/pfs/a", ("onprem:31",), ("alice",), S.WATCHED)
TWO = DirPlan("file:///pfs/a", "/pfs/a", ("onprem:32", "onprem:31"), ("bob", "alice"),
              S.WATCHED)


@pytest.mark.parametrize("plan, probe, uids, expected", [
    (PLAN, Probe(uid=1000), {"alice": 1000}, None),
    (TWO, Probe(uid=1000), {"alice": 1000, "bob": 1001}, None),   # one of its users
    (PLAN, Probe(missing=True), {"alice": 1000}, "/pfs/a does not exist"),
    (PLAN, Probe(not_a_directory=True), {"alice": 1000}, "/pfs/a is not a directory"),
    (PLAN, Probe(error="Input/output error"), {"alice": 1000},
     "/pfs/a cannot be read: Input/output error"),
    (PLAN, Probe(uid=0), {"alice": 1000}, "/pfs/a belongs to uid 0, not to alice"),
    (PLAN, Probe(uid=1000), {"alice": None}, "/pfs/a: its job's user alice is not known"),
])
def test_a_directory_is_read_only_when_one_of_its_users_owns_it(plan, probe, uids, expected):
    found = directory_problem(plan, probe, uids)
    assert (found is None) if expected is None else expected in (found or "")


@pytest.mark.parametrize("path, directives, cluster, site, expected", [
    ("/pfs/x", Directives(), "onprem", None,
     Protection(None, False, "this site runs no checkpoint-sync ([sync] table)")),
    ("/pfs/x", Directives(), "rented", SITE,
     Protection(None, False, "checkpoint-sync replicates the home cluster 'onprem''s "
                             "directories only")),
    ("/lustre/ckpt", Directives(), "onprem", SITE, Protection("/lustre/ckpt", True, "root")),
    ("/backup/offsite", Directives(), "onprem", SITE,
     Protection(None, False, "it is checkpoint-sync's destination")),
    ("/pfs/x", Directives(residency=("home",)), "onprem", SITE,
     Protection(None, False, "its --geo-residency=home excludes the destination's region "
                             "'remote'")),
    ("/pfs/x", Directives(), "onprem", SITE, Protection("file:///pfs/x", True, "job directory")),
])
def test_what_the_epilog_tells_the_job(path, directives, cluster, site, expected):
    assert protection(path, directives, cluster, site) == expected


def test_the_site_as_the_decisions_see_it():
    urls = {"pfs": "file:///pfs/ckpt", "offsite": "s3://bucket/p", "local": "file:///backup"}
    assert file_roots(["pfs", "s3://b/x", "file:///scratch"], urls) == {
        "pfs": "/pfs/ckpt", "file:///scratch": "/scratch"}
    site = sync_site(["pfs"], urls, "local", "remote", "onprem", POLICY,
                     lambda p: p.replace("/pfs", "/lustre"))
    assert site == SyncSite("onprem", {"pfs": "/lustre/ckpt"}, "local", "/backup", "remote",
                            POLICY)
    assert sync_site(["pfs"], urls, "offsite", "remote", "", POLICY).destination_path is None


A, B = "file:///home/a/ckpt", "file:///home/b/ckpt"


@pytest.mark.parametrize("name, found, owners, expected", [
    ("distinct names: nothing refused", {A: {"x"}, B: {"y"}, "pfs": {"z"}}, {}, {}),
    ("a name already replicated from another directory is refused",
     {A: {"trainer"}, B: {"trainer", "own"}}, {"trainer": A}, {B: {"trainer": A}}),
    ("... whichever directory sorts first",
     {A: {"trainer"}, B: {"trainer"}}, {"trainer": B}, {A: {"trainer": B}}),
    ("new in two directories at once: the first by name",
     {A: {"trainer"}, B: {"trainer"}}, {}, {B: {"trainer": A}}),
    ("a [sync] root's run wins over a job directory's",
     {"pfs": {"trainer"}, A: {"trainer"}}, {}, {A: {"trainer": "pfs"}}),
    ("a [sync] root is never refused, even where a directory was first",
     {"pfs": {"trainer"}, A: {"trainer"}}, {"trainer": A}, {}),
    ("the owner's own run goes on", {A: {"trainer"}}, {"trainer": A}, {}),
    ("a run another root replicated, not in this scan", {A: {"old"}}, {"old": "pfs"},
     {A: {"old": "pfs"}}),
])
def test_a_run_name_belongs_to_the_root_that_replicated_it_first(name, found, owners,
                                                                   expected):
    assert run_conflicts(found, {A, B}, owners) == expected, name


def test_a_conflict_says_which_run_where_and_the_fix():
    assert conflict_detail({"trainer": A}) == (
        "run 'trainer' is already replicated from /home/a/ckpt; the destination keeps one "
        "run of each name, so it is not replicated from here: train it under another --run "
        "name")
    assert "(and 1 more run(s) of its names elsewhere)" in conflict_detail(
        {"a": "pfs", "b": "pfs"})
