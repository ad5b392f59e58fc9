"""Prolog/Epilog logic without Slurm: checkpoint directory, what a resume finds, registry,
restart cap, and the fast path that must never fail (or slow down) a job without
directives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_geo.ckpt import LocalDirStore, Repository
from slurm_geo.hooks import ctld, node
from slurm_geo.hooks.context import job_context
from slurm_geo.policy.directives import Directives
from slurm_geo.registry import IllegalTransition, IncarnationState, Registry
from slurm_geo.site import HOOKS
from slurm_geo.slurm.errors import SlurmRejected
from slurm_geo.sync.jobdirs import Protection
from tests.helpers import pack_files, stored_packs
from tests.kit.hooks import RUN, env_for, save

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def key() -> bytes:
    return os.urandom(32)


# --- the context ------------------------------------------------------------------------------

def test_context_reads_what_slurm_passes(tmp_path):
    job = job_context(env_for(tmp_path, restart=2, SLURM_JOB_EXIT_CODE2="0:15"))
    assert (job.cluster, job.job_id, job.restart, job.node, job.exit_code) == \
        ("onprem", 42, 2, "n1", "0:15")
    assert job.directives == Directives(ckpt_dir=str(tmp_path), residency=("home",))
    assert job.tag == "onprem-42"


def test_context_keeps_the_checkpoint_dir_when_a_directive_no_longer_parses(tmp_path):
    job = job_context({**env_for(tmp_path), "SPANK_GEO_RESIDENCY": "home,,x"})
    assert job.directives == Directives(ckpt_dir=str(tmp_path))


# --- node prolog ------------------------------------------------------------------------------

def test_prolog_creates_the_directory_and_a_marker(tmp_path):
    ckpt = tmp_path / "a dir" / "with 'quotes'"
    marker = node.prolog(job_context(env_for(ckpt)), now=100.0)
    assert ckpt.is_dir() and (ckpt / ".slurm-geo" / "prolog-onprem-42-0.json").is_file()
    assert marker["directives"] == {"geo-ckpt-dir": str(ckpt), "geo-residency": "home"}
    assert marker["newest"] == []
    assert LocalDirStore(ckpt).list("") == []  # the marker is not part of the repository


def test_in_a_shared_checkpoint_directory_each_users_markers_lie_in_their_own(tmp_path):
    """In a directory all users' jobs checkpoint into (1777) the prolog makes no shared
    .slurm-geo/, whose maker could remove everyone's markers: the user's own
    .slurm-geo-<uid>/, which no one else may write (tests/test_job_records.py is bob)."""
    shared = tmp_path / "pfs"
    shared.mkdir()
    shared.chmod(0o1777)
    node.prolog(job_context(env_for(shared)), now=100.0)
    mine = shared / f".slurm-geo-{os.geteuid()}"
    assert (mine / "prolog-onprem-42-0.json").is_file()
    assert mine.stat().st_mode & 0o7777 == 0o755 and not (shared / ".slurm-geo").exists()
    own = tmp_path / "own"
    node.prolog(job_context(env_for(own)), now=100.0)
    assert (own / ".slurm-geo").stat().st_mode & 0o022 == 0


def test_resumed_incarnation_lists_each_runs_newest_step_without_a_key(tmp_path, key):
    repo = Repository(LocalDirStore(tmp_path), key)
    save(repo, 10)
    save(repo, 20)
    marker = node.prolog(job_context(env_for(tmp_path, restart=1)), now=1.0)
    assert marker["newest"] == [{"run": RUN, "step": 20}]
    first = node.prolog(job_context(env_for(tmp_path / "new", restart=0)), now=1.0)
    assert first["newest"] == []


def damage_newest(ckpt: Path) -> None:
    store = LocalDirStore(ckpt)
    packs = sorted(pack_files(ckpt), key=lambda p: p.stat().st_mtime)
    data = bytearray(packs[-1].read_bytes())
    data[len(data) // 2] ^= 0x10
    packs[-1].write_bytes(bytes(data))
    assert stored_packs(store)


def test_the_prolog_touches_no_checkpoint_damaged_or_under_a_users_own_key(tmp_path, key):
    """Verifying and falling back are the job's resume's (it holds the key): the prolog
    lists the newest steps by name and changes nothing, whatever the packs hold."""
    ours, hers = tmp_path / "ours", tmp_path / "hers"
    ours.mkdir()
    hers.mkdir()
    repo = Repository(LocalDirStore(ours), key)
    save(repo, 10)
    save(repo, 20)
    damage_newest(ours)
    save(Repository(LocalDirStore(hers), os.urandom(32)), 5)
    before = {d: sorted((p.relative_to(d), p.read_bytes()) for p in d.rglob("*")
                        if p.is_file() and ".slurm-geo" not in p.parts) for d in (ours, hers)}
    for directory, step in ((ours, 20), (hers, 5)):
        marker = node.prolog(job_context(env_for(directory, restart=3)), now=1.0)
        assert marker["newest"] == [{"run": RUN, "step": step}]
    assert before == {d: sorted((p.relative_to(d), p.read_bytes()) for p in d.rglob("*")
                                if p.is_file() and ".slurm-geo" not in p.parts)
                      for d in (ours, hers)}


PROLOG_AS_THE_OWNER = """
import contextlib, json, sys
from slurm_geo.hooks import node
from slurm_geo.hooks.context import job_context


