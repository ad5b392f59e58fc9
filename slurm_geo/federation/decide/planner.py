"""Where a job should run next: stay, move to another cluster, or fail back home. Pure.

The rule (docs/federation.md, "Placement planner"): remaining training is the same
everywhere, so a cluster's cost in time is what it takes the job to *start* there:

    total_s = predicted transfer of the newest verified checkpoint
              + predicted transfer of its world not yet staged there + queue wait

- The current cluster is usable (up and able to run the job): move only when the best
  other eligible cluster satisfies `total_s + margin_s < current queue wait` (the current
  cluster's transfer is 0). The margin is hysteresis: a job does not flap between two
  clusters whose estimates differ by noise.
- Failback: a job away from home, whose home is eligible and can start within
  `failback_s`, goes home even though staying would be quicker: home is where the site
  wants its jobs (its own hardware, no rental). The daemon moves it at its next checkpoint.
- The current cluster is down (or can no longer run the job): the eligible cluster that
  starts soonest, ties by cost. A cluster whose wait or bandwidth is unknown is then still
  eligible (an unknown wait beats an outage) but ranks after every known one.

Eligibility (a candidate other than the current cluster): the job's owner can run there
(on a REST cluster, `[clusters.NAME.users]` maps them to an account); up; fits the job;
allowed by residency / data class (`slurm_geo.policy.geo.check`); named by `--geo-clusters` when
given; predicted cost within `--geo-max-cost` when given; not a native Slurm federation
sibling of the current cluster (Slurm moves jobs between those); a verified checkpoint to
move from; `--geo-failover` not `never`; and, while the current cluster is usable, known
queue wait and bandwidth.

`--geo-failover`: `auto` moves without asking; `manual` and no directive plan the same
but mark a move `needs_approval` (the daemon asks a person instead of moving); `never`
makes every other cluster ineligible, so the job stays, waiting out an outage.

Cost of running the rest of the job on a cluster (gpus and cpus are the job's totals over
all its nodes, not per node):

    compute = remaining_s / 3600 * (gpus * gpu_hour + cpus * cpu_hour)   (gpu, cpu parts)
    fee     = marketplace_fee_pct / 100 * compute
    egress  = checkpoint_bytes / 1e9 * egress_per_gb of the source region, when the
              checkpoint's store and the cluster's store are in different regions

The source region's price is that of the current cluster when it is in that region, else
of the first cluster by name in it, else the current cluster's. Staying costs no egress.

A job's *world* (its `--geo-inputs` and `--geo-env`: docs/directives.md) lives at home
and is staged to other sites' stores ahead of a loss (`WorldStaging`). At a candidate, the
bytes not yet staged in its store are read from home's store at the link's predicted rate,
twice (`stage_s`: checkpoint-sync reads each pack back to verify it), with the link
shared with the job's own checkpoints meanwhile (`with_checkpoints`: each one, every
`checkpoint_every_s` of its newest checkpoints' times, is replicated first and cuts the
world's pass), and charged as
egress from home's region; a move while home is up waits until they are there
(federation.worldwait); a candidate where the world is missing, or of
unknown size, is ineligible while home is down (nothing can be read from home then), so
a job whose world is staged nowhere else is not moved off a lost home. A candidate where
the world already is starts sooner, and so ranks first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from slurm_geo.cells import table
from slurm_geo.config.model import Prices
from slurm_geo.policy.directives import DirectiveError, Directives
from slurm_geo.policy.geo import GeoRules, check

DEFAULT_MARGIN_S = 60.0
DEFAULT_FAILBACK_S = 600.0
WORLD_CROSSINGS = 2  # a staged byte is put at the destination, then read back to verify
# What each of the job's checkpoints costs a world being staged besides the checkpoint's
# own bytes: checkpoint-sync's world pass gives way to it (the packs in flight drain,
# the checkpoint goes, the pass starts again). bench/world_move.py at 200 Mbit/s, a
# checkpoint every 5 s: 2048 MB crossed in 92.0 s, 85.7 s at the link's payload rate, 18
# checkpoints: 0.35 s each.
WORLD_GIVE_WAY_S = 0.35
# The share of the link the job's checkpoints may be counted to take from its world at
# most: a job that checkpoints all the time still has its world staged, slowly (10x).
MAX_CHECKPOINT_SHARE = 0.9

PredictTransfer = Callable[[str, str, int], float | None]


@dataclass(frozen=True)
class WorldStaging:
    """The job's inputs and software environment as staging has them: their size at home
    (`total_bytes`; None while no staging has measured it), the bytes verified in each
    store by name (`staged`), and `source_store`, home's store, where they are read from."""

    source_store: str
    total_bytes: int | None = None
    staged: Mapping[str, int] = field(default_factory=dict)

    def missing(self, store: str) -> int | None:
        """Bytes still to stage into `store`; None when the size is unknown."""
        if store == self.source_store:
            return 0
        if self.total_bytes is None:
            return None
        return max(0, self.total_bytes - self.staged.get(store, 0))


