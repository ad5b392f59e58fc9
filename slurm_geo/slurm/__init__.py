"""The only code that talks to Slurm: one interface, a CLI and a slurmrestd backend."""

from slurm_geo.config.model import ClusterConfig
from slurm_geo.slurm.cli_backend import CliSlurmClient
from slurm_geo.slurm.client import SlurmClient
from slurm_geo.slurm.errors import (
    CertificateRejected,
    ControllerUnreachable,
    JobNotFound,
    SlurmCommandError,
    SlurmdbdUnreachable,
    SlurmError,
    SlurmRejected,
    TokenRejected,
)
from slurm_geo.slurm.models import (
    AccountingRecord,
    JobInfo,
    JobSpec,
    JobState,
    MalformedAccountingRow,
    NodeInfo,
    Owner,
)
from slurm_geo.slurm.rest_backend import RestLogin, RestSlurmClient


def connect(cluster: ClusterConfig) -> SlurmClient:
    """The client for `cluster`, by its configured access method."""
    if cluster.access == "rest":
        assert cluster.token_file is not None
        accounts = {user: RestLogin(remote.account, remote.token_file)
                    for user, remote in cluster.users.items()}
        return RestSlurmClient(cluster.name, cluster.rest_url, cluster.rest_user,
                               cluster.token_file, cluster.timeout_s, accounts,
                               ca_file=cluster.ca_file)
    assert cluster.slurm_conf is not None
    return CliSlurmClient(cluster.name, cluster.slurm_conf, cluster.timeout_s)


__all__ = [
    "AccountingRecord", "CertificateRejected", "CliSlurmClient", "ControllerUnreachable",
    "JobInfo", "JobNotFound", "JobSpec", "JobState", "MalformedAccountingRow", "NodeInfo",
    "Owner", "RestLogin", "RestSlurmClient", "SlurmClient", "SlurmCommandError", "SlurmError",
    "SlurmRejected", "SlurmdbdUnreachable", "TokenRejected", "connect",
]