class NothingImportable:
    def find_spec(self, name, path=None, target=None):
        raise ImportError(f"{name} imported under the job owner's uid")


@contextlib.contextmanager
def as_owner_who_cannot_read_python(uid, gid):
    sys.meta_path.insert(0, NothingImportable())
    try:
        yield
    finally:
        sys.meta_path.pop(0)


node.as_user = as_owner_who_cannot_read_python
print(json.dumps(node.prolog(job_context(json.loads(sys.argv[1])), now=1.0)["newest"]))
"""


def test_the_prolog_imports_nothing_once_it_acts_as_the_jobs_owner(tmp_path, key):
    """The owner may not be able to read the Python installation (the sandbox's is under
    /root): everything the prolog runs is loaded as root before it takes the owner's uid.
    In a fresh interpreter, as the prolog is."""
    save(Repository(LocalDirStore(tmp_path), key), 10)
    done = subprocess.run(
        [sys.executable, "-c", PROLOG_AS_THE_OWNER, json.dumps(env_for(tmp_path, restart=1))],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [{"run": RUN, "step": 10}]


# --- node epilog ------------------------------------------------------------------------------

@pytest.mark.parametrize(("restart_after", "exit_code", "reason"), [
    (1, "0:0", "requeued"),       # Slurm counts the restart before the epilog
    (0, "0:0", "completed"),
    (0, "1:0", "failed"),
    (0, "0:9", "failed"),
])
def test_epilog_records_reason_and_final_checkpoint(tmp_path, key, restart_after, exit_code,
                                                    reason):
    repo = Repository(LocalDirStore(tmp_path), key)
    node.prolog(job_context(env_for(tmp_path)), now=1.0)
    save(repo, 10)
    time.sleep(0.01)
    save(repo, 15)
    (tmp_path / ".slurm-geo" / "staging-onprem-42-0").mkdir()
    record = node.epilog(job_context(env_for(tmp_path, restart=restart_after,
                                             SLURM_JOB_EXIT_CODE2=exit_code)),
                         Protection(str(tmp_path), True, "root"), now=2.0)
    (entry,) = record["incarnations"]
    assert entry["reason"] == reason
    assert entry["restart"] == 0
    assert entry["final_checkpoint"] == {"run": RUN, "step": 15}
    assert entry["sync"] == {"root": str(tmp_path), "replicated": True, "as": "root"}
    assert not (tmp_path / ".slurm-geo" / "staging-onprem-42-0").exists()


def test_epilog_of_a_directory_not_replicated_says_why(tmp_path):
    why = "its --geo-residency=home excludes the destination's region 'remote'"
    record = node.epilog(job_context(env_for(tmp_path)), Protection(None, False, why),
                         now=2.0)
    assert record["incarnations"][0]["sync"] == {"root": None, "replicated": False,
                                                 "why": why}
    assert record["incarnations"][0]["final_checkpoint"] is None


# --- registry and the restart cap ---------------------------------------------------------------

def test_incarnations_follow_their_lifecycle(tmp_path):
    with Registry(tmp_path / "r.db") as registry:
        started = registry.job_started("onprem", 7, 0, name="t", user="u", nodes="n1",
                                       directives={"geo-ckpt-dir": "/x"}, now=1.0)
        assert started.state is IncarnationState.RUNNING
        requeued = registry.job_ended("onprem", 7, 1, "0:0", now=2.0)
        assert requeued is not None and requeued.state is IncarnationState.REQUEUED
        registry.job_started("onprem", 7, 1, name="t", user="u", nodes="n2", directives={},
                             now=3.0)
        ended = registry.job_ended("onprem", 7, 1, "0:0", now=4.0)
        assert ended is not None and ended.state is IncarnationState.ENDED
        assert [i.state for i in registry.incarnations("onprem", 7)] == \
            [IncarnationState.REQUEUED, IncarnationState.ENDED]
        assert registry.job_ended("onprem", 7, 1, "0:0", now=5.0) is None  # nothing running
        assert registry.job("onprem", 7)["directives"] == {"geo-ckpt-dir": "/x"}


def test_a_lost_epilog_is_repaired_by_the_next_start(tmp_path):
    with Registry(tmp_path / "r.db") as registry:
        registry.job_started("onprem", 8, 0, name="t", user="u", nodes="n1", directives={},
                             now=1.0)
        registry.job_started("onprem", 8, 1, name="t", user="u", nodes="n2", directives={},
                             now=2.0)
        assert [i.state for i in registry.incarnations("onprem", 8)] == \
            [IncarnationState.REQUEUED, IncarnationState.RUNNING]


def test_ended_incarnations_cannot_move_again(tmp_path):
    with Registry(tmp_path / "r.db") as registry:
        registry.job_started("onprem", 9, 0, name="t", user="u", nodes="n1", directives={},
                             now=1.0)
        ended = registry.job_ended("onprem", 9, 0, "0:0", now=2.0)
        assert ended is not None
        with pytest.raises(IllegalTransition, match="cannot go from ended to requeued"):
            Registry._move(registry._db, ended, IncarnationState.REQUEUED, 3.0, None)


def test_lineage_links_jobs_of_one_logical_job(tmp_path):
    with Registry(tmp_path / "r.db") as registry:
        registry.job_started("onprem", 1, 0, name="t", user="u", nodes="n1", directives={},
                             now=1.0)
        assert registry.link("rented", 50, "onprem", 1, now=2.0) == "onprem:1"
        assert registry.link("onprem", 77, "rented", 50, now=3.0) == "onprem:1"
        assert registry.lineage("onprem:1") == [("onprem", 1), ("rented", 50), ("onprem", 77)]


class FakeController:
    def __init__(self, fail: bool = False):
        self.held: list[int] = []
        self.comments: dict[int, str | None] = {}
        self.fail = fail

    def hold(self, job_id: int, comment: str | None = None) -> None:
        if self.fail:
            raise SlurmRejected("onprem", "hold", "no")
        self.held.append(job_id)
        self.comments[job_id] = comment


@pytest.mark.parametrize(("requeues", "held"), [(1, False), (3, False), (4, True)])
def test_restart_cap_holds_the_job(tmp_path, requeues, held):
    """max_restarts = 3: four incarnations may run; the fourth requeue holds the job."""
    controller = FakeController()
    results = []
    with Registry(tmp_path / "r.db") as registry:
        for restart in range(requeues):
            ctld.prolog_slurmctld(job_context(env_for(tmp_path, restart=restart)), registry,
                                  now=float(restart))
            after = job_context(env_for(tmp_path, restart=restart + 1))  # queued again
            results.append(ctld.epilog_slurmctld(after, registry, 3, lambda: controller,
                                                 now=float(restart) + 0.5))
        assert results == [False] * (requeues - 1) + [held]
        assert controller.held == ([42] if held else [])
        assert (registry.job("onprem", 42)["held_reason"] is not None) is held


def incarnations_ending(registry: Registry, controller: FakeController, comments: list[str],
                        max_restarts: int) -> list[bool]:
    """One incarnation per comment, each queued again as it ends with that comment."""
    results = []
    for restart, comment in enumerate(comments):
        ctld.prolog_slurmctld(job_context(env_for(None, restart=restart)), registry,
                              now=float(restart))
        after = job_context(env_for(None, restart=restart + 1, SLURM_JOB_COMMENT=comment))
        results.append(ctld.epilog_slurmctld(after, registry, max_restarts,
                                             lambda: controller, now=float(restart) + 0.5))
    return results


def test_planned_requeues_never_count_toward_the_cap(tmp_path):
    """A long job surviving its time limit ten times with max_restarts = 2 is never held."""
    controller = FakeController()
    with Registry(tmp_path / "r.db") as registry:
        comments = [f"geo:planned-requeue={restart} my run" for restart in range(10)]
        assert incarnations_ending(registry, controller, comments, 2) == [False] * 10
        assert registry.unplanned_requeues("onprem", 42) == 0
        assert all(i.planned for i in registry.incarnations("onprem", 42))
    assert controller.held == []


@pytest.mark.parametrize(("comments", "held_at"), [
    # A mark an earlier incarnation left never covers a later one.
    (["geo:planned-requeue=0", "geo:planned-requeue=0", "geo:planned-requeue=0",
      "geo:planned-requeue=0"], 3),
    # Planned requeues between unplanned ones: only the three unplanned count.
    (["", "geo:planned-requeue=1", "", "geo:planned-requeue=3", "geo:planned-requeue=4", ""],
     5),
    # Marks in the user's own text, or malformed, are not marks.
    (["my geo:planned-requeue=0", "geo:planned-requeue=x", "geo:planned-requeue=2x"], 2),
])
def test_only_unplanned_requeues_count(tmp_path, comments, held_at):
    controller = FakeController()
    with Registry(tmp_path / "r.db") as registry:
        results = incarnations_ending(registry, controller, comments, 2)
    assert results.index(True) == held_at and results.count(True) == 1


def test_a_job_held_at_its_cap_says_why_in_its_comment(tmp_path):
    controller = FakeController()
    with Registry(tmp_path / "r.db") as registry:
        comments = ["", "geo:planned-requeue=1 sweep 7", "sweep 7", "sweep 7"]
        assert incarnations_ending(registry, controller, comments, 2)[-1] is True
        reason = registry.job("onprem", 42)["held_reason"]
    assert reason == "requeued 3 times without planning it (node failures, crashes; " \
                     "max_restarts = 2)"
    assert controller.comments[42] == f"geo: held: {reason}; fix the job, then ask an admin " \
                                      "to release it | sweep 7"


def test_a_registry_from_before_planned_requeues_counts_every_requeue(tmp_path):
    import sqlite3

    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.executescript(
        "CREATE TABLE incarnations (cluster TEXT NOT NULL, job_id INTEGER NOT NULL, restart "
        "INTEGER NOT NULL, state TEXT NOT NULL, nodes TEXT NOT NULL, started_at REAL NOT "
        "NULL, ended_at REAL, exit_code TEXT, PRIMARY KEY (cluster, job_id, restart));"
        "INSERT INTO incarnations VALUES ('onprem', 5, 0, 'requeued', 'n1', 1, 2, '0:0');")
    old.close()
    with Registry(path) as registry:
        assert registry.unplanned_requeues("onprem", 5) == 1
        assert registry.incarnations("onprem", 5)[0].planned is False


def test_a_failed_hold_is_logged_not_raised(tmp_path):
    with Registry(tmp_path / "r.db") as registry:
        ctld.prolog_slurmctld(job_context(env_for(tmp_path)), registry, now=1.0)
        after = job_context(env_for(tmp_path, restart=1))
        assert ctld.epilog_slurmctld(after, registry, 0, lambda: FakeController(True),
                                     now=2.0) is False


# --- the entry points: fast, and never failing a job ------------------------------------------

def run_script(name: str, env: dict[str, str]) -> tuple[int, float]:
    began = time.monotonic()
    proc = subprocess.run([sys.executable, str(HOOKS / name)],
                          env=env, capture_output=True, timeout=60, check=False)
    return proc.returncode, time.monotonic() - began


@pytest.mark.parametrize("script", ["prolog.py", "epilog.py", "prolog_slurmctld.py",
                                    "epilog_slurmctld.py"])
def test_non_geo_jobs_pass_even_when_slurm_geo_cannot_be_imported(script, tmp_path):
    broken = tmp_path / "broken"
    (broken / "slurm_geo").mkdir(parents=True)
    (broken / "slurm_geo" / "__init__.py").write_text("raise ImportError('broken install')\n")
    env = {**env_for(None), "PYTHONPATH": str(broken), "PATH": "/usr/bin:/bin"}
    code, _ = run_script(script, env)
    assert code == 0


@pytest.mark.parametrize("script", ["prolog.py", "epilog.py", "prolog_slurmctld.py",
                                    "epilog_slurmctld.py"])
@pytest.mark.root(reason="runs as other users or in namespaces (failed as nobody)")
def test_geo_hooks_never_fail_the_job(script, tmp_path):
    """A broken config and an impossible checkpoint directory: logged, exit 0."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {**env_for(blocker / "ckpt"), "SLURM_GEO_CONFIG": str(tmp_path / "missing.toml"),
           "SLURM_GEO_HOOK_LOG": str(tmp_path / "hooks.log"), "PATH": os.environ["PATH"],
           "SLURM_CONF": str(tmp_path / "no-slurm.conf")}
    code, _ = run_script(script, env)
    assert code == 0
    log = (tmp_path / "hooks.log").read_text()
    assert "no usable slurm-geo config" in log