@dataclass(frozen=True)
class JobNeeds:
    """What the job needs to continue. `checkpoint_store` is "" when no verified
    checkpoint exists (the job cannot move). `spent_usd` counts against --geo-max-cost."""

    logical_job: str
    home: str
    current: str
    nodes: int
    cpus: int
    gpus: int
    remaining_s: float
    checkpoint_bytes: int
    checkpoint_store: str
    directives: Directives = field(default_factory=Directives)
    spent_usd: float = 0.0
    world: WorldStaging | None = None  # None: the job declares no inputs and no env
    # How often the job checkpoints now (`checkpoint_every_s` of its newest
    # checkpoints' times); None: unknown (fewer than two checkpoints).
    checkpoint_every_s: float | None = None


@dataclass(frozen=True)
class ClusterView:
    """One cluster as the daemon sees it now. `queue_wait_s` None: Slurm could not tell."""

    name: str
    region: str
    store: str
    prices: Prices
    up: bool
    queue_wait_s: float | None
    fits: bool
    federation_sibling: bool = False
    owner_refused: str = ""  # why the job's owner cannot run there ('' if they can)
    # Where the cluster has none of home's files, how fast a moved job's preamble fetches
    # and materialises its world there (MB/s); None: it runs on home's files.
    world_fetch_mb_s: float | None = None


@dataclass(frozen=True)
class Cost:
    """A move's predicted cost at a target, in USD: the rest of the job's GPU and CPU hours,
    its checkpoint's (and world's) egress, the marketplace's fee on the hours."""

    gpu: float = 0.0
    cpu: float = 0.0
    egress: float = 0.0
    fee: float = 0.0

    @property
    def total(self) -> float:
        return self.gpu + self.cpu + self.egress + self.fee


@dataclass(frozen=True)
class Candidate:
    cluster: str
    eligible: bool
    why_not: str
    transfer_s: float | None
    queue_wait_s: float | None
    total_s: float | None
    cost_usd: float
    cost_breakdown: Cost


@dataclass(frozen=True)
class Plan:
    """`choice == current`: stay. `needs_approval`: a move --geo-failover lets a person
    approve, not the daemon."""

    logical_job: str
    current: str
    choice: str
    reason: str
    candidates: tuple[Candidate, ...]
    needs_approval: bool = False

    def moves(self) -> bool:
        return self.choice != self.current

    def candidate(self, cluster: str) -> Candidate:
        return next(c for c in self.candidates if c.cluster == cluster)


