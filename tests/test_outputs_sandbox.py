"""Shipped outputs read by their owner on the real sandbox (issue 31 item 6): alice, who
reads neither the daemon's state nor the master key, gets her run's key from the
federation daemon by MUNGE (`run-key`) to ship and then to fetch what an incarnation of
her job shipped into the home store (`slurm-geo outputs fetch`); bob is refused in one
line with NOT_OWNER and no file of hers reaches him."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from slurm_geo.drills import drill
from slurm_geo.exitcodes import ExitCode
from slurm_geo.sandbox import Sandbox
from slurm_geo.sandbox.users import ALICE, BOB, job_environment, run_as
from tests.kit.owners import alices_training_job, geo, one_line_refusal

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

SETTINGS = drill.DrillSettings(steps=6000, ckpt_every=40, step_delay_s=0.05)

SHIP = """
import sys
from slurm_geo.cli.ckpt_owner import run_key
from slurm_geo.ckpt.stores.open_store import open_store_or_named
from slurm_geo.config.model import load_config
from slurm_geo.stage.outputs import ship
run, log, home, local = sys.argv[1:5]
report = ship(open_store_or_named("pfs"), run_key(load_config(None), run), run,
              "rented-999", log, {home: local}, final=True)
print(report.index, report.files_read)
"""


@pytest.fixture(scope="module")
def alice_job(sandbox: Sandbox, site):
    yield from alices_training_job(sandbox, site, "outputs-fetch", SETTINGS.ckpt_every + 1)


def test_alice_fetches_what_her_job_shipped_and_bob_is_refused(sandbox, alice_job):
    logical_job, run, work = alice_job
    local = work / "rented-results"
    local.mkdir()
    (local / "metrics.json").write_text('{"loss": 0.25}\n')
    (work / "rented.out").write_text("step 40\n")
    for path in (local, local / "metrics.json", work / "rented.out"):
        os.chown(path, ALICE.uid, ALICE.uid)
    home = work / "results"
    shipped = _ship(sandbox, run, work / "rented.out", home, local)
    assert shipped.returncode == 0, shipped.stderr
    assert shipped.stdout.split() == ["1", "2"]

    fetched = geo(sandbox, ALICE, "outputs", "fetch", logical_job, "--json")
    assert fetched.returncode == 0, fetched.stderr
    answer = json.loads(fetched.stdout)
    assert answer["written"] == [str(home / "metrics.json")]
    assert answer["incarnations"] == ["rented-999"]
    assert (home / "metrics.json").read_text() == '{"loss": 0.25}\n'
    assert (home / "metrics.json").stat().st_uid == ALICE.uid  # written as her

    refused = geo(sandbox, BOB, "outputs", "fetch", logical_job, "--to", "/tmp/bob-outputs")
    one_line_refusal(refused, ExitCode.NOT_OWNER)
    assert not Path("/tmp/bob-outputs").exists()


def _ship(sandbox, run, log, home, local):
    """What a moved job's preamble does, as alice: her run's key from the daemon, then
    `ship` (here straight into the home store, where checkpoint-sync would bring it)."""
    return run_as(ALICE, [str(sandbox.layout.site_python), "-c", SHIP, run, str(log),
                          str(home), str(local)],
                  env=job_environment(sandbox.layout, ALICE), capture_output=True, text=True,
                  timeout=120, check=False)
