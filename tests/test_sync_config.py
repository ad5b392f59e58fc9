"""The [sync] table: what it accepts, one clear message per mistake, and its docs table."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path

import pytest

from slurm_geo.ckpt import LocalDirStore, create_master_key_file
from slurm_geo.config import parse_config
from slurm_geo.config.model import SYNC_SETTINGS, SyncConfig, settings_table
from slurm_geo.errors import ConfigError
from slurm_geo.sandbox.layout import SandboxLayout
from slurm_geo.sandbox.render import site_config, sync_metrics_port, sync_state_path
from slurm_geo.sync.runtime import link_plan, runtime_from_site

DOCS = Path(__file__).resolve().parent.parent / "docs" / "checkpoint-sync.md"

GOOD = {
    "stores": {
        "pfs": {"url": "file:///lustre/ckpt", "region": "home"},
        "offsite": {"url": "s3://bucket/ckpt", "region": "eu", "endpoint_url": "https://m:9000"},
    },
    "sync": {"roots": ["pfs", "file:///scratch/ckpt"], "destination": "offsite",
             "state": "/var/lib/slurm-geo/sync.db", "metrics_port": 9900,
             "bandwidth_mb_s": 50, "poll_interval_s": 5, "nice": 15, "cpu_policy": "batch",
             "io_class": "best-effort",
             "max_attempts": 3, "attempt_timeout_s": 600, "retry_base_s": 10,
             "retry_max_s": 300, "key_file": "/etc/slurm-geo/master.key"},
}


def with_sync(**changes):
    raw = copy.deepcopy(GOOD)
    for key, value in changes.items():
        if value is None:
            raw["sync"].pop(key, None)
        else:
            raw["sync"][key] = value
    return raw


def test_good_sync_table_reads_into_typed_values():
    sync = parse_config(GOOD).sync
    assert sync == SyncConfig(
        roots=("pfs", "file:///scratch/ckpt"), destination="offsite",
        state=Path("/var/lib/slurm-geo/sync.db"), key_file=Path("/etc/slurm-geo/master.key"),
        metrics_port=9900, bandwidth_mb_s=50.0, poll_interval_s=5.0, nice=15,
        cpu_policy="batch", io_class="best-effort", max_attempts=3, attempt_timeout_s=600.0,
        retry_base_s=10.0, retry_max_s=300.0)


def test_defaults_fill_everything_but_roots_and_destination():
    minimal = with_sync(**{s.name: None for s in SYNC_SETTINGS if not s.required})
    sync = parse_config(minimal).sync
    assert sync is not None
    assert (sync.state, sync.metrics_port, sync.bandwidth_mb_s, sync.max_attempts,
            sync.attempt_timeout_s) == (Path("/var/lib/slurm-geo/checkpoint-sync.db"), 9851,
                                        0.0, 5, 1800.0)


def test_no_sync_table_is_fine_for_everything_else():
    raw = copy.deepcopy(GOOD)
    del raw["sync"]
    assert parse_config(raw).sync is None


@pytest.mark.parametrize("changes, message", [
    ({"roots": None}, "missing roots"),
    ({"destination": None}, "missing destination"),
    ({"roots": []}, "roots must be a non-empty list"),
    ({"roots": "pfs"}, "roots must be a non-empty list"),
    ({"roots": ["pfs", "pfs"]}, "names a store twice"),
    ({"roots": ["scratch"]}, "root 'scratch' is neither a URL nor one of [stores] "
                             "(stores: offsite, pfs)"),
    ({"roots": ["ftp://x"]}, "root 'ftp://x' must start with file:// or s3://"),
    ({"destination": "tape"}, "destination 'tape' is not one of [stores]"),
    ({"roots": ["offsite"]}, "cannot be replicated into itself"),
    ({"roots": ["s3://bucket/ckpt"]}, "cannot be replicated into itself"),
    ({"state": "relative.db"}, "state must be an absolute path"),
    ({"metrics_port": 70000}, "metrics_port must be a whole number from 0 to 65535"),
    ({"metrics_port": True}, "metrics_port must be a whole number"),
    ({"bandwidth_mb_s": -1}, "bandwidth_mb_s must be a number of MB/s >= 0"),
    ({"poll_interval_s": 0}, "poll_interval_s must be a number of seconds > 0"),
    ({"nice": 20}, "nice must be a whole number from 0 to 19"),
    ({"io_class": "realtime"}, "io_class must be one of idle, best-effort, none"),
    ({"cpu_policy": "fifo"}, "cpu_policy must be one of idle, batch, normal"),
    ({"max_attempts": 0}, "max_attempts must be a whole number from 1"),
    ({"attempt_timeout_s": "30m"}, "attempt_timeout_s must be a number of seconds"),
    ({"retry_max_s": 5}, "retry_max_s (5) is shorter than retry_base_s (10)"),
    ({"bandwith_mb_s": 5}, "unknown key(s) bandwith_mb_s"),
])
def test_each_mistake_has_its_own_message(changes, message):
    with pytest.raises(ConfigError) as caught:
        parse_config(with_sync(**changes), source="site.toml")
    assert message in str(caught.value)
    assert "site.toml [sync]" in str(caught.value)


@pytest.mark.parametrize("bandwidth_mb_s, wan_rtt_ms, streams, part_mib", [
    (0, 80, 2, 8),        # no cap: the rate is unknown; two, one hides the other's checks
    (25, 0, 2, 8),        # 200 Mbit/s without latency: two, one hides the other's turnaround
    (25, None, 2, 8),     # the same at the default 20 ms
    (12.5, 80, 2, 10),    # 100 Mbit/s at 80 ms: two streams, longer parts
    (1250, 50, 15, 80),   # 10 Gbit/s at 50 ms
])
def test_the_cap_and_the_round_trip_size_the_uploads(bandwidth_mb_s, wan_rtt_ms, streams,
                                                     part_mib):
    sync = parse_config(with_sync(bandwidth_mb_s=bandwidth_mb_s, wan_rtt_ms=wan_rtt_ms)).sync
    assert sync is not None
    plan = link_plan(sync)
    assert (plan.streams, plan.part_size) == (streams, part_mib * 1024 * 1024)


def test_the_destination_opens_with_the_links_plan(tmp_path):
    create_master_key_file(tmp_path / "master.key")
    raw = with_sync(bandwidth_mb_s=1250, wan_rtt_ms=50, key_file=str(tmp_path / "master.key"))
    opened = []

    def open_store(url, **options):
        opened.append((url, options))
        return LocalDirStore(tmp_path)

    runtime = runtime_from_site(parse_config(raw), env={}, open_store=open_store)
    assert runtime.transfer_plan.streams == 15
    assert opened == [("s3://bucket/ckpt", {"endpoint_url": "https://m:9000",
                                            "plan": runtime.transfer_plan,
                                            "ca_file": None})]


@pytest.mark.parametrize("value", [-1, 10_001, "20", True])
def test_a_round_trip_out_of_range_is_refused(value):
    with pytest.raises(ConfigError, match="wan_rtt_ms must be a number of milliseconds"):
        parse_config(with_sync(wan_rtt_ms=value), source="site.toml")


def test_sync_must_be_a_table():
    raw = copy.deepcopy(GOOD)
    raw["sync"] = ["pfs"]
    with pytest.raises(ConfigError, match=r"\[sync\] must be a table"):
        parse_config(raw, source="site.toml")


def test_every_setting_is_a_field_and_every_field_a_setting():
    assert [s.name for s in SYNC_SETTINGS] == list(SyncConfig.__dataclass_fields__)


def test_the_admin_guide_shows_the_declared_settings():
    assert settings_table(SYNC_SETTINGS) in DOCS.read_text()


def test_sandbox_config_syncs_pfs_to_offsite():
    layout = SandboxLayout(Path('/srv/sandbox "quoted" dir'), 20000)
    site = parse_config(tomllib.loads(site_config(layout)))
    assert site.sync is not None
    assert site.sync.roots == ("pfs",) and site.sync.destination == "offsite"
    assert site.sync.state == sync_state_path(layout)
    assert site.sync.key_file == layout.master_key
    assert site.sync.metrics_port == sync_metrics_port(layout) == 20045


def test_the_sandbox_sync_port_collides_with_no_other():
    layout = SandboxLayout(Path("/srv/box"), 20000)
    ports = {layout.mariadb_port, layout.s3_port, layout.rented.rest_port}
    for cluster in layout.clusters:
        ports |= {cluster.ctld_port, cluster.dbd_port, *cluster.node_ports}
    assert sync_metrics_port(layout) not in ports
