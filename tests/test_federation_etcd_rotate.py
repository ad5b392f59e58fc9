"""`slurm-geo keys rotate` and the federation state in etcd, on a real member: the state
key S is derived from the master key, so the rotation seals every value in etcd again
under the new S, as it does the stores' objects; while the key file holds the ring the
replicas read values sealed under either key and write under the new one; afterwards a
replica holding only the new key reads everything, the leader keeps leading (its key
keeps its lease and its term), and one holding only the old key reads nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_geo.ckpt import LocalDirStore
from slurm_geo.ckpt.format.keys import KeyFile, LiveKeyFile, federation_state_key, fingerprint
from slurm_geo.ckpt.format.seal import sealing_fingerprint
from slurm_geo.ckpt.ops.rotate import Outcome, RotationRefused, rotate_master_key
from slurm_geo.cli import cli
from slurm_geo.federation.model import FederationStateError, JobStatus, Lease
from slurm_geo.federation.state.etcd.layout import Layout
from slurm_geo.federation.state.etcd.reseal import NAME, SealedState
from slurm_geo.federation.state.etcd.state import EtcdFederationState
from tests.etcd_server import MASTER_KEY, EtcdMember, fresh_prefix, open_replica
from tests.kit.builders import NAME as JOB
from tests.kit.builders import NOW
from tests.kit.builders import logical_job as job
from tests.replica_site import toml


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "master.key"
    path.write_bytes(MASTER_KEY)
    path.chmod(0o600)
    return path


@pytest.fixture
def leader(etcd: EtcdMember, key_file: Path) -> Iterator[EtcdFederationState]:
    """The leading replica, following the key file as a daemon does, with a job, a lease
    and audit entries written under the old key."""
    replica = open_replica([etcd.client_url], fresh_prefix(), "home-a",
                           master_keys=LiveKeyFile(key_file))
    assert replica.leadership.campaign()
    replica.add_job(job())
    replica.put_lease(Lease(JOB, 0, "onprem", 7, 0, NOW, 10, False), True)
    yield replica
    replica.leadership.resign()
    replica.close()


def sealed_state(replica: EtcdFederationState) -> dict[str, SealedState]:
    return {NAME: SealedState(replica.kv, replica.layout)}


def fingerprints(replica: EtcdFederationState) -> set[bytes | None]:
    return {sealing_fingerprint(item.sealed)
            for item in replica.kv.range_sealed(replica.layout.prefix + "/")}


def test_the_rotation_seals_the_state_in_etcd_again_and_the_leader_goes_on(
        leader, key_file, etcd):
    old_print = fingerprint(federation_state_key(MASTER_KEY))
    assert fingerprints(leader) == {old_print}
    first = rotate_master_key({}, key_file, also=sealed_state(leader))
    assert first.outcome is Outcome.RING_WRITTEN
    (planned,) = first.stores
    assert planned.store == NAME and leader.layout.leader in planned.rewrapped
    assert fingerprints(leader) == {old_print}  # nothing sealed again yet
    ring = KeyFile(*(k for k in LiveKeyFile(key_file).keys()), rotating=(NAME,))
    new_print = fingerprint(federation_state_key(ring.current))
    # With the ring in the file, the leader writes under the new key and reads both.
    leader.move_status(JOB, JobStatus.RUNNING, JobStatus.CANCELLED, NOW + 1)
    assert fingerprints(leader) == {old_print, new_print}
    assert leader.job(JOB).status is JobStatus.CANCELLED
    term, lease = leader.leadership.term, leader.leadership.lease

    second = rotate_master_key({}, key_file, also=sealed_state(leader))
    assert second.outcome is Outcome.COMPLETE
    (done,) = second.stores
    assert leader.layout.leader in done.rewrapped and done.refused == {}
    assert fingerprints(leader) == {new_print}
    assert LiveKeyFile(key_file).keys() == (ring.current,)

    # The leader key kept its lease and its term: the leader renews and writes on.
    assert leader.leadership.keepalive() and leader.leadership.term == term
    assert leader.leadership.lease == lease
    leader.put_sync_transfer_id(3)
    fresh = open_replica([etcd.client_url], leader.layout.prefix, "control-b",
                         master_key=ring.current, site="control")
    stale = open_replica([etcd.client_url], leader.layout.prefix, "control-b",
                         master_key=MASTER_KEY, site="control")
    try:
        assert fresh.job(JOB).status is JobStatus.CANCELLED
        assert fresh.lease(JOB) == leader.lease(JOB)
        assert fresh.leadership.leader() == leader.leadership.me
        assert fresh.sync_transfer_id() == 3
        with pytest.raises(FederationStateError, match="sealed with key"):
            stale.job(JOB)
    finally:
        fresh.close()
        stale.close()


def test_a_dry_run_says_what_would_be_sealed_again_and_writes_nothing(leader, key_file):
    before = {item.key: item.mod_revision
              for item in leader.kv.range_sealed(leader.layout.prefix + "/")}
    report = rotate_master_key({}, key_file, dry_run=True, also=sealed_state(leader))
    assert report.outcome is Outcome.DRY_RUN
    assert sorted(report.stores[0].rewrapped) == sorted(before)
    assert {item.key: item.mod_revision
            for item in leader.kv.range_sealed(leader.layout.prefix + "/")} == before
    assert LiveKeyFile(key_file).keys() == (MASTER_KEY,)


def test_a_rotation_in_progress_must_name_the_federation_state_again(leader, key_file,
                                                                     tmp_path):
    rotate_master_key({}, key_file, also=sealed_state(leader))
    store = LocalDirStore(tmp_path)
    with pytest.raises(RotationRefused, match="missing: federation-state"):
        rotate_master_key({"home": store}, key_file)


def test_keys_rotate_federation_state_takes_etcd_from_the_config(leader, key_file,
                                                                tmp_path, etcd):
    (tmp_path / "pfs").mkdir()
    config = tmp_path / "config.toml"
    config.write_text(toml({
        "site": {"home_cluster": "onprem"},
        "clusters": {"onprem": {"region": "home", "access": "cli", "slurm_conf": "/x",
                                "store": "pfs"},
                     "cloud": {"region": "eu", "access": "cli", "slurm_conf": "/y",
                               "store": "pfs"}},
        "stores": {"pfs": {"url": f"file://{tmp_path / 'pfs'}", "region": "home"}},
        "federation": {"etcd_endpoints": [etcd.client_url],
                       "etcd_prefix": leader.layout.prefix, "replica": "home-a",
                       "replicas": [{"name": "home-a", "site": "home",
                                     "url": "http://127.0.0.1:9852"}]}}))
    args = ["keys", "rotate", "--store", f"file://{tmp_path / 'pfs'}", "--federation-state",
            "--config", str(config), "--key-file", str(key_file), "--json"]
    for outcome in ("ring-written", "complete"):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
        report = json.loads(result.output)
        assert report["outcome"] == outcome
        assert [s["store"] for s in report["stores"]] == [f"file://{tmp_path / 'pfs'}", NAME]
    assert len(fingerprints(leader)) == 1  # one key now: the new one
    assert Layout(leader.layout.prefix).leader in report["stores"][1]["rewrapped"]
