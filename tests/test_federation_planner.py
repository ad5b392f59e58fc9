"""The placement planner, table-driven over one small world of four clusters.

    onprem   home region, store pfs       free, the job's home
    onprem2  home region, store pfs       a native Slurm federation sibling of onprem
    rented   eu region, store offsite     2 USD/GPU-h, 0.05 USD/CPU-h, 10 % fee
    spare    us region, store spare-s3    1.5 USD/GPU-h, 0.04 USD/CPU-h

The newest verified checkpoint (50 GB) is on offsite; moving it to pfs takes 400 s, to
spare-s3 500 s; rented reads offsite directly (no transfer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from slurm_geo.config.model import Prices
from slurm_geo.federation.decide.planner import (
    ClusterView,
    Cost,
    JobNeeds,
    WorldStaging,
    materialise_s,
    plan,
    plan_to_json,
    prefers_home,
    render_plan,
)
from slurm_geo.policy.directives import Directives
from slurm_geo.policy.geo import GeoPolicy, GeoRules

RULES = GeoRules(GeoPolicy(data_classes={"restricted": ("home",)}),
                 {"onprem": "home", "onprem2": "home", "rented": "eu", "spare": "us"})
STORE_REGIONS = {"pfs": "home", "offsite": "eu", "spare-s3": "us"}

CLUSTERS = {
    "onprem": ClusterView("onprem", "home", "pfs", Prices(egress_per_gb=0.02), up=True,
                          queue_wait_s=0.0, fits=True),
    "onprem2": ClusterView("onprem2", "home", "pfs", Prices(), up=False, queue_wait_s=0.0,
                           fits=True, federation_sibling=True),
    "rented": ClusterView("rented", "eu", "offsite",
                          Prices(gpu_hour=2.0, cpu_hour=0.05, egress_per_gb=0.09,
                                 marketplace_fee_pct=10.0),
                          up=True, queue_wait_s=30.0, fits=True),
    "spare": ClusterView("spare", "us", "spare-s3",
                         Prices(gpu_hour=1.5, cpu_hour=0.04, egress_per_gb=0.09),
                         up=True, queue_wait_s=300.0, fits=True),
}
TRANSFERS = {("offsite", "pfs"): 400.0, ("offsite", "spare-s3"): 500.0}
DIRECTIVES = Directives(ckpt_dir="/pfs/ckpt/llm", failover="auto")
JOB = JobNeeds(logical_job="onprem:42", home="onprem", current="onprem", nodes=2, cpus=64,
               gpus=8, remaining_s=36000.0, checkpoint_bytes=50 * 10**9,
               checkpoint_store="offsite", directives=DIRECTIVES)

DOWN = {"up": False}


@dataclass
class Case:
    id: str
    choice: str
    reason: str
    job: dict[str, Any] = field(default_factory=dict)
    directives: dict[str, Any] = field(default_factory=dict)
    views: dict[str, dict[str, Any]] = field(default_factory=dict)
    transfers: dict[tuple[str, str], float | None] = field(default_factory=dict)
    margin_s: float = 60.0
    why_not: dict[str, str] = field(default_factory=dict)  # "" = eligible
    needs_approval: bool = False


CASES = [
    Case("home-down-goes-to-rented", "rented",
         "home onprem is down; rented is the eligible cluster that starts soonest "
         "(transfer 0 s + wait 30 s, 211.20 USD)",
         views={"onprem": DOWN}, why_not={"onprem": "down", "rented": "", "spare": ""}),
    Case("home-up-and-running-stays", "onprem",
         "stay on onprem: it starts in 0 s, rented (the soonest elsewhere) in 30 s"),
    Case("hopeless-home-queue-moves", "rented",
         "move to rented: it starts in 30 s (transfer 0 s + wait 30 s) against a 7200 s "
         "queue wait on onprem, saving 7170 s > margin 60 s",
         views={"onprem": {"queue_wait_s": 7200.0}}),
    Case("margin-holds-a-small-saving", "onprem",
         "stay on onprem: moving to rented saves 50 s <= margin 60 s",
         views={"onprem": {"queue_wait_s": 80.0}}),
    Case("saving-above-margin-moves", "rented", "saving 70 s > margin 60 s",
         views={"onprem": {"queue_wait_s": 100.0}}),
    Case("zero-margin-moves-on-any-saving", "rented", "saving 50 s > margin 0 s",
         views={"onprem": {"queue_wait_s": 80.0}}, margin_s=0.0),
    Case("residency-forbids-every-move", "onprem",
         "home onprem is down and no other cluster is eligible", directives={
             "residency": ("home",)}, views={"onprem": DOWN},
         why_not={"rented": "geo: cluster 'rented' is in region 'eu', outside the job's "
                            "residency (home)",
                  "spare": "outside the job's residency (home)"}),
    Case("restricted-data-stays-home-despite-the-queue", "onprem",
         "stay on onprem: no other cluster is eligible", directives={
             "data_class": "restricted"}, views={"onprem": {"queue_wait_s": 7200.0}},
         why_not={"rented": "outside the job's residency (home)"}),
    Case("restricted-input-keeps-the-job-home", "onprem",
         "home onprem is down and no other cluster is eligible", directives={
             "inputs": ("/home/alice/llm", "/pfs/data/tokens:restricted")},
         views={"onprem": DOWN},
         why_not={"rented": "geo: --geo-inputs: '/pfs/data/tokens' is data class "
                            "'restricted', which may not reside in region 'eu' of cluster "
                            "'rented' (allowed: home)",
                  "spare": "may not reside in region 'us'"}),
    Case("public-input-moves-with-its-job", "rented", "home onprem is down; rented",
         directives={"inputs": ("/pfs/data/tokens:public",), "env": "/home/alice/venv"},
         views={"onprem": DOWN}, why_not={"rented": "", "spare": ""}),
    Case("geo-clusters-limits-the-choice", "spare", "home onprem is down; spare",
         directives={"clusters": ("onprem", "spare")}, views={"onprem": DOWN},
         why_not={"rented": "not in --geo-clusters (onprem,spare)", "spare": ""}),
    Case("max-cost-excludes-both-rentals", "onprem", "the job waits for onprem",
         directives={"max_cost_usd": 100.0}, views={"onprem": DOWN},
         why_not={"rented": "predicted cost 211.20 USD exceeds --geo-max-cost=100",
                  "spare": "predicted cost 150.10 USD exceeds --geo-max-cost=100"}),
    Case("max-cost-leaves-the-cheaper-rental", "spare", "home onprem is down; spare",
         directives={"max_cost_usd": 200.0}, views={"onprem": DOWN},
         why_not={"rented": "exceeds --geo-max-cost=200", "spare": ""}),
    Case("money-spent-counts-against-max-cost", "onprem", "the job waits",
         job={"spent_usd": 60.0}, directives={"max_cost_usd": 200.0},
         views={"onprem": DOWN}, why_not={"spare": "predicted cost 210.10 USD exceeds"}),
    Case("unknown-wait-is-not-plannable-while-up", "spare", "move to spare",
         views={"onprem": {"queue_wait_s": 7200.0}, "rented": {"queue_wait_s": None}},
         why_not={"rented": "queue wait unknown", "spare": ""}),
    Case("unknown-wait-ranks-after-known-while-down", "spare", "home onprem is down; spare",
         views={"onprem": DOWN, "rented": {"queue_wait_s": None}},
         why_not={"rented": "", "spare": ""}),
    Case("unknown-wait-beats-an-outage", "rented",
         "no eligible cluster has a known queue wait and bandwidth, rented ranks first "
         "(transfer 0 s + wait unknown",
         views={"onprem": DOWN, "rented": {"queue_wait_s": None},
                "spare": {"queue_wait_s": None}}),
    Case("unknown-bandwidth-is-not-plannable-while-up", "onprem",
         "stay on onprem: no other cluster is eligible",
         views={"onprem": {"queue_wait_s": 7200.0}, "rented": DOWN},
         transfers={("offsite", "spare-s3"): None},
         why_not={"spare": "bandwidth from offsite to spare-s3 unknown"}),
    Case("unknown-wait-at-current-stays", "onprem",
         "stay on onprem: its queue wait is unknown", views={"onprem": {"queue_wait_s": None}}),
    Case("failback-when-home-returns", "onprem",
         "fail back to home onprem: it can start in 420 s (transfer 400 s + wait 20 s) "
         "<= 600 s",
         job={"current": "rented"},
         views={"rented": {"queue_wait_s": 0.0}, "onprem": {"queue_wait_s": 20.0}}),
    Case("no-failback-while-home-queue-is-long", "rented",
         "stay on rented: it starts in 0 s, spare (the soonest elsewhere) in 800 s",
         job={"current": "rented"},
         views={"rented": {"queue_wait_s": 0.0}, "onprem": {"queue_wait_s": 3600.0}}),
    Case("no-failback-while-home-is-down", "rented", "stay on rented",
         job={"current": "rented"}, views={"rented": {"queue_wait_s": 0.0}, "onprem": DOWN},
         why_not={"onprem": "down"}),
    Case("rented-lost-goes-home-first", "onprem",
         "rented is down; onprem is the eligible cluster that starts soonest "
         "(transfer 400 s + wait 0 s, 4.50 USD)",  # egress out of eu at rented's price
         job={"current": "rented"}, views={"rented": DOWN}),
    Case("federation-sibling-is-left-to-slurm", "onprem", "the job waits for onprem",
         views={"onprem": DOWN, "onprem2": {"up": True}, "rented": DOWN, "spare": DOWN},
         why_not={"onprem2": "in a native Slurm federation with onprem"}),
    Case("failover-never-stays-through-an-outage", "onprem",
         "home onprem is down and no other cluster is eligible",
         directives={"failover": "never"}, views={"onprem": DOWN},
         why_not={"rented": "--geo-failover=never", "spare": "--geo-failover=never"}),
    Case("failover-manual-plans-but-needs-approval", "rented", "home onprem is down",
         directives={"failover": "manual"}, views={"onprem": DOWN}, needs_approval=True),
    Case("no-failover-directive-needs-approval", "rented", "home onprem is down",
         directives={"failover": None}, views={"onprem": DOWN}, needs_approval=True),
    Case("cluster-that-does-not-fit-is-skipped", "spare", "home onprem is down; spare",
         views={"onprem": DOWN, "rented": {"fits": False}},
         why_not={"rented": "cannot run the job"}),
    Case("current-that-no-longer-fits-is-left", "rented", "home onprem cannot run the job",
         views={"onprem": {"fits": False}}),
    Case("no-verified-checkpoint-cannot-move", "onprem", "the job waits for onprem",
         job={"checkpoint_store": ""}, views={"onprem": DOWN},
         why_not={"rented": "no verified checkpoint to move from"}),
    Case("equal-start-goes-to-the-cheaper", "spare", "home onprem is down; spare",
         views={"onprem": DOWN, "rented": {"queue_wait_s": 800.0}}),
]


def run_case(case: Case):
    job = replace(JOB, directives=replace(DIRECTIVES, **case.directives), **case.job)
    views = [replace(view, **case.views.get(name, {})) for name, view in CLUSTERS.items()]
    transfers = {**TRANSFERS, **case.transfers}
    return plan(job, views, RULES, lambda src, dst, _n: transfers.get((src, dst)),
                store_regions=STORE_REGIONS, margin_s=case.margin_s)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_plan(case: Case):
    result = run_case(case)
    assert (result.choice, result.needs_approval) == (case.choice, case.needs_approval), \
        result.reason
    assert case.reason in result.reason
    for cluster, why in case.why_not.items():
        candidate = result.candidate(cluster)
        if why:
            assert not candidate.eligible and why in candidate.why_not
        else:
            assert candidate.eligible and candidate.why_not == "", candidate.why_not
    assert "\n" not in result.reason


def test_cost_reproduced_by_hand():
    # 10 h left, 8 GPUs and 64 CPUs in all (over 2 nodes). Checkpoint of 50 GB on pfs
    # (home region), so moving to rented (eu) pays home's egress: onprem's 0.02 USD/GB.
    job = replace(JOB, checkpoint_store="pfs")
    result = plan(job, list(CLUSTERS.values()), RULES, lambda *_: 400.0,
                  store_regions=STORE_REGIONS)
    rented = result.candidate("rented")
    gpu = 10 * 8 * 2.0           # 160.00
    cpu = 10 * 64 * 0.05         # 32.00
    fee = 0.10 * (gpu + cpu)     # 19.20: the marketplace fee is on compute only
    egress = 50 * 0.02           # 1.00
    assert rented.cost_breakdown == pytest.approx(Cost(gpu, cpu, egress, fee))
    assert rented.cost_usd == pytest.approx(212.20)
    assert result.candidate("onprem").cost_usd == 0.0   # staying: free, nothing moves
    assert result.candidate("onprem").transfer_s == 0.0


@pytest.mark.parametrize("home_wait, max_cost, choice", [
    (7200.0, None, "rented"), (480.0, None, "onprem"), (7200.0, 200.0, "onprem")])
def test_worked_example_of_the_docs(home_wait, max_cost, choice):
    job = replace(JOB, checkpoint_store="pfs",
                  directives=replace(DIRECTIVES, max_cost_usd=max_cost))
    views = [replace(CLUSTERS["onprem"], queue_wait_s=home_wait), CLUSTERS["rented"]]
    result = plan(job, views, RULES, lambda *_: 400.0, store_regions=STORE_REGIONS)
    assert result.choice == choice, result.reason


def test_egress_from_a_region_without_a_cluster_is_priced_by_the_current_cluster():
    job = replace(JOB, checkpoint_store="vault")
    result = plan(job, list(CLUSTERS.values()), RULES, lambda *_: 10.0,
                  store_regions={**STORE_REGIONS, "vault": "ap"})
    assert result.candidate("rented").cost_breakdown.egress == pytest.approx(50 * 0.02)


def test_a_checkpoint_already_in_the_candidates_store_moves_nothing():
    calls = []

    def predict(src, dst, n):
        calls.append((src, dst, n))
        return 400.0

    result = plan(replace(JOB, current="onprem"), list(CLUSTERS.values()), RULES, predict,
                  store_regions=STORE_REGIONS)
    assert result.candidate("rented").transfer_s == 0.0
    assert result.candidate("rented").cost_breakdown.egress == 0.0
    assert ("offsite", "offsite", JOB.checkpoint_bytes) not in calls


def test_prefers_home_only_for_a_move_home():
    failback = run_case(next(c for c in CASES if c.id == "failback-when-home-returns"))
    assert prefers_home(failback, "onprem")
    stay_home = run_case(next(c for c in CASES if c.id == "home-up-and-running-stays"))
    assert not prefers_home(stay_home, "onprem")
    away = run_case(next(c for c in CASES if c.id == "home-down-goes-to-rented"))
    assert not prefers_home(away, "onprem")


def test_candidates_list_current_first_then_eligible_best_first():
    result = run_case(next(c for c in CASES if c.id == "residency-forbids-every-move"))
    assert [c.cluster for c in result.candidates][0] == "onprem"
    result = run_case(next(c for c in CASES if c.id == "home-down-goes-to-rented"))
    assert [c.cluster for c in result.candidates] == ["onprem", "rented", "spare", "onprem2"]


def test_render_and_json():
    result = run_case(next(c for c in CASES if c.id == "failover-manual-plans-but-needs-approval"))
    text = render_plan(result)
    lines = text.splitlines()
    assert lines[0].split() == ["CLUSTER", "ELIGIBLE", "TRANSFER_S", "WAIT_S", "TOTAL_S",
                                "COST_USD", "WHY_NOT"]
    assert lines[1].startswith("onprem (current)") and lines[1].split()[2] == "no"
    assert lines[2].split()[:6] == ["rented", "yes", "0", "30", "30", "211.20"]
    assert f"choice: rented — {result.reason}" in lines
    assert lines[-1].startswith("the move needs approval")
    data = json.loads(json.dumps(plan_to_json(result)))
    assert (data["choice"], data["moves"], data["needs_approval"]) == ("rented", True, True)
    rented = next(c for c in data["candidates"] if c["cluster"] == "rented")
    assert rented["cost_breakdown"]["fee"] == pytest.approx(19.2)
    spare = next(c for c in data["candidates"] if c["cluster"] == "spare")
    assert (spare["transfer_s"], spare["total_s"]) == (500.0, 800.0)


def test_plan_rejects_inputs_that_cannot_be_planned():
    with pytest.raises(ValueError, match="current cluster 'nowhere'"):
        plan(replace(JOB, current="nowhere"), list(CLUSTERS.values()), RULES, lambda *_: 1.0)
    with pytest.raises(ValueError, match="share a name"):
        plan(JOB, [CLUSTERS["onprem"], CLUSTERS["onprem"]], RULES, lambda *_: 1.0)


# --- the job's world (issue 31: inputs and env, staged ahead) --------------------------------

WORLD_TRANSFERS = {("pfs", "offsite"): 80.0, ("pfs", "spare-s3"): 100.0}
GB = 10**9


def run_world(world: WorldStaging, home_up: bool = True, current: str = "onprem",
              rented_wait: float = 30.0):
    views = [replace(view, up=home_up if name == "onprem" else view.up,
                     queue_wait_s=rented_wait if name == "rented" else view.queue_wait_s)
             for name, view in CLUSTERS.items()]
    transfers = {**TRANSFERS, **WORLD_TRANSFERS}
    asked: list[tuple[str, str, int]] = []

    def predict(src: str, dst: str, n: int) -> float | None:
        asked.append((src, dst, n))
        return transfers.get((src, dst))
    job = replace(JOB, world=world, current=current)
    return plan(job, views, RULES, predict, store_regions=STORE_REGIONS), asked


@pytest.mark.parametrize("world, home_up, choice, why_rented, why_spare", [
    # Staged everywhere: the world changes nothing.
    (WorldStaging("pfs", 2 * GB, {"offsite": 2 * GB, "spare-s3": 2 * GB}), False,
     "rented", "", ""),
    # Staged on offsite only, home lost: spare would need 2 GB from a lost home.
    (WorldStaging("pfs", 2 * GB, {"offsite": 2 * GB}), False, "rented", "",
     "2000 MB of its inputs and env are not staged in spare-s3 and home onprem, where they "
     "are, is down"),
    # Staged nowhere, size unknown, home lost: the job is not moved at all.
    (WorldStaging("pfs"), False, "onprem",
     "staged nowhere yet and home onprem, where they are, is down",
     "staged nowhere yet and home onprem, where they are, is down"),
])
def test_a_job_whose_world_is_not_staged_is_not_moved_off_a_lost_home(
        world, home_up, choice, why_rented, why_spare):
    result, _ = run_world(world, home_up)
    assert result.choice == choice, result.reason
    for cluster, why in (("rented", why_rented), ("spare", why_spare)):
        candidate = result.candidate(cluster)
        assert candidate.eligible is (why == ""), candidate.why_not
        assert why in candidate.why_not


def test_the_world_not_yet_staged_counts_in_time_and_egress_and_the_staged_site_wins():
    """Home up, a hopeless home queue: rented lacks 1 GB of the world (80 s from pfs),
    spare has it all; each candidate's transfer and egress count what is missing."""
    world = WorldStaging("pfs", 3 * GB, {"offsite": 2 * GB, "spare-s3": 3 * GB})
    views = {name: replace(view, queue_wait_s=5000.0 if name == "onprem" else
                           view.queue_wait_s) for name, view in CLUSTERS.items()}
    transfers = {**TRANSFERS, **WORLD_TRANSFERS}
    result = plan(replace(JOB, world=world), list(views.values()), RULES,
                  lambda s, d, _n: transfers.get((s, d)), store_regions=STORE_REGIONS)
    rented, spare = result.candidate("rented"), result.candidate("spare")
    assert rented.transfer_s == 0.0 + 80.0 and spare.transfer_s == 500.0
    home_egress = CLUSTERS["onprem"].prices.egress_per_gb
    assert rented.cost_breakdown.egress == pytest.approx(1 * home_egress)
    assert spare.cost_breakdown.egress == pytest.approx(50 * 0.09)  # the checkpoint's only
    # With the world staged at rented too, it starts 80 s sooner.
    staged, _ = run_world(WorldStaging("pfs", 3 * GB, {"offsite": 3 * GB}), home_up=True)
    assert staged.candidate("rented").transfer_s == 0.0