def plan(job: JobNeeds, clusters: Sequence[ClusterView], rules: GeoRules,
         predict_transfer: PredictTransfer, *, store_regions: Mapping[str, str] | None = None,
         margin_s: float = DEFAULT_MARGIN_S, failback_s: float = DEFAULT_FAILBACK_S) -> Plan:
    """Where `job` should run next; see the module docstring for the rule.

    `store_regions` maps store names to regions (the config's [stores]); a store not in it
    is taken to be in the region of a cluster that uses it. `predict_transfer(source
    store, destination store, bytes)` gives seconds, None when the bandwidth is unknown.
    """
    views = {c.name: c for c in clusters}
    if len(views) != len(clusters):
        raise ValueError("plan: two clusters share a name")
    if job.current not in views:
        raise ValueError(f"plan: current cluster '{job.current}' is not among the clusters")
    if margin_s < 0 or failback_s < 0:
        raise ValueError("plan: margin_s and failback_s must be >= 0")
    current = views[job.current]
    usable = current.up and current.fits
    regions = _store_regions(clusters, store_regions or {})
    egress_price = _egress_price(regions.get(job.checkpoint_store), clusters, current)
    home_up = job.home in views and views[job.home].up
    world_price = (0.0 if job.world is None else
                   _egress_price(regions.get(job.world.source_store), clusters, current))
    candidates = [_candidate(job, view, rules, predict_transfer, regions,
                             (egress_price, world_price), usable, home_up)
                  for view in clusters]
    choice, reason = (_choose_while_up(job, current, candidates, margin_s, failback_s)
                      if usable else _choose_while_down(job, current, candidates))
    mode = job.directives.failover
    return Plan(job.logical_job, job.current, choice, reason, _ordered(candidates, job),
                needs_approval=choice != job.current and mode != "auto")


def prefers_home(plan: Plan, home: str) -> bool:
    """Whether the plan moves the job back to `home` (a failback to do at the next
    checkpoint); False when the job is home already or goes elsewhere."""
    return plan.current != home and plan.choice == home


# --- candidates ----------------------------------------------------------------------

def _candidate(job: JobNeeds, view: ClusterView, rules: GeoRules, predict: PredictTransfer,
               regions: Mapping[str, str], prices: tuple[float, float], usable: bool,
               home_up: bool) -> Candidate:
    staying = view.name == job.current
    world_missing = 0 if staying or job.world is None else job.world.missing(view.store)
    transfer = 0.0 if staying else _transfer_s(job, view, predict, world_missing)
    wait = view.queue_wait_s
    total = None if transfer is None or wait is None else transfer + wait
    moves_data = not staying and regions.get(job.checkpoint_store) != regions.get(view.store)
    world_moves = job.world is not None and regions.get(job.world.source_store) != \
        regions.get(view.store)
    cost = _cost(job, view.prices, prices[0] if moves_data else 0.0,
                 (world_missing or 0) / 1e9 * (prices[1] if world_moves else 0.0))
    why_not = (_why_not_stay(view) if staying
               else _why_not_move(job, view, rules, cost, transfer, usable,
                                  _why_not_world(job, view, world_missing, home_up, usable)))
    return Candidate(view.name, not why_not, why_not, transfer, wait, total, cost.total, cost)


def _transfer_s(job: JobNeeds, view: ClusterView, predict: PredictTransfer,
                world_missing: int | None) -> float | None:
    checkpoint = (0.0 if view.store == job.checkpoint_store or job.checkpoint_bytes == 0
                  else predict(job.checkpoint_store, view.store, job.checkpoint_bytes))
    if job.world is None:
        return checkpoint
    world = 0.0 if world_missing == 0 else stage_s(
        job.world, view.store, predict,
        Cadence(job.checkpoint_every_s, job.checkpoint_bytes, job.checkpoint_store))
    fetch = materialise_s(job.world, view)
    return None if checkpoint is None or world is None or fetch is None \
        else checkpoint + world + fetch


def materialise_s(world: WorldStaging, view: ClusterView) -> float | None:
    """Seconds the moved job's preamble spends fetching its whole world from the
    cluster's store into its workspace before the trainer starts: 0 on a cluster with
    home's files, None when the world's size is unknown."""
    if view.world_fetch_mb_s is None:
        return 0.0
    if world.total_bytes is None:
        return None
    return world.total_bytes / (view.world_fetch_mb_s * 1e6)


@dataclass(frozen=True)
class Cadence:
    """The job's checkpoints while its world is staged: one every `every_s` (None:
    unknown), `bytes` each, from `store`."""

    every_s: float | None = None
    bytes: int = 0
    store: str = ""


