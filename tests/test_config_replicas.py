"""[federation] as one replica of a federation whose state is in etcd: the settings, and
one line naming the setting and the fix for each way they can be wrong."""

from __future__ import annotations

import copy

import pytest

from slurm_geo.config import parse_config
from slurm_geo.config.daemons import ReplicaConfig
from slurm_geo.errors import ConfigError
from tests.kit.site import federated

HOME = {"name": "home-a", "site": "home", "url": "https://fed-home.example:9852"}
CONTROL = {"name": "control-b", "site": "control", "url": "https://fed-control.example:9852"}
REPLICATED = {"etcd_endpoints": ["https://etcd-home.example:2379",
                                 "https://etcd-control.example:2379",
                                 "https://etcd-rented.example:2379"],
              "replica": "home-a", "replicas": [HOME, CONTROL],
              "tls_cert": "/etc/slurm-geo/fed.pem", "tls_key": "/etc/slurm-geo/fed.key"}


def replicated(**change) -> dict:
    table = {**copy.deepcopy(REPLICATED), **change}
    return federated(**{k: v for k, v in table.items() if v is not None})


def test_a_replica_reads_its_url_and_every_replicas():
    config = parse_config(replicated()).federation
    assert config is not None and config.replicated
    assert config.url == "https://fed-home.example:9852"  # its public_url: its entry's url
    assert config.job_urls == ("https://fed-home.example:9852",
                               "https://fed-control.example:9852")
    assert config.this_replica == ReplicaConfig("home-a", "home",
                                                "https://fed-home.example:9852")
    assert config.etcd_prefix == "/slurm-geo/federation"
    other = parse_config(replicated(replica="control-b")).federation
    assert other is not None and other.job_urls[0] == "https://fed-control.example:9852"


def test_the_sqlite_daemon_is_as_it_was():
    config = parse_config(federated()).federation
    assert config is not None and not config.replicated
    assert config.job_urls == (config.url,) and config.replicas == ()


@pytest.mark.parametrize("change, message", [
    pytest.param({"replica": "nobody"}, "replica 'nobody' is not one of "
                 "[[federation.replicas]] (home-a, control-b)", id="unknown replica"),
    pytest.param({"replica": None}, "etcd_endpoints needs replica = \"NAME\": which of "
                 "[[federation.replicas]] (home-a, control-b) this daemon is",
                 id="no replica named"),
    pytest.param({"replicas": [HOME, {**CONTROL, "url": HOME["url"]}]},
                 "[[federation.replicas]] names url 'https://fed-home.example:9852' twice",
                 id="duplicate url"),
    pytest.param({"replicas": [HOME, {**CONTROL, "name": "home-a"}]},
                 "[[federation.replicas]] names name 'home-a' twice", id="duplicate name"),
    pytest.param({"replicas": None}, "etcd_endpoints needs [[federation.replicas]] to name "
                 "every replica", id="etcd without replicas"),
    pytest.param({"state": "/var/lib/slurm-geo/federation.db"}, "state is the SQLite state; "
                 "with etcd_endpoints the state and the audit log are in etcd: remove state",
                 id="a SQLite state beside etcd"),
    pytest.param({"audit_path": "/var/lib/slurm-geo/audit.db"}, "remove audit_path",
                 id="a SQLite audit log beside etcd"),
    pytest.param({"public_url": "https://elsewhere.example"}, "public_url "
                 "https://elsewhere.example is not the url of replica home-a",
                 id="public_url not its entry's"),
    pytest.param({"etcd_endpoints": ["http://etcd-home.example:2379"]},
                 "etcd_endpoints is plain http to etcd-home.example, which is not loopback",
                 id="etcd in clear across the network"),
    pytest.param({"etcd_endpoints": ["https://etcd.example"]},
                 "etcd_endpoints must be URLs of the form https://host:port", id="no port"),
    pytest.param({"etcd_endpoints": ["https://e.example:2379", "https://e.example:2379"]},
                 "etcd_endpoints names a member twice", id="a member twice"),
    pytest.param({"etcd_prefix": "slurm"}, "etcd_prefix: etcd prefix 'slurm': expected "
                 "/name", id="a prefix that is not a path"),
    pytest.param({"etcd_cert": "/etc/slurm-geo/etcd.pem"}, "etcd_cert and etcd_key go "
                 "together", id="a client certificate without its key"),
    pytest.param({"etcd_user": "slurm-geo-replica"}, "etcd_user and etcd_password_file go "
                 "together", id="an etcd user without its password"),
    pytest.param({"replicas": [HOME, {**CONTROL, "url": "http://fed.example"}]},
                 "url is plain http to fed.example", id="a replica in clear"),
    pytest.param({"replicas": [HOME, {"name": "control-b", "url": "https://c.example"}]},
                 "replicas[1]: missing site", id="a replica without its site"),
])
def test_replica_mistakes_are_one_line_naming_the_setting(change, message):
    with pytest.raises(ConfigError) as error:
        parse_config(replicated(**change))
    assert message in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("setting, value", [
    ("replica", "home-a"), ("replicas", [HOME]), ("etcd_prefix", "/x"),
    ("etcd_ca_file", "/etc/slurm-geo/etcd-ca.pem"),
])
def test_etcd_settings_without_etcd_endpoints_are_refused(setting, value):
    with pytest.raises(ConfigError, match=f"{setting} is for a state shared in etcd, and "
                       "there are no etcd_endpoints"):
        parse_config(federated(**{setting: value}))
