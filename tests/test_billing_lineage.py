"""Whose is it (billing.lineage), table-driven and pure: the federation's records of each
logical job, which logical job every Slurm job belongs to, and whom each checkpoint
transfer is charged to, whatever store it came from. No files."""

from __future__ import annotations

import pytest

from slurm_geo.billing.attribution import RegistryJob
from slurm_geo.billing.lineage import (
    Attribution,
    FederatedJob,
    Leg,
    LegOwner,
    Owners,
    attribute,
    from_audit,
    from_state,
    merge,
)
from slurm_geo.federation.state.audit import Entry, utc_iso
from slurm_geo.slurm.models import Owner
from tests.kit import builders as kit

# onprem-50 trained on onprem:50 from t=100 and was moved to rented:1 at t=500 (the drill);
# run "shared" was continued by onprem-70 once onprem-60 had ended.
FEDERATED = [
    FederatedJob("onprem-50", "drill-a", "alice", "ml-research", 100.0,
                 (Leg("onprem", 50, 100.0), Leg("rented", 1, 500.0))),
    FederatedJob("onprem-60", "shared", "bob", "ops", 100.0, (Leg("onprem", 60, 100.0),)),
    FederatedJob("onprem-70", "shared", "bob", "", 1000.0, (Leg("onprem", 70, 1000.0),)),
]
REGISTRY = [
    RegistryJob("onprem", 50, "onprem:50", "alice", "ml-research", "/srv/pfs", 90.0),
    RegistryJob("onprem", 70, "onprem:70", "bob", "ops-2", "/srv/pfs", 990.0),
    RegistryJob("onprem", 80, "onprem:80", "bob", "ops", "/home/bob/ck", 200.0),
    RegistryJob("onprem", 81, "onprem:81", "bob", "ops-late", "/home/bob/ck/", 900.0),
    RegistryJob("onprem", 90, "onprem:90", "carol", "ml", "/pfs/ckpt/llm-7b", 50.0),
    RegistryJob("onprem", 95, "onprem:95", "dave", "", "/home/dave/ck", 50.0),
]
OWNERS = Owners(FEDERATED, REGISTRY, {("onprem", 50): "onprem:50"})
JOB_DIRS = {"file:///real/bob/ck": ("onprem:80",), "file:///real/eve": ("onprem:404",)}


def upload(run, root, at, **more):
    return {"run": run, "source": root, "destination": "offsite", "finished_at": at, **more}


def verify(run, root, at):
    return {"run": run, "source": "offsite", "destination": root, "finished_at": at}


@pytest.mark.parametrize("transfer, expected", [
    # a sync root (the store's name: no path to compare) holding the drill's run
    (upload("drill-a", "pfs", 300.0),
     Attribution("onprem-50", "onprem", 50, "alice", "ml-research", "federation")),
    # after the move, charged to the leg then current
    (upload("drill-a", "pfs", 600.0),
     Attribution("onprem-50", "rented", 1, "alice", "ml-research", "federation")),
    (verify("drill-a", "pfs", 600.0),
     Attribution("onprem-50", "rented", 1, "alice", "ml-research", "federation")),
    # before the records begin (another host's clock): the first leg
    (upload("drill-a", "pfs", 50.0),
     Attribution("onprem-50", "onprem", 50, "alice", "ml-research", "federation")),
    # the daemon's own copy names its logical job, whatever the run
    (upload("renamed", "offsite", 700.0, logical_job="onprem-50"),
     Attribution("onprem-50", "rented", 1, "alice", "ml-research", "federation")),
    (upload("drill-a", "offsite", 700.0, logical_job="onprem-999"),
     Attribution("onprem-50", "rented", 1, "alice", "ml-research", "federation")),
    # a run continued by a later job: the one registered by then
    (upload("shared", "pfs", 500.0), Attribution("onprem-60", "onprem", 60, "bob", "ops",
                                                 "federation")),
    # its own record has no cost center: the registry's for its leg
    (upload("shared", "pfs", 2000.0), Attribution("onprem-70", "onprem", 70, "bob", "ops-2",
                                                  "federation")),
    # a registered job directory, by its path as registered (normalised) ...
    (upload("x", "file:///home/bob/ck", 300.0),
     Attribution("onprem:80", "onprem", 80, "bob", "ops", "job directory")),
    (verify("x", "file:///home/bob/ck/.", 300.0),
     Attribution("onprem:80", "onprem", 80, "bob", "ops", "job directory")),
    # ... reused by a later job: the one started by then
    (upload("x", "file:///home/bob/ck", 950.0),
     Attribution("onprem:81", "onprem", 81, "bob", "ops-late", "job directory")),
    # ... or by checkpoint-sync's record of who named its real path
    (upload("x", "file:///real/bob/ck", 950.0),
     Attribution("onprem:80", "onprem", 80, "bob", "ops", "job directory")),
    # the federated job's own directory: its logical job, not the registry's spelling
    (upload("other", "file:///srv/pfs", 300.0),
     Attribution("onprem-50", "onprem", 50, "alice", "ml-research", "job directory")),
    # a directory named after the run
    (upload("llm-7b", "pfs", 300.0),
     Attribution("onprem:90", "onprem", 90, "carol", "ml", "run directory")),
    # owned, without a cost center (flagged in the report)
    (upload("y", "file:///home/dave/ck", 300.0),
     Attribution("onprem:95", "onprem", 95, "dave", "", "job directory")),
    # nobody: a shared root's run no record names; a tag the registry does not know
    (upload("nobody", "pfs", 300.0), Attribution()),
    (upload("nobody", "file:///real/eve", 300.0), Attribution()),
    (verify("nobody", "offsite", 300.0), Attribution()),
])
def test_whom_a_transfer_is_charged_to(transfer, expected):
    assert attribute(transfer, OWNERS, JOB_DIRS) == expected


