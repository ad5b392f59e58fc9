"""What a user at home may ask the daemon about her own jobs and runs (POST /v1/owner,
slurm_geo.lease.protocol.OwnerRequest): `status`, `logs`, `cancel`, `resubmit`, and her
run's data key for `ckpt ls/verify/pull` (`run-key`).

She proves who she is with a MUNGE credential, as her home jobs do (federation.authn);
the daemon's files and keys stay its own: she never reads `federation.db`, the audit log
or the master key. What she may ask for is decided from the job's recorded owner (the uid
Slurm's record named at registration), never from the request: another user's job or run
is refused (403, one line, `NOT_OWNER`). Admins, root and the daemon's own account, are
answered for every job; a run's data key still goes only to a run's owner or an admin,
never the master key to anyone. An incarnation's signature (away from home) is refused:
these are a person's verbs.
"""

from __future__ import annotations

import os
import pwd
from typing import TYPE_CHECKING, Any

from slurm_geo.ckpt.errors import CkptError
from slurm_geo.ckpt.repo.runkey import unwrap_run_keys
from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode
from slurm_geo.federation.access.authn import Caller
from slurm_geo.federation.access.refusals import REFUSED, Refusal, clip
from slurm_geo.federation.engine.leaseservice import Reply
from slurm_geo.federation.model import LogicalJob, RunOwner
from slurm_geo.federation.state.etcd.records import incarnation_record, job_record
from slurm_geo.lease.protocol import KeyReply, OwnerRequest
from slurm_geo.lease.signing import Credentials, Forbidden, Refused

if TYPE_CHECKING:
    from slurm_geo.federation.engine.core import Federation


class NotOwner(Forbidden):
    """Another user's job or run."""


def is_admin(uid: int, daemon_uid: int | None = None) -> bool:
    """Root and the account the daemon runs as (the service account) are admins."""
    return uid == 0 or uid == (os.getuid() if daemon_uid is None else daemon_uid)


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


NOT_FOUND = (ExitCode.JOB_NOT_FOUND, ExitCode.OBJECT_MISSING)  # 404, with its exit code


def answer(federation: Federation, request: OwnerRequest, credentials: Credentials) -> Reply:
    """The reply to an authenticated owner's request; 401/403 with one line otherwise."""
    try:
        caller = federation.authenticator.authenticate(credentials)
        if not caller.at_home or caller.uid is None:
            raise Forbidden("a job's signature does not speak for a person: ask from a login "
                            "shell at home (MUNGE)")
        return _VERBS[request.verb](federation, request, caller)
    except Refused as exc:
        return _refusal(exc, request)
    except SlurmGeoError as exc:
        if exc.exit_code >= ExitCode.SLURM and exc.exit_code not in (
                *NOT_FOUND, ExitCode.NOT_ACTIONABLE, ExitCode.RESUBMIT_FAILED):
            raise  # the daemon cannot answer now: 503, as for a lease (federation.service)
        status = 404 if exc.exit_code in NOT_FOUND else 409
        return Reply(status, {"reason": str(exc), "exit_code": int(exc.exit_code)})


def _refusal(exc: Refused, request: OwnerRequest) -> Reply:
    code = ExitCode.LEASE_UNREACHABLE if exc.status >= 500 else ExitCode.NOT_OWNER
    what = f"refused {request.verb} {clip(request.job or request.run, 64)}".rstrip()
    return Reply(exc.status, {"reason": str(exc), "exit_code": int(code)},
                 Refusal(REFUSED, None, f"{what} ({exc.status})", str(exc)))


def _owned(federation: Federation, ref: str, caller: Caller, verb: str) -> LogicalJob:
    from slurm_geo.federation.operator.operations import resolve

    job = resolve(federation.state, ref)
    assert caller.uid is not None
    if not is_admin(caller.uid) and (job.owner is None or job.owner.uid != caller.uid):
        raise NotOwner(f"{job.logical_job} is another user's job: only its owner or an admin "
                       f"may {verb} it")
    return job


def _status(federation: Federation, request: OwnerRequest, caller: Caller) -> Reply:
    from slurm_geo.federation.operator.operations import current_in_slurm, display_state
    from slurm_geo.federation.operator.views import job_view

    assert caller.uid is not None
    state = federation.state
    if request.job:
        jobs = [_owned(federation, request.job, caller, "see")]
    else:
        jobs = [j for j in state.jobs() if is_admin(caller.uid)
                or (j.owner is not None and j.owner.uid == caller.uid)]
    health = state.health()
    slurm = current_in_slurm(federation.wiring.clients, jobs, health)
    return Reply(200, {"views": [
        job_view(state, j, display_state(j, health, slurm.get(j.logical_job)),
                 slurm.get(j.logical_job), _world_staging(federation, j) if request.job
                 else None) for j in jobs]})


