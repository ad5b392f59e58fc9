"""One exit code per error class, in every command (issue 29, item 8; docs/cli.md, "Error
classes"). The command tree is walked: every command that takes a cluster, a job, a run, a
step or a key file is given an unknown one, and must exit with its class's code from
slurm_geo.exitcodes and say exactly one `slurm-geo: error:` line on stderr naming it, with
no traceback. A command that gains such a parameter fails here until it is listed.

    unknown cluster (argument or --cluster)      CONFIG          3
    unknown job (logical id, CLUSTER:ID, run)    JOB_NOT_FOUND  12
    unknown run, or a step the run does not have OBJECT_MISSING 26 (never "damaged")
    --key-file missing or malformed              KEY_FILE       28

Then the human tables: `-` for a missing value, floats to 4 significant digits.

Runs in-process against a temp config, file:// stores and a SQLite federation state: no
sandbox, no Slurm.
"""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from slurm_geo.cells import cell
from slurm_geo.cli import PROG, cli
from slurm_geo.cli.tree import walk
from slurm_geo.exitcodes import ExitCode
from tests.kit.cli import cli_site, run_cli

LEAVES = {" ".join(path[1:]): command for path, command in walk(cli, PROG)
          if not isinstance(command, click.Group)}

CLUSTER, JOB, RUN, STEP, KEY = "cluster", "job", "run", "step", "key"
CODES = {CLUSTER: ExitCode.CONFIG, JOB: ExitCode.JOB_NOT_FOUND, RUN: ExitCode.OBJECT_MISSING,
         STEP: ExitCode.OBJECT_MISSING, KEY: ExitCode.KEY_FILE}
NOWHERE, NO_JOB, NO_RUN = "nowhere-cluster", "onprem-404", "no-such-run"

# (command, class) -> its arguments; {root}, {key}, {nokey} filled in per site. The thing
# named must appear in the error line: NOWHERE, NO_JOB, NO_RUN, "r@99" or the key path.
CASES: dict[tuple[str, str], str] = {
    ("approve", CLUSTER): f"onprem-9 {NOWHERE}",
    ("billing check", CLUSTER): f"--cluster {NOWHERE}",
    ("billing ingest", CLUSTER): f"--cluster {NOWHERE}",
    ("policy check", CLUSTER): f"--cluster {NOWHERE} --geo-failover=auto",
    ("policy export-lua", CLUSTER): f"--cluster {NOWHERE} --dir {{root}}/lua",
    ("sandbox env", CLUSTER): f"--dir {{root}}/sandbox {NOWHERE}",
    ("approve", JOB): f"{NO_JOB} rented",
    ("cancel", JOB): NO_JOB,
    ("logs", JOB): NO_JOB,
    ("outputs fetch", JOB): NO_JOB,
    ("plan", JOB): NO_JOB,
    ("resubmit", JOB): NO_JOB,
    ("status", JOB): NO_JOB,
    ("ckpt ls", RUN): f"{NO_RUN} --store pfs --key-file {{key}}",
    ("ckpt verify", RUN): f"{NO_RUN} --store pfs --key-file {{key}}",
    ("ckpt pull", RUN): f"{NO_RUN} --from pfs --to {{root}}/out --key-file {{key}}",
    ("ckpt promote", RUN): f"{NO_RUN}@10 --store pfs --key-file {{key}}",
    ("ckpt prune", RUN): f"{NO_RUN} --store pfs --key-file {{key}}",
    ("ckpt stats", RUN): f"--run {NO_RUN} --store pfs --key-file {{key}}",
    ("ckpt push", RUN): f"{{root}}/pfs --to off --run {NO_RUN} --key-file {{key}}",
    ("sync retry", RUN): f"{NO_RUN} --state {{root}}/sync.db",
    ("federation runs assign", RUN): f"{NO_RUN} --owner bob",
    ("ckpt verify", STEP): "r@99 --store pfs --key-file {key}",
    ("ckpt pull", STEP): "r@99 --from pfs --to {root}/out --key-file {key}",
    ("ckpt promote", STEP): "r@99 --store pfs --key-file {key}",
    ("ckpt push", STEP): "{root}/pfs --to off --run r --step 99 --key-file {key}",
    ("ckpt check", KEY): "--store pfs --key-file {nokey}",
    ("ckpt gc", KEY): "--store pfs --key-file {nokey}",
    ("ckpt ls", KEY): "r --store pfs --key-file {nokey}",
    ("ckpt promote", KEY): "r@10 --store pfs --key-file {nokey}",
    ("ckpt prune", KEY): "r --store pfs --key-file {nokey}",
    ("ckpt pull", KEY): "r --from pfs --to {root}/out --key-file {nokey}",
    ("ckpt push", KEY): "{root}/pfs --to off --key-file {nokey}",
    ("ckpt reseal", KEY): "--store pfs --key-file {nokey}",
    ("ckpt stats", KEY): "--store pfs --key-file {nokey}",
    ("ckpt verify", KEY): "r --store pfs --key-file {nokey}",
    ("keys rotate", KEY): "--store pfs --key-file {nokey}",
}

# Parameters that name a thing of a class but are not looked up, each for its reason.
NOT_LOOKED_UP = {
    ("audit show", JOB): "a filter over the audit log, which outlives the jobs it names: a "
                         "job with no entries lists none",
}


