"""A run an admin gives to an owner: `slurm-geo federation runs assign RUN --owner USER`.

A run's owner is the owner of the jobs of the federation that name it
(federation.registration, `run_taken_by`). A run already in a store that no job names
has none (an operator wrote it, an older slurm-geo, a job that never leased), and nobody
may take it over, its key included. An admin, root or the daemons' service account, who
reads the federation state and the master key, gives it one: the assignment is a record
of the state (`run_owners` in SQLite, `<prefix>/run-owners/<run>` in etcd), audited;
from then on that owner's jobs, and no one else's, may name the run and get its key.

An assignment is refused while a job that names the run is active (it holds the run's
lease and key), for a run already owned (by an assignment or a job's owner) unless
`--force`, for a run nothing holds (a new run is its first job's), and for a name that is
no user who runs jobs. `assign_refusal` decides, pure; `assign` is the command's act.
"""

from __future__ import annotations

import pwd
from typing import TYPE_CHECKING, Any

from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode
from slurm_geo.federation.model import LogicalJob, RunOwner
from slurm_geo.slurm.models import Owner

if TYPE_CHECKING:
    from slurm_geo.federation.engine.core import Federation

# The lowest uid of a person: slurm-geo-submit-as starts jobs for no one below it.
FIRST_USER_UID = 1000


class AssignRefused(SlurmGeoError):
    """An assignment the state's present contents do not allow: nothing was written."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def current_owner(jobs: list[LogicalJob], assigned: RunOwner | None) -> Owner | None:
    """Whom the run belongs to now: its assignment, else the owner of the newest job that
    names it (None: nobody's). Pure."""
    if assigned is not None:
        return assigned.owner
    owned = [j for j in jobs if j.owner is not None]
    return max(owned, key=lambda j: j.created_at).owner if owned else None


def assign_refusal(run: str, jobs: list[LogicalJob], assigned: RunOwner | None,
                   stored_in: str | None, to: Owner, force: bool) -> AssignRefused | None:
    """Why `run` may not be given to `to` now (`jobs`: every job naming it; `assigned`:
    its assignment; `stored_in`: a store holding something of it); None when it may.
    Pure."""
    active = [j for j in jobs if not j.status.is_final()]
    if active:
        return AssignRefused(
            f"run {run} is in use by logical job {active[0].logical_job} "
            f"({active[0].status.value}), which holds its lease and key: cancel it or let it "
            "end first", ExitCode.NOT_ACTIONABLE)
    if not jobs and assigned is None and stored_in is None:
        return AssignRefused(f"no store holds run {run} and no job names it: there is nothing "
                             "to assign (a new run belongs to the first job that names it)",
                             ExitCode.OBJECT_MISSING)
    owner = current_owner(jobs, assigned)
    if owner is not None and owner.uid != to.uid and not force:
        how = "given by an admin" if assigned is not None else "the owner of its jobs"
        return AssignRefused(f"run {run} belongs to {owner.user} ({how}); add --force to give "
                             f"it to {to.user} instead (audited)", ExitCode.FEDERATION_STATE)
    return None


def user_owner(user: str) -> Owner:
    """The account named `user` as an owner; AssignRefused (usage) when there is none, or
    it is no person who runs jobs (root, a system account)."""
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise AssignRefused(f"--owner {user}: no such user on this host (getent passwd "
                            f"{user} finds none)", ExitCode.USAGE) from None
    if entry.pw_uid < FIRST_USER_UID:
        raise AssignRefused(f"--owner {user}: uid {entry.pw_uid} is a system account, not a "
                            f"person whose jobs run (uid {FIRST_USER_UID} or more)",
                            ExitCode.USAGE)
    return Owner(entry.pw_name, entry.pw_uid, entry.pw_gid)


def assign(federation: Federation, run: str, user: str, force: bool, who: str
           ) -> dict[str, Any]:
    """Give `run` to `user` as admin `who`; what the command prints. Audited when it
    changes anything (a forced change with the owner it replaced)."""
    from slurm_geo.federation.act.registration import store_holding
    from slurm_geo.lease.protocol import ProtocolError, check_run
    from slurm_geo.lease.signing import CannotCheck

    try:
        check_run(run)
    except ProtocolError as exc:
        raise AssignRefused(str(exc), ExitCode.UNSAFE_NAME) from None
    to = user_owner(user)
    w = federation.wiring
    jobs = w.state.find_by_run(run)
    assigned = w.state.identities.run_owner(run)
    try:
        stored_in = store_holding(w, run)
    except CannotCheck as exc:
        raise AssignRefused(str(exc), ExitCode.STORE_UNAVAILABLE) from None
    refused = assign_refusal(run, jobs, assigned, stored_in, to, force)
    if refused is not None:
        raise refused
    before = current_owner(jobs, assigned)
    answer = {"run": run, "owner": to.user, "uid": to.uid, "previous_owner":
              None if before is None else before.user, "assigned_by": who, "changed": False}
    if assigned is not None and assigned.owner == to:
        return answer
    record = RunOwner(run, to, who, w.clock())
    w.state.identities.assign_run(record)
    forced = before is not None and before.uid != to.uid
    w.audit.append("assign", None, f"run {run} given to {to.user}"
                   + (f", taken from {before.user}" if forced and before else ""),
                   f"assigned by {who}" + (" with --force" if forced else ""),
                   run=run, owner=to.user, uid=to.uid, gid=to.gid,
                   previous_owner=None if before is None else before.user,
                   forced=forced, store=stored_in)
    return {**answer, "changed": True}