def test_a_world_of_unknown_size_keeps_a_running_job_where_it_is_and_says_why():
    result, _ = run_world(WorldStaging("pfs"), home_up=True, rented_wait=30.0)
    assert result.choice == "onprem"
    assert "not staged yet: their size is unknown" in result.candidate("rented").why_not


def test_the_missing_world_is_read_from_home_s_store_at_the_link_s_rate():
    """Twice: checkpoint-sync puts each pack, then reads it back whole to verify it."""
    _, asked = run_world(WorldStaging("pfs", 2 * GB, {"offsite": GB}), home_up=True)
    assert ("pfs", "offsite", 2 * GB) in asked and ("pfs", "spare-s3", 4 * GB) in asked


@pytest.mark.parametrize("fetch_mb_s, staged_at_rented, transfer_s", [
    (None, 3 * GB, 0.0),         # rented runs on home's files: nothing to materialise
    (50.0, 3 * GB, 60.0),        # its own files: 3 GB fetched at 50 MB/s before the trainer
    (50.0, 2 * GB, 80.0 + 60.0),  # and 1 GB still to stage first (80 s from pfs)
    (100.0, 3 * GB, 30.0),
])
def test_a_cluster_without_home_s_files_counts_materialising_the_whole_world(
        fetch_mb_s, staged_at_rented, transfer_s):
    """The moved job's preamble fetches its whole world from the cluster's store before
    the trainer starts (bench/world_move.py: 18-20 s for 1 GB): the time to resume there
    counts it, staged or not; home, which has the files, counts none."""
    world = WorldStaging("pfs", 3 * GB, {"offsite": staged_at_rented})
    views = [replace(view, world_fetch_mb_s=fetch_mb_s if name == "rented" else None,
                     queue_wait_s=5000.0 if name == "onprem" else view.queue_wait_s)
             for name, view in CLUSTERS.items()]
    transfers = {**TRANSFERS, **WORLD_TRANSFERS}
    result = plan(replace(JOB, world=world), views, RULES,
                  lambda s, d, _n: transfers.get((s, d)), store_regions=STORE_REGIONS)
    assert result.candidate("rented").transfer_s == pytest.approx(transfer_s)
    assert result.candidate("onprem").transfer_s == 0.0