def classes_taken(command: click.Command) -> set[str]:
    """The classes a command's parameters name, read from their names."""
    names = {param.name for param in command.params}
    taken = set()
    if names & {"cluster", "clusters"}:
        taken.add(CLUSTER)
    if names & {"job", "logical_job"}:
        taken.add(JOB)
    if names & {"run", "target"}:
        taken.add(RUN)
    if any(param.name == "target" and "STEP" in (param.metavar or "")
           for param in command.params) or {"run", "step"} <= names:
        taken.add(STEP)
    if "key_file" in names:
        taken.add(KEY)
    return taken


def test_every_command_taking_a_cluster_job_run_step_or_key_is_walked():
    taken = {(name, kind) for name, command in LEAVES.items()
             for kind in classes_taken(command)}
    assert taken - set(NOT_LOOKED_UP) == set(CASES)
    assert set(NOT_LOOKED_UP) <= taken
    assert len({name for name, _ in CASES}) >= 20


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> dict[str, Path]:
    """tests.kit.cli's site: clusters onprem and rented, stores pfs and off, onprem-9
    completed, run r at step 10 in pfs, a master key."""
    return cli_site(tmp_path_factory.mktemp("site"))


@pytest.mark.parametrize(("command", "kind"), sorted(CASES), ids=lambda v: v.replace(" ", "-"))
def test_an_unknown_thing_is_its_class_code_and_one_line(command, kind, site, monkeypatch,
                                                         capsys):
    nokey = site["root"] / "absent.key"
    args = CASES[(command, kind)].format(root=site["root"], key=site["key"], nokey=nokey)
    code, _out, err = run_cli([*command.split(), *args.split()], monkeypatch, capsys, site)
    named = {CLUSTER: NOWHERE, JOB: NO_JOB, RUN: NO_RUN, STEP: "step 99", KEY: str(nokey)}
    assert code == CODES[kind], err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("slurm-geo: error: "), err
    assert named[kind] in lines[0]
    assert "damaged" not in lines[0]


@pytest.mark.parametrize("command", sorted({c for c, kind in CASES if kind == KEY}))
def test_a_malformed_key_file_is_key_file_too(command, site, monkeypatch, capsys, tmp_path):
    bad = tmp_path / "bad.key"
    bad.write_text("not a key\n")
    bad.chmod(0o600)
    args = CASES[(command, KEY)].format(root=site["root"], key=site["key"], nokey=bad)
    code, _out, err = run_cli([*command.split(), *args.split()], monkeypatch, capsys, site)
    assert code == ExitCode.KEY_FILE, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("slurm-geo: error: ") and str(bad) in lines[0]


def test_approve_and_cancel_of_a_finished_job_are_both_not_actionable(site, monkeypatch,
                                                                     capsys):
    for argv in (["approve", "onprem-9", "rented"], ["cancel", "onprem-9"]):
        code, _out, err = run_cli(argv, monkeypatch, capsys, site)
        assert code == ExitCode.NOT_ACTIONABLE, (argv, err)
        assert err.startswith("slurm-geo: error: logical job onprem-9 is completed")


def test_policy_check_refusals_are_an_error_line_on_stderr(site, monkeypatch, capsys):
    code, out, err = run_cli(["policy", "check", "--geo-residency=mars"], monkeypatch, capsys,
                             site)
    assert code == ExitCode.DIRECTIVE and out == ""
    assert err.startswith("slurm-geo: error: ") and err.count("\n") == 1


# --- human tables: `-` for missing values, rounded figures ----------------------------------


@pytest.mark.parametrize(("value", "shown"), [
    (None, "-"), ("", "-"), (0, "0"), (42, "42"), ("run-a", "run-a"), (True, "True"),
    (0.123456789, "0.1235"), (2.0, "2"), (1234.5678, "1235"), (1e-7, "1e-07"),
    (1234567.8, "1.235e+06"), (float("nan"), "nan"),
])
def test_a_cell_is_a_dash_when_missing_and_a_float_has_4_significant_digits(value, shown):
    assert cell(value) == shown


def test_ckpt_ls_rounds_the_loss_and_dashes_what_is_missing(site, monkeypatch, capsys):
    code, out, err = run_cli(["ckpt", "ls", "--store", "pfs", "--key-file", str(site["key"])],
                             monkeypatch, capsys, site)
    assert code == 0, err
    header, row = out.splitlines()
    columns, cells = header.split(), row.split()  # SIZE's "10 B" ends the row
    assert columns[3:7] == ["LOSS", "CREATED_AT", "CLUSTER", "JOB_ID"]
    assert cells[3] == "0.1235" and cells[5:7] == ["-", "-"]
    assert "None" not in out


def test_status_dashes_an_empty_reason_and_prints_no_none(site, monkeypatch,
                                                                 capsys):
    code, out, err = run_cli(["status"], monkeypatch, capsys, site)
    assert code == 0, err
    header, row = out.splitlines()
    assert header.split()[-1] == "REASON" and row.split()[-1] == "-"
    code, out, err = run_cli(["status", "onprem-9"], monkeypatch, capsys, site)
    assert code == 0 and "None" not in out, err


def test_federation_status_names_no_leader_with_empty_fields():
    from slurm_geo.federation.model import Replica
    from slurm_geo.federation.operator.replication import ReplicationStatus, render

    shown = render(ReplicationStatus(False, Replica("", "", "http://127.0.0.1:1"), [], []))
    assert "leader: - at site - (http://127.0.0.1:1)" in shown