def _world_staging(federation: Federation, job: LogicalJob) -> dict[str, Any] | None:
    """Where the job's world is staged, read from the stores (one job asked by name)."""
    from slurm_geo.federation.operator.worldstatus import job_world_status

    w = federation.wiring
    try:
        return job_world_status(w.stores, w.master_keys, w.site, job, w.clock())
    except (CkptError, OSError) as exc:
        return {"error": str(exc)}


def _logs(federation: Federation, request: OwnerRequest, caller: Caller) -> Reply:
    """Where each incarnation wrote its output: the job and its incarnations, which the
    CLI reads the files of as the user (federation.output)."""
    job = _owned(federation, request.job, caller, "read the output of")
    return Reply(200, {"job": job_record(job), "incarnations": [
        incarnation_record(i) for i in federation.state.incarnations(job.logical_job)]})


def _cancel(federation: Federation, request: OwnerRequest, caller: Caller) -> Reply:
    from slurm_geo.federation.operator import operations

    assert caller.uid is not None
    job = _owned(federation, request.job, caller, "cancel")
    report = operations.cancel(federation, job, _who(caller.uid))
    return Reply(200, report.to_json())


def _resubmit(federation: Federation, request: OwnerRequest, caller: Caller) -> Reply:
    from slurm_geo.federation.operator import operations

    assert caller.uid is not None
    job = _owned(federation, request.job, caller, "resubmit")
    from slurm_geo.federation.operator.views import resubmitted_view

    return Reply(200, resubmitted_view(operations.resubmit(federation, job,
                                                           _who(caller.uid))))


def _approve(federation: Federation, request: OwnerRequest, caller: Caller) -> Reply:
    """Her consent to her job's move (Federation.approve: never where its policy forbids)."""
    assert caller.uid is not None
    job = _owned(federation, request.job, caller, "approve a move of")
    moved = federation.approve(job.logical_job, request.cluster, _who(caller.uid))
    return Reply(200, {"logical_job": moved.logical_job, "cluster": request.cluster,
                       "approved_by": _who(caller.uid)})


def _run_key(federation: Federation, request: OwnerRequest, caller: Caller) -> Reply:
    """The run's key ring, to its owner (or an admin): the owner an admin gave the run to,
    else the owner of a job that names it. Read from the first store of the federation
    that holds it, never created."""
    assert caller.uid is not None
    w = federation.wiring
    jobs = w.state.find_by_run(request.run)
    assigned = w.state.identities.run_owner(request.run)
    if not jobs and assigned is None:
        return Reply(404, {"reason": f"no job of the federation names run {request.run}; a "
                           "run's key goes only to the owner of a job that names it",
                           "exit_code": int(ExitCode.OBJECT_MISSING)})
    if not key_goes_to(caller.uid, is_admin(caller.uid), jobs, assigned):
        raise NotOwner(f"run {request.run} is another user's: only its owner or an admin may "
                       "have its key")
    first = ([w.store_of(jobs[0].home), w.store_of(jobs[0].cluster)] if jobs
             else [w.store_of(w.home)])
    logical_job = jobs[0].logical_job if jobs else None
    failures: list[str] = []
    for name in dict.fromkeys([*first, *w.stores]):
        try:
            data_keys = unwrap_run_keys(w.stores[name], w.master_keys, request.run)
        except CkptError as exc:
            failures.append(f"{name}: {exc}")
            continue
        w.audit.append("key", logical_job, f"released run {request.run}'s data key "
                       f"to its owner {_who(caller.uid)}", "asked by MUNGE from a login "
                       "shell (ckpt ls/verify/pull)", uid=caller.uid, store=name)
        return Reply(200, KeyReply(request.run, data_keys).to_json())
    return Reply(404, {"reason": f"no store holds run {request.run}'s key: "
                       + "; ".join(failures), "exit_code": int(ExitCode.OBJECT_MISSING)})


def key_goes_to(uid: int, admin: bool, jobs: list[LogicalJob],
                assigned: RunOwner | None) -> bool:
    """Whether `uid` may have a run's key from a login shell: an admin; the owner an admin
    gave the run to (an assignment replaces whoever owned the jobs that named it before);
    else the owner of a job that names it. Pure."""
    if admin:
        return True
    if assigned is not None:
        return assigned.owner.uid == uid
    return any(j.owner is not None and j.owner.uid == uid for j in jobs)


def _who(uid: int) -> str:
    return f"{user_name(uid)} (uid {uid}, MUNGE)"


_VERBS: dict[str, Any] = {"status": _status, "logs": _logs, "cancel": _cancel,
                          "resubmit": _resubmit, "run-key": _run_key, "approve": _approve}
