"""What billing needs of the slurm-geo config, gathered into a `BillingConfig`.

The `[billing]` table is declared and checked with the rest of the config
(slurm_geo.config.tables, BILLING_SETTINGS); a bad one stops `load_config` with one line.

    [billing]
    database = "/var/lib/slurm-geo/billing.db"
    webhook_url = "https://hooks.example.org/finance"   # optional: budget alerts go there
    warn_pct = 80                  # alert when a cost center has spent this share of budget
    first_ingest_days = 31         # how far back the first ingest of a cluster looks

    [billing.budgets]              # USD per calendar month (UTC) and cost center
    ml-research = 10000

    [[billing.prices]]             # effective-dated; for a cluster or for a provider
    cluster = "rented"             # or: provider = "sandbox-rental"
    effective_from = "2026-12-01"  # UTC
    gpu_hour = 2.10
    cpu_hour = 0.04
    egress_per_gb = 0.09
    marketplace_fee_pct = 5

A cluster without `[[billing.prices]]` entries of its own (by name or by provider) is priced
from its `[clusters.NAME.prices]` table, effective since the epoch. A cluster with entries
has no price before its earliest one: those hours are flagged, never priced at zero.
`[policy.budgets]` (USD per job) is checked as well: a job costing more is reported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from slurm_geo.config.daemons import FederationConfig
from slurm_geo.config.model import SiteConfig
from slurm_geo.config.tables import DEFAULT_BILLING_DATABASE as DEFAULT_DATABASE
from slurm_geo.config.tables import PriceEntry

__all__ = ["DEFAULT_DATABASE", "BillingConfig", "ClusterFacts", "PriceEntry", "billing_config"]


@dataclass(frozen=True)
class ClusterFacts:
    """What billing needs to know of a cluster: where it is and who rents it out."""

    name: str
    region: str
    provider: str


@dataclass(frozen=True)
class BillingConfig:
    database: Path = DEFAULT_DATABASE
    sync_state: Path | None = None       # checkpoint-sync's database: egress
    federation_audit: Path | None = None  # the federation daemon's audit log: its copies
    federation_state: Path | None = None  # its state: logical jobs, runs, incarnations
    # Replicas of the daemon: both are in etcd, as this [federation] table says.
    federation_etcd: FederationConfig | None = None
    registry: Path | None = None         # the controller's job registry: lineage
    budgets: Mapping[str, float] = field(default_factory=dict)
    job_budgets: Mapping[str, float] = field(default_factory=dict)  # [policy.budgets]
    warn_pct: float = 80.0
    webhook_url: str = ""
    first_ingest_days: int = 31
    prices: tuple[PriceEntry, ...] = ()
    clusters: Mapping[str, ClusterFacts] = field(default_factory=dict)


def billing_config(site: SiteConfig) -> BillingConfig:
    """The billing settings of a loaded site config: its [billing] table (read and checked
    by slurm_geo.config), with each cluster's own prices for clusters it gives none."""
    table = site.billing
    alone = site.federation if site.federation and not site.federation.replicated else None
    clusters = {name: ClusterFacts(name, c.region, c.provider or name)
                for name, c in site.clusters.items()}
    defaults = tuple(
        PriceEntry(0, c.prices.gpu_hour, c.prices.cpu_hour, c.prices.egress_per_gb,
                   c.prices.marketplace_fee_pct, cluster=name, source=f"[clusters.{name}.prices]")
        for name, c in site.clusters.items()
        if not any(e.cluster == name or e.provider == clusters[name].provider
                   for e in table.prices))
    return BillingConfig(
        database=table.database,
        sync_state=site.sync.state if site.sync else None,
        federation_audit=alone.audit_path if alone else None,
        federation_state=alone.state if alone else None,
        federation_etcd=site.federation if site.federation and site.federation.replicated
        else None,
        registry=site.registry_path,
        budgets=dict(table.budgets),
        job_budgets=dict(site.policy.budgets),
        warn_pct=table.warn_pct,
        webhook_url=table.webhook_url,
        first_ingest_days=table.first_ingest_days,
        prices=table.prices + defaults,
        clusters=clusters,
    )
