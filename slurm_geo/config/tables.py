"""The tables of the config file, each declared once: its dataclass, Settings and reader.

A table's Settings say every key's type, default and help (`slurm_geo.config.settings`);
its reader adds only what crosses keys or tables (access 'cli' needs slurm_conf, a
[[billing.prices]] entry names a known cluster). The daemons' tables are in daemons.py;
`parse_config` (model.py) calls the readers in order.

The [policy] and [retention] tables read into the policy package's own dataclasses:
config knows policy, policy never knows config.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from slurm_geo.config.paths import DEFAULT_KEY_FILE, KEY_FILE_ENV
from slurm_geo.config.settings import (
    Parse,
    Setting,
    choice,
    flag,
    moment,
    names,
    number,
    path,
    read_settings,
    seconds,
    secure_url,
    shown,
    site_name,
    table_of,
    tables,
    text,
    url,
    whole,
)
from slurm_geo.errors import ConfigError
from slurm_geo.policy.directives import DATA_CLASSES
from slurm_geo.policy.geo import DEFAULT_MAX_RESTARTS, DEFAULT_SIGNAL_LEAD_S, GeoPolicy
from slurm_geo.policy.retention import RetentionPolicy

ACCESS_METHODS = ("cli", "rest")
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_REGISTRY_PATH = Path("/var/lib/slurm-geo/registry.db")
DEFAULT_BILLING_DATABASE = Path("/var/lib/slurm-geo/billing.db")
KEY_FILE_HELP = (f"The site master key (0600). Default: ${KEY_FILE_ENV}, else "
                 f"{DEFAULT_KEY_FILE}.")


def mapping_of(parse: Parse, what: str, key: Parse | None = None) -> Parse:
    """A table of NAME = value, each value read by `parse` (and each name by `key`)."""
    def read(value: Any, where: str) -> dict[str, Any]:
        table = table_of(value, where, what)
        for name in table:
            if key is not None:
                key(name, f"{where}: key")
        return {str(name): parse(item, f"{where}: {name}") for name, item in table.items()}
    return read


# --- [site] and [registry] ----------------------------------------------------------------

SITE_SETTINGS = (
    Setting("home_cluster", site_name, "", "The [clusters] name of the site's own cluster: jobs "
            "fail over from it and back."),
)
REGISTRY_SETTINGS = (
    Setting("path", path, DEFAULT_REGISTRY_PATH, "The controller's registry of geo jobs "
            "(SQLite)."),
)


# --- [clusters.NAME] ----------------------------------------------------------------------

@dataclass(frozen=True)
class Prices:
    """What a cluster charges; all in USD."""

    gpu_hour: float = 0.0
    cpu_hour: float = 0.0
    egress_per_gb: float = 0.0
    marketplace_fee_pct: float = 0.0


PRICE_SETTINGS = (
    Setting("gpu_hour", number(0), Prices.gpu_hour, "USD per GPU-hour."),
    Setting("cpu_hour", number(0), Prices.cpu_hour, "USD per CPU-hour."),
    Setting("egress_per_gb", number(0), Prices.egress_per_gb,
            "USD per GB (10^9 bytes) of checkpoints sent out of the cluster's region."),
    Setting("marketplace_fee_pct", number(0, 100), Prices.marketplace_fee_pct,
            "A marketplace's fee, in percent of the compute price."),
)


def _prices(value: Any, where: str) -> Prices:
    return Prices(**read_settings(value, PRICE_SETTINGS, where))


@dataclass(frozen=True)
class RemoteAccount:
    """The account a home user's jobs run as on a REST cluster, and that account's JWT."""

    account: str
    token_file: Path
    work_dir: Path | None = None  # on a cluster that has none of home's files


REMOTE_ACCOUNT_SETTINGS = (
    Setting("account", text, None, "The cluster's account the home user's jobs run as "
            "there.", required=True),
    Setting("token_file", path, None, "That account's slurmrestd JWT; refused at every use "
            "if the file has any group or other permission bit (chmod 600).", required=True),
    Setting("work_dir", path, None, "Where that account's jobs run there, on the cluster's "
            "own filesystem (its home or scratch), when the cluster has none of home's "
            "files: a moved job runs in it, its --output by file name only; unset, it "
            "runs in /tmp with the paths it was submitted with."),
)
_USER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,31}")


def _remote_account(value: Any, where: str) -> RemoteAccount:
    return RemoteAccount(**read_settings(value, REMOTE_ACCOUNT_SETTINGS, where))


def _user_name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _USER_NAME.fullmatch(value):
        raise ConfigError(f"{where} must be a user name (1-32 letters, digits, '.', '_' or "
                          f"'-'), got {value!r}")
    return value


@dataclass(frozen=True)
class ClusterConfig:
    """One Slurm cluster and how slurm-geo reaches it.

    `access = "cli"` runs Slurm's commands with `slurm_conf`; `access = "rest"` talks to
    slurmrestd at `rest_url` with the JWT in `token_file`, as across the internet (over TLS
    verified against `ca_file` or the system's CAs), and
    submits each home user's jobs as the account `users` maps them to (a user it maps to
    none cannot run there).
    """

    name: str
    region: str
    access: str
    provider: str = ""
    slurm_conf: Path | None = None
    rest_url: str = ""
    rest_user: str = ""
    token_file: Path | None = None
    ca_file: Path | None = None  # None: the system's CAs
    timeout_s: float = DEFAULT_TIMEOUT_S
    prices: Prices = field(default_factory=Prices)
    store: str = ""  # the [stores] name jobs on this cluster write checkpoints to
    partitions: tuple[str, ...] = ()  # empty: any
    gpu_types: tuple[str, ...] = ()
    compliance: str = ""  # compliance domain, e.g. "eu-gdpr"; informational
    slurm_federation: str = ""  # native Slurm federation it belongs to: Slurm moves jobs
    users: Mapping[str, RemoteAccount] = field(default_factory=dict)  # home user -> account
    # How fast a moved job's preamble fetches its world from the cluster's store and
    # materialises it, where the cluster has none of home's files (MB/s). 100: on the
    # sandbox's provider a 1 GB world took 7 s on the idle VM (146 MB/s) and 18-20 s at
    # load 4-6 (50 MB/s) (docs/benchmarks.md, "Resuming a job whose world is not staged at
    # its target"); a site sets its own cluster's measured figure.
    world_fetch_mb_s: float = 100.0
    # The Python with slurm-geo that a moved job's preamble runs there (a path on the
    # cluster's nodes), where the cluster has none of home's files; None: python3 on the
    # job's PATH.
    python: Path | None = None


CLUSTER_SETTINGS = (
    Setting("region", site_name, None, "The region the cluster is in (residency rules name "
            "it).", required=True),
    Setting("access", choice(*ACCESS_METHODS), None, "How slurm-geo reaches the cluster: "
            "cli (Slurm's commands, with slurm_conf) or rest (slurmrestd).", required=True),
    Setting("provider", text, ClusterConfig.provider, "Who rents the cluster out (billing "
            "prices a provider's clusters alike); default: the cluster's name."),
    Setting("slurm_conf", path, None, "The cluster's slurm.conf (access cli)."),
    Setting("rest_url", secure_url("write https://, with slurmrestd behind TLS"),
            ClusterConfig.rest_url, "slurmrestd's URL (access rest); https unless the host is "
            "loopback."),
    Setting("rest_user", text, ClusterConfig.rest_user, "The daemon's own account on the "
            "cluster, for everything but submissions (access rest)."),
    Setting("token_file", path, None, "The file holding rest_user's JWT, mode 0600 (access "
            "rest)."),
    Setting("ca_file", path, None, "The CA bundle (PEM) that signs slurmrestd's TLS "
            "certificate, when it is not in the system store (access rest, https rest_url); "
            "checked when slurm-geo connects."),
    Setting("timeout_s", seconds, ClusterConfig.timeout_s,
            "A Slurm command or REST call still unanswered after this long fails."),
    Setting("prices", _prices, Prices(), "[clusters.NAME.prices]: what the cluster charges.",
            subtable=True),
    Setting("store", site_name, ClusterConfig.store, "The [stores] name jobs on this cluster "
            "write checkpoints to."),
    Setting("partitions", names(each="a partition"), ClusterConfig.partitions,
            "Partitions geo jobs may use; none: any."),
    Setting("gpu_types", names(each="a GPU type"), ClusterConfig.gpu_types,
            "GPU types the cluster has (gres names)."),
    Setting("compliance", text, ClusterConfig.compliance, "Compliance domain, e.g. "
            "\"eu-gdpr\"; informational."),
    Setting("slurm_federation", text, ClusterConfig.slurm_federation,
            "The native Slurm federation the cluster belongs to: Slurm moves its jobs."),
    Setting("users", mapping_of(_remote_account, "home user = {account, token_file}",
                                key=_user_name), None,
            "[clusters.NAME.users.USER]: the account and token each home user's jobs run "
            "with (access rest); a user without one cannot run there.", subtable=True),
    Setting("world_fetch_mb_s", number(0, above=True, unit="MB/s"), ClusterConfig.world_fetch_mb_s,
            "How fast a moved job's preamble fetches its world (--geo-inputs, --geo-env) from "
            "the cluster's store and materialises it, where the cluster has none of home's "
            "files (users with a work_dir): the planner counts it in the time to resume."),
    Setting("python", path, None, "The Python interpreter, on the cluster's nodes, with "
            "slurm-geo installed, that a moved job's preamble runs (a job with --geo-inputs, "
            "--geo-env or --geo-outputs, where the cluster has none of home's files); "
            "default: python3 on the job's PATH there."),
)


def parse_cluster(name: str, table: Any, where: str) -> ClusterConfig:
    values = read_settings(table, CLUSTER_SETTINGS, where)
    if values["access"] == "cli" and "slurm_conf" not in values:
        raise ConfigError(
            f"{where}: access 'cli' needs slurm_conf = PATH to the cluster's slurm.conf")
    if values["access"] == "cli" and values.get("users"):
        raise ConfigError(f"{where}: users is for access 'rest'; on a CLI cluster jobs run "
                          "as their owner's own uid and gid (slurm-geo-submit-as)")
    if values["access"] == "rest":
        for key in ("rest_url", "rest_user", "token_file"):
            if key not in values:
                raise ConfigError(f"{where}: missing {key} (access 'rest' needs rest_url, "
                                  "rest_user and token_file)")
        values["rest_url"] = values["rest_url"].rstrip("/")
    if "ca_file" in values and not values.get("rest_url", "").startswith("https://"):
        raise ConfigError(f"{where}: ca_file is for slurmrestd behind TLS (access 'rest' with "
                          "an https:// rest_url); remove it or write https://")
    return ClusterConfig(name=name, **values)


# --- [stores.NAME] ------------------------------------------------------------------------

@dataclass(frozen=True)
class StoreConfig:
    """An object store or directory checkpoints are written to."""

    name: str
    url: str
    region: str
    endpoint_url: str = ""
    ca_file: Path | None = None  # None: the system's CAs (certifi's, for boto3)
    # S3 credentials (an env file) the federation daemon gives jobs it submits that write
    # here, in place of its own: scope them to this store's bucket.
    job_credentials: Path | None = None
    job_keys: str = ""  # "per-run": the daemon mints each run a key of its own


_S3_ENDPOINT = secure_url("write https://, with the S3 service behind TLS (ca_file names "
                          "its CA unless the system's CAs sign it)")


def _endpoint_url(value: Any, where: str) -> str:
    return "" if value == "" else _S3_ENDPOINT(value, where)


STORE_SETTINGS = (
    Setting("url", url("file://", "s3://"), None, "file:///PATH or s3://BUCKET/PREFIX.",
            required=True),
    Setting("region", site_name, None, "The region the store is in.", required=True),
    Setting("endpoint_url", _endpoint_url, StoreConfig.endpoint_url,
            "The S3 endpoint (default: AWS); https unless the host is loopback."),
    Setting("ca_file", path, None, "The CA bundle (PEM) that signs the S3 endpoint's TLS "
            "certificate, when it is not in the system store (https endpoint_url); jobs get "
            "its path in AWS_CA_BUNDLE, so it must be readable where they run."),
    Setting("job_credentials", path, None, "An env file (0600) of S3 credentials scoped to "
            "this store's bucket, given to jobs the federation daemon moves here in place of "
            "its own."),
    Setting("job_keys", choice("per-run"), StoreConfig.job_keys, "\"per-run\": the "
            "federation daemon mints each run's jobs a key that writes that run's objects "
            "only, through the store's IAM API with its own key (docs/stores.md)."),
)


def parse_store(name: str, table: Any, where: str) -> StoreConfig:
    store = StoreConfig(name=name, **read_settings(table, STORE_SETTINGS, where))
    given = "job_credentials" if store.job_credentials is not None else \
        "job_keys" if store.job_keys else ""
    if given and not store.url.startswith("s3://"):
        raise ConfigError(f"{where}: {given} is for s3:// stores; {shown(store.url)} "
                          "needs none")
    if store.job_credentials is not None and store.job_keys:
        raise ConfigError(f"{where}: job_keys = \"{store.job_keys}\" mints the jobs' keys; "
                          "remove job_credentials, or job_keys to use the file")
    if store.ca_file is not None and not store.endpoint_url.startswith("https://"):
        raise ConfigError(f"{where}: ca_file is for an S3 endpoint behind TLS (an https:// "
                          "endpoint_url); remove it or write https://")
    return store


# --- [policy] and [retention] -------------------------------------------------------------

POLICY_SETTINGS = (
    Setting("require_cost_center", flag, GeoPolicy.require_cost_center,
            "Refuse geo jobs without --geo-cost-center."),
    Setting("default_data_class", choice(*DATA_CLASSES), GeoPolicy.default_data_class,
            "The data class of a job that names none."),
    Setting("signal_lead_s", whole(10, 3600), DEFAULT_SIGNAL_LEAD_S,
            "Seconds of warning (--signal=B:USR1@N) jobs with --geo-ckpt-dir get."),
    Setting("max_restarts", whole(0, 1000), DEFAULT_MAX_RESTARTS,
            "A job requeued more often than this is held."),
    Setting("data_classes", mapping_of(names(what="regions", each="a region"),
                                       "data class = [regions]", key=choice(*DATA_CLASSES)),
            None, "[policy.data_classes]: the regions each data class may reside in; "
            "unlisted: anywhere.", subtable=True),
    Setting("budgets", mapping_of(number(0, above=True, unit="USD"), "cost center = USD",
                                  key=site_name), None,
            "[policy.budgets]: USD per job each cost center allows; none: no budgets.",
            subtable=True),
)


def parse_policy(table: Any, regions: set[str], where: str) -> GeoPolicy:
    """The [policy] table; `regions` are the regions the config's clusters are in."""
    values = read_settings(table, POLICY_SETTINGS, where)
    allowlists = values.get("data_classes", {})
    for data_class, allowed in allowlists.items():
        unknown = sorted(set(allowed) - regions)
        if unknown:
            raise ConfigError(f"{where}.data_classes: {data_class} names unknown region(s) "
                              f"{', '.join(unknown)} (regions of [clusters]: "
                              f"{', '.join(sorted(regions)) or 'none'})")
    if allowlists:
        values["data_classes"] = {name: tuple(sorted(allowed))
                                  for name, allowed in allowlists.items()}
    return GeoPolicy(**values)


