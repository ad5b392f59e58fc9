"""The audit log in etcd, against a real etcd: what someone with write access to etcd (and
not the master key) can do to it is found at the right seq; only the leader appends, and
the chain goes on across a change of leader. The chain itself is tested on both backends
in test_federation_audit.py."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import etcd3gw
import pytest

from slurm_geo.federation.model import NotLeader
from slurm_geo.federation.state.etcd.audit import EtcdAuditLog
from slurm_geo.federation.state.etcd.state import EtcdFederationState
from tests.etcd_server import EtcdMember, data_bytes, fresh_prefix, open_replica
from tests.kit.audit import audit_clock, fill


def audit_of(replica: EtcdFederationState) -> EtcdAuditLog:
    return EtcdAuditLog(replica.kv, replica.layout, replica.leadership, clock=audit_clock())


@pytest.fixture
def two(etcd: EtcdMember) -> Iterator[tuple[EtcdFederationState, EtcdFederationState]]:
    prefix = fresh_prefix()
    onprem = open_replica([etcd.client_url], prefix, "onprem-a")
    cloud = open_replica([etcd.client_url], prefix, "cloud-b", site="cloud")
    assert onprem.leadership.campaign()
    yield onprem, cloud
    for replica in (onprem, cloud):
        replica.leadership.resign()
        replica.close()


@pytest.fixture
def raw(etcd: EtcdMember) -> etcd3gw.Etcd3Client:
    """etcd as someone with access to it and not to the master key sees it."""
    return etcd3gw.client(host="127.0.0.1", port=etcd.client_port)


def test_a_deleted_entry_is_a_gap(two, raw) -> None:
    log = fill(audit_of(two[0]))
    raw.delete(log.layout.audit_entry(3))
    report = log.verify()
    assert (report.ok, report.first_bad_seq, report.entries) == (False, 3, 5)
    assert "entry 3 is missing (the next is 4)" in report.problem


def test_an_entry_moved_from_another_key_does_not_open_and_is_found_at_its_seq(
        two, raw) -> None:
    log = fill(audit_of(two[0]))
    (sealed,) = raw.get(log.layout.audit_entry(5))
    raw.put(log.layout.audit_entry(2), sealed)
    report = log.verify()
    assert (report.ok, report.first_bad_seq, report.entries) == (False, 2, 6)
    assert "entry 2 does not open under the state key" in report.problem


def test_a_cut_tail_is_only_found_with_a_head_kept_elsewhere(two, raw) -> None:
    log = fill(audit_of(two[0]))
    kept = log.head()
    for seq in (5, 6):
        raw.delete(log.layout.audit_entry(seq))
    raw.delete(log.layout.audit_head)
    assert log.verify().ok
    report = log.verify(expected_head=kept)
    assert (report.ok, report.first_bad_seq) == (False, 5)
    assert "entries 5 to 6 were cut off" in report.problem


def test_only_the_leader_appends_and_the_chain_goes_on_across_a_new_leader(two) -> None:
    onprem, cloud = two
    old, new = audit_of(onprem), audit_of(cloud)
    fill(old, 3)
    with pytest.raises(NotLeader):
        new.append("decision", None, "move", "a follower")
    cloud.kv.revoke(onprem.leadership.lease or 0)  # onprem's lease ran out while it stalled
    assert cloud.leadership.campaign()
    with pytest.raises(NotLeader):
        old.append("decision", None, "move", "deposed")
    entry = new.append("decision", None, "moved", "cloud-b leads")
    assert (entry.seq, entry.prev_hash) == (4, old.entries()[2].hash)
    report = old.verify()  # any replica reads and verifies
    assert (report.ok, report.entries, report.head) == (True, 4, (4, entry.hash))


def test_concurrent_appends_from_two_threads_of_the_leader_keep_one_chain(two) -> None:
    onprem, _ = two
    logs = [audit_of(onprem), audit_of(onprem)]
    start = threading.Barrier(2)

    def append_many(log: EtcdAuditLog, worker: int) -> None:
        start.wait()
        for i in range(30):
            log.append("transfer", f"job-{worker}", f"chunk {i}", "replication", worker=worker)

    threads = [threading.Thread(target=append_many, args=(log, w)) for w, log in
               enumerate(logs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    report = logs[0].verify()
    assert (report.ok, report.entries) == (True, 60)
    assert [e.seq for e in logs[1].entries()] == list(range(1, 61))
    assert len(logs[0].entries(logical_job="job-1")) == 30


def test_no_detail_of_an_entry_is_in_the_clear_in_etcds_data(two, etcd: EtcdMember) -> None:
    marker = uuid.uuid4().hex
    audit_of(two[0]).append("decision", f"job-{marker}", f"what-{marker}", f"why-{marker}",
                            detail=f"detail-{marker}")
    stored = data_bytes(etcd)
    for text in ("what", "why", "detail", "job"):
        assert f"{text}-{marker}".encode() not in stored