# --- as the job's user ------------------------------------------------------------------------

NOBODY = 65534


@pytest.fixture
def open_dir():
    """A directory anyone may write to, outside pytest's root-only tmp_path."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="slurm-geo-hooks-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path)


@pytest.mark.root(reason="needs root, as slurmd runs hooks")
def test_the_prolog_works_as_the_jobs_user(open_dir):
    ckpt = open_dir / "alice" / "ckpt"
    env = {**env_for(ckpt), "SLURM_JOB_UID": str(NOBODY), "SLURM_JOB_GID": str(NOBODY)}
    node.prolog(job_context(env), now=1.0)
    assert ckpt.stat().st_uid == NOBODY
    assert (ckpt / ".slurm-geo" / "prolog-onprem-42-0.json").stat().st_uid == NOBODY
    assert os.geteuid() == 0 and os.getegid() == 0  # root's ids are back


@pytest.mark.root(reason="needs root, as slurmd runs hooks")
def test_a_planted_link_leads_nowhere_the_user_could_not_write(open_dir, tmp_path):
    protected = tmp_path / "root-only"
    protected.mkdir(mode=0o755)
    ckpt = open_dir / "ckpt"
    ckpt.mkdir()
    (ckpt / ".slurm-geo").symlink_to(protected)
    env = {**env_for(ckpt), "SLURM_JOB_UID": str(NOBODY), "SLURM_JOB_GID": str(NOBODY)}
    with pytest.raises(PermissionError):
        node.prolog(job_context(env), now=1.0)
    assert list(protected.iterdir()) == []
    assert os.geteuid() == 0


# --- a job whose user is not known ------------------------------------------------------------

@pytest.mark.parametrize("uid, gid", [
    (None, "100"), ("100", None), ("", "100"), ("abc", "100"), ("-1", "100"),
    ("100", "-1"), ("4294967295", "100"), ("100", "4294967295"), (" 100", "100"),
])
def test_a_uid_or_gid_that_is_not_an_id_is_unknown(tmp_path, uid, gid):
    env = env_for(tmp_path)
    for key, value in (("SLURM_JOB_UID", uid), ("SLURM_JOB_GID", gid)):
        if value is None:
            del env[key]
        else:
            env[key] = value
    job = job_context(env)
    assert not job.ids_known
    assert job_context(env_for(tmp_path)).ids_known


@pytest.mark.parametrize("hook", ["prolog", "epilog", "prolog_slurmctld", "epilog_slurmctld"])
def test_a_hook_without_the_jobs_uid_logs_one_line_and_does_nothing(tmp_path, hook):
    from slurm_geo.hooks.entry import run_hook

    ckpt = tmp_path / "ckpt"
    log = tmp_path / "hooks.log"
    env = {**env_for(ckpt, restart=1), "SLURM_GEO_HOOK_LOG": str(log),
           "SLURM_GEO_CONFIG": str(tmp_path / "missing.toml")}
    del env["SLURM_JOB_UID"]
    assert run_hook(hook, env) == 0  # exit 0: Slurm must not drain the node
    lines = log.read_text().splitlines()
    assert len(lines) == 1, lines
    assert f"{hook} of job 42 does nothing: SLURM_JOB_UID/SLURM_JOB_GID missing" in lines[0]
    assert not ckpt.exists()


@pytest.mark.root(reason="needs root, as slurmd runs hooks")
def test_as_root_the_hooks_never_act_for_an_unknown_user(tmp_path):
    env = env_for(tmp_path / "ckpt")
    del env["SLURM_JOB_GID"]
    with pytest.raises(node.UnknownJobUser):
        node.prolog(job_context(env), now=1.0)
    with pytest.raises(node.UnknownJobUser):
        node.epilog(job_context(env), Protection(None, False, "-"), now=1.0)
    assert not (tmp_path / "ckpt").exists()
    with node.as_user(0, 0):  # root's own job runs as root
        assert os.geteuid() == 0


# --- what checkpoint-sync does with the directory ----------------------------------------------

def test_the_epilog_records_whether_checkpoint_sync_replicates_the_directory(tmp_path,
                                                                            monkeypatch):
    """A root's directory, any other directory (a registered job's: replicated too), and
    one the job's residency keeps home."""
    from slurm_geo.config import load_config
    from slurm_geo.hooks.entry import protection_of, run_hook

    for name in ("pfs", "offsite", "jobs/a"):
        (tmp_path / name).mkdir(parents=True)
    config = tmp_path / "site.toml"
    config.write_text(f'''
[stores.pfs]
url = "file://{tmp_path / 'pfs'}"
region = "home"
[stores.offsite]
url = "file://{tmp_path / 'offsite'}"
region = "remote"
[sync]
roots = ["pfs"]
destination = "offsite"
key_file = "{tmp_path / 'no.key'}"
''')
    site = load_config(config)

    def job(ckpt, **extra):
        return job_context({**env_for(ckpt), "SPANK_GEO_RESIDENCY": "home,remote", **extra})

    assert protection_of(site, job(tmp_path / "pfs")) == Protection(
        str(tmp_path / "pfs"), True, "root")
    assert protection_of(site, job(tmp_path / "jobs" / "a")) == Protection(
        f"file://{tmp_path / 'jobs' / 'a'}", True, "job directory")
    home_only = job(tmp_path / "jobs" / "a", SPANK_GEO_RESIDENCY="home")
    assert not protection_of(site, home_only).replicated

    monkeypatch.setenv("SLURM_GEO_CONFIG", str(config))  # the hooks read the config thus
    env = {**env_for(tmp_path / "jobs" / "a"), "SPANK_GEO_RESIDENCY": "home,remote",
           "SLURM_GEO_HOOK_LOG": str(tmp_path / "h.log")}
    assert run_hook("epilog", env) == 0
    record = (tmp_path / "jobs" / "a" / ".slurm-geo" / "job-onprem-42.json").read_text()
    assert '"as": "job directory"' in record and '"replicated": true' in record
    assert "unconfirmed: checkpoint-sync's state is not readable here" in \
        json.loads(record)["incarnations"][0]["sync"]["note"]


