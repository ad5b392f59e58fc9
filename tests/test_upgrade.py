"""Upgrades without loss: the state slurm-geo 0.1 wrote (tests/data/release-0.1, made by
that release's own code: its README) opens with this code, migrates, and reads back as
that release read it: the jobs, incarnations, leases, fences, key tokens and secrets of
the federation state (SQLite, and etcd restored from the release's snapshot), the audit
chain, billing, checkpoint-sync's replicas, the job registry and a store's checkpoints
and fence. Every state refuses, in one line and without changing a byte, one that a
newer slurm-geo wrote."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_geo.billing.db import SCHEMA_VERSION as BILLING_VERSION
from slurm_geo.billing.db import BillingDB
from slurm_geo.ckpt.format.keys import KeyFile
from slurm_geo.errors import SlurmGeoError
from slurm_geo.federation.state.audit import SCHEMA_VERSION as AUDIT_VERSION
from slurm_geo.federation.state.audit import AuditLog
from slurm_geo.federation.state.open import open_federation_state
from slurm_geo.federation.state.sqlite import SCHEMA_VERSION as FEDERATION_VERSION
from slurm_geo.federation.state.sqlite import FederationState
from slurm_geo.registry.db import SCHEMA_VERSION as REGISTRY_VERSION
from slurm_geo.registry.db import Registry, RegistryReader
from slurm_geo.sync.state import SCHEMA_VERSION as SYNC_VERSION
from slurm_geo.sync.state import StateDB
from tests import upgrade_state as u

RELEASE = Path(__file__).parent / "data" / "release-0.1"
EXPECTED: dict[str, Any] = json.loads((RELEASE / "expected.json").read_text())
NEWER = "written by a newer slurm-geo"
FIX = "upgrade slurm-geo on this host"


@pytest.fixture
def old(tmp_path: Path) -> Path:
    """A copy of the release's state: the test data is never written."""
    copy = tmp_path / "release-0.1"
    shutil.copytree(RELEASE, copy)
    return copy


def test_the_data_is_the_last_releases():
    assert EXPECTED["release"] == {"version": "0.1.0", "commit": "a4963d1"}


def test_no_schema_of_the_release_is_newer_than_this_codes():
    versions = EXPECTED["versions"]
    assert versions["federation"] <= FEDERATION_VERSION
    assert versions["audit"] <= AUDIT_VERSION
    assert versions["billing"] <= BILLING_VERSION
    assert versions["sync"] <= SYNC_VERSION


# --- each database opens, migrates and reads back as the release read it ------------------

def test_the_federation_state_keeps_jobs_leases_fences_tokens_and_secrets(old: Path):
    state = FederationState(old / "federation.db")
    try:
        assert u.readback_federation(state) == EXPECTED["federation"]
        assert state.db.execute("PRAGMA user_version").fetchone()[0] == FEDERATION_VERSION
    finally:
        state.close()
    reader = FederationState(old / "federation.db", readonly=True)  # a command, after
    try:
        assert u.readback_federation(reader) == EXPECTED["federation"]
    finally:
        reader.close()


def test_the_audit_chain_verifies_and_goes_on(old: Path):
    with AuditLog(old / "audit.db", clock=lambda: u.NOW + 60) as log:
        assert u.readback_audit(log) == EXPECTED["audit"]
        log.append("decision", u.AT_HOME, "stay", "home answers again")
        report = log.verify()
        assert (report.ok, report.entries) == (True, len(EXPECTED["audit"]["entries"]) + 1)


def test_billing_keeps_its_jobs_and_watermarks(old: Path):
    with BillingDB(old / "billing.db") as billing:
        assert u.readback_billing(billing) == EXPECTED["billing"]


def test_checkpoint_syncs_replicas_are_kept(old: Path):
    state = StateDB(old / "checkpoint-sync.db")
    try:
        assert u.readback_sync(state) == EXPECTED["sync"]
        found = state.db.execute("SELECT value FROM meta WHERE key = 'schema_version'"
                                 ).fetchone()[0]
        assert found == str(SYNC_VERSION)
    finally:
        state.close()


def test_the_registry_is_numbered_and_keeps_its_incarnations(old: Path):
    path = old / "registry.db"
    assert _user_version(path) == 0  # the release numbered nothing
    with Registry(path) as registry:
        assert u.readback_registry(registry) == EXPECTED["registry"]
    assert _user_version(path) == REGISTRY_VERSION
    assert [j.job_id for j in RegistryReader(path).jobs()] == [7, 8]


def test_the_store_reads_the_releases_checkpoints_and_fence(old: Path):
    assert u.readback_store(old / "store") == EXPECTED["store"]


# --- a state a newer slurm-geo wrote is refused, untouched ---------------------------------

def _user_version(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute("PRAGMA user_version").fetchone()[0])


def _set_user_version(path: Path, version: int) -> None:
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {version}")
    db.close()


def _set_meta_version(path: Path, version: int) -> None:
    db = sqlite3.connect(path)
    with db:
        db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", [str(version)])
    db.close()


