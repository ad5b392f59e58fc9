"""An admin gives a run that no job names to an owner (`slurm-geo federation runs assign`,
federation.runowners; issue 28, finding 7): the decision's table, the record on both
state backends, and the lease path of the daemon: before, nobody may claim the run nor
get its key; after, the named owner's job does and everyone else's is still refused."""

from __future__ import annotations

from dataclasses import replace

import pytest

from slurm_geo.exitcodes import ExitCode
from slurm_geo.federation.act.registration import run_taken_by
from slurm_geo.federation.model import JobStatus, RunOwner
from slurm_geo.federation.operator.runowners import AssignRefused, assign, assign_refusal
from slurm_geo.slurm import Owner
from tests.kit.builders import logical_job as job
from tests.kit.federation import BOB as DAEMON_BOB
from tests.kit.federation import Site, operator_run
from tests.kit.state import (  # noqa: F401 - the fixtures path, sqlite_state and state
    path_fixture,
    sqlite_state_fixture,
    state_fixture,
)

ALICE, BOB = Owner("alice", 2001, 2001), Owner("bob", 2002, 2002)


def _job(name: str, status: JobStatus, owner: Owner | None):
    return replace(job(), logical_job=name, status=status, owner=owner)


GIVEN_TO_ALICE = RunOwner("r", ALICE, "root", 1.0)


@pytest.mark.parametrize("jobs, assigned, stored_in, to, force, code", [
    ([], None, "pfs", BOB, False, None),                # in a store, nobody's: given
    ([], None, None, BOB, False, ExitCode.OBJECT_MISSING),  # nothing to give
    ([], GIVEN_TO_ALICE, "pfs", BOB, False, ExitCode.FEDERATION_STATE),  # alice's already
    ([], GIVEN_TO_ALICE, "pfs", BOB, True, None),       # --force
    ([], GIVEN_TO_ALICE, "pfs", ALICE, False, None),    # hers again: nothing to refuse
    ([_job("onprem-1", JobStatus.COMPLETED, ALICE)], None, None, BOB, False,
     ExitCode.FEDERATION_STATE),                        # owned by its jobs' owner
    ([_job("onprem-1", JobStatus.COMPLETED, ALICE)], None, None, BOB, True, None),
    ([_job("onprem-1", JobStatus.RUNNING, ALICE)], None, None, BOB, True,
     ExitCode.NOT_ACTIONABLE),                          # in use: never, even forced
    ([_job("onprem-1", JobStatus.FAILED, None)], None, None, BOB, False, None),  # no owner
])
def test_when_a_run_may_be_given_to_an_owner(jobs, assigned, stored_in, to, force, code):
    refused = assign_refusal("r", jobs, assigned, stored_in, to, force)
    if code is None:
        assert refused is None
        return
    assert isinstance(refused, AssignRefused) and refused.exit_code == code
    assert "\n" not in str(refused) and "run r" in str(refused)


@pytest.mark.parametrize("others, uid, assigned, taken", [
    ([], 2002, RunOwner("r", BOB, "root", 1.0), False),    # stored, given to bob: his
    ([], 2001, RunOwner("r", BOB, "root", 1.0), True),     # not alice's
    ([], None, RunOwner("r", BOB, "root", 1.0), True),     # an unknown uid: nobody's
    # Taken from alice's finished job and given to bob: her new job is refused.
    ([_job("onprem-1", JobStatus.COMPLETED, ALICE)], 2002, RunOwner("r", BOB, "root", 1.0),
     False),
    ([_job("onprem-1", JobStatus.COMPLETED, ALICE)], 2001, RunOwner("r", BOB, "root", 1.0),
     True),
    ([_job("onprem-1", JobStatus.RUNNING, BOB)], 2002, RunOwner("r", BOB, "root", 1.0),
     True),                                              # still one active job per run
])
def test_an_assignment_decides_who_may_name_the_run(others, uid, assigned, taken):
    reason = run_taken_by(others, "r", "onprem-9", uid, "pfs", assigned)
    assert (reason is not None) is taken


def test_an_assignment_is_kept_and_replaced_on_both_backends(state) -> None:
    assert state.identities.run_owner("r") is None
    state.identities.assign_run(RunOwner("r", ALICE, "root", 5.0))
    assert state.identities.run_owner("r") == RunOwner("r", ALICE, "root", 5.0)
    state.identities.assign_run(RunOwner("r", BOB, "slurm-geo", 6.0))  # --force
    assert state.identities.run_owner("r") == RunOwner("r", BOB, "slurm-geo", 6.0)
    assert state.identities.run_owner("other") is None


# --- the daemon's lease path -----------------------------------------------------------------

