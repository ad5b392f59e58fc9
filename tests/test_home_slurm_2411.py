"""Home on Debian 13's Slurm 24.11, live: the CLI backend through every call.

Brings up a home cluster (sandbox.home24: slurmctld, two slurmds, slurmdbd and MariaDB from
a trixie root filesystem, auth/slurm, alice and bob at home's uids) in a directory of its
own, and drives it through CliSlurmClient as the federation daemon would: as the service
account (a Slurm operator there), every command the root's 24.11 one, a job of alice's
submitted through slurm-geo-submit-as (built into the site; it drops to alice and runs
sbatch: no `sbatch --uid`), read, estimated, held, released, requeued and cancelled, its
script, environment and accounting read back; nodes drained and resumed.

Needs root and Debian's registry (mmdebstrap builds the image once per machine, about
30 s): skipped only when the registry cannot be reached, saying so. Its own ports (free
ones from $SLURM_GEO_HOME24_TEST_PORT, default 24670) and directory
($SLURM_GEO_HOME24_TEST_DIR, else a temporary one); nothing of a sandbox is used.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TypeVar

import pytest

from slurm_geo.sandbox import home24, rootfs
from slurm_geo.sandbox.provider import ProviderSite, exec_in
from slurm_geo.slurm.cli_backend import CliSlurmClient
from slurm_geo.slurm.errors import JobNotFound, SlurmRejected
from slurm_geo.slurm.models import JobSpec, JobState, MalformedAccountingRow, Owner
from slurm_geo.slurm.windows import incarnation_order
from tests.provider_sites import free_base, running

pytestmark = [pytest.mark.slow,
              pytest.mark.root(reason="namespaces and mounts need root")]

ALICE = Owner("alice", 2001, 2001)
T = TypeVar("T")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProviderSite]:
    root = Path(os.environ.get("SLURM_GEO_HOME24_TEST_DIR")
                or tmp_path_factory.mktemp("home24"))
    made = home24.site(root, free_base(int(os.environ.get("SLURM_GEO_HOME24_TEST_PORT")
                                           or 24670), 6))
    with running(made, home24.up, root) as site:
        yield site


@pytest.fixture(scope="module")
def slurm(site: ProviderSite) -> CliSlurmClient:
    return home24.client(site)


def eventually(read: Callable[[], T], ok: Callable[[T], bool], timeout_s: float = 60) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if ok(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def spec(name: str, **changes: object) -> JobSpec:
    fields: dict[str, object] = dict(
        script="#!/bin/bash\necho started as $(id -un) $GEO_MARK\nsleep 300\n", name=name,
        working_dir=Path("/home/alice"), environment={"GEO_MARK": name}, owner=ALICE,
        time_limit_minutes=10, requeue=True, signal="B:USR1@60",
        output=f"/home/alice/{name}-%j.out", comment="c1")
    return JobSpec(**{**fields, **changes})  # type: ignore[arg-type]


def test_its_slurm_is_24_11(site: ProviderSite, slurm: CliSlurmClient) -> None:
    assert rootfs.slurm_version(exec_in(site, ["slurmctld", "-V"]).stdout).startswith("24.11.")
    version = exec_in(site, ["sbatch", "--version"]).stdout
    assert version.startswith("slurm-wlm 24.11."), version
    assert slurm.ping() >= 0


def test_nodes_drained_and_resumed(site: ProviderSite, slurm: CliSlurmClient) -> None:
    nodes = {n.name: n for n in slurm.nodes()}
    assert sorted(nodes) == ["home24-n1", "home24-n2"]
    assert all(n.state == "idle" and n.cpus == 2 and not n.flags for n in nodes.values())
    # Draining is an admin's (root at home: slurm_geo.slurm.admin).
    exec_in(site, ["scontrol", "update", "NodeName=home24-n2", "State=DRAIN",
                   "Reason=test drain"])
    try:
        drained = {n.name: n for n in slurm.nodes()}["home24-n2"]
        assert "DRAIN" in drained.flags and drained.reason == "test drain"
    finally:
        exec_in(site, ["scontrol", "update", "NodeName=home24-n2", "State=RESUME"])
    # 24.11 marks a resumed node NOT_RESPONDING until it answers slurmctld's next ping.
    resumed = eventually(lambda: {n.name: n for n in slurm.nodes()}["home24-n2"],
                         lambda n: not n.flags)
    assert (resumed.state, resumed.flags) == ("idle", ())


def test_a_job_of_alices_through_every_call(site: ProviderSite,
                                             slurm: CliSlurmClient) -> None:
    began = datetime.now(UTC)
    job_spec = spec("every-call", hold=True)
    job_id = slurm.submit(job_spec)
    held = slurm.job(job_id)
    assert (held.state, held.reason) == (JobState.PENDING, "JobHeldUser")
    assert (held.user, held.uid, held.gid, held.work_dir) == ("alice", 2001, 2001,
                                                              "/home/alice")
    assert job_id in [j.job_id for j in slurm.jobs()]
    assert slurm.expected_start(spec("estimate")) is not None  # sbatch --test-only, as alice

    slurm.release(job_id)
    running = eventually(lambda: slurm.job(job_id), lambda j: j.state is JobState.RUNNING)
    assert running.state is JobState.RUNNING and running.nodes.startswith("home24-n")
    out = site.home_of("alice") / f"every-call-{job_id}.out"
    eventually(lambda: out.exists() and out.read_text(), bool)
    assert out.read_text().split() == ["started", "as", "alice", "every-call"]
    assert out.stat().st_uid == 2001  # the helper dropped to alice before sbatch ran
    assert slurm.batch_script(job_id) == job_spec.script
    env = eventually(lambda: _environment(slurm, job_id), lambda e: e is not None)
    assert env is not None and env["GEO_MARK"] == "every-call"

    slurm.requeue(job_id)
    requeued = eventually(lambda: slurm.job(job_id), lambda j: j.restart_count == 1)
    assert requeued.restart_count == 1 and requeued.state is not JobState.UNKNOWN
    slurm.hold(job_id, comment="held by the test")
    assert slurm.job(job_id).reason == "JobHeldAdmin"
    slurm.release(job_id)
    slurm.cancel(job_id)
    assert eventually(lambda: slurm.job(job_id).state,
                      lambda s: s is JobState.CANCELLED) is JobState.CANCELLED

    records = eventually(lambda: slurm.accounting([job_id]),
                         lambda rs: [r.state for r in rs][-1:] == [JobState.CANCELLED])
    assert [r.state for r in records] == [JobState.REQUEUED, JobState.CANCELLED]
    assert records[0].allocated_tres.get("cpu") == 1 and records[0].elapsed_s >= 0
    assert records[1].cancelled_by == "slurm-geo"  # the service account, an operator
    end = datetime.now(UTC) + timedelta(seconds=5)
    window = [r for r in slurm.accounting(start=began, end=end) if r.job_id == job_id]
    rows = sorted((r for r in slurm.accounting_rows(began, end)  # streamed, as seen
                   if not isinstance(r, MalformedAccountingRow) and r.job_id == job_id),
                  key=incarnation_order)
    assert [r.state for r in window] == [r.state for r in rows] == [r.state for r in records]
    assert [r.start_time for r in window] == [r.start_time for r in rows]


def _environment(slurm: CliSlurmClient, job_id: int) -> dict[str, str] | None:
    try:
        return slurm.batch_environment(job_id)
    except SlurmRejected:
        return None  # its record reaches slurmdbd seconds after submission


def test_unknown_jobs_are_unknown(slurm: CliSlurmClient) -> None:
    for call in (slurm.cancel, slurm.requeue, slurm.job, slurm.release):
        with pytest.raises(JobNotFound):
            call(999999)


def test_the_helper_still_refuses_a_wrong_owner(slurm: CliSlurmClient) -> None:
    with pytest.raises(SlurmRejected, match="does not have uid"):
        slurm.submit(spec("wrong-uid", owner=Owner("alice", 2002, 2002)))


def test_a_submission_without_owner_runs_as_the_service_account(
        slurm: CliSlurmClient) -> None:
    job_id = slurm.submit(spec("service", owner=None, working_dir=Path("/tmp"),
                               output="/tmp/service-%j.out", hold=True))
    try:
        assert (slurm.job(job_id).user, slurm.job(job_id).uid) == ("slurm-geo", 3100)
    finally:
        slurm.cancel(job_id)