def test_materialising_a_world_of_unknown_size_is_unknown_not_free():
    view = replace(CLUSTERS["rented"], world_fetch_mb_s=50.0)
    assert materialise_s(WorldStaging("pfs"), view) is None
    assert materialise_s(WorldStaging("pfs", GB), replace(view, world_fetch_mb_s=None)) == 0.0


# --- what no consent overrides (`slurm-geo approve`) -----------------------------------

@pytest.mark.parametrize("changes, cluster, owner_refused, expected", [
    ({}, "rented", "", ""),
    ({"residency": ("home",)}, "rented", "", "outside the job's residency (home)"),
    ({"residency": ("home",)}, "onprem", "", ""),
    ({"data_class": "restricted"}, "rented", "", "outside the job's residency (home)"),
    ({"failover": "never"}, "rented", "", "--geo-failover=never"),
    ({"failover": "manual"}, "rented", "", ""),  # what approval is for
    ({"clusters": ("onprem", "spare")}, "rented", "", "not in --geo-clusters"),
    ({}, "rented", "alice has no account on rented", "alice has no account on rented"),
], ids=["allowed", "residency", "residency at home", "data class", "never", "manual",
        "geo-clusters", "no account"])
def test_what_no_approval_overrides(changes, cluster, owner_refused, expected):
    from dataclasses import replace as replaced

    from slurm_geo.federation.decide.planner import policy_refusal

    found = policy_refusal(replaced(DIRECTIVES, **changes), RULES, cluster, owner_refused)
    assert (expected in found) if expected else found == ""
