"""A job's records in a checkpoint directory users share (slurm_geo.jobrecords), as the
attacker: bob, a co-tenant of a 1777 directory, makes `.slurm-geo/` before alice's job
does, plants records under her names, and tries to remove, rename or replace hers. Her
records lie in her own `.slurm-geo-<uid>/`; none of his attempts changes them, and nothing
he planted is read as hers. The rules first, without I/O."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_geo import jobrecords
from slurm_geo.hooks import node
from slurm_geo.hooks.context import JobContext, job_context
from slurm_geo.lease import places
from slurm_geo.sandbox.users import ALICE, BOB
from slurm_geo.sync.jobdirs import Protection
from tests.helpers import as_uid
from tests.kit.hooks import env_for

# --- the rules ----------------------------------------------------------------------------

DIR = stat.S_IFDIR
LINK = stat.S_IFLNK


@pytest.mark.parametrize("mode, shared", [
    (0o1777, True), (0o2770, True), (0o777, True), (0o0775, True), (0o0757, True),
    (0o755, False), (0o750, False), (0o700, False), (0o2750, False),
])
def test_which_checkpoint_directories_are_shared(mode, shared):
    assert jobrecords.is_shared(mode) is shared
    assert jobrecords.records_name(shared, 2001) == \
        (".slurm-geo-2001" if shared else ".slurm-geo")


@pytest.mark.parametrize("kind, owner, mode, why", [
    (DIR, 2001, 0o755, None),
    (DIR, 2001, 0o700, None),
    (DIR, 2002, 0o755, "belongs to"),              # bob's, under alice's name
    (DIR, 0, 0o755, "belongs to"),                 # not even root's is hers
    (DIR, 2001, 0o1777, "may be written by group or others"),
    (DIR, 2001, 0o775, "may be written by group or others"),
    (LINK, 2001, 0o777, "is not a directory"),     # her own link: to anywhere
    (stat.S_IFREG, 2001, 0o644, "is not a directory"),
])
def test_which_records_directories_a_user_trusts(kind, owner, mode, why):
    info = os.stat_result((kind | mode, 0, 0, 1, owner, owner, 0, 0, 0, 0))
    found = jobrecords.refusal(info, 2001)
    assert (found is None) if why is None else (why in found)
    assert jobrecords.refusal(None, 2001) is None  # missing: nothing to refuse


# --- as alice and bob ----------------------------------------------------------------------

pytestmark_root = pytest.mark.root(reason="needs root to act as alice and bob")
CLUSTER, JOB = "onprem", 42


@pytest.fixture
def shared() -> Iterator[Path]:
    """A checkpoint directory every user's jobs write into (1777, root's), outside pytest's
    root-only tmp_path."""
    top = Path(tempfile.mkdtemp(prefix="slurm-geo-records-"))
    top.chmod(0o755)
    pfs = top / "pfs"
    pfs.mkdir()
    pfs.chmod(0o1777)
    yield pfs
    shutil.rmtree(top)


def alices_job(ckpt: Path, restart: int = 0) -> JobContext:
    env = {**env_for(ckpt, restart), "SLURM_JOB_UID": str(ALICE.uid),
           "SLURM_JOB_GID": str(ALICE.uid)}
    return job_context(env)


def run_record(step: int, run: str = "alice-run") -> places.RunRecord:
    return places.RunRecord(run, CLUSTER, JOB, 0, "pfs", "file:///pfs", step, True, "root")


def bob_plants(shared: Path, job: int = JOB) -> None:
    """Bob's `.slurm-geo/`, before any job of alice's, with records under her job's names."""
    def plant() -> None:
        meta = shared / jobrecords.META_DIR
        meta.mkdir(mode=0o777)
        meta.chmod(0o1777)
        forged = run_record(999_999, run="bobs-run")
        for name, value in ((f"run-{CLUSTER}-{job}.json", forged.__dict__),
                            (f"prolog-{CLUSTER}-{job}-7.json", {"restart": 7}),
                            (f"job-{CLUSTER}-{job}.json",
                             {"cluster": CLUSTER, "job_id": job, "incarnations": [
                                 {"restart": 5, "reason": "completed", "forged": True}]})):
            (meta / name).write_text(json.dumps(value))
    assert as_uid(BOB.uid, plant) == "ok"


