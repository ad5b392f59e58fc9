"""Every config table, declared once: each refuses unknown keys, wrong types and NaN/inf
with one line naming the table and the key, and each declaration matches its dataclass."""

from __future__ import annotations

import copy
import dataclasses
from datetime import UTC, date, datetime
from pathlib import Path

import pytest

from slurm_geo.config import DEFAULT_KEY_FILE, KEY_FILE_ENV, master_key_path, parse_config
from slurm_geo.config.daemons import (
    FEDERATION_SETTINGS,
    REPLICA_SETTINGS,
    SYNC_SETTINGS,
    FederationConfig,
    ReplicaConfig,
    SyncConfig,
)
from slurm_geo.config.settings import Setting, moment, number, whole
from slurm_geo.config.tables import (
    BILLING_SETTINGS,
    CLUSTER_SETTINGS,
    POLICY_SETTINGS,
    PRICE_ENTRY_SETTINGS,
    PRICE_SETTINGS,
    REGISTRY_SETTINGS,
    REMOTE_ACCOUNT_SETTINGS,
    RETENTION_SETTINGS,
    SITE_SETTINGS,
    STORE_SETTINGS,
    BillingTable,
    ClusterConfig,
    PriceEntry,
    Prices,
    RemoteAccount,
    StoreConfig,
)
from slurm_geo.errors import ConfigError
from slurm_geo.policy.geo import GeoPolicy
from slurm_geo.policy.retention import RetentionPolicy
from tests.kit.site import SITE

# (where the table is in SITE, how messages name it, its declaration)
TABLES = [
    (("site",), "[site]", SITE_SETTINGS),
    (("registry",), "[registry]", REGISTRY_SETTINGS),
    (("clusters", "onprem"), "[clusters.onprem]", CLUSTER_SETTINGS),
    (("clusters", "onprem", "prices"), "[clusters.onprem].prices", PRICE_SETTINGS),
    (("clusters", "rented", "users", "alice"), "[clusters.rented].users: alice",
     REMOTE_ACCOUNT_SETTINGS),
    (("stores", "offsite"), "[stores.offsite]", STORE_SETTINGS),
    (("policy",), "[policy]", POLICY_SETTINGS),
    (("retention",), "[retention]", RETENTION_SETTINGS),
    (("billing",), "[billing]", BILLING_SETTINGS),
    (("billing", "prices", 0), "[billing] prices[0]", PRICE_ENTRY_SETTINGS),
    (("sync",), "[sync]", SYNC_SETTINGS),
    (("federation",), "[federation]", FEDERATION_SETTINGS),
]
IDS = [where for _, where, _ in TABLES]


def with_key(at: tuple, key: str, value) -> dict:
    raw = copy.deepcopy(SITE)
    table = raw
    for step in at:
        table = table[step]
    table[key] = value
    return raw


def refusal(raw: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, source="site.toml")
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_the_site_with_every_table_reads():
    site = parse_config(SITE)
    assert site.retention == RetentionPolicy(keep_local=2)
    assert site.policy.data_classes == {"restricted": ("home",)}
    assert site.billing.budgets == {"ml": 1000.0}
    assert site.billing.prices == (PriceEntry(
        int(datetime(2026, 12, 1, tzinfo=UTC).timestamp()), 2.0, 0.0, 0.1, 5.0,
        provider="market", source="[[billing.prices]] #0"),)
    assert site.cluster("rented").rest_url == "https://r.example"
    assert site.cluster("rented").users == {
        "alice": RemoteAccount("geo-alice", Path("/etc/slurm-geo/rented/alice.jwt"))}
    assert site.cluster("onprem").users == {}


def test_users_map_only_rest_clusters_and_only_user_names():
    cli = refusal(with_key(("clusters", "onprem"), "users", {
        "alice": {"account": "a", "token_file": "/t"}}))
    assert "users is for access 'rest'" in cli and "slurm-geo-submit-as" in cli
    bad = refusal(with_key(("clusters", "rented"), "users", {
        "a b": {"account": "a", "token_file": "/t"}}))
    assert "must be a user name" in bad and "'a b'" in bad
    relative = refusal(with_key(("clusters", "rented", "users", "alice"), "token_file", "t"))
    assert "[clusters.rented].users: alice: token_file must be an absolute path" in relative
    missing = refusal(with_key(("clusters", "rented", "users"), "bob", {"account": "b"}))
    assert "missing token_file" in missing


def test_ca_file_names_the_ca_of_an_https_slurmrestd_only():
    site = parse_config(with_key(("clusters", "rented"), "ca_file", "/etc/slurm-geo/ca.pem"))
    assert site.cluster("rented").ca_file == Path("/etc/slurm-geo/ca.pem")
    assert parse_config(SITE).cluster("rented").ca_file is None  # the system's CAs
    relative = refusal(with_key(("clusters", "rented"), "ca_file", "ca.pem"))
    assert "[clusters.rented]: ca_file must be an absolute path" in relative
    cli = refusal(with_key(("clusters", "onprem"), "ca_file", "/etc/slurm-geo/ca.pem"))
    assert "[clusters.onprem]: ca_file is for slurmrestd behind TLS" in cli
    loopback = with_key(("clusters", "rented"), "ca_file", "/etc/slurm-geo/ca.pem")
    loopback["clusters"]["rented"]["rest_url"] = "http://127.0.0.1:6820"
    assert "remove it or write https://" in refusal(loopback)


