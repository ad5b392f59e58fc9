"""Billing's errors: each a one-line message with a stable exit code."""

from __future__ import annotations

from slurm_geo.errors import SlurmGeoError


class BillingError(SlurmGeoError):
    """Billing cannot do what was asked (bad period, no database, bad [billing] table)."""

    exit_code = 50


class BudgetExceeded(BillingError):
    """At least one cost center spent more than its budget in the period (for scripts)."""

    exit_code = 51
