"""The drill's cost table is billing's own computation (`billing.legs`): a leg lost with its
cluster is billed to the cluster's last answer, flagged estimated, as ingest stores it and
the report sums it; never Slurm's elapsed time (issue 29: the drill billed the lost leg
665 s where billing said 245 s). Pure: records in, the same figures as ingest + report."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from slurm_geo.billing import service
from slurm_geo.billing.config import ClusterFacts, PriceEntry
from slurm_geo.billing.costs import PriceTable
from slurm_geo.billing.db import BillingDB
from slurm_geo.billing.ingest import IngestStats, ingest_records
from slurm_geo.billing.legs import leg_cost
from slurm_geo.billing.lineage import LegOwner
from slurm_geo.billing.outages import Outage
from slurm_geo.billing.periods import Period
from slurm_geo.slurm.models import AccountingRecord, JobState

T0 = int(datetime(2026, 11, 10, 8, 0, tzinfo=UTC).timestamp())
CLUSTERS = {"onprem": ClusterFacts("onprem", "home", "onprem"),
            "rented": ClusterFacts("rented", "remote", "gpu-market")}
PRICES = PriceTable([PriceEntry(0, 0.0, 0.01, 0.0, 0.0, cluster="onprem", source="t"),
                     PriceEntry(0, 2.5, 0.04, 0.09, 5.0, cluster="rented", source="t")],
                    CLUSTERS)
LOST = Outage("onprem", declared_at=T0 + 260, last_ok=T0 + 245)
LINEAGE = {("onprem", 20): LegOwner("onprem-20", "ml-research"),
           ("rented", 1): LegOwner("onprem-20", "ml-research")}


def record(cluster: str, job_id: int, start: int, elapsed: int, submit: int | None = None,
           state: JobState = JobState.COMPLETED, gpus: int = 0) -> AccountingRecord:
    def at(seconds: int) -> datetime:
        return datetime.fromtimestamp(seconds, UTC)
    tres = {"cpu": 2, **({"gres/gpu": gpus} if gpus else {})}
    return AccountingRecord(cluster, job_id, "train", "alice", "users", "batch", state,
                            at(submit if submit is not None else start), at(start),
                            at(start) + timedelta(seconds=elapsed), elapsed, tres, 0, "n1",
                            admin_comment="geo:cost_center=ml-research")


LEGS = {
    # the lost leg: Slurm closed it when the controller came back, 665 s after its start
    ("onprem", 20): [record("onprem", 20, T0, 665, state=JobState.CANCELLED)],
    # the leg that finished elsewhere: requeued once, both incarnations billed
    ("rented", 1): [record("rented", 1, T0 + 300, 40, state=JobState.REQUEUED, gpus=1),
                    record("rented", 1, T0 + 360, 93, submit=T0 + 341, gpus=1)],
}


@pytest.mark.parametrize("leg, elapsed, estimated", [
    (("onprem", 20), 245, True),
    (("rented", 1), 133, False),
])
def test_a_legs_cost_is_what_billing_stores_and_reports(tmp_path, leg, elapsed, estimated):
    cost = leg_cost(*leg, LEGS[leg], LINEAGE, [LOST], PRICES, T0 + 3600)
    assert cost.elapsed_s == elapsed
    assert any(flag.startswith("estimated: onprem was lost") for flag in cost.flags) \
        == estimated
    period = Period("2026-11", T0 - 3600, T0 + 7200)
    with BillingDB(tmp_path / "billing.db") as db:
        db.set_prices(*_config_prices())
        ingest_records(db, [r for records in LEGS.values() for r in records],
                       IngestStats("all", period.start, period.end), LINEAGE, T0 + 3600,
                       PRICES, outages=[LOST])
        billed = service.report(db, period, "job").groups[f"{leg[0]}:{leg[1]}"]
    assert (cost.cpu_seconds, cost.gpu_seconds) == (billed.cpu_seconds, billed.gpu_seconds)
    assert cost.cpu_seconds == 2 * elapsed
    assert round(cost.total_usd, 6) == round(billed.cpu_usd + billed.gpu_usd + billed.fee_usd, 6)
    assert (cost.fee_usd > 0) == (leg[0] == "rented")
    shown = cost.as_dict()
    assert shown["elapsed_s"] == elapsed and shown["total_usd"] == round(cost.total_usd, 6)


def _config_prices():
    entries = [PriceEntry(0, 0.0, 0.01, 0.0, 0.0, cluster="onprem", source="t"),
               PriceEntry(0, 2.5, 0.04, 0.09, 5.0, cluster="rented", source="t")]
    return entries, CLUSTERS


def test_a_leg_without_records_costs_nothing_and_a_pending_one_too():
    assert leg_cost("onprem", 9, [], {}, [], PRICES, T0).total_usd == 0
    pending = AccountingRecord("onprem", 9, "x", "alice", "users", "batch", JobState.PENDING,
                               datetime.fromtimestamp(T0, UTC), None, None, 0, {}, None, "")
    assert leg_cost("onprem", 9, [pending], {}, [], PRICES, T0).elapsed_s == 0