RETENTION_SETTINGS = (
    Setting("keep_local", whole(1), RetentionPolicy.keep_local,
            "Tier 1: checkpoints of a run kept on the on-prem filesystem."),
    Setting("replicate_every", whole(1), RetentionPolicy.replicate_every,
            "Tier 2: every N-th checkpoint (and always the newest) goes off-site."),
    Setting("remote_days", number(0, above=True), RetentionPolicy.remote_days,
            "Tier 2: days replicas are kept (the newest always stays)."),
)


def parse_retention(table: Any, where: str) -> RetentionPolicy:
    return RetentionPolicy(**read_settings(table, RETENTION_SETTINGS, where))


# --- [billing] ----------------------------------------------------------------------------

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


PRICE_ENTRY_SETTINGS = (
    Setting("cluster", site_name, "", "The [clusters] name these prices are for (or "
            "provider)."),
    Setting("provider", text, "", "The provider whose clusters these prices are for (or "
            "cluster)."),
    Setting("effective_from", moment, None, "The date or time (UTC) from which they apply.",
            required=True),
    *(replace(s, required=True, default=None) for s in PRICE_SETTINGS),
)


@dataclass(frozen=True)
class BillingTable:
    """The [billing] table: where chargeback keeps its data, budgets and dated prices."""

    database: Path = DEFAULT_BILLING_DATABASE
    webhook_url: str = ""
    warn_pct: float = 80.0
    first_ingest_days: int = 31
    budgets: Mapping[str, float] = field(default_factory=dict)
    prices: tuple[PriceEntry, ...] = ()