def stage_s(world: WorldStaging, store: str, predict: PredictTransfer,
            cadence: Cadence = Cadence()) -> float | None:
    """Seconds to stage what `store` lacks of the world from home's store: each byte
    crosses the link twice (checkpoint-sync puts a pack, then reads it back whole to
    verify it, before the world's record is written there), while the job goes on
    checkpointing (`cadence`: each checkpoint is replicated first, `with_checkpoints`); 0
    when nothing is missing, None when the size or the link's rate is unknown."""
    missing = world.missing(store)
    if missing == 0:
        return 0.0
    if missing is None:
        return None
    link = predict(world.source_store, store, WORLD_CROSSINGS * missing)
    if link is None or cadence.every_s is None:
        return link
    checkpoint = 0.0 if not cadence.bytes or cadence.store == store else \
        predict(cadence.store, store, cadence.bytes)
    return with_checkpoints(link, cadence.every_s, checkpoint or 0.0)


def with_checkpoints(link_s: float, every_s: float, checkpoint_s: float) -> float:
    """Wall seconds to move `link_s` of world over the link while the job checkpoints
    every `every_s`, each checkpoint taking `checkpoint_s` of the link and costing the
    world pass WORLD_GIVE_WAY_S (checkpoint-sync never lets a checkpoint wait behind a
    world): the world has the link's remaining share, `1 - (checkpoint_s +
    WORLD_GIVE_WAY_S) / every_s`, MAX_CHECKPOINT_SHARE at most taken from it."""
    if every_s <= 0:
        return link_s
    share = min(MAX_CHECKPOINT_SHARE, (checkpoint_s + WORLD_GIVE_WAY_S) / every_s)
    return link_s / (1.0 - share)


def checkpoint_every_s(created: Sequence[float], declared_s: float | None = None
                       ) -> float | None:
    """How often a job checkpoints, from its newest checkpoints' times (Unix seconds, in
    any order): the mean gap between them; for fewer than two (or all at once) what the
    job declared (`--geo-ckpt-interval`, in seconds), else None."""
    span = max(created) - min(created) if len(created) >= 2 else 0.0
    return span / (len(created) - 1) if span > 0 else declared_s


def _why_not_world(job: JobNeeds, view: ClusterView, missing: int | None, home_up: bool,
                   usable: bool) -> str:
    """Why the job's world keeps it from `view`: missing there while home, the only place
    it can be read from, is down; or of a size no staging has measured yet, while the
    current cluster runs the job (no move can be shown to help)."""
    if job.world is None or missing == 0:
        return ""
    if home_up:
        return ("its inputs and env (--geo-inputs, --geo-env) are not staged yet: their "
                "size is unknown") if missing is None and usable else ""
    if missing is None:
        return (f"its inputs and env (--geo-inputs, --geo-env) are staged nowhere yet and "
                f"home {job.home}, where they are, is down")
    return (f"{missing / 1e6:.0f} MB of its inputs and env are not staged in {view.store} "
            f"and home {job.home}, where they are, is down")


def _cost(job: JobNeeds, prices: Prices, egress_per_gb: float,
          world_egress: float = 0.0) -> Cost:
    hours = job.remaining_s / 3600
    gpu = hours * job.gpus * prices.gpu_hour
    cpu = hours * job.cpus * prices.cpu_hour
    return Cost(gpu=gpu, cpu=cpu,
                egress=job.checkpoint_bytes / 1e9 * egress_per_gb + world_egress,
                fee=prices.marketplace_fee_pct / 100 * (gpu + cpu))


def _why_not_stay(view: ClusterView) -> str:
    if not view.up:
        return "down"
    if not view.fits:
        return "cannot run the job (no partition, GPU type or size fits)"
    return ""


def policy_refusal(directives: Directives, rules: GeoRules, cluster: str,
                   owner_refused: str = "") -> str:
    """Why the job may never run on `cluster`, whatever its state or a person's consent:
    --geo-failover=never, its owner without an account there (`owner_refused`),
    --geo-clusters, residency and data classes (`check`); "" when none. Pure."""
    if directives.failover == "never":
        return "--geo-failover=never: the job stays on its cluster"
    if owner_refused:
        return owner_refused
    if directives.clusters and cluster not in directives.clusters:
        return f"not in --geo-clusters ({','.join(directives.clusters)})"
    try:
        check(directives, rules, cluster)
    except DirectiveError as exc:
        return str(exc)
    return ""