def alice_writes_her_records(shared: Path) -> Path:
    """Her prolog (root, as her), her FederatedRun's record (her job) and her epilog."""
    node.prolog(alices_job(shared), now=1.0)
    assert as_uid(ALICE.uid, lambda: places.write_record(shared, run_record(40))) == "ok"
    node.epilog(alices_job(shared), Protection(None, False, "not a root"), now=2.0)
    return shared / f".slurm-geo-{ALICE.uid}"


def snapshot(directory: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_uid, p.read_bytes()) for p in sorted(directory.iterdir())}


@pytestmark_root
def test_bob_cannot_remove_replace_or_forge_alices_records_in_a_shared_directory(shared):
    bob_plants(shared)
    mine = alice_writes_her_records(shared)
    info = mine.lstat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (ALICE.uid, 0o755)
    assert {p.name for p in mine.iterdir()} == {
        f"prolog-{CLUSTER}-{JOB}-0.json", f"run-{CLUSTER}-{JOB}.json",
        f"job-{CLUSTER}-{JOB}.json"}
    before = snapshot(mine)
    # Her epilog read her own records, none of bob's: restart 0, not his 7 or 5.
    job = json.loads(before[f"job-{CLUSTER}-{JOB}.json"][1])
    assert [i["restart"] for i in job["incarnations"]] == [0]
    assert "forged" not in json.dumps(job)

    run_name, job_name = f"run-{CLUSTER}-{JOB}.json", f"job-{CLUSTER}-{JOB}.json"

    def rename_her_directory() -> None:
        os.rename(mine, shared / "moved")

    attacks = {
        "delete her run record": lambda: (mine / run_name).unlink(),
        "replace her run record": lambda: os.replace(
            shared / jobrecords.META_DIR / run_name, mine / run_name),
        "write into her records": lambda: (mine / "run-onprem-43.json").write_text("{}"),
        "overwrite her job record": lambda: (mine / job_name).write_text("{}"),
        "remove her directory": lambda: shutil.rmtree(mine),
        "rename her directory": rename_her_directory,
        "make her records read-only to her": lambda: mine.chmod(0o555),
    }
    for what, attack in attacks.items():
        answer = as_uid(BOB.uid, attack)
        assert answer.startswith("PermissionError"), (what, answer)
    assert snapshot(mine) == before
    # What her job and her next epilog read are hers, whatever bob planted beside them.
    read = as_uid(ALICE.uid, lambda: _assert_read(shared, run_record(40)))
    assert read == "ok", read


def _assert_read(shared: Path, expected: places.RunRecord) -> None:
    assert places.read_record(shared, CLUSTER, JOB) == expected


@pytestmark_root
def test_a_records_directory_bob_makes_under_alices_name_is_refused_never_read(shared):
    """Bob makes `.slurm-geo-<alice's uid>/` first, with a run record in it: her prolog
    refuses it in one line (denial of service, said), and no reader takes his record."""
    theirs = shared / f".slurm-geo-{ALICE.uid}"

    def plant() -> None:
        theirs.mkdir(mode=0o755)
        (theirs / f"run-{CLUSTER}-{JOB}.json").write_text(
            json.dumps(run_record(999_999, run="bobs-run").__dict__))
    assert as_uid(BOB.uid, plant) == "ok"
    with pytest.raises(jobrecords.RecordsRefused) as refused:
        node.prolog(alices_job(shared), now=1.0)
    message = str(refused.value)
    assert "\n" not in message and str(theirs) in message and "belongs to bob" in message
    assert as_uid(ALICE.uid, lambda: _assert_none(shared)) == "ok"
    failed = as_uid(ALICE.uid, lambda: places.write_record(shared, run_record(40)))
    assert failed.startswith("RecordsRefused"), failed
    assert {p.name for p in theirs.iterdir()} == {f"run-{CLUSTER}-{JOB}.json"}


def _assert_none(shared: Path) -> None:
    assert places.read_record(shared, CLUSTER, JOB) is None


@pytestmark_root
def test_a_record_in_her_directory_that_is_not_hers_is_not_read(shared):
    """A file of another owner in her own directory (only root could put it there) or a
    link in a record's place is no record of hers."""
    mine = alice_writes_her_records(shared)
    run_name = f"run-{CLUSTER}-{JOB}.json"
    (mine / run_name).unlink()
    (mine / run_name).write_text(json.dumps(run_record(7).__dict__))  # root's
    assert as_uid(ALICE.uid, lambda: _assert_none(shared)) == "ok"
    (mine / run_name).unlink()
    (mine / run_name).symlink_to(shared / jobrecords.META_DIR / "anything")
    os.lchown(mine / run_name, ALICE.uid, ALICE.uid)
    assert as_uid(ALICE.uid, lambda: _assert_none(shared)) == "ok"


