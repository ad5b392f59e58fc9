"""Egress and moved legs charged to their logical job, through the ingest path and real
files: a registry written by the registry's own writer, a federation state and audit log
written by their own classes (as the daemon writes them), a checkpoint-sync state with its
transfers and sources. The story is the sandbox drill's: job onprem:50 checkpoints run
drill-a straight into the sync root `pfs`; the federation daemon moves it to rented:1
through slurmrestd (no PrologSlurmctld there, no cost-center tag) and copies a checkpoint
back on failback. Beside it: a job writing to its own directory, and a run nobody owns."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from slurm_geo.billing import costs, invoice, service
from slurm_geo.billing.config import BillingConfig, ClusterFacts, PriceEntry
from slurm_geo.billing.db import BillingDB
from slurm_geo.billing.periods import parse_period
from slurm_geo.ckpt.format.keys import create_master_key_file, load_master_key
from slurm_geo.config.daemons import FederationConfig, ReplicaConfig
from slurm_geo.federation.model import FederationStateError, JobStatus, LogicalJob
from slurm_geo.federation.state.audit import AuditLog
from slurm_geo.federation.state.etcd.audit import EtcdAuditLog
from slurm_geo.federation.state.sqlite import FederationState
from slurm_geo.registry import Registry
from slurm_geo.slurm.fake import FakeSlurm
from slurm_geo.slurm.models import AccountingRecord, JobState, Owner
from slurm_geo.sync.jobdirs import SourceStatus
from slurm_geo.sync.state import Source, StateDB
from tests.etcd_server import fresh_prefix, open_replica

CLUSTERS = {"onprem": ClusterFacts("onprem", "home", "onprem"),
            "rented": ClusterFacts("rented", "remote", "gpu-market")}
PRICES = (PriceEntry(0, 0.0, 0.01, 0.02, 0.0, cluster="onprem", source="t"),
          PriceEntry(0, 2.5, 0.04, 0.09, 5.0, cluster="rented", source="t"))
T0 = datetime(2026, 11, 12, 8, 0, tzinfo=UTC).timestamp()  # registered, trains at home
MOVED = T0 + 3600                                        # rented:1 submitted
BACK = T0 + 7200                                         # failback copy offsite -> pfs
OBJECTS = 13                                             # objects per checkpoint
GB = 10**9


class Accounting(FakeSlurm):
    """A cluster's accounting as the Slurm layer answers it (REST clusters' shape)."""

    def __init__(self, cluster: str, records: list[AccountingRecord]):
        super().__init__(cluster)
        self.records = records

    def accounting(self, job_ids: Iterable[int] = (), start: datetime | None = None,
                   end: datetime | None = None) -> list[AccountingRecord]:
        return self.records


def record(cluster, job_id, start, hours, admin="", account=""):
    began = datetime.fromtimestamp(start, UTC)
    return AccountingRecord(cluster=cluster, job_id=job_id, name="geo-drill", user="alice",
                            account=account, partition="gpu", state=JobState.COMPLETED,
                            submit_time=began - timedelta(seconds=5), start_time=began,
                            end_time=began + timedelta(hours=hours),
                            elapsed_s=int(hours * 3600), allocated_tres={"cpu": 4, "gres/gpu": 1},
                            exit_code=0, nodes="n1", admin_comment=admin)


def write_registry(tmp_path, pfs):
    with Registry(tmp_path / "registry.db") as registry:
        registry.job_started("onprem", 50, 0, name="geo-drill", user="alice", nodes="n1",
                             directives={"geo-ckpt-dir": str(pfs),
                                         "geo-cost-center": "ml-research",
                                         "geo-failover": "auto"}, now=T0 - 10)
        registry.job_started("onprem", 70, 0, name="bob", user="bob", nodes="n2",
                             directives={"geo-ckpt-dir": "/home/bob/link-to-ck",
                                         "geo-cost-center": "ops"}, now=T0 - 10)


def write_federation(tmp_path, pfs):
    """What the daemon writes: the job registered at its first lease, moved to rented:1,
    a checkpoint copied back on failback (federation.registration, .mover)."""
    clock = [T0]
    state = FederationState(tmp_path / "federation.db")
    with AuditLog(tmp_path / "audit.db", clock=lambda: clock[0]) as audit:
        record_federation(state, audit, clock, pfs)
    state.close()


def record_federation(state, audit, clock: list[float], pfs) -> None:
    directives = {"geo-ckpt-dir": str(pfs), "geo-cost-center": "ml-research",
                  "geo-failover": "auto"}
    state.add_job(LogicalJob(logical_job="onprem-50", run="drill-a", home="onprem",
                             script="#!/bin/bash\n", spec={}, directives=directives, generation=0,
                             cluster="onprem", job_id=50, resume_step=None,
                             status=JobStatus.RUNNING, created_at=T0, updated_at=T0,
                             owner=Owner("alice", 1000, 1000)))
    audit.append("register", "onprem-50", "registered onprem:50 (run drill-a) of alice",
                 "first lease", cluster="onprem", job_id=50, run="drill-a",
                 directives=directives, owner="alice", uid=1000, gid=1000)
    clock[0] = MOVED
    state.begin_generation("onprem-50", 0, "rented", 80, MOVED)
    state.submitted("onprem-50", 1, 1, "0" * 64, MOVED)
    audit.append("requeue", "onprem-50", "generation 1 submitted as rented:1",
                 "resumes drill-a from step 80", cluster="rented", job_id=1, generation=1,
                 run="drill-a", resume_step=80, store="offsite")
    clock[0] = BACK
    audit.append("transfer", "onprem-50", "copied drill-a@160 from offsite to pfs",
                 "the job moves; its newest checkpoint goes with it", bytes=2 * GB,
                 seconds=4.0, packs_copied=3, run="drill-a", step=160, source="offsite",
                 destination="pfs", source_region="remote", destination_region="home")


def write_sync(tmp_path):
    """checkpoint-sync's uploads (each object a transfer) and read-backs: drill-a from the
    root `pfs`, before and after the move; bob's run from his job directory (named by its
    real path); a run nobody owns."""
    state = StateDB(tmp_path / "sync.db")
    bob_root = "file:///real/bob/ck"
    for run, root, step, at in (("drill-a", "pfs", 40, T0 + 600), ("drill-a", "pfs", 80, T0 + 1200),
                                ("drill-a", "pfs", 160, MOVED + 600),
                                ("bob-run", bob_root, 10, T0 + 900),
                                ("nobody", "pfs", 1, T0 + 900), ("nobody", "pfs", 2, T0 + 1800)):
        [replica_id] = state.add([{"root": root, "run": run, "step": step,
                                   "destination": "offsite", "sequence": 1,
                                   "status": "pending"}], now=at)
        replica = state.replica(replica_id)
        for i in range(OBJECTS):
            state.record_transfer(replica, {
                "object": f"packs/{run}-{step}-{i}", "kind": "pack", "bytes": GB // 10,
                "source": root, "source_region": "home", "destination_region": "remote",
                "started_at": at, "finished_at": at + i})
        state.record_transfer(replica, {
            "object": f"manifests/{run}/{step}", "kind": "verify", "bytes": GB // 2,
            "source": "offsite", "destination": root, "source_region": "remote",
            "destination_region": "home", "started_at": at + 20, "finished_at": at + 30})
    state.record_sources([Source(bob_root, "job", "/home/bob/link-to-ck",
                                 SourceStatus.WATCHED, ("onprem:70",), ("bob",), since=T0)])
    state.close()


@pytest.fixture
def site(tmp_path):
    pfs = tmp_path / "pfs"
    write_registry(tmp_path, pfs)
    write_federation(tmp_path, pfs)
    write_sync(tmp_path)
    config = BillingConfig(database=tmp_path / "billing.db", sync_state=tmp_path / "sync.db",
                           federation_audit=tmp_path / "audit.db",
                           federation_state=tmp_path / "federation.db",
                           registry=tmp_path / "registry.db", prices=PRICES, clusters=CLUSTERS)
    clients = [Accounting("onprem", [record("onprem", 50, T0, 1.0,
                                            admin="geo:cost_center=ml-research")]),
               # slurmrestd's record of the moved leg: no tag, the rental's own account
               Accounting("rented", [record("rented", 1, MOVED + 60, 1.5,
                                            account="marketplace")])]
    return config, clients


@pytest.fixture
def replicated_site(site, etcd, tmp_path):
    """The same records written by a replica of the daemon into etcd, sealed under the
    site's master key, and billing configured to read them there ([federation]
    etcd_endpoints: no SQLite state or audit log)."""
    config, clients = site
    key_file = tmp_path / "master.key"
    create_master_key_file(key_file)
    prefix = fresh_prefix()
    state = open_replica([etcd.client_url], prefix, "home", site="home",
                         master_keys=load_master_key(key_file))
    assert state.leadership.campaign()
    clock = [T0]
    audit = EtcdAuditLog(state.kv, state.layout, state.leadership, clock=lambda: clock[0],
                         replica="home")
    record_federation(state, audit, clock, tmp_path / "pfs")
    federation = FederationConfig(
        key_file=key_file, etcd_endpoints=(etcd.client_url,), etcd_prefix=prefix,
        replica="home", replicas=(ReplicaConfig("home", "home", "https://home.example:9852"),))
    yield replace(config, database=tmp_path / "billing-etcd.db", federation_audit=None,
                  federation_state=None, federation_etcd=federation), clients
    state.leadership.resign()
    state.close()


def ingest_twice(config, clients):
    with BillingDB(config.database) as db:
        dumps = []
        for _ in range(2):  # the second time changes nothing
            service.run_ingest(db, config, clients, now=int(BACK) + 60, since=int(T0) - 60)
            dumps.append(db.dump())
        assert dumps[0] == dumps[1]
        return {"egress": [dict(r) for r in db.conn.execute(
                    "SELECT * FROM egress ORDER BY finished_at, object")],
                "jobs": {(r["cluster"], r["job_id"]): dict(r)
                         for r in db.conn.execute("SELECT * FROM jobs")},
                "report": service.report(db, parse_period("2026-11"), "cost-center"),
                "lines": list(service.period_lines(db, parse_period("2026-11"), []))}


def test_egress_of_a_sync_root_run_is_its_logical_jobs_before_and_after_the_move(site):
    found = ingest_twice(*site)
    drill = [r for r in found["egress"] if r["run"] == "drill-a"]
    assert len(drill) == 3 * (OBJECTS + 1) + 1  # uploads, read-backs, the daemon's copy
    assert {(r["logical_id"], r["cost_center"], r["cost_center_source"], r["user"])
            for r in drill} == {("onprem-50", "ml-research", "directive", "alice")}
    legs = {(r["step"], r["kind"]): f"{r['job_cluster']}:{r['job_id']}" for r in drill}
    assert legs[(40, "pack")] == legs[(80, "verify")] == "onprem:50"
    assert legs[(160, "pack")] == legs[(160, "verify")] == legs[(160, "move")] == "rented:1"
    bob = {(r["logical_id"], r["job_id"], r["cost_center"])
           for r in found["egress"] if r["run"] == "bob-run"}
    assert bob == {("onprem:70", 70, "ops")}  # by checkpoint-sync's record of the directory


def test_the_moved_leg_is_billed_under_its_logical_job_with_its_cluster(site):
    jobs = ingest_twice(*site)["jobs"]
    home, moved = jobs[("onprem", 50)], jobs[("rented", 1)]
    assert (home["logical_id"], home["cost_center"], home["cost_center_source"]) == (
        "onprem-50", "ml-research", "directive")
    assert (moved["cluster"], moved["logical_id"], moved["cost_center"],
            moved["cost_center_source"], moved["flags"]) == (
        "rented", "onprem-50", "ml-research", "logical job", "")


def test_flags_and_invoices_are_per_job_not_per_object(site):
    found = ingest_twice(*site)
    result = found["report"]
    assert set(result.groups) == {"ml-research", "ops", "(none)"}
    # one flag for the run nobody owns, though its 28 transfers are priced by two clusters
    assert [(f.kind, f.cluster, f.subject, f.count) for f in result.flags] == [
        ("no cost center", "onprem,rented", "run:nobody", 2 * (OBJECTS + 1))]
    bills = invoice.invoices(found["lines"], parse_period("2026-11"))
    assert {li.owner.logical_id for li in bills["ml-research"].lines} == {"onprem-50"}
    assert [(li.owner.job, li.line.kind, li.line.cluster, li.items)
            for li in bills["ml-research"].lines] == [
        ("onprem:50", "cpu", "onprem", 1), ("onprem:50", "gpu", "onprem", 1),
        ("rented:1", "cpu", "rented", 1), ("rented:1", "gpu", "rented", 1),
        ("rented:1", "marketplace_fee", "rented", 1),
        # uploads leave home (priced by onprem), read-backs and the copy leave remote
        ("onprem:50", "egress", "onprem", 2 * OBJECTS), ("onprem:50", "egress", "rented", 2),
        ("rented:1", "egress", "onprem", OBJECTS), ("rented:1", "egress", "rented", 2)]
    assert [(li.owner.job, li.line.cluster, li.items) for li in bills["(none)"].lines] == [
        ("run:nobody", "onprem", 2 * OBJECTS), ("run:nobody", "rented", 2)]
    assert bills["ml-research"].total == round(result.groups["ml-research"].total_usd, 2)


def test_replicas_records_in_etcd_bill_exactly_as_a_daemon_alones(site, replicated_site):
    alone, replicated = ingest_twice(*site), ingest_twice(*replicated_site)
    assert replicated["egress"] == alone["egress"] and replicated["jobs"] == alone["jobs"]
    moved = replicated["jobs"][("rented", 1)]
    assert (moved["logical_id"], moved["cost_center"]) == ("onprem-50", "ml-research")
    assert any(r["kind"] == "move" for r in replicated["egress"])  # the daemon's own copy


def test_etcd_not_answering_fails_ingest_and_bills_nothing_blind(replicated_site):
    config, clients = replicated_site
    gone = replace(config.federation_etcd, etcd_endpoints=("http://127.0.0.1:9",))
    with BillingDB(config.database) as db:
        result = service.run_ingest(db, replace(config, federation_etcd=gone), clients,
                                    now=int(BACK) + 60)
        assert db.conn.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 0
    assert result.exit_code == FederationStateError.exit_code
    assert "ownership" in result.failures


def test_a_damaged_federation_state_stops_ingest(site, tmp_path):
    config, clients = site
    (tmp_path / "federation.db").write_bytes(b"not a database, whatever it is\n" * 100)
    with BillingDB(config.database) as db:
        result = service.run_ingest(db, config, clients, now=int(BACK) + 60)
    assert result.exit_code == FederationStateError.exit_code
    assert "federation state" in result.failures["ownership"]
    assert {s.outcome.value for s in result.sources if s.source != "ownership"} == {"skipped"}


def test_without_the_federations_records_a_shared_roots_run_is_nobodys(site, tmp_path):
    config, clients = site
    (tmp_path / "federation.db").unlink()
    (tmp_path / "audit.db").unlink()
    with BillingDB(config.database) as db:
        service.run_ingest(db, config, clients, now=int(BACK) + 60, since=int(T0) - 60)
        rows = db.conn.execute("SELECT DISTINCT logical_id, cost_center FROM egress WHERE "
                               "run = 'drill-a'").fetchall()
        moved = db.conn.execute("SELECT logical_id FROM jobs WHERE cluster = 'rented'"
                                ).fetchone()
    # the registry's job 50 wrote into the root itself: the path names no run
    assert [tuple(r) for r in rows] == [("", "")]
    assert moved[0] == "rented:1"


def test_prices_are_those_of_the_region_the_bytes_leave():
    table = costs.PriceTable(PRICES, CLUSTERS)
    assert costs.egress_line(GB, "home", "remote", int(T0), table).amount == 0.02
    assert costs.egress_line(GB, "remote", "home", int(T0), table).amount == 0.09
