"""The config file: what it accepts, and one clear message for each mistake."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from slurm_geo.config import Prices, load_config, parse_config
from slurm_geo.errors import ConfigError
from slurm_geo.sandbox.layout import SandboxLayout
from slurm_geo.sandbox.render import site_config
from slurm_geo.sandbox.sites import Site
from tests.kit.site import GOOD, federated


def test_good_config_reads_into_typed_values():
    site = parse_config(GOOD)
    rented = site.cluster("rented")
    assert rented.rest_url == "https://r.example:6820"
    assert rented.token_file == Path("/etc/slurm-geo/rented.jwt")
    assert rented.timeout_s == 5.0
    assert rented.prices == Prices(gpu_hour=2.5, egress_per_gb=0.09)
    assert site.cluster("onprem").slurm_conf == Path("/etc/slurm/slurm.conf")
    assert site.stores["offsite"].endpoint_url == "https://minio:9000"


def with_change(path: str, value):
    """GOOD with one key set (or removed when value is None), by dotted path."""
    import copy

    raw = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    table = raw
    for key in parents:
        table = table[key]
    if value is None:
        del table[last]
    else:
        table[last] = value
    return raw


@pytest.mark.parametrize("path, value, message", [
    ("site.home_cluster", "nowhere", "home_cluster 'nowhere'"),
    ("clusters.onprem.access", "ssh", "access must be one of cli, rest, got 'ssh'"),
    ("clusters.onprem.slurm_conf", None, "needs slurm_conf"),
    ("clusters.rented.token_file", None, "missing token_file"),
    ("clusters.rented.region", None, "missing region"),
    ("clusters.rented.timeout_s", -1, "timeout_s must be a number of seconds > 0"),
    ("clusters.rented.prices", {"gpu_hour": -1}, "gpu_hour must be a number >= 0"),
    ("clusters.rented.prices", {"gpu_hours": 1}, "unknown key(s) gpu_hours"),
    ("clusters.rented.colour", "red", "unknown key(s) colour"),
    ("stores.offsite.url", "ftp://x", "must start with file:// or s3://"),
    ("stores.offsite.job_credentials", "creds.env", "job_credentials must be an absolute path"),
    ("clusters", "not a table", "[clusters] must be a table"),
])
def test_each_mistake_has_its_own_message(path, value, message):
    with pytest.raises(ConfigError) as caught:
        parse_config(with_change(path, value), source="site.toml")
    assert message in str(caught.value)
    assert "site.toml" in str(caught.value)


def test_unknown_cluster_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"known clusters: onprem, rented"):
        parse_config(GOOD).cluster("elsewhere")


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist; set SLURM_GEO_CONFIG"):
        load_config(tmp_path / "absent.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[site\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken)


def test_sandbox_config_is_a_valid_site_config():
    layout = SandboxLayout(Path('/srv/sandbox "quoted" dir'), 20000)
    site = parse_config(tomllib.loads(site_config(layout)))
    assert site.home_cluster == "onprem"
    assert site.cluster("onprem").slurm_conf == layout.onprem.slurm_conf
    assert site.cluster("rented").access == "rest"
    remote = layout.address(Site.REMOTE)
    # slurmrestd behind TLS at the remote site, trusted through the sandbox's site CA.
    assert site.cluster("rented").rest_url == f"https://{remote}:20025"
    assert site.cluster("rented").ca_file == layout.ca_cert
    assert site.cluster("rented").prices.gpu_hour > site.cluster("onprem").prices.gpu_hour
    # S3 across the WAN on TLS too, verified against the site CA; a key per moved run.
    offsite = site.stores["offsite"]
    assert (offsite.endpoint_url, offsite.ca_file) == (f"https://{remote}:20040", layout.ca_cert)
    assert offsite.job_keys == "per-run" and offsite.job_credentials is None


def test_the_federation_settings_table_in_the_docs_is_current():
    from pathlib import Path

    from slurm_geo.config.model import FEDERATION_SETTINGS, settings_table
    docs = Path(__file__).resolve().parent.parent / "docs" / "federation.md"
    assert settings_table(FEDERATION_SETTINGS) in docs.read_text()


def test_the_rest_user_mapping_table_in_the_docs_is_current():
    from pathlib import Path

    from slurm_geo.config.model import settings_table
    from slurm_geo.config.tables import REMOTE_ACCOUNT_SETTINGS
    docs = Path(__file__).resolve().parent.parent / "docs" / "install.md"
    assert settings_table(REMOTE_ACCOUNT_SETTINGS) in docs.read_text()


def test_a_federation_table_reads_into_settings():
    site = parse_config(federated(probe_interval_s=2, outage_after=4, lease_ttl_s=8,
                                  listen_port=9999, failback=False))
    config = site.federation
    assert config is not None
    assert (config.probe_interval_s, config.outage_after, config.lease_ttl_s) == (2.0, 4, 8.0)
    assert config.detection_window_s == 8.0
    assert config.url == "http://127.0.0.1:9999"
    assert config.failback is False
    assert site.cluster("rented").store == "offsite"


@pytest.mark.parametrize("change, message", [
    ({"outage_after": 0}, "outage_after must be a whole number from 1 to 100"),
    ({"lease_ttl_s": -1}, "lease_ttl_s must be a number of seconds > 0"),
    ({"failback": "yes"}, "failback must be true or false"),
    ({"audit_path": "audit.db"}, "audit_path must be an absolute path"),
    ({"listen_port": 70000}, "listen_port must be a whole number from 1 to 65535"),
    ({"probes": 3}, "unknown key(s) probes"),
    ({"tls_cert": "/etc/slurm-geo/fed.pem"}, "tls_cert and tls_key go together"),
    ({"tls_key": "/etc/slurm-geo/fed.key"}, "tls_cert and tls_key go together"),
    ({"tls_cert": "fed.pem", "tls_key": "/k"}, "tls_cert must be an absolute path"),
    ({"ca_file": "ca.pem"}, "ca_file must be an absolute path"),
    ({"refusal_audit_interval_s": 0}, "refusal_audit_interval_s must be a number of seconds"),
    ({"public_url": "http://fed.example:9852"},
     "public_url is plain http to fed.example, which is not loopback (127.0.0.1, ::1, "
     "localhost): write https:// and give tls_cert and tls_key"),
    ({"public_url": "http://10.0.0.5:9852"}, "plain http to 10.0.0.5"),
    ({"public_url": "fed.example:9852"}, "public_url must be an http:// or https:// URL"),
    ({"public_url": "https://"}, "public_url must be an http:// or https:// URL with a host"),
    ({"public_url": "http://127.0.0.1:9852", "tls_cert": "/c", "tls_key": "/k"},
     "public_url is http:// but tls_cert makes the service speak https"),
    ({"listen_address": "0.0.0.0"}, "listen_address 0.0.0.0 is not loopback and the service "
     "has no TLS"),
])
def test_federation_mistakes_are_named(change, message):
    with pytest.raises(ConfigError) as error:
        parse_config(federated(**change))
    assert message in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("change, url", [
    ({"public_url": "http://127.0.0.1:9852"}, "http://127.0.0.1:9852"),
    ({"public_url": "http://127.8.0.1:9852"}, "http://127.8.0.1:9852"),
    ({"public_url": "http://[::1]:9852"}, "http://[::1]:9852"),
    ({"public_url": "http://localhost:9852"}, "http://localhost:9852"),
    ({"public_url": "https://fed.example"}, "https://fed.example"),
    ({"public_url": "https://fed.example", "listen_address": "0.0.0.0"},
     "https://fed.example"),  # TLS in front of it
    ({"tls_cert": "/c", "tls_key": "/k", "listen_address": "10.0.0.5"},
     "https://10.0.0.5:9852"),
    ({"tls_cert": "/c", "tls_key": "/k", "listen_address": "::1"}, "https://[::1]:9852"),
])
def test_jobs_reach_the_service_over_https_unless_it_stays_on_the_machine(change, url):
    config = parse_config(federated(**change)).federation
    assert config is not None and config.url == url


@pytest.mark.parametrize("rest_url, message", [
    ("http://r.example:6820", "rest_url is plain http to r.example, which is not loopback "
     "(127.0.0.1, ::1, localhost): write https://, with slurmrestd behind TLS"),
    ("ftp://r.example", "rest_url must be an http:// or https:// URL"),
])
def test_slurmrestd_is_reached_over_https_unless_it_is_local(rest_url, message):
    with pytest.raises(ConfigError) as error:
        parse_config(with_change("clusters.rented.rest_url", rest_url), source="site.toml")
    assert message in str(error.value)


def test_federation_needs_a_store_per_cluster():
    raw = {**GOOD, "federation": {}}
    with pytest.raises(ConfigError, match="cluster.s. onprem, rented have no store"):
        parse_config(raw)


def test_a_cluster_store_must_be_a_known_store():
    raw = with_change("clusters.onprem.store", "nowhere")
    with pytest.raises(ConfigError, match="store 'nowhere' is not one of \\[stores\\]"):
        parse_config(raw)


def test_a_store_names_the_credentials_its_jobs_get():
    site = parse_config(with_change("stores.offsite.job_credentials", "/etc/slurm-geo/job.env"))
    assert site.stores["offsite"].job_credentials == Path("/etc/slurm-geo/job.env")
    assert parse_config(GOOD).stores["offsite"].job_credentials is None


def test_a_directory_store_takes_no_job_credentials():
    raw = with_change("stores.offsite.url", "file:///pfs/ckpt")
    raw["stores"]["offsite"]["job_credentials"] = "/etc/slurm-geo/job.env"
    with pytest.raises(ConfigError, match="job_credentials is for s3:// stores"):
        parse_config(raw, source="site.toml")