def test_every_leg_belongs_to_its_logical_job():
    legs = OWNERS.lineage()
    # the daemon's id over the registry's spelling, for the home leg and the moved one
    assert legs[("onprem", 50)] == LegOwner("onprem-50", "ml-research")
    assert legs[("rented", 1)] == LegOwner("onprem-50", "ml-research")
    assert legs[("onprem", 70)] == LegOwner("onprem-70", "ops-2")
    assert legs[("onprem", 80)] == LegOwner("onprem:80", "ops")
    assert legs[("onprem", 95)] == LegOwner("onprem:95", "")
    assert ("rented", 2) not in legs


def entry(seq, kind, logical, at, **detail):
    return Entry(seq, utc_iso(at), kind, logical, "what", "why", detail, "0" * 64, "h")


AUDIT = [
    entry(1, "register", "onprem-50", 100.0, cluster="onprem", job_id=50, run="",
          directives={"geo-cost-center": "ml-research", "geo-ckpt-dir": "/srv/pfs"},
          owner="alice", uid=1000, gid=1000),
    entry(2, "lease", "onprem-50", 110.0, cluster="onprem", job_id=50, generation=0),
    # a refused request names what the requester claims: never a leg
    entry(3, "refused", "onprem-50", 120.0, cluster="onprem", job_id=66),
    entry(4, "transfer", "onprem-50", 490.0, run="drill-a", step=80, bytes=5),
    entry(5, "requeue", "onprem-50", 500.0, cluster="rented", job_id=1, generation=1,
          run="drill-a", resume_step=80),
    entry(6, "requeue", "onprem-50", 510.0, cluster="rented", generation=2),  # not submitted
    entry(7, "resubmit", "onprem-50", 900.0, cluster="onprem", job_id=77, generation=3),
    entry(8, "requeue", "onprem-60", 950.0, cluster="rented", job_id=True),  # not an id
    entry(9, "outage", None, 960.0, cluster="onprem"),
]


def test_the_audit_log_names_runs_owners_and_every_leg():
    assert from_audit(AUDIT) == [
        FederatedJob("onprem-50", "drill-a", "alice", "ml-research", 100.0,
                     (Leg("onprem", 50, 100.0, trained_since=110.0), Leg("rented", 1, 500.0),
                      Leg("onprem", 77, 900.0))),
        FederatedJob("onprem-60", "", "", "", 950.0, ()),
    ]


def logical_job(name, run, created, **over):
    return kit.logical_job(**{
        "logical_job": name, "run": run, "script": "#!/bin/sh", "spec": {},
        "directives": {"geo-cost-center": "ml-research"}, "generation": 1, "cluster": "rented",
        "job_id": 1, "resume_step": 80, "created_at": created, "updated_at": 0.0,
        "owner": Owner("alice", 1000, 1000), **over})


def incarnation(name, generation, cluster, job_id, at):
    return kit.incarnation(logical_job=name, generation=generation, cluster=cluster,
                           job_id=job_id, submitted_at=at, training_at=None)


def test_a_legs_first_lease_survives_the_merge_whichever_record_is_earlier():
    """The state records no lease; the audit log's first lease of a leg is kept even when
    the state's record of that leg starts earlier (it billed a leg whose start Slurm lost
    from the wrong moment, seen on a replicated sandbox's site-loss drill)."""
    state = [FederatedJob("onprem-5", "r", "alice", "", 99.0, (Leg("onprem", 5, 99.0),))]
    audit = [FederatedJob("onprem-5", "r", "", "", 100.0, (Leg("onprem", 5, 100.0, 101.5),))]
    for sources in ((state, audit), (audit, state)):
        [job] = merge(*sources)
        assert job.legs == (Leg("onprem", 5, 99.0, 101.5),)


def test_the_state_and_the_audit_log_merge_into_one_record_per_job():
    state = from_state(
        [logical_job("onprem-50", "drill-a", 100.0),
         logical_job("onprem-80", "late", 800.0, owner=None, directives={})],
        {"onprem-50": [incarnation("onprem-50", 0, "onprem", 50, 101.0),
                       incarnation("onprem-50", 1, "rented", 1, 499.0),
                       incarnation("onprem-50", 2, "onprem", None, 950.0)]})  # moving
    assert state[0] == FederatedJob("onprem-50", "drill-a", "alice", "ml-research", 100.0,
                                    (Leg("onprem", 50, 101.0), Leg("rented", 1, 499.0)))
    audit = [FederatedJob("onprem-50", "from-audit", "", "ops", 90.0,
                          (Leg("onprem", 50, 100.0), Leg("onprem", 77, 900.0))),
             FederatedJob("onprem-20", "old", "zoe", "", 10.0, ())]
    assert merge(state, audit) == [
        FederatedJob("onprem-20", "old", "zoe", "", 10.0, ()),
        # the state's fields first; legs the union, each from its earliest record
        FederatedJob("onprem-50", "drill-a", "alice", "ml-research", 90.0,
                     (Leg("onprem", 50, 100.0), Leg("rented", 1, 499.0),
                      Leg("onprem", 77, 900.0))),
        FederatedJob("onprem-80", "late", "", "", 800.0, ()),
    ]
