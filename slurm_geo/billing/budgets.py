"""Budget checks: pure decisions over what a period cost, and the webhook that reports them.

Two budgets exist. `[billing.budgets]` is USD per calendar month and cost center; a cost
center past `warn_pct` of it gets a warning, past all of it an "exceeded" alert.
`[policy.budgets]` is USD per job (the cap --geo-max-cost is checked against at
submission); a logical job that cost more than its cost center's cap is reported too.
`check_budgets` decides both for a period (`billing budgets`, `billing ingest
--check-budgets`); the command only prints what it found and exits 51 on `exceeded`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from slurm_geo.billing.costs import CostLine
from slurm_geo.billing.report import Owner


@dataclass(frozen=True)
class Alert:
    level: str          # "warning" or "exceeded"; "error" (`failure_alert`)
    cost_center: str
    subject: str        # "month" or the logical job
    spent_usd: float
    budget_usd: float
    message: str


@dataclass(frozen=True)
class BudgetCheck:
    """One period's budgets checked: USD spent per cost center and the alerts, monthly
    budgets' first (by cost center), then per-job budgets' (by cost center and job)."""

    period: str
    spent: dict[str, float]
    alerts: list[Alert]

    @property
    def exceeded(self) -> list[Alert]:
        """The alerts of a budget overspent (not those only past `warn_pct`)."""
        return [a for a in self.alerts if a.level == "exceeded"]


def check_budgets(lines: Iterable[tuple[Owner, CostLine]], monthly: Mapping[str, float],
                  warn_pct: float, job_caps: Mapping[str, float], period: str) -> BudgetCheck:
    """`lines`: the period's cost lines; `monthly`: [billing.budgets]; `job_caps`:
    [policy.budgets]."""
    centers, jobs = spending(lines)
    return BudgetCheck(period, centers, check_monthly(centers, monthly, warn_pct, period)
                       + check_jobs(jobs, job_caps))


def check_monthly(spent: Mapping[str, float], budgets: Mapping[str, float], warn_pct: float,
                  period: str) -> list[Alert]:
    alerts = []
    for center, budget in sorted(budgets.items()):
        used = round(spent.get(center, 0.0), 2)
        if used > budget:
            level = "exceeded"
        elif used >= budget * warn_pct / 100:
            level = "warning"
        else:
            continue
        alerts.append(Alert(level, center, "month", used, budget,
                            f"billing: cost center '{center}' spent {used:.2f} USD of its "
                            f"{budget:.2f} USD budget for {period} ({used / budget:.0%})"))
    return alerts


def check_jobs(job_costs: Mapping[tuple[str, str], float], caps: Mapping[str, float]
               ) -> list[Alert]:
    """`job_costs`: {(cost center, logical job): USD}; `caps`: [policy.budgets]."""
    alerts = []
    for (center, job), used in sorted(job_costs.items()):
        cap = caps.get(center)
        if cap is not None and round(used, 2) > cap:
            alerts.append(Alert("exceeded", center, job, round(used, 2), cap,
                                f"billing: job {job} of cost center '{center}' cost "
                                f"{used:.2f} USD, over the per-job budget of {cap:.2f} USD"))
    return alerts


def spending(lines: Iterable[tuple[Owner, CostLine]]
             ) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    """USD per cost center, and per (cost center, logical job)."""
    centers: dict[str, float] = {}
    jobs: dict[tuple[str, str], float] = {}
    for owner, line in lines:
        amount = line.amount or 0.0
        centers[owner.cost_center] = centers.get(owner.cost_center, 0.0) + amount
        key = (owner.cost_center, owner.logical_id or owner.job)
        jobs[key] = jobs.get(key, 0.0) + amount
    return centers, jobs


def failure_alert(subject: str, message: str) -> Alert:
    """A `billing ingest` that could not read a source, or a `billing check` that found a
    difference, sent as budget alerts are (level "error"): a bill known to be incomplete or
    wrong is the webhook's business as much as an overspent one."""
    return Alert("error", "", subject, 0.0, 0.0, message)


def post_webhook(url: str, period: str, alerts: Sequence[Alert], timeout_s: float = 5.0,
                 session: Any = None) -> str | None:
    """POST the alerts as JSON; the error text if that failed (alerts are logged anyway)."""
    import requests

    http = session or requests
    body = {"source": "slurm-geo billing", "period": period,
            "alerts": [asdict(a) for a in alerts],
            "text": "\n".join(a.message for a in alerts)}
    try:
        response = http.post(url, json=body, timeout=timeout_s)
    except requests.RequestException as exc:
        return f"webhook {url}: {type(exc).__name__}"
    if response.status_code >= 400:
        return f"webhook {url}: HTTP {response.status_code}"
    return None
