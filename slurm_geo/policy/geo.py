"""Where a job's data may go and what it may cost: the `[policy]` rules, and the decision.

The policy is written once, in the slurm-geo config (slurm_geo.config reads the table
below into a GeoPolicy; nothing here imports config). The client-side check (the SPANK
plugin's validator) calls `check` here; the controller-side check (job_submit.lua) runs
the same rules over the same data, exported by `slurm_geo.policy.lua`. Both report the
same one-line messages, in the same order (tests/test_policy_geo.py holds them to it).

    [policy]
    require_cost_center = true
    default_data_class = "internal"
    signal_lead_s = 120          # --signal=B:USR1@120 for jobs with --geo-ckpt-dir
    max_restarts = 10            # a job requeued more often is held

    [policy.data_classes]        # regions each class may reside in; unlisted: anywhere
    restricted = ["home"]

    [policy.budgets]             # USD per job a cost center allows; none: no budgets
    ml-research = 500
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from slurm_geo.policy.directives import DirectiveError, Directives, PolicyViolation, quote
from slurm_geo.policy.world import Input, World, check_world

DEFAULT_SIGNAL_LEAD_S = 120
DEFAULT_MAX_RESTARTS = 10


@dataclass(frozen=True)
class GeoPolicy:
    require_cost_center: bool = False
    default_data_class: str = "internal"
    signal_lead_s: int = DEFAULT_SIGNAL_LEAD_S
    max_restarts: int = DEFAULT_MAX_RESTARTS
    data_classes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    budgets: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class GeoRules:
    """A policy with the facts it is applied to: every cluster's region."""

    policy: GeoPolicy
    cluster_regions: Mapping[str, str]

    @property
    def regions(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.cluster_regions.values())))

    def allowed_regions(self, data_class: str) -> tuple[str, ...]:
        return self.policy.data_classes.get(data_class, self.regions)


def check(directives: Directives, rules: GeoRules, cluster: str) -> None:
    """Accept `directives` for a job submitted to `cluster`, or raise the first mistake.

    `DirectiveError` for what the user must fix in the directives themselves (unknown
    region or cluster, clusters that leave out `cluster`, failover without checkpoints, a
    missing cost center), and for a `cluster` the config does not know;
    `PolicyViolation` for what the site forbids (residency, data class, budget).
    """
    if cluster not in rules.cluster_regions:
        raise DirectiveError(f"geo: cluster {quote(cluster)} is not in the slurm-geo config "
                             f"(known: {', '.join(sorted(rules.cluster_regions))})")
    if not directives.is_geo:
        return
    _check_known(directives, rules)
    if directives.clusters and cluster not in directives.clusters:
        # Slurm runs a job where it was submitted: a list without this cluster is refused
        # here rather than ignored (the federation moves jobs only when a cluster is lost).
        raise DirectiveError(f"geo: --geo-clusters: {quote(','.join(directives.clusters))} "
                             f"leaves out {quote(cluster)}, the cluster this job is submitted "
                             f"to: name it too, or submit the job to a cluster it names")
    if directives.failover == "auto" and directives.ckpt_dir is None:
        raise DirectiveError("geo: --geo-failover=auto needs --geo-ckpt-dir=PATH: a job "
                             "moves with its checkpoints")
    if rules.policy.require_cost_center and directives.cost_center is None:
        raise DirectiveError("geo: this site requires --geo-cost-center=NAME on jobs with "
                             "--geo-* directives")
    check_world(directives)
    _check_residency(directives, rules, cluster)
    _check_inputs(directives, rules, cluster)
    _check_failover_possible(directives, rules, cluster)
    _check_budget(directives, rules.policy)


def effective_residency(directives: Directives, rules: GeoRules) -> tuple[str, ...]:
    """The regions the job may use: as asked, else every region its data class allows."""
    data_class = directives.data_class or rules.policy.default_data_class
    return directives.residency or rules.allowed_regions(data_class)


def narrowing_inputs(directives: Directives,
                     rules: GeoRules) -> list[tuple[Input, tuple[str, ...]]]:
    """`(input, its class's regions)` of the inputs whose own data class keeps the job out
    of some region of its residency: the job runs only where its inputs may be."""
    residency = effective_residency(directives, rules)
    found = []
    for given in World.of(directives).inputs:
        if given.data_class is None:
            continue
        allowed = rules.allowed_regions(given.data_class)
        if any(region not in allowed for region in residency):
            found.append((given, allowed))
    return found


def placement_regions(directives: Directives, rules: GeoRules) -> tuple[str, ...]:
    """The regions the job may run in: its residency, less those an input's own data class
    forbids (its checkpoints may still go wherever the residency allows: a job with a
    restricted dataset stays home, its model need not)."""
    regions = effective_residency(directives, rules)
    for _, allowed in narrowing_inputs(directives, rules):
        regions = tuple(r for r in regions if r in allowed)
    return regions


