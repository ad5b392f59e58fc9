"""The `[billing]` table of the slurm-geo config, read once into a `BillingConfig`.

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
from typing import TYPE_CHECKING, Any

from slurm_geo.billing.periods import epoch, utc_time
from slurm_geo.errors import ConfigError

if TYPE_CHECKING:
    from slurm_geo.config.model import SiteConfig

DEFAULT_DATABASE = Path("/var/lib/slurm-geo/billing.db")
PRICE_FIELDS = ("gpu_hour", "cpu_hour", "egress_per_gb", "marketplace_fee_pct")


@dataclass(frozen=True)
class PriceEntry:
    """Prices in force from `effective_from` (Unix seconds) for a cluster or a provider."""

    effective_from: int
    gpu_hour: float
    cpu_hour: float
    egress_per_gb: float
    marketplace_fee_pct: float
    cluster: str = ""
    provider: str = ""
    source: str = ""


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
    registry: Path | None = None         # the controller's job registry: lineage
    budgets: Mapping[str, float] = field(default_factory=dict)
    job_budgets: Mapping[str, float] = field(default_factory=dict)  # [policy.budgets]
    warn_pct: float = 80.0
    webhook_url: str = ""
    first_ingest_days: int = 31
    prices: tuple[PriceEntry, ...] = ()
    clusters: Mapping[str, ClusterFacts] = field(default_factory=dict)


_KEYS = {"database", "webhook_url", "warn_pct", "first_ingest_days", "budgets", "prices"}


def billing_config(site: SiteConfig) -> BillingConfig:
    """The billing settings of a loaded site config (its raw `[billing]` table)."""
    where = f"{site.source} [billing]"
    table: Mapping[str, Any] = getattr(site, "billing", None) or {}
    unknown = sorted(set(table) - _KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: "
                          f"{', '.join(sorted(_KEYS))}")
    clusters = {name: ClusterFacts(name, c.region, c.provider or name)
                for name, c in site.clusters.items()}
    entries = tuple(_price_entry(raw, clusters, f"{where} prices[{i}]")
                    for i, raw in enumerate(_list(table.get("prices", []), f"{where}: prices")))
    defaults = tuple(
        _entry(0, {k: float(getattr(c.prices, k)) for k in PRICE_FIELDS}, cluster=name,
               source=f"[clusters.{name}.prices]")
        for name, c in site.clusters.items()
        if not any(e.cluster == name or e.provider == clusters[name].provider for e in entries))
    return BillingConfig(
        database=_path(table.get("database", str(DEFAULT_DATABASE)), f"{where}: database"),
        sync_state=site.sync.state if site.sync else None,
        federation_audit=site.federation.audit_path if site.federation else None,
        registry=site.registry_path,
        budgets=_amounts(table.get("budgets", {}), f"{where}.budgets"),
        job_budgets=dict(site.policy.budgets),
        warn_pct=_number(table.get("warn_pct", 80.0), f"{where}: warn_pct", 0, 100),
        webhook_url=_webhook(table.get("webhook_url", ""), f"{where}: webhook_url"),
        first_ingest_days=int(_number(table.get("first_ingest_days", 31),
                                      f"{where}: first_ingest_days", 1, 3660)),
        prices=entries + defaults,
        clusters=clusters,
    )


def _price_entry(raw: Any, clusters: Mapping[str, ClusterFacts], where: str) -> PriceEntry:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a table")
    allowed = {"cluster", "provider", "effective_from", *PRICE_FIELDS}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: "
                          f"{', '.join(sorted(allowed))}")
    cluster, provider = str(raw.get("cluster", "")), str(raw.get("provider", ""))
    if bool(cluster) == bool(provider):
        raise ConfigError(f"{where}: give exactly one of cluster = \"NAME\" or "
                          "provider = \"NAME\"")
    if cluster and cluster not in clusters:
        raise ConfigError(f"{where}: cluster '{cluster}' is not one of [clusters] (known: "
                          f"{', '.join(sorted(clusters)) or 'none'})")
    if provider and provider not in {c.provider for c in clusters.values()}:
        raise ConfigError(f"{where}: no cluster has provider '{provider}'")
    missing = [k for k in ("effective_from", *PRICE_FIELDS) if k not in raw]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}")
    effective = raw["effective_from"]
    try:
        moment = epoch(utc_time(effective if isinstance(effective, str) else
                                effective.isoformat()))
    except Exception:
        raise ConfigError(f"{where}: effective_from must be a date or time (UTC), got "
                          f"{effective!r}") from None
    prices = {k: _number(raw[k], f"{where}: {k}", 0, 1e9) for k in PRICE_FIELDS}
    return _entry(moment, prices, cluster=cluster, provider=provider,
                      source=f"[[billing.prices]] #{where.rsplit('[', 1)[-1].rstrip(']')}")


def _entry(moment: int, prices: Mapping[str, float], cluster: str = "", provider: str = "",
           source: str = "") -> PriceEntry:
    return PriceEntry(moment, gpu_hour=prices["gpu_hour"], cpu_hour=prices["cpu_hour"],
                      egress_per_gb=prices["egress_per_gb"],
                      marketplace_fee_pct=prices["marketplace_fee_pct"], cluster=cluster,
                      provider=provider, source=source)


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ConfigError(f"{where} must be a list of tables ([[billing.prices]])")
    return value


def _number(value: Any, where: str, low: float, high: float) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{where} must be a number from {low:g} to {high:g}, got {value!r}")
    return float(value)


def _amounts(table: Any, where: str) -> dict[str, float]:
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table of cost center = USD per month")
    return {str(name): _number(usd, f"{where}: {name}", 0.01, 1e12)
            for name, usd in table.items()}


def _path(value: Any, where: str) -> Path:
    if not isinstance(value, str) or not value.startswith("/"):
        raise ConfigError(f"{where} must be an absolute path, got {value!r}")
    return Path(value)


def _webhook(value: Any, where: str) -> str:
    if not isinstance(value, str) or (value and not value.startswith(("http://", "https://"))):
        raise ConfigError(f"{where} must be an http:// or https:// URL, got {value!r}")
    return value