@pytest.mark.parametrize("at, where, settings", TABLES, ids=IDS)
def test_each_table_refuses_unknown_keys(at, where, settings):
    message = refusal(with_key(at, "colour", "red"))
    assert f"site.toml {where}: unknown key(s) colour; allowed: " in message
    assert all(s.name in message for s in settings)


@pytest.mark.parametrize("at, where, settings", TABLES, ids=IDS)
def test_each_key_refuses_a_wrong_type(at, where, settings):
    for setting in settings:
        wrong = "text" if setting.subtable else {"nested": "table"}
        message = refusal(with_key(at, setting.name, wrong))
        assert f"site.toml {where}" in message and setting.name in message, message


@pytest.mark.parametrize("at, where, settings", TABLES, ids=IDS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), True])
def test_no_key_takes_nan_inf_or_a_boolean_for_a_number(at, where, settings, value):
    for setting in settings:
        if setting.subtable or (value is True and setting.parse.__name__ == "flag"):
            continue  # what a sub-table holds is refused below
        message = refusal(with_key(at, setting.name, value))
        assert setting.name in message and repr(value) in message, message


@pytest.mark.parametrize("at, key", [
    (("policy", "budgets"), "ml"),
    (("billing", "budgets"), "ml"),
    (("clusters", "onprem", "prices"), "gpu_hour"),
])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1, "5"])
def test_amounts_in_sub_tables_are_finite_numbers(at, key, value):
    assert f"{key} must be a number" in refusal(with_key(at, key, value))


def test_a_bad_billing_table_stops_loading_the_config():
    message = refusal(with_key(("billing",), "warn_pct", 120))
    assert message == ("site.toml [billing]: warn_pct must be a number from 0 to 100, "
                       "got 120")


# --- each declaration is its dataclass --------------------------------------------------------

DECLARED = [
    (ClusterConfig, CLUSTER_SETTINGS, {"name"}),
    (Prices, PRICE_SETTINGS, set()),
    (StoreConfig, STORE_SETTINGS, {"name"}),
    (RemoteAccount, REMOTE_ACCOUNT_SETTINGS, set()),
    (GeoPolicy, POLICY_SETTINGS, set()),
    (RetentionPolicy, RETENTION_SETTINGS, set()),
    (BillingTable, BILLING_SETTINGS, set()),
    (PriceEntry, PRICE_ENTRY_SETTINGS, {"source"}),
    (SyncConfig, SYNC_SETTINGS, set()),
    (FederationConfig, FEDERATION_SETTINGS, set()),
    (ReplicaConfig, REPLICA_SETTINGS, set()),
]


@pytest.mark.parametrize("cls, settings, not_keys", DECLARED,
                         ids=[c.__name__ for c, _, _ in DECLARED])
def test_every_setting_is_a_field_with_its_default(cls, settings, not_keys):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert sorted(s.name for s in settings) == sorted(set(fields) - not_keys)
    for setting in settings:
        default = fields[setting.name].default
        if setting.default is not None and default is not dataclasses.MISSING:
            assert setting.default == default, setting.name


@pytest.mark.parametrize("settings", [s for _, _, s in TABLES], ids=IDS)
def test_every_setting_has_help(settings: tuple[Setting, ...]):
    assert all(s.help.endswith(".") for s in settings)


# --- the validators ---------------------------------------------------------------------------

@pytest.mark.parametrize("parse, value, message", [
    (whole(1), 0, "x must be a whole number >= 1, got 0"),
    (whole(0, 19), 20, "x must be a whole number from 0 to 19, got 20"),
    (whole(1), 1.5, "x must be a whole number >= 1, got 1.5"),
    (number(0, above=True, unit="seconds"), 0, "x must be a number of seconds > 0, got 0"),
    (number(0, unit="MB/s", note="(0: no cap)"), -1,
     "x must be a number of MB/s >= 0 (0: no cap), got -1"),
    (number(0, 100), float("nan"), "x must be a number from 0 to 100, got nan"),
])
def test_validators_say_what_a_key_must_be(parse, value, message):
    with pytest.raises(ConfigError) as caught:
        parse(value, "x")
    assert str(caught.value) == message


@pytest.mark.parametrize("value, expected", [
    (date(2026, 12, 1), datetime(2026, 12, 1, tzinfo=UTC)),
    (datetime(2026, 12, 1, 6), datetime(2026, 12, 1, 6, tzinfo=UTC)),
    ("2026-12-01T08:00:00+02:00", datetime(2026, 12, 1, 6, tzinfo=UTC)),
    (" 2026-12-01 ", datetime(2026, 12, 1, tzinfo=UTC)),
])
def test_moments_are_utc_unless_they_carry_an_offset(value, expected):
    assert moment(value, "x") == int(expected.timestamp())


# --- the master key ---------------------------------------------------------------------------

@pytest.mark.parametrize("configured, env, expected", [
    (Path("/srv/key"), {KEY_FILE_ENV: "/env/key"}, Path("/srv/key")),
    (None, {KEY_FILE_ENV: "/env/key"}, Path("/env/key")),
    (None, {KEY_FILE_ENV: ""}, DEFAULT_KEY_FILE),
    (None, {}, Path("/etc/slurm-geo/master.key")),
])
def test_the_master_key_path_is_resolved_in_one_place(configured, env, expected):
    assert master_key_path(configured, env) == expected