@pytest.fixture
def site(tmp_path) -> Site:
    return Site(tmp_path)


def bobs_job(site: Site) -> int:
    job_id = site.submit_home(owner=DAEMON_BOB, failover=None)
    site.start_home(job_id)
    return job_id


def test_a_run_given_to_bob_is_his_jobs_and_no_one_elses(site):
    run = operator_run(site)
    bob = bobs_job(site)
    assert site.lease_reply("onprem", bob, run=run, as_user="bob").status == 403
    answer = assign(site.federation, run, "bob", False, "root")
    assert answer == {"run": run, "owner": "bob", "uid": 2002, "previous_owner": None,
                      "assigned_by": "root", "changed": True}
    (entry,) = [e for e in site.federation.audit.entries() if e.kind == "assign"]
    assert entry.detail["owner"] == "bob" and entry.detail["forced"] is False
    assert site.lease("onprem", bob, run=run, as_user="bob")["verdict"] == "grant"
    key = site.key("onprem", bob, as_user="bob")
    assert key.status == 200 and "data_key" in key.body
    # Alice's job naming it is refused, and gets no key.
    alices = site.submit_home(failover=None)
    site.start_home(alices)
    refused = site.lease_reply("onprem", alices, run=run)
    assert refused.status == 403, refused.body
    assert site.key("onprem", alices).status in (403, 409)
    # While bob's job holds it, not even --force gives it away.
    with pytest.raises(AssignRefused) as busy:
        assign(site.federation, run, "alice", True, "root")
    assert busy.value.exit_code == ExitCode.NOT_ACTIONABLE


def test_a_given_run_is_taken_only_with_force_and_audited(site):
    run = operator_run(site)
    assign(site.federation, run, "alice", False, "root")
    assert assign(site.federation, run, "alice", False, "root")["changed"] is False
    with pytest.raises(AssignRefused, match="belongs to alice") as owned:
        assign(site.federation, run, "bob", False, "root")
    assert owned.value.exit_code == ExitCode.FEDERATION_STATE
    answer = assign(site.federation, run, "bob", True, "root (sudo by carol)")
    assert (answer["previous_owner"], answer["changed"]) == ("alice", True)
    forced = [e for e in site.federation.audit.entries() if e.kind == "assign"][-1]
    assert forced.detail["forced"] is True and forced.detail["previous_owner"] == "alice"
    assert "taken from alice" in forced.what
    assert site.federation.state.identities.run_owner(run).owner.user == "bob"


@pytest.mark.parametrize("user, run, code", [
    ("no-such-user-x", "operator-run", ExitCode.USAGE),
    ("root", "operator-run", ExitCode.USAGE),            # a system account runs no jobs
    ("bob", "never-stored", ExitCode.OBJECT_MISSING),
    ("bob", "../etc", ExitCode.UNSAFE_NAME),
])
def test_a_bad_owner_or_run_is_one_line_and_changes_nothing(site, user, run, code):
    operator_run(site)
    before = site.federation.audit.entries()
    with pytest.raises(AssignRefused) as refused:
        assign(site.federation, run, user, False, "root")
    assert refused.value.exit_code == code and "\n" not in str(refused.value)
    assert site.federation.state.identities.run_owner(run.strip("./")) is None
    assert site.federation.audit.entries() == before


# --- the command ---------------------------------------------------------------------------

def test_the_admins_command_gives_run_r_and_says_so(monkeypatch, capsys, tmp_path_factory):
    """`slurm-geo federation runs assign` through the real entry point, on a SQLite state
    and file stores (tests.kit.cli's site: run r in pfs, no job names
    it): --json, a refusal without --force, an unknown user, a user who is no admin."""
    import json

    from tests.kit.cli import cli_site, run_cli

    site = cli_site(tmp_path_factory.mktemp("site"))
    code, out, err = run_cli(["federation", "runs", "assign", "r", "--owner", "bob",
                              "--json"], monkeypatch, capsys, site)
    assert code == 0, err
    assert json.loads(out) | {"assigned_by": "-"} == {
        "run": "r", "owner": "bob", "uid": 2002, "previous_owner": None,
        "assigned_by": "-", "changed": True}
    for argv, expected, says in [
        (["--owner", "alice"], ExitCode.FEDERATION_STATE, "belongs to bob"),
        (["--owner", "no-such-user-x"], ExitCode.USAGE, "no such user"),
    ]:
        code, out, err = run_cli(["federation", "runs", "assign", "r", *argv], monkeypatch,
                                 capsys, site)
        assert code == expected and out == "", err
        assert err.count("\n") == 1 and err.startswith("slurm-geo: error: ") and says in err
    code, out, _ = run_cli(["federation", "runs", "assign", "r", "--owner", "alice",
                            "--force"], monkeypatch, capsys, site)
    assert code == 0 and "now belongs to alice, taken from bob" in out
    # Whoever cannot read the master key is no admin: one line, exit 47, nothing changed.
    monkeypatch.setattr("slurm_geo.federation.operator.ownerclient.can_read_key",
                        lambda _key: False)
    code, out, err = run_cli(["federation", "runs", "assign", "r", "--owner", "bob",
                              "--force"], monkeypatch, capsys, site)
    assert code == ExitCode.NOT_OWNER and "admin's command" in err and err.count("\n") == 1