def _why_not_move(job: JobNeeds, view: ClusterView, rules: GeoRules, cost: Cost,
                  transfer: float | None, usable: bool, world: str = "") -> str:
    directives = job.directives
    if directives.failover == "never":
        return "--geo-failover=never: the job stays on its cluster"
    if not job.checkpoint_store:
        return "no verified checkpoint to move from"
    if view.federation_sibling:
        return f"in a native Slurm federation with {job.current}: Slurm moves jobs there"
    if view.owner_refused:
        return view.owner_refused
    if not view.up:
        return "down"
    if not view.fits:
        return "cannot run the job (no partition, GPU type or size fits)"
    refused = policy_refusal(directives, rules, view.name)
    if refused:
        return refused
    limit = directives.max_cost_usd
    if limit is not None and job.spent_usd + cost.total > limit:
        return (f"predicted cost {job.spent_usd + cost.total:.2f} USD exceeds "
                f"--geo-max-cost={limit:g}")
    if world:
        return world
    if usable and view.queue_wait_s is None:
        return "queue wait unknown"
    if usable and transfer is None:
        return f"bandwidth from {job.checkpoint_store} to {view.store} unknown"
    return ""


def _store_regions(clusters: Sequence[ClusterView],
                   given: Mapping[str, str]) -> dict[str, str]:
    regions = {c.store: c.region for c in sorted(clusters, key=lambda c: c.name, reverse=True)}
    return {**regions, **given}


def _egress_price(source_region: str | None, clusters: Sequence[ClusterView],
                  current: ClusterView) -> float:
    if current.region == source_region:
        return current.prices.egress_per_gb
    owners = sorted((c for c in clusters if c.region == source_region), key=lambda c: c.name)
    return (owners[0] if owners else current).prices.egress_per_gb


# --- choosing --------------------------------------------------------------------------

def _rank(candidate: Candidate, home: str) -> tuple[bool, float, float, bool, str]:
    """Known totals first, soonest first, then cheapest, then home, then by name."""
    known = candidate.total_s is not None
    partial = (candidate.transfer_s or 0.0) + (candidate.queue_wait_s or 0.0)
    total = candidate.total_s if candidate.total_s is not None else partial
    return (not known, total, candidate.cost_usd, candidate.cluster != home,
            candidate.cluster)


def _others(job: JobNeeds, candidates: list[Candidate]) -> list[Candidate]:
    eligible = [c for c in candidates if c.eligible and c.cluster != job.current]
    return sorted(eligible, key=lambda c: _rank(c, job.home))


def _choose_while_up(job: JobNeeds, current: ClusterView, candidates: list[Candidate],
                     margin_s: float, failback_s: float) -> tuple[str, str]:
    here = job.current
    others = _others(job, candidates)
    wait = current.queue_wait_s
    if not others:
        return here, f"stay on {here}: {_no_eligible(job, candidates)}"
    if wait is not None and _total(others[0]) + margin_s < wait:
        best = others[0]
        return best.cluster, (
            f"move to {best.cluster}: it starts in {_s(_total(best))} ({_parts(best)}) "
            f"against a {_s(wait)} queue wait on {here}, saving "
            f"{_s(wait - _total(best))} > margin {_s(margin_s)}")
    home = next((c for c in others if c.cluster == job.home), None)
    if home is not None and _total(home) <= failback_s:
        return home.cluster, (
            f"fail back to home {home.cluster}: it can start in {_s(_total(home))} "
            f"({_parts(home)}) <= {_s(failback_s)}")
    if wait is None:
        return here, f"stay on {here}: its queue wait is unknown, so no move can be shown " \
                     "to help"
    best = others[0]
    saving = wait - _total(best)
    if saving <= 0:
        return here, (f"stay on {here}: it starts in {_s(wait)}, {best.cluster} (the "
                      f"soonest elsewhere) in {_s(_total(best))}")
    return here, (f"stay on {here}: moving to {best.cluster} saves {_s(saving)} <= margin "
                  f"{_s(margin_s)}")