BILLING_SETTINGS = (
    Setting("database", path, BillingTable.database, "The billing database (SQLite)."),
    Setting("webhook_url", url("http://", "https://", empty=True), BillingTable.webhook_url,
            "Budget alerts are posted there; empty: none."),
    Setting("warn_pct", number(0, 100), BillingTable.warn_pct,
            "Alert when a cost center has spent this share of its monthly budget."),
    Setting("first_ingest_days", whole(1, 3660), BillingTable.first_ingest_days,
            "How far back the first ingest of a cluster looks."),
    Setting("budgets", mapping_of(number(0.01, 1e12, unit="USD"),
                                  "cost center = USD per month", key=site_name), None,
            "[billing.budgets]: USD per calendar month (UTC) and cost center.", subtable=True),
    Setting("prices", tables, (), "[[billing.prices]]: effective-dated prices for a cluster "
            "or a provider."),
)


def parse_billing(table: Any, clusters: Mapping[str, ClusterConfig],
                  where: str) -> BillingTable:
    values = read_settings(table, BILLING_SETTINGS, where)
    values["prices"] = tuple(_price_entry(row, i, clusters, f"{where} prices[{i}]")
                             for i, row in enumerate(values.get("prices", [])))
    return BillingTable(**values)


def _price_entry(row: Any, index: int, clusters: Mapping[str, ClusterConfig],
                 where: str) -> PriceEntry:
    values = read_settings(row, PRICE_ENTRY_SETTINGS, where)
    cluster, provider = values.get("cluster", ""), values.get("provider", "")
    if bool(cluster) == bool(provider):
        raise ConfigError(f"{where}: give exactly one of cluster = \"NAME\" or "
                          "provider = \"NAME\"")
    if cluster and cluster not in clusters:
        raise ConfigError(f"{where}: cluster '{cluster}' is not one of [clusters] (known: "
                          f"{', '.join(sorted(clusters)) or 'none'})")
    if provider and provider not in {c.provider or c.name for c in clusters.values()}:
        raise ConfigError(f"{where}: no cluster has provider {shown(provider)}")
    return PriceEntry(**values, source=f"[[billing.prices]] #{index}")
