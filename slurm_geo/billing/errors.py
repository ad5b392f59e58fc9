"""Billing's errors: each a one-line message with a stable exit code."""

from __future__ import annotations

from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode


class BillingError(SlurmGeoError):
    """Billing cannot do what was asked (bad period, no database, bad [billing] table)."""

    exit_code: int = ExitCode.BILLING


class BudgetExceeded(BillingError):
    """At least one cost center spent more than its budget in the period (for scripts)."""

    exit_code = ExitCode.BUDGET_EXCEEDED


class SourceUnreadable(BillingError):
    """A source billing reads could not be read completely: a cluster's accounting (token
    refused, controller or slurmdbd unreachable, an error in slurmrestd's answer), or more
    than one source at once. Its watermark stayed: the next run reads that window again.
    (A single unreadable database keeps its own code: 40, 42, 55.)"""

    exit_code: int = ExitCode.BILLING_SOURCE

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class BillingDiffers(BillingError):
    """`billing check`: the billing database and what the sources account for disagree."""

    exit_code = ExitCode.BILLING_DIFFERS


class BillingUncompared(BillingError):
    """`billing check --strict`: the sources agree as far as they were compared, but part of
    what was ingested lies where a source may still be recording (named, with when to ingest
    and check again)."""

    exit_code = ExitCode.BILLING_UNCOMPARED