def _check_known(directives: Directives, rules: GeoRules) -> None:
    for region in directives.residency:
        if region not in rules.regions:
            raise DirectiveError(f"geo: --geo-residency: unknown region {quote(region)} (known: "
                                 f"{', '.join(rules.regions)})")
    for name in directives.clusters:
        if name not in rules.cluster_regions:
            raise DirectiveError(f"geo: --geo-clusters: unknown cluster {quote(name)} (known: "
                                 f"{', '.join(sorted(rules.cluster_regions))})")


def _check_residency(directives: Directives, rules: GeoRules, cluster: str) -> None:
    data_class = directives.data_class or rules.policy.default_data_class
    allowed = rules.allowed_regions(data_class)
    for region in directives.residency:
        if region not in allowed:
            raise PolicyViolation(f"geo: data class {quote(data_class)} may not reside in region "
                                  f"{quote(region)} (allowed: {', '.join(allowed)})")
    residency = effective_residency(directives, rules)
    here = rules.cluster_regions[cluster]
    if here not in residency:
        raise PolicyViolation(f"geo: cluster {quote(cluster)} is in region {quote(here)}, outside "
                              f"the job's residency ({', '.join(residency)})")
    for name in directives.clusters:
        if rules.cluster_regions[name] not in residency:
            raise PolicyViolation(f"geo: --geo-clusters: cluster {quote(name)} is in region "
                                  f"{quote(rules.cluster_regions[name])}, outside the job's "
                                  f"residency ({', '.join(residency)})")


def _check_inputs(directives: Directives, rules: GeoRules, cluster: str) -> None:
    """An input whose own data class may not reside in `cluster`'s region keeps the job
    out of it."""
    here = rules.cluster_regions[cluster]
    for given in World.of(directives).inputs:
        if given.data_class is None:
            continue
        allowed = rules.allowed_regions(given.data_class)
        if here not in allowed:
            raise PolicyViolation(f"geo: --geo-inputs: {quote(given.path)} is data class "
                                  f"{quote(given.data_class)}, which may not reside in region "
                                  f"{quote(here)} of cluster {quote(cluster)} (allowed: "
                                  f"{', '.join(allowed)})")


def _check_failover_possible(directives: Directives, rules: GeoRules, cluster: str) -> None:
    """--geo-failover=auto promises a move when `cluster` is lost; refused when the job's
    residency (or data class), its inputs' data classes and --geo-clusters leave it no
    other cluster to move to."""
    if directives.failover != "auto":
        return
    regions = placement_regions(directives, rules)
    others = [name for name, region in sorted(rules.cluster_regions.items())
              if name != cluster and region in regions
              and (not directives.clusters or name in directives.clusters)]
    if not others:
        parts = [f"its residency ({', '.join(effective_residency(directives, rules))})"]
        parts += [f"input {quote(given.path)} of data class {quote(str(given.data_class))} "
                  f"({', '.join(allowed)})"
                  for given, allowed in narrowing_inputs(directives, rules)]
        if directives.clusters:
            parts.append(f"--geo-clusters ({','.join(directives.clusters)})")
        limits = " and ".join(parts) + (" leaves" if len(parts) == 1 else " leave")
        raise DirectiveError(f"geo: --geo-failover=auto can never move this job: {limits} "
                             f"no cluster but {quote(cluster)}; write "
                             "--geo-failover=never, or allow another cluster")


def _check_budget(directives: Directives, policy: GeoPolicy) -> None:
    if not policy.budgets or directives.cost_center is None:
        return
    budget = policy.budgets.get(directives.cost_center)
    if budget is None:
        raise PolicyViolation(f"geo: --geo-cost-center: unknown cost center "
                              f"{quote(directives.cost_center)} (known: "
                              f"{', '.join(sorted(policy.budgets))})")
    if directives.max_cost_usd is not None and directives.max_cost_usd > budget:
        raise PolicyViolation(f"geo: --geo-max-cost={directives.max_cost_usd:g} exceeds the "
                              f"budget of cost center {quote(directives.cost_center)} "
                              f"({budget:g} USD)")


class _InRegion(Protocol):
    @property
    def region(self) -> str: ...


class _Site(Protocol):
    """What the rules need of a loaded site config (a SiteConfig; policy does not import
    config, which reads the [policy] table into a GeoPolicy)."""

    @property
    def policy(self) -> GeoPolicy: ...

    @property
    def clusters(self) -> Mapping[str, _InRegion]: ...


def rules_for(site: _Site) -> GeoRules:
    """The rules of a loaded site config: its [policy] and its clusters' regions."""
    return GeoRules(site.policy, {name: c.region for name, c in site.clusters.items()})