@pytestmark_root
def test_a_private_directory_keeps_its_records_in_slurm_geo(shared):
    """A directory of alice's own (0750 as the prolog makes it) keeps the layout it had;
    a `.slurm-geo/` an older version left shared there is made hers alone again."""
    ckpt = shared / "alice-own"
    node.prolog(alices_job(ckpt), now=1.0)
    meta = ckpt / jobrecords.META_DIR
    assert (meta / f"prolog-{CLUSTER}-{JOB}-0.json").stat().st_uid == ALICE.uid
    assert not list(ckpt.glob(".slurm-geo-*"))
    os.chmod(meta, 0o1777)
    node.epilog(alices_job(ckpt), Protection(None, False, "not a root"), now=2.0)
    assert not stat.S_IMODE(meta.stat().st_mode) & 0o022
    assert (meta / f"job-{CLUSTER}-{JOB}.json").stat().st_uid == ALICE.uid


@pytestmark_root
def test_the_prolog_hook_says_the_refusal_in_one_line_and_the_job_goes_on(shared, tmp_path):
    """The real hook (slurm_geo.hooks.entry, as slurmd runs it): bob's directory under
    alice's name is one line in the hook log, no traceback, exit 0."""
    from slurm_geo.hooks.entry import run_hook

    assert as_uid(BOB.uid, lambda: (shared / f".slurm-geo-{ALICE.uid}").mkdir()) == "ok"
    log = tmp_path / "hooks.log"
    env = {**env_for(shared), "SLURM_JOB_UID": str(ALICE.uid), "SLURM_JOB_GID": str(ALICE.uid),
           "SLURM_GEO_CONFIG": str(tmp_path / "missing.toml"), "SLURM_GEO_HOOK_LOG": str(log)}
    assert run_hook("prolog", env) == 0
    refused = [line for line in log.read_text().splitlines() if "records directory" in line]
    assert len(refused) == 1 and "belongs to bob" in refused[0], log.read_text()
    assert "Traceback" not in log.read_text()


@pytest.mark.sandbox
@pytest.mark.slow
def test_alices_real_job_keeps_its_records_in_her_own_directory_past_bobs(sandbox, request):
    """The real prolog and epilog (slurmd runs them as root) of alice's job in a shared
    1777 directory where bob made `.slurm-geo/` first and planted records under her job's
    names: hers go to `.slurm-geo-<her uid>/`, hers alone, and name restart 0, completed,
    whatever bob planted."""
    from slurm_geo.slurm.models import JobState
    from tests.helpers import eventually, sbatch_as
    from tests.kit.sandbox import wait_done

    top = sandbox.layout.root / "test-shared-ckpt"
    top.mkdir(mode=0o755, exist_ok=True)
    ckpt = top / request.node.name
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir()
    ckpt.chmod(0o1777)
    try:
        # Her job, held while bob plants records under its very id, then released.
        script = (f"#!/bin/bash\n#SBATCH --geo-ckpt-dir={ckpt}\n"
                  "#SBATCH --geo-cost-center=ml-research\n#SBATCH --hold\n"
                  f"#SBATCH --output={ckpt}/%j.out\ntrue\n")
        done = sbatch_as(sandbox, ALICE, script)
        assert done.returncode == 0, done.stderr
        job_id = int(done.stdout.strip().split(";")[0])
        bob_plants(ckpt, job_id)
        subprocess.run(["scontrol", "release", str(job_id)], check=True, timeout=30,
                       env={**os.environ, "SLURM_CONF": str(sandbox.layout.onprem.slurm_conf)})
        assert wait_done(sandbox, job_id) is JobState.COMPLETED
        mine = ckpt / f".slurm-geo-{ALICE.uid}"
        path = mine / f"job-onprem-{job_id}.json"
        record = eventually(lambda: json.loads(path.read_text()) if path.exists() else None,
                            lambda r: r is not None, timeout_s=60, interval_s=1)
        assert [(i["restart"], i["reason"]) for i in record["incarnations"]] == \
            [(0, "completed")]
        info = mine.lstat()
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (ALICE.uid, 0o755)
        assert {p.stat().st_uid for p in mine.iterdir()} == {ALICE.uid}
        assert (mine / f"prolog-onprem-{job_id}-0.json").is_file()
        assert len(list((ckpt / jobrecords.META_DIR).glob(f"*-{job_id}*"))) == 3  # his own
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
