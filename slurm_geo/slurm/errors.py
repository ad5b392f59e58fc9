"""Typed failures of the Slurm access layer; each names the cluster it concerns."""

from __future__ import annotations

from pathlib import Path

from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode


class SlurmError(SlurmGeoError):
    exit_code = ExitCode.SLURM


class ControllerUnreachable(SlurmError):
    """The cluster's controller (or its slurmrestd) did not answer within the timeout."""

    exit_code = ExitCode.SLURM_UNREACHABLE

    def __init__(self, cluster: str, detail: str, timeout_s: float):
        self.cluster = cluster
        self.timeout_s = timeout_s
        super().__init__(
            f"cluster '{cluster}': controller unreachable within {timeout_s:g} s ({detail}); "
            "check that slurmctld (and slurmrestd for REST clusters) is running"
        )


class SlurmdbdUnreachable(ControllerUnreachable):
    """The cluster's accounting (slurmdbd, or its database behind it) did not answer;
    slurmctld may be fine. An outage of accounting only: jobs still run."""

    def __init__(self, cluster: str, detail: str, timeout_s: float):
        self.cluster = cluster
        self.timeout_s = timeout_s
        SlurmError.__init__(
            self, f"cluster '{cluster}': accounting (slurmdbd) unreachable within "
                  f"{timeout_s:g} s ({detail}); check that slurmdbd and the database behind it "
                  "are running")


class JobNotFound(SlurmError):
    exit_code = ExitCode.JOB_NOT_FOUND

    def __init__(self, cluster: str, job_id: int):
        self.cluster = cluster
        self.job_id = job_id
        super().__init__(f"cluster '{cluster}': job {job_id} is not known to Slurm")


class SlurmRejected(SlurmError):
    """Slurm answered, and said no (invalid request, permission, job in the wrong state)."""

    exit_code = ExitCode.SLURM_REJECTED

    def __init__(self, cluster: str, action: str, detail: str):
        self.cluster = cluster
        self.action = action
        self.detail = detail
        super().__init__(f"cluster '{cluster}': {action} refused: {detail}")


class TokenRejected(SlurmRejected):
    """slurmrestd, or slurmctld behind it, refused the JWT (expired, revoked, another
    user's), or the token file cannot be used. The cluster answered: never an outage."""

    def __init__(self, cluster: str, action: str, user: str, token_file: Path, detail: str,
                 fix: str = ""):
        self.user = user
        self.token_file = token_file
        fix = fix or (f"it has expired or is not that user's: issue a new one with `scontrol "
                      f"token username={user}` on {cluster} and write it there (mode 0600)")
        super().__init__(cluster, action, f"token problem with {token_file} (user "
                         f"'{user}'): {detail}; {fix}")


class CertificateRejected(SlurmRejected):
    """slurm-geo refused slurmrestd's TLS certificate (signed by a CA it does not trust, or
    not for the host in rest_url), or the TLS handshake failed. Something answered at that
    address: a configuration to mend (ca_file, rest_url), never an outage; nothing is known
    of the cluster behind it until it is mended."""

    def __init__(self, cluster: str, url: str, detail: str, fix: str):
        self.url = url
        super().__init__(cluster, f"TLS with slurmrestd at {url}", f"{detail}; {fix}")


class SlurmCommandError(SlurmError):
    """A Slurm command could not be run, or printed what we cannot read."""

    exit_code = ExitCode.SLURM_COMMAND

    def __init__(self, command: str, detail: str):
        super().__init__(f"{command}: {detail}")
