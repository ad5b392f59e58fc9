"""docs/training.md is true to the code (issue 29): its exit codes are exitcodes.py's, its
API table's signatures are the code's, and its first geo job runs as alice from her login
shell on the sandbox."""

from __future__ import annotations

import inspect
import os
import re
import subprocess

import pytest

from slurm_geo.ckpt.errors import StepMismatch
from slurm_geo.exitcodes import ExitCode
from slurm_geo.torch import Checkpointer, NoValidCheckpoint, RequeueOnSignal, request_requeue
from tests.kit.docs import first_job_blocks, text

ERRORS = {"StepMismatch": StepMismatch, "NoValidCheckpoint": NoValidCheckpoint}
API = {"Checkpointer": Checkpointer, "save": Checkpointer.save, "wait": Checkpointer.wait,
       "resume": Checkpointer.resume, "RequeueOnSignal": RequeueOnSignal,
       "request_requeue": request_requeue}


def test_every_row_of_the_exit_code_table_is_exitcodes_py():
    rows = re.findall(r"^\| (\d+) \| `([A-Z_]+)` \| (.+?) \|$", text(), re.M)
    assert rows, "training.md has no exit-code table"
    for code, name, meaning in rows:
        assert ExitCode[name] == int(code), name
        assert ExitCode[name].meaning == meaning, name


def test_every_error_named_with_its_exit_code_has_that_code():
    found = re.findall(r"`(\w+)` \(exit code (\d+)\)", text())
    assert {name for name, _ in found} == set(ERRORS)
    for name, code in found:
        assert int(ERRORS[name].exit_code) == int(code), name


def test_the_api_tables_signatures_are_the_codes():
    rows = re.findall(r"^\| `(\w+)\(([^()`]*(?:\([^)]*\)[^()`]*)*)\)", text(), re.M)
    documented = {name: params for name, params in rows if name in API}
    assert set(documented) == set(API)
    for name, params in documented.items():
        names = [p.split("=")[0].strip() for p in _split(params)]
        names = [n for n in names if n and n != "*"]
        code = [p for p in inspect.signature(API[name]).parameters if p != "self"]
        assert names == code, name


def _split(params: str) -> list[str]:
    """Top-level comma-separated parts (a default may hold parentheses or commas)."""
    parts, depth, current = [], 0, ""
    for char in params:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]


@pytest.mark.slow
def test_the_first_geo_job_runs_as_alice_from_her_login_shell(sandbox, request):
    from slurm_geo.sandbox import login
    from slurm_geo.sandbox.users import ALICE
    from tests.helpers import eventually
    from tests.kit.sandbox import user_dir

    trainer, script = first_job_blocks()
    work = user_dir(sandbox, ALICE, request.node.name)
    for name, body in (("train.py", trainer), ("first.sh", script)):
        (work / name).write_text(body)
        (work / name).chmod(0o644)
        os.chown(work / name, ALICE.uid, ALICE.uid)
    login.ensure_profile(sandbox.layout, sandbox.env_lines(sandbox.layout.onprem.name, False))
    done = subprocess.run(["su", "-", ALICE.name, "-c", f"cd {work} && sbatch first.sh"],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    out = work / "first.out"
    seen = eventually(lambda: out.read_text() if out.exists() else "",
                      lambda t: "final step" in t or "Error" in t, timeout_s=300, interval_s=2)
    where, *lines = seen.splitlines()  # FederatedRun's line first: where it saves (stderr)
    assert where.startswith("slurm-geo: run first-") and " saves its checkpoints to store " \
        "'pfs' " in where and "checkpoint-sync replicates them off-site" in where, seen
    assert lines == ["started at step 0", "final step 40"], seen