def test_the_epilog_says_not_replicated_when_checkpoint_sync_keeps_failing(tmp_path, key,
                                                                           monkeypatch):
    """The configuration says the directory is replicated; checkpoint-sync's state says
    its run failed 18 times (sealed under the user's own key): the record says the
    latter (issue 29)."""
    from slurm_geo.hooks.entry import run_hook
    from slurm_geo.sync.state import StateDB, Status

    ckpt = tmp_path / "jobs" / "a"
    for name in ("pfs", "offsite", "jobs/a"):
        (tmp_path / name).mkdir(parents=True, exist_ok=True)
    save(Repository(LocalDirStore(ckpt), key), 10)
    state = StateDB(tmp_path / "sync.db")
    (replica_id,) = state.add([{"root": f"file://{ckpt}", "run": RUN, "step": 10,
                                "destination": "offsite", "sequence": 0,
                                "status": "pending"}], now=1.0)
    state.update(replica_id, Status.PENDING, 2.0, failures=18,
                 last_error="sealed under another key")
    state.close()
    config = tmp_path / "site.toml"
    config.write_text(f'''
[stores.pfs]
url = "file://{tmp_path / 'pfs'}"
region = "home"
[stores.offsite]
url = "file://{tmp_path / 'offsite'}"
region = "remote"
[sync]
roots = ["pfs"]
destination = "offsite"
state = "{tmp_path / 'sync.db'}"
key_file = "{tmp_path / 'no.key'}"
''')
    monkeypatch.setenv("SLURM_GEO_CONFIG", str(config))
    env = {**env_for(ckpt), "SPANK_GEO_RESIDENCY": "home,remote",
           "SLURM_GEO_HOOK_LOG": str(tmp_path / "h.log")}
    assert run_hook("epilog", env) == 0
    (entry,) = json.loads((ckpt / ".slurm-geo" / "job-onprem-42.json").read_text())[
        "incarnations"]
    assert entry["final_checkpoint"] == {"run": RUN, "step": 10}
    assert entry["sync"] == {
        "root": None, "replicated": False,
        "why": f"run {RUN}: checkpoint-sync has not replicated step 10 to offsite (retrying "
               f"after 18 failed attempts: sealed under another key)"}
