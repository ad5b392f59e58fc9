"""Building the federation daemon from a site config: the wiring it gets (clients with
the daemon's short timeouts, stores behind the site's bandwidth cap, the state and the
audit log) and the one-line errors of a config it cannot run with."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_geo.ckpt import create_master_key_file
from slurm_geo.ckpt.stores.pacing import PacedStore
from slurm_geo.errors import ConfigError
from slurm_geo.federation.engine.runtime import build
from slurm_geo.federation.model import Lease
from slurm_geo.federation.state.sqlite import FederationState
from tests.kit.site import cluster, store, write_site


def write_config(tmp_path: Path, federation: bool = True, sync: bool = True) -> Path:
    for name in ("pfs", "away"):
        (tmp_path / name).mkdir(exist_ok=True)
    tables = {"sync": {"roots": ["pfs"], "destination": "away", "state": f"{tmp_path}/sync.db",
                       "bandwidth_mb_s": 25}} if sync else {}
    return write_site(
        tmp_path,
        clusters={"onprem": cluster(slurm_conf=f"{tmp_path}/onprem/slurm.conf", timeout_s=30),
                  "rented": cluster("eu", "away", slurm_conf=f"{tmp_path}/rented/slurm.conf")},
        stores={"pfs": store(tmp_path / "pfs"), "away": store(tmp_path / "away", "eu")},
        federation={"state": f"{tmp_path}/fed/federation.db",
                    "audit_path": f"{tmp_path}/fed/audit.db",
                    "key_file": f"{tmp_path}/master.key", "probe_interval_s": 2}
        if federation else None,
        **tables)


def test_the_daemon_gets_short_timeouts_and_paced_stores(tmp_path):
    create_master_key_file(tmp_path / "master.key")
    federation = build(write_config(tmp_path), env={})
    wiring = federation.wiring
    # Its own calls wait at most three probe intervals; its probes one (at most 5 s).
    assert wiring.clients["onprem"].timeout_s == 6.0
    assert federation.health.probes["onprem"].timeout_s == 2.0
    assert set(wiring.paced_stores) == {"pfs", "away"}
    paced = wiring.paced_stores["away"]
    assert isinstance(paced, PacedStore)
    assert paced._bucket is not None and paced._bucket.rate == 25e6  # [sync]'s cap
    assert (tmp_path / "fed" / "federation.db").stat().st_mode & 0o777 == 0o600


def test_without_a_sync_table_the_daemon_copies_uncapped(tmp_path):
    create_master_key_file(tmp_path / "master.key")
    federation = build(write_config(tmp_path, sync=False), env={})
    paced = federation.wiring.paced_stores["pfs"]
    assert isinstance(paced, PacedStore) and paced._bucket is None


def test_a_restarted_daemon_counts_every_live_lease_as_renewed_now(tmp_path):
    create_master_key_file(tmp_path / "master.key")
    config = write_config(tmp_path)
    state = FederationState(tmp_path / "fed" / "federation.db")
    state.put_lease(Lease("onprem-1", 0, "onprem", 1, 0, 5.0, None, False), True)
    state.close()
    build(config, env={}, daemon=False)  # a command that only looks changes nothing
    assert FederationState(tmp_path / "fed" / "federation.db").lease("onprem-1").renewed_at == 5.0
    federation = build(config, env={})
    assert federation.state.lease("onprem-1").renewed_at > 5.0


@pytest.mark.parametrize("federation_table, key, message", [
    (False, True, "has no [federation] table"),
    (True, False, "master.key"),
])
def test_a_config_the_daemon_cannot_run_with_is_one_line(tmp_path, federation_table, key,
                                                          message):
    if key:
        create_master_key_file(tmp_path / "master.key")
    with pytest.raises(Exception, match=message.replace("[", r"\[")) as raised:
        build(write_config(tmp_path, federation=federation_table), env={})
    assert "\n" not in str(raised.value)
    if not federation_table:
        assert isinstance(raised.value, ConfigError)
