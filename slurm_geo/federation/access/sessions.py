"""An incarnation's lease secret is a one-time bootstrap.

The secret the daemon mints for an incarnation travels in the job's environment, so
slurmdbd's records of the job and the process's /proc/PID/environ keep it for as long as
they live. At the incarnation's first lease the daemon hands it a fresh session secret in
the reply (over TLS); once a request was signed with that one, the bootstrap secret no
longer speaks for that Slurm restart of the job: what slurmdbd keeps is worthless after
the job started. A Slurm requeue starts the job again with the environment it was
submitted with, so the bootstrap secret speaks for a later restart, once Slurm's own
record of the job says it was restarted that far, and gets that restart a session of its
own. `decide` is the rule (pure); `Sessions` gathers, asks Slurm and writes.

    bootstrap-signed, restart R:
      no session yet                       -> issue one for R
      session for R, not used yet          -> hand out the same one again (a lost reply)
      session for R, used; or R older      -> 401
      R newer than the session's           -> ask Slurm: restarted to R? issue for R : 401
    session-signed, not used yet           -> mark it used (the bootstrap is spent)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from slurm_geo.federation.access.authn import Caller
from slurm_geo.federation.access.lookups import SlurmLookups
from slurm_geo.federation.state.identities import IncarnationSecrets
from slurm_geo.federation.wiring import Wiring
from slurm_geo.lease.signing import CannotCheck, NotAuthenticated, new_secret
from slurm_geo.slurm import SlurmError
from slurm_geo.slurm.errors import JobNotFound


class Step(Enum):
    NOTHING = "nothing"        # the request goes on; nothing to write or hand out
    ISSUE = "issue"            # write `secrets` and hand out its session secret
    HAND_OUT = "hand out"      # hand out the session secret already written
    CONFIRM = "confirm"        # write `secrets`: the session secret was used
    ASK_SLURM = "ask slurm"    # whether the job was restarted to the request's restart
    REFUSE = "refuse"          # 401 with `reason`


@dataclass(frozen=True)
class Decision:
    step: Step
    secrets: IncarnationSecrets | None = None
    reason: str = ""


def decide(secrets: IncarnationSecrets, bootstrap: bool, restart: int, issue: bool,
           slurm_restart: int | None, fresh: str) -> Decision:
    """What a request of the incarnation (signed with its `bootstrap` secret or its
    session one, for Slurm restart `restart`) does to its secrets. `issue`: a lease
    request (a session is handed out in its reply); `slurm_restart`: the restart Slurm's
    record shows, None when not asked yet; `fresh`: the secret a new session would get.
    Pure."""
    if not bootstrap:
        if secrets.confirmed:
            return Decision(Step.NOTHING)
        return Decision(Step.CONFIRM, replace(secrets, confirmed=True))
    if secrets.session and restart < secrets.restart or (
            secrets.session and restart == secrets.restart and secrets.confirmed):
        return Decision(Step.REFUSE, reason=(
            "the bootstrap secret of this incarnation was exchanged for a session secret at "
            f"its first lease (Slurm restart {secrets.restart}); sign with that one"))
    if secrets.session and restart > secrets.restart:
        if slurm_restart is None:
            return Decision(Step.ASK_SLURM)
        if slurm_restart < restart:
            return Decision(Step.REFUSE, reason=(
                f"Slurm's record of the job shows restart {slurm_restart}, not {restart}: "
                "the bootstrap secret speaks only for a restart Slurm made"))
    elif secrets.session and issue:  # same restart, not used yet: the reply was lost
        return Decision(Step.HAND_OUT, secrets)
    if not issue:
        return Decision(Step.NOTHING)
    return Decision(Step.ISSUE, IncarnationSecrets(secrets.bootstrap, fresh, restart))


class Sessions:
    """`lookups`: the budget a Slurm question is spent from (federation.lookups)."""

    def __init__(self, wiring: Wiring, lookups: SlurmLookups):
        self.wiring, self.lookups = wiring, lookups

    def admit(self, caller: Caller, cluster: str, job_id: int, restart: int,
              issue: bool) -> str:
        """Apply `decide` to a request of incarnation `caller` (already known to be Slurm
        job `cluster:job_id`): the session secret to hand out in the reply ("" none), or
        NotAuthenticated. Slurm is asked only for a restart later than the session's."""
        if caller.at_home:
            return ""
        assert caller.logical_job is not None and caller.generation is not None
        identities = self.wiring.state.identities
        secrets = caller.secrets
        if secrets is None:       # a caller authentication did not read (tests, callers)
            stored = identities.secret(caller.logical_job, caller.generation)
            if stored is None:
                raise NotAuthenticated(f"{caller} holds no secret of this daemon")
            secrets = IncarnationSecrets.parse(stored)
        fresh = new_secret()
        decision = decide(secrets, caller.bootstrap, restart, issue, None, fresh)
        if decision.step is Step.ASK_SLURM:
            decision = decide(secrets, caller.bootstrap, restart, issue,
                              self._slurm_restart(str(caller), cluster, job_id), fresh)
        if decision.step is Step.REFUSE:
            raise NotAuthenticated(decision.reason)
        if decision.step in (Step.ISSUE, Step.CONFIRM):
            assert decision.secrets is not None
            identities.put_secret(caller.logical_job, caller.generation,
                                  decision.secrets.to_text())
        if decision.step in (Step.ISSUE, Step.HAND_OUT):
            assert decision.secrets is not None
            return decision.secrets.session
        return ""

    def _slurm_restart(self, caller: str, cluster: str, job_id: int) -> int:
        client = self.wiring.clients.get(cluster)
        if client is None:
            raise CannotCheck(f"cannot ask {cluster} whether job {job_id} was requeued: no "
                              "client of that cluster here")
        self.lookups.may_ask(caller, cluster, job_id)
        try:
            return client.job(job_id).restart_count
        except JobNotFound:
            raise self.lookups.not_found(cluster, job_id) from None
        except SlurmError as exc:
            raise CannotCheck(f"cannot ask {cluster} whether job {job_id} was requeued: "
                              f"{exc}") from None
