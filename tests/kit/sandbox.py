"""Paths of the sandbox's users as a test reads and writes them (tests/conftest.py's
fixtures and the sandbox tests use these)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from slurm_geo.sandbox import Sandbox, remote_site
from slurm_geo.sandbox.users import ALICE, SandboxUser
from slurm_geo.slurm import CliSlurmClient
from slurm_geo.slurm.models import JobState
from tests.helpers import eventually


def host_path(sandbox: Sandbox, path: Path) -> Path:
    """A path a job wrote, as the test reads it: on the provider's machine, through the
    operator's view of its disk; else the path itself."""
    layout = sandbox.layout
    if remote_site.is_provider(layout) and path.is_relative_to(
            remote_site.work_dir(ALICE.name)):
        return remote_site.operator_path(layout, ALICE.name, path)
    return path


def user_dir(sandbox: Sandbox, person: SandboxUser, name: str) -> Path:
    """An empty directory of that user's, for one test: theirs, 0700."""
    tests = sandbox.layout.project_dir(person.name) / "tests"
    path = tests / name.replace("/", "_")
    for directory in (tests, path):
        directory.mkdir(exist_ok=True)
        os.chown(directory, person.uid, person.uid)
        directory.chmod(0o700)
    for stale in path.iterdir():
        if stale.is_dir():
            shutil.rmtree(stale)
        else:
            stale.unlink()
    return path


def wait_done(sandbox: Sandbox, job_id: int, timeout_s: float = 90) -> JobState:
    client = connect_onprem(sandbox)
    info = eventually(lambda: client.job(job_id), lambda j: j.state.is_terminal(), timeout_s)
    return info.state


def connect_onprem(sandbox: Sandbox):

    return CliSlurmClient("onprem", sandbox.layout.onprem.slurm_conf, timeout_s=10)


def cluster_dir(sandbox: Sandbox, cluster: str, shared_dir: Path, name: str) -> Path:
    """`shared_dir`, or on the provider's machine alice's account's directory `name`."""
    layout = sandbox.layout
    if cluster != layout.rented.name or not remote_site.is_provider(layout):
        return shared_dir
    inside = remote_site.work_dir(ALICE.name) / "tests" / name.replace("/", "_")
    account = remote_site.account_for(ALICE.name)
    for directory in (inside.parent, inside):
        there = remote_site.operator_path(layout, ALICE.name, directory)
        there.mkdir(exist_ok=True)
        os.chown(there, account.uid, account.uid)
    return inside