def _choose_while_down(job: JobNeeds, current: ClusterView,
                       candidates: list[Candidate]) -> tuple[str, str]:
    here = _label(job.current, job)
    state = "is down" if not current.up else "cannot run the job"
    others = _others(job, candidates)
    if not others:
        return job.current, (f"{here} {state} and {_no_eligible(job, candidates)}; the job "
                             f"waits for {job.current}")
    best = others[0]
    if best.total_s is None:
        return best.cluster, (f"{here} {state}; no eligible cluster has a known queue wait "
                              f"and bandwidth, {best.cluster} ranks first "
                              f"({_parts(best)}, {best.cost_usd:.2f} USD)")
    return best.cluster, (f"{here} {state}; {best.cluster} is the eligible cluster that "
                          f"starts soonest ({_parts(best)}, {best.cost_usd:.2f} USD)")


def _label(cluster: str, job: JobNeeds) -> str:
    return f"home {cluster}" if cluster == job.home else cluster


def _no_eligible(job: JobNeeds, candidates: list[Candidate]) -> str:
    why = "; ".join(f"{c.cluster}: {c.why_not}" for c in candidates
                    if c.cluster != job.current)
    return f"no other cluster is eligible ({why})" if why else "there is no other cluster"


def _total(candidate: Candidate) -> float:
    return candidate.total_s if candidate.total_s is not None else math.inf


def _parts(candidate: Candidate) -> str:
    def show(value: float | None) -> str:
        return "unknown" if value is None else _s(value)
    return f"transfer {show(candidate.transfer_s)} + wait {show(candidate.queue_wait_s)}"


def _s(seconds: float) -> str:
    return f"{seconds:.0f} s"


def _ordered(candidates: list[Candidate], job: JobNeeds) -> tuple[Candidate, ...]:
    """The current cluster first, then eligible candidates best first, then the rest."""
    here = [c for c in candidates if c.cluster == job.current]
    rest = sorted((c for c in candidates if c.cluster != job.current),
                  key=lambda c: (not c.eligible, *_rank(c, job.home)))
    return (*here, *rest)


# --- showing ---------------------------------------------------------------------------

_COLUMNS = ("CLUSTER", "ELIGIBLE", "TRANSFER_S", "WAIT_S", "TOTAL_S", "COST_USD", "WHY_NOT")


def render_plan(plan: Plan) -> str:
    """The candidates as a table, then `choice: X — reason`."""
    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    rows = [list(_COLUMNS)]
    for c in plan.candidates:
        name = f"{c.cluster} (current)" if c.cluster == plan.current else c.cluster
        rows.append([name, "yes" if c.eligible else "no", number(c.transfer_s),
                     number(c.queue_wait_s), number(c.total_s), f"{c.cost_usd:.2f}",
                     c.why_not or "-"])
    lines = [table(rows)]
    lines.append(f"choice: {plan.choice} — {plan.reason}")
    if plan.needs_approval:
        lines.append("the move needs approval: the job's --geo-failover is not auto")
    return "\n".join(lines)


def plan_to_json(plan: Plan) -> dict[str, Any]:
    """The plan as plain JSON-ready values."""
    return {
        "logical_job": plan.logical_job, "current": plan.current, "choice": plan.choice,
        "moves": plan.moves(), "needs_approval": plan.needs_approval, "reason": plan.reason,
        "candidates": [{
            "cluster": c.cluster, "eligible": c.eligible, "why_not": c.why_not,
            "transfer_s": c.transfer_s, "queue_wait_s": c.queue_wait_s,
            "total_s": c.total_s, "cost_usd": c.cost_usd,
            "cost_breakdown": {"gpu": c.cost_breakdown.gpu, "cpu": c.cost_breakdown.cpu,
                               "egress": c.cost_breakdown.egress,
                               "fee": c.cost_breakdown.fee},
        } for c in plan.candidates],
    }