NEWER_STATES = {
    "federation": ("federation.db", lambda p: _set_user_version(p, FEDERATION_VERSION + 1),
                   [lambda p: FederationState(p), lambda p: FederationState(p, readonly=True)]),
    "audit": ("audit.db", lambda p: _set_user_version(p, AUDIT_VERSION + 1),
              [lambda p: AuditLog(p), lambda p: AuditLog(p, readonly=True)]),
    "billing": ("billing.db", lambda p: _set_meta_version(p, BILLING_VERSION + 1),
                [lambda p: BillingDB(p), lambda p: BillingDB(p, readonly=True)]),
    "sync": ("checkpoint-sync.db", lambda p: _set_meta_version(p, SYNC_VERSION + 1),
             [lambda p: StateDB(p), lambda p: StateDB(p, readonly=True)]),
    "registry": ("registry.db", lambda p: _set_user_version(p, REGISTRY_VERSION + 1),
                 [lambda p: Registry(p), lambda p: RegistryReader(p).jobs()]),
}


@pytest.mark.parametrize("which", sorted(NEWER_STATES))
def test_a_state_a_newer_slurm_geo_wrote_is_refused_in_one_line_untouched(old: Path, which):
    name, make_newer, openers = NEWER_STATES[which]
    path = old / name
    make_newer(path)
    before = path.read_bytes()
    for opener in openers:
        with pytest.raises(SlurmGeoError) as raised:
            opener(path)
        message = str(raised.value)
        assert NEWER in message and FIX in message and "\n" not in message, message
        assert path.read_bytes() == before
        assert not Path(f"{path}-wal").exists() or Path(f"{path}-wal").stat().st_size == 0


# --- the replicated federation's state in etcd ---------------------------------------------

@pytest.fixture
def restored(tmp_path: Path) -> Iterator[str]:
    """An etcd member started from the release's snapshot: the keys, their versions and
    revisions as the release left them (every value is sealed for them)."""
    from tests.etcd_server import EtcdMember, require_etcd

    require_etcd()
    snapshot = RELEASE / "etcd.snapshot.db"
    if not snapshot.exists():
        pytest.skip("no etcd snapshot in the test data")
    member = EtcdMember("m0", tmp_path)
    initial = f"m0={member.peer_url}"
    subprocess.run(["etcdctl", "snapshot", "restore", str(snapshot), "--name", "m0",
                    "--data-dir", str(member.data_dir), "--initial-cluster", initial,
                    "--initial-advertise-peer-urls", member.peer_url],
                   check=True, capture_output=True, env={"ETCDCTL_API": "3",
                                                         "PATH": "/usr/bin:/bin"})
    member.start(initial)
    try:
        _wait_healthy(member)
        yield member.client_url
    finally:
        member.stop()


def _wait_healthy(member: Any) -> None:
    import time

    deadline = time.monotonic() + 20
    while not member.healthy():
        assert time.monotonic() < deadline, "the restored etcd member did not start"
        time.sleep(0.05)


def test_the_etcd_state_keeps_jobs_leases_fences_and_gets_a_layout_version(restored: str):
    from slurm_geo.federation.state.etcd.audit import EtcdAuditLog
    from slurm_geo.federation.state.etcd.version import LAYOUT_VERSION, read_version
    from tests.etcd_server import open_replica

    replica = open_replica([restored], u.ETCD_PREFIX, "home-a", site="home")
    try:
        assert read_version(replica.kv, replica.layout) is None  # the release wrote none
        assert u.readback_federation(replica) == EXPECTED["etcd_federation"]
        assert replica.leadership.campaign()  # the new leader settles the layout
        assert read_version(replica.kv, replica.layout) == LAYOUT_VERSION
        assert u.readback_federation(replica) == EXPECTED["etcd_federation"]
        log = EtcdAuditLog(replica.kv, replica.layout, replica.leadership,
                           clock=lambda: u.NOW + 60, replica="home-a")
        assert u.readback_audit(log) == EXPECTED["etcd_audit"]
        keys = {f.key for f in replica.kv.range(u.ETCD_PREFIX + "/")}
        assert set(EXPECTED["etcd_keys"]) <= keys
        assert keys - set(EXPECTED["etcd_keys"]) == {replica.layout.leader,
                                                      replica.layout.version}
        replica.leadership.resign()
    finally:
        replica.close()


def test_an_etcd_layout_a_newer_slurm_geo_wrote_is_refused_and_never_led(restored: str):
    from slurm_geo.federation.state.etcd.kv import ABSENT, created_at
    from slurm_geo.federation.state.etcd.version import LayoutTooNew, check_layout, settle_layout
    from tests.etcd_server import open_replica

    replica = open_replica([restored], u.ETCD_PREFIX, "home-a", site="home")
    try:
        key = replica.layout.version
        newer = json.dumps({"version": 99}).encode()
        assert replica.kv.commit([created_at(key, 0)],
                                 [replica.kv.put(key, newer, at=ABSENT)], []).succeeded
        with pytest.raises(LayoutTooNew) as raised:
            check_layout(replica.kv, replica.layout)
        assert NEWER in str(raised.value) and FIX in str(raised.value)
        with pytest.raises(LayoutTooNew):
            settle_layout(replica.kv, replica.layout)
        assert not replica.leadership.campaign()
        assert replica.leadership.leader() is None
        for daemon in (True, False):  # the daemon at its start, a command
            with pytest.raises(LayoutTooNew):
                open_federation_state(replicated_config(restored), KeyFile(u.MASTER_KEY),
                                      daemon=daemon)
    finally:
        replica.close()


def replicated_config(endpoint: str) -> Any:
    from slurm_geo.config.daemons import FederationConfig, ReplicaConfig

    me = ReplicaConfig("home-a", "home", "http://127.0.0.1:9852")
    return FederationConfig(etcd_endpoints=(endpoint,), etcd_prefix=u.ETCD_PREFIX,
                            replica=me.name, replicas=(me,))