@pytest.mark.parametrize("uid, admin, jobs, assigned, goes", [
    (2001, False, [_job("onprem-1", JobStatus.COMPLETED, ALICE)], None, True),
    (2002, False, [_job("onprem-1", JobStatus.COMPLETED, ALICE)], None, False),
    (2002, False, [], RunOwner("r", BOB, "root", 1.0), True),          # given to bob
    # given to bob over alice's finished job: hers no more
    (2001, False, [_job("onprem-1", JobStatus.COMPLETED, ALICE)],
     RunOwner("r", BOB, "root", 1.0), False),
    (2001, False, [], None, False),
    (0, True, [], None, True),                                          # an admin
])
def test_who_gets_a_runs_key_from_a_login_shell(uid, admin, jobs, assigned, goes):
    from slurm_geo.federation.operator.ownerverbs import key_goes_to

    assert key_goes_to(uid, admin, jobs, assigned) is goes


def test_a_given_run_s_key_goes_to_its_new_owner_s_login_shell_only(site):
    """`slurm-geo ckpt ls/pull RUN` from a login shell: bob, once given the run, gets its
    key ring before any job of his names it; alice does not."""
    from slurm_geo.federation.operator.ownerverbs import answer
    from slurm_geo.lease.protocol import OWNER_PATH, OwnerRequest

    run = operator_run(site)

    def ask(user: str):
        request = OwnerRequest("run-key", run=run)
        return answer(site.federation, request, site.credentials(
            OWNER_PATH, request.to_json(), "onprem", 0, 0, as_user=user))
    assert ask("bob").status == 404  # no job names it, and nobody was given it
    assign(site.federation, run, "bob", False, "root")
    reply = ask("bob")
    assert reply.status == 200 and reply.body["data_keys"], reply.body
    refused = ask("alice")
    assert refused.status == 403 and refused.body["exit_code"] == ExitCode.NOT_OWNER


@pytest.mark.parametrize("body, error", [
    ({"verb": "approve", "job": "onprem-1", "cluster": "rented"}, None),
    ({"verb": "approve", "job": "onprem-1"}, "is not a cluster name"),
    ({"verb": "approve", "job": "onprem-1", "cluster": "../etc"}, "is not a cluster name"),
    ({"verb": "approve", "cluster": "rented"}, "approve names a job"),
    ({"verb": "status", "job": ""}, None),  # no cluster: as before
])
def test_an_owners_approval_names_a_job_and_a_cluster(body, error):
    from slurm_geo.lease.protocol import OwnerRequest, ProtocolError

    if error is None:
        request = OwnerRequest.from_json({"protocol": 2, **body})
        assert OwnerRequest.from_json(request.to_json()) == request
        return
    with pytest.raises(ProtocolError, match=error):
        OwnerRequest.from_json({"protocol": 2, **body})


def test_alice_approves_her_own_jobs_move_and_bob_is_refused(site):
    """`slurm-geo approve` from a login shell, by MUNGE to the daemon: her own job's
    move is planned; bob's approval of it is refused (NOT_OWNER), and so is any
    approval where the job's policy forbids (NOT_ACTIONABLE, one line)."""
    from slurm_geo.federation.operator.ownerverbs import answer
    from slurm_geo.lease.protocol import OWNER_PATH, OwnerRequest

    site.home_job_training()
    site.checkpoint("away", 40)
    logical = site.job().logical_job

    def ask(user: str, cluster: str):
        request = OwnerRequest("approve", logical, cluster=cluster)
        return answer(site.federation, request, site.credentials(
            OWNER_PATH, request.to_json(), "onprem", 0, 0, as_user=user))
    refused = ask("bob", "rented")
    assert refused.status == 403 and refused.body["exit_code"] == ExitCode.NOT_OWNER
    assert site.job().move_to is None
    unknown = ask("alice", "nowhere")
    assert unknown.status == 409 and "nowhere" in unknown.body["reason"]
    reply = ask("alice", "rented")
    assert reply.status == 200 and reply.body["approved_by"].startswith("alice"), reply.body
    assert site.job().move_to == "rented"
