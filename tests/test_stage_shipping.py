"""A moved job's preamble ships its log and --geo-outputs home (stage.shipping, plugged
into stage.run's enter_world hooks; issue 31 item 6): as alice, from where each output
lies on the node, under the run key, once more (final) when the script ends; the job's
exit code stands. No Slurm, no daemon (the world is staged as in test_stage_preamble)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from slurm_geo.ckpt.stores.store import LocalDirStore
from slurm_geo.policy.world import Input, World
from slurm_geo.sandbox.users import ALICE
from slurm_geo.stage.outputs import latest_index, read_file, read_log
from slurm_geo.stage.preamble import enter_world
from slurm_geo.stage.shipping import OutputsUploader, log_file, output_roots, ship_interval
from tests.helpers import as_uid
from tests.kit.stage import (  # noqa: F401 - base_fixture: the fixture base
    PYTHON,
    RUN,
    base_fixture,
    home_path,
    stage_world,
)

SCRIPT = b"""#!/bin/bash
echo "trained: step 3"
echo "weights 42" > "$SLURM_GEO_OUTPUT_0/result.txt"
exit 7
"""


@pytest.mark.root(reason="runs as other users or in namespaces (failed as nobody)")
def test_the_log_and_outputs_ship_home_under_the_run_key(base: Path) -> None:
    staged = stage_world(base, "ship")
    out_home = home_path("ship") + "/runs/out"
    world = World((Input(staged.data_home),), outputs=(out_home,))
    shipped = base / "site-store"  # the store alice's moved job ships into, hers here
    shipped.mkdir()
    os.chown(shipped, ALICE.uid, ALICE.uid)
    log = base / "job.out"
    log.touch()
    log.chmod(0o666)

    def alice() -> None:
        errors = io.StringIO()
        uploader = OutputsUploader(LocalDirStore(shipped), staged.reply.data_keys, RUN,
                                   "rented", "42", log, every_s=3600, err=errors)
        with open(log, "a") as job_out:
            rc = enter_world(staged.reply, staged.store, SCRIPT, world, "42", base=base,
                             environ={"PATH": "/usr/bin:/bin"}, out=job_out,
                             err=io.StringIO(), python=PYTHON, at_start=uploader.start,
                             at_exit=uploader.finish)
        assert rc == 7, rc
        assert not errors.getvalue(), errors.getvalue()
    answer = as_uid(ALICE.uid, alice)
    assert answer == "ok", answer
    ring = staged.reply.data_keys
    store = LocalDirStore(shipped)
    shipped_log = read_log(store, ring, RUN, "rented-42")
    assert shipped_log is not None and b"trained: step 3" in shipped_log, shipped_log
    index = latest_index(store, ring, RUN, "rented-42")
    assert index is not None and index.final
    (output,) = index.outputs
    assert output.home == out_home
    entry = next(e for e in output.entries if e.path == "result.txt")
    assert b"".join(read_file(store, ring, RUN, "rented-42", entry)) == b"weights 42\n"


def test_pieces() -> None:
    assert output_roots(None) == {}
    assert ship_interval({}) == 60.0
    assert ship_interval({"SLURM_GEO_SHIP_INTERVAL_S": "5"}) == 5.0
    assert ship_interval({"SLURM_GEO_SHIP_INTERVAL_S": "soon"}) == 60.0
    with open(os.devnull, "w") as null:
        assert log_file(null.fileno()) is None  # a device, not Slurm's output file
    read, write = os.pipe()
    try:
        assert log_file(write) is None
    finally:
        os.close(read)
        os.close(write)


def test_the_log_file_is_the_regular_file_standard_output_writes_to(tmp_path: Path) -> None:
    path = tmp_path / "job.out"
    with open(path, "w") as handle:
        assert log_file(handle.fileno()) == path
