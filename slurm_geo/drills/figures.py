"""The drill's measured figures from the daemons' records: what checkpoint-sync moved
off-site for the run (each checkpoint's copy, actual and predicted, and its lag), and
each leg's elapsed time and cost as billing bills it."""

from __future__ import annotations

import time
from typing import Any

from slurm_geo.config.model import SiteConfig
from slurm_geo.drills import losses
from slurm_geo.slurm import SlurmClient
from slurm_geo.sync.reader import SyncStateReader


def replication(site: SiteConfig, view: losses.FederationView, run: str,
                 resume_step: int | None) -> dict[str, Any]:
    """Bytes checkpoint-sync moved off-site for the run; each checkpoint's copy, actual
    and predicted by the daemon's bandwidth model (as it stands after the drill), and its
    lag (committed at home to verified off-site); and the same for the resume's."""
    if site.sync is None:
        return {"replicated_bytes": 0, "replication_seconds": 0.0, "replications": [],
                "predicted_transfer_s": None, "actual_transfer_s": None}
    from slurm_geo.federation.decide.bandwidth import BandwidthModel

    state = SyncStateReader(site.sync.state)  # it verified checkpoints: it must be there
    model = BandwidthModel.restore(view.bandwidth_snapshot())
    source, destination = site.sync.roots[0], site.sync.destination
    lags = {r.step: r.lag_s for r in state.replicas(run)}
    replications = []
    for step, lag in sorted(lags.items()):
        copy = state.copied(run, step)
        actual = None if copy.started_at is None or copy.finished_at is None \
            else round(copy.finished_at - copy.started_at, 3)
        predicted = model.predict_seconds(source, destination, copy.bytes)
        replications.append({
            "step": step, "bytes": copy.bytes, "actual_s": actual,
            "predicted_s": None if predicted is None else round(predicted, 3),
            "lag_s": None if lag is None else round(lag, 3)})
    resumed = next((r for r in replications if r["step"] == resume_step), None)
    total = state.copied(run)
    return {"replicated_bytes": total.bytes, "replication_seconds": total.seconds,
            "replications": replications,
            "predicted_transfer_s": None if resumed is None else resumed["predicted_s"],
            "actual_transfer_s": None if resumed is None else resumed["actual_s"]}


def legs(site: SiteConfig, clients: dict[str, SlurmClient],
          jobs: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """Elapsed time and cost of each leg as billing bills it (`billing.legs`, ingest's own
    arithmetic): a leg lost with its cluster is billed to the cluster's last answer,
    flagged estimated, not Slurm's elapsed time."""
    from slurm_geo.billing.config import billing_config
    from slurm_geo.billing.legs import leg_costs

    return [leg.as_dict() for leg in leg_costs(billing_config(site), clients, jobs,
                                               int(time.time()))]
