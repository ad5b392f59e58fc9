"""The drill's DR report: the measured figures, the verdict over them (pure), and the text
for people (`--json` gives the same for scripts). The drill fills it in, the timeline
picture draws it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

# Beyond detection (and a lost leader's failover): scheduling, start, load. A move reads
# nothing back across the WAN (issue 32): the resume checkpoint is off-site and verified
# already, so the target does not grow with its size.
RTO_SLACK_S = 15.0
FAILOVER_TARGET_S = 10.0  # a new leader this soon after the old one died (issue 17)
# A prediction is judged within this fraction of the actual transfer, and only for
# transfers long enough to time: below MIN_JUDGED_TRANSFER_S a fixed cost (a request, a
# thread's start) is most of the figure, and 0.1 s against 0.05 s says nothing of a link.
PREDICTION_TOLERANCE = 0.25
MIN_JUDGED_TRANSFER_S = 2.0
# One crossing per checkpoint (issue 32), judged like the prediction: for checkpoints whose
# one transfer at the link's rate takes MIN_JUDGED_TRANSFER_S or more. A lag also holds
# checkpoint-sync's discovery of the checkpoint (up to one poll): it is judged once the
# target's room over the transfer covers a poll.
WAN_OVER_STORED_TARGET = 1.05    # bytes over the link's counters / the stored bytes
LAG_OVER_TRANSFER_TARGET = 1.15  # replication lag / one transfer of the stored bytes


@dataclass
class Sample:
    t: float
    cluster: str
    state: str


@dataclass
class DrillReport:
    run: str
    logical_job: str
    home: str
    target: str
    settings: dict[str, Any]
    killed_at: float
    detected_at: float | None
    moved_at: float | None            # the new generation was submitted
    running_elsewhere_at: float | None  # it was granted its lease: training again
    completed_at: float | None
    detection_window_s: float
    last_step_home: int
    offsite_step_at_kill: int     # the newest step verified off-site just before the kill
    resume_step: int | None
    steps_lost: int | None
    final_step: int | None
    final_weights: str | None
    reference_weights: str
    bit_identical: bool
    replicated_bytes: int
    replication_seconds: float
    predicted_transfer_s: float | None
    actual_transfer_s: float | None
    legs: list[dict[str, Any]]
    stale_incarnation: str
    audit_ok: bool
    owner: str = ""                 # whose job the drill submitted, and their uid
    owner_uid: int = -1
    ran_as: dict[str, int] = field(default_factory=dict)  # uid per incarnation 'cluster:job'
    # the uid of the owner's account on each cluster (the provider's accounts are its own);
    # a cluster not named: owner_uid
    account_uids: dict[str, int] = field(default_factory=dict)
    ranks: int = 1
    ranks_after_move: int = 1
    resumed_weights: str | None = None  # what the moved job loaded (sharded jobs say)
    saved_weights: str | None = None    # what was saved at that step before the loss
    timeline: list[Sample] = field(default_factory=list)
    picture: str = ""
    # Each checkpoint's copy off-site: step, bytes, actual_s, predicted_s, lag_s.
    replications: list[dict[str, Any]] = field(default_factory=list)
    link_mbit: float | None = None  # the home -> remote rate the drill was paced for
    lose: str = "cluster"              # what was taken away (drills.losses)
    leader_before: str | None = None   # the replica that led when the loss came
    leader_after: str | None = None    # the one that led after it
    leader_lost_at: float | None = None  # the leading replica died (site or leader loss)
    failover_at: float | None = None   # another replica said it leads
    returned_at: float | None = None   # home came back
    # Each entry the federation wrote about the loss and the job: time, kind, what, and
    # the replica that wrote it.
    decisions: list[dict[str, Any]] = field(default_factory=list)
    offsite_kept: bool = True          # every checkpoint verified off-site before it is kept
    # The master key or the run's key found on the rented provider's disks (remote's etcd
    # member, its S3 server): 'what in file' each. None is the only right answer.
    provider_secrets: list[str] = field(default_factory=list)
    cluster_sites: dict[str, str] = field(default_factory=dict)  # the site each cluster is at
    fenced_at: float | None = None     # the stale incarnation was fenced (audit entry)
    # drill --world (drills.world.check): the dataset, each incarnation's hash of it, what
    # came home; None: the job carried no world.
    world: dict[str, Any] | None = None
    # Each checkpoint verified off-site before the loss (drills.wan): step, stored_bytes,
    # lag_s, and what the home-remote link's own counters carried during its replication:
    # wan_bytes (both ways), wan_out (home to remote), wan_back.
    wan: list[dict[str, Any]] = field(default_factory=list)
    sync_poll_s: float | None = None  # checkpoint-sync's poll interval ([sync])

    def one_transfer_s(self, stored_bytes: int | None) -> float | None:
        """Seconds `stored_bytes` take once across the link at the rate paced for."""
        if not self.link_mbit or stored_bytes is None:
            return None
        return stored_bytes * 8 / (self.link_mbit * 1e6)

    @property
    def wan_judged(self) -> list[dict[str, Any]]:
        """The WAN rows long enough to judge (MIN_JUDGED_TRANSFER_S at the link's rate)."""
        return [row for row in self.wan
                if (self.one_transfer_s(row["stored_bytes"]) or 0) >= MIN_JUDGED_TRANSFER_S]

    @property
    def wan_over_stored(self) -> float | None:
        """The worst judged checkpoint's bytes over the link / its stored bytes (None:
        nothing judged, or a judged one the counters did not bracket: inf)."""
        if not self.wan_judged:
            return None
        return max(float("inf") if row["wan_bytes"] is None
                   else row["wan_bytes"] / row["stored_bytes"] for row in self.wan_judged)

    @property
    def wan_met(self) -> bool:
        return self.wan_over_stored is None or self.wan_over_stored <= WAN_OVER_STORED_TARGET

    def lags_over_transfer(self, rows: list[dict[str, Any]]) -> float | None:
        """The worst of `rows`' replication lag / one transfer of its stored bytes (None:
        no rows; inf: a lag unknown)."""
        if not rows:
            return None
        return max(float("inf") if row["lag_s"] is None
                   else row["lag_s"] / (self.one_transfer_s(row["stored_bytes"]) or 1.0)
                   for row in rows)

    @property
    def lag_judged(self) -> list[dict[str, Any]]:
        """The judged WAN rows whose target's room over one transfer covers a poll."""
        return [row for row in self.wan_judged
                if (LAG_OVER_TRANSFER_TARGET - 1) * (self.one_transfer_s(row["stored_bytes"])
                                                     or 0) >= (self.sync_poll_s or 0)]

    @property
    def lag_over_transfer(self) -> float | None:
        """The worst judged checkpoint's lag over one transfer (None: none judged)."""
        return self.lags_over_transfer(self.lag_judged)

    @property
    def lag_met(self) -> bool:
        return self.lag_over_transfer is None or \
            self.lag_over_transfer <= LAG_OVER_TRANSFER_TARGET

    @property
    def data_identical(self) -> bool:
        """Every incarnation hashed the dataset it read once, as home's (two at least)."""
        if self.world is None:
            return True
        found = self.world["job_sha256"]
        return len(found) >= 2 and all(shas == [self.world["sha256"]]
                                        for shas in found.values())

    @property
    def world_ok(self) -> bool:
        return self.world is None or (self.data_identical and self.world["outputs_home"]
                                      and self.world["log_home"])

    @property
    def failover_s(self) -> float | None:
        if self.failover_at is None or self.leader_lost_at is None:
            return None
        return self.failover_at - self.leader_lost_at

    @property
    def failover_met(self) -> bool:
        """A new leader within FAILOVER_TARGET_S of the old one's loss (when one died)."""
        if self.leader_lost_at is None:
            return True
        return self.failover_s is not None and self.failover_s <= FAILOVER_TARGET_S

    @property
    def moved_by(self) -> str | None:
        """The replica that submitted the new incarnation."""
        return next((d["replica"] for d in self.decisions if d["kind"] == "requeue"), None)

    @property
    def detection_s(self) -> float | None:
        return None if self.detected_at is None else self.detected_at - self.killed_at

    @property
    def rto_s(self) -> float | None:
        return None if self.running_elsewhere_at is None \
            else self.running_elsewhere_at - self.killed_at

    @property
    def rto_target_s(self) -> float:
        return self.detection_window_s + (self.failover_s or 0.0) + RTO_SLACK_S

    @property
    def prediction_judged(self) -> bool:
        return self.actual_transfer_s is not None and \
            self.actual_transfer_s >= MIN_JUDGED_TRANSFER_S

    @property
    def prediction_met(self) -> bool:
        """The bandwidth model predicted the resume checkpoint's transfer within
        PREDICTION_TOLERANCE of what it took (when it took long enough to judge)."""
        if not self.prediction_judged:
            return True
        assert self.actual_transfer_s is not None
        return self.predicted_transfer_s is not None and \
            abs(self.predicted_transfer_s - self.actual_transfer_s) <= \
            PREDICTION_TOLERANCE * self.actual_transfer_s

    @property
    def rto_met(self) -> bool:
        return self.rto_s is not None and self.rto_s <= self.rto_target_s

    @property
    def steps_lost_met(self) -> bool:
        return self.steps_lost is not None and self.steps_lost <= self.settings["ckpt_every"]

    @property
    def ran_as_owner(self) -> bool:
        """Every incarnation ran as the job's owner (as their account on its cluster), and
        at least the home one and the moved one said so."""
        return len(self.ran_as) >= 2 and all(
            uid == self.account_uids.get(incarnation.partition(":")[0], self.owner_uid)
            for incarnation, uid in self.ran_as.items())

    @property
    def resharded(self) -> bool:
        return self.ranks_after_move != self.ranks

    @property
    def weights_ok(self) -> bool:
        """Same world size: the final weights equal an uninterrupted run's. Resharded
        (the reduction order changed, so those differ): the moved job loaded exactly
        the weights saved at its resume step, and trained to the end."""
        if not self.resharded:
            return self.bit_identical
        return (self.resumed_weights is not None and self.resumed_weights == self.saved_weights
                and self.final_step == self.settings["steps"])

    @property
    def shape_ok(self) -> bool:
        """A drill asked to reshard did: the job resumed on fewer ranks."""
        return not self.settings.get("reshard") or self.ranks == 1 or self.resharded

    @property
    def passed(self) -> bool:
        return self.weights_ok and self.shape_ok and self.rto_met and self.steps_lost_met and \
            self.audit_ok and self.ran_as_owner and self.prediction_met and \
            self.failover_met and self.offsite_kept and self.successor_moved and \
            not self.provider_secrets and self.world_ok and self.wan_met and self.lag_met

    @property
    def successor_moved(self) -> bool:
        """When the leader was lost, the replica that took over submitted the move."""
        return self.leader_lost_at is None or (
            self.moved_by is not None and self.moved_by == self.leader_after)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(detection_s=self.detection_s, rto_s=self.rto_s,
                    rto_target_s=self.rto_target_s, ran_as_owner=self.ran_as_owner,
                    resharded=self.resharded, weights_ok=self.weights_ok,
                    shape_ok=self.shape_ok, prediction_judged=self.prediction_judged,
                    prediction_met=self.prediction_met, failover_s=self.failover_s,
                    failover_met=self.failover_met, moved_by=self.moved_by,
                    successor_moved=self.successor_moved, passed=self.passed,
                    data_identical=self.data_identical, world_ok=self.world_ok,
                    wan_bytes_per_checkpoint=_mean(row["wan_bytes"] for row in self.wan),
                    stored_bytes_per_checkpoint=_mean(row["stored_bytes"] for row in self.wan),
                    wan_over_stored=_finite(self.wan_over_stored), wan_met=self.wan_met,
                    lag_over_transfer=_finite(self.lag_over_transfer), lag_met=self.lag_met,
                    # every command's --json names what it moved, and for how long
                    bytes=self.replicated_bytes, seconds=self.replication_seconds)
        return data


def _mean(values: Iterable[int | None]) -> float | None:
    """The mean of the known values (None: none known)."""
    known = [value for value in values if value is not None]
    return sum(known) / len(known) if known else None


def _finite(value: float | None) -> float | None:
    """JSON has no infinity: an unmeasured figure is null there."""
    return None if value is None or value == float("inf") else value


def _wan_lines(report: DrillReport) -> list[str]:
    """Bytes over the WAN per checkpoint by the link's own counters, over its stored
    bytes, and the replication lag over one transfer of them (issue 32's targets)."""
    if not report.wan:
        return []
    wire, stored = _mean(r["wan_bytes"] for r in report.wan), \
        _mean(r["stored_bytes"] for r in report.wan)
    back = _mean(r["wan_back"] for r in report.wan)
    mb = "n/a" if wire is None else f"{wire / 1e6:.1f} MB"
    counted = (f"home-remote link's counters over {len(report.wan)} checkpoint(s) verified "
               f"before the loss: {'n/a' if back is None else f'{back / 1e6:.1f} MB'} of it "
               f"remote to home; stored {'n/a' if stored is None else f'{stored / 1e6:.1f} MB'}")
    lag_rows = [r["lag_s"] for r in report.wan if r["lag_s"] is not None]
    lag = max(lag_rows) if lag_rows else None
    if report.wan_over_stored is None:
        unjudged = (f"a transfer under {MIN_JUDGED_TRANSFER_S:.0f} s" if report.link_mbit
                    else "link rate unknown") + ", not judged"
        return [f"  WAN per checkpoint  {mb:>10}   {counted}; {unjudged}",
                f"  replication lag     {_seconds(lag):>10}   worst; {unjudged}"]
    ratio = report.wan_over_stored
    one = report.one_transfer_s(max(r["stored_bytes"] for r in report.wan_judged))
    lag_verdict = (f"target <= {LAG_OVER_TRANSFER_TARGET:g}x: {_verdict(report.lag_met)}"
                   if report.lag_judged else
                   f"not judged: {LAG_OVER_TRANSFER_TARGET - 1:.0%} of it is under "
                   f"checkpoint-sync's {report.sync_poll_s:g} s poll")
    return [
        f"  WAN per checkpoint  {mb:>10}   {counted}; worst {_ratio(ratio)} the stored "
        f"bytes, target <= {WAN_OVER_STORED_TARGET:g}x: {_verdict(report.wan_met)}",
        f"  replication lag     {_seconds(lag):>10}   worst "
        f"{_ratio(report.lags_over_transfer(report.wan_judged))} one transfer of the stored "
        f"bytes ({_seconds(one)} at {report.link_mbit:g} Mbit/s), {lag_verdict}",
    ]


def _ratio(value: float | None) -> str:
    return "n/a" if value is None or value == float("inf") else f"{value:.3f}x"


def _weights_line(report: DrillReport) -> str:
    if report.resharded:
        same = report.resumed_weights is not None and \
            report.resumed_weights == report.saved_weights
        return (f"  resumed weights     {'identical' if same else 'DIFFERENT':>10}   to those "
                f"saved at step {report.resume_step}, on {report.ranks_after_move} of "
                f"{report.ranks} ranks (resharded); final step {report.final_step}")
    ranks = f" ({report.ranks} ranks)" if report.ranks > 1 else ""
    return (f"  final weights       {'identical' if report.bit_identical else 'DIFFERENT':>10}"
            f"   step {report.final_step}{ranks}, sha256 {str(report.final_weights)[:16]}...")


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} s"


def _verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def _transfer_line(report: DrillReport) -> str:
    judged = (f"within {PREDICTION_TOLERANCE:.0%}: {_verdict(report.prediction_met)}"
              if report.prediction_judged else
              f"under {MIN_JUDGED_TRANSFER_S:.0f} s, not judged")
    return (f"  transfer of resume  predicted {_seconds(report.predicted_transfer_s)}, actual "
            f"{_seconds(report.actual_transfer_s)}; {judged}")


def _replication_lines(report: DrillReport) -> list[str]:
    """A row per checkpoint copied off-site: size, predicted and actual time, lag."""
    if not report.replications:
        return []
    link = f"at {report.link_mbit:g} Mbit/s" if report.link_mbit else "link rate unknown"
    lines = [f"  replications        {len(report.replications):>10}   paced for the link "
             f"{link}",
             "    step        MB  predicted     actual        lag"]

    def cell(value: float | None) -> str:
        return f"{'n/a':>8}  " if value is None else f"{value:>8.1f} s"
    for row in report.replications:
        lines.append(f"    {row['step']:>4} {row['bytes'] / 1e6:>9.1f} {cell(row['predicted_s'])}"
                     f" {cell(row['actual_s'])} {cell(row['lag_s'])}")
    return lines


def _leader_lines(report: DrillReport) -> list[str]:
    """Who led, how soon another did, and which replica wrote what (replicated only)."""
    if not any(d.get("replica") for d in report.decisions) and report.leader_lost_at is None:
        return []
    lines = []
    if report.leader_lost_at is not None:
        lines.append(f"  leader failover     {_seconds(report.failover_s):>10}   "
                     f"{report.leader_before} -> {report.leader_after}; target <= "
                     f"{FAILOVER_TARGET_S:.0f} s: {_verdict(report.failover_met)}; the move "
                     f"submitted by {report.moved_by}: {_verdict(report.successor_moved)}")
    by: dict[str, list[str]] = {}
    for decision in report.decisions:
        by.setdefault(decision.get("replica") or "-", []).append(decision["kind"])
    for replica, kinds in by.items():
        counted = ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))
        lines.append(f"  written by {replica:<8} {counted}")
    return lines


def _world_lines(report: DrillReport) -> list[str]:
    """drill --world: the dataset read, what it staged, and what came home."""
    world = report.world
    if world is None:
        return []
    hashed = ", ".join(f"{where} {shas[0][:12] if len(shas) == 1 else shas or '-'}"
                       for where, shas in world["job_sha256"].items())
    return [
        f"  world staged        {world['staged_bytes'] / 1e6:>7.1f} MB   a {world['mb']:g} "
        f"MiB dataset in {world['files']} files, the project and a venv, off-site "
        f"{_seconds(world.get('offsite_s'))} after submission, before the loss",
        f"  first step moved    {_seconds(world.get('first_step_s')):>10}   after the loss, "
        "the world materialised from the target's store and hashed (RTO ends before: at the "
        "preamble's lease)",
        f"  data read           {'identical' if report.data_identical else 'DIFFERENT':>10}"
        f"   sha256 {world['sha256'][:12]} at home; as each job hashed it: {hashed}",
        f"  outputs home        {'fetched' if world['outputs_home'] else 'MISSING':>10}   "
        f"slurm-geo outputs fetch as {report.owner}: "
        f"{len(world['outputs_fetched'])} file(s)",
        f"  log home            {'shown' if world['log_home'] else 'MISSING':>10}   "
        f"slurm-geo logs as {report.owner}: the moved incarnation's log, its data-sha",
    ]


def _accounts(report: DrillReport) -> str:
    """Where the owner's account has another uid (a provider's own accounts)."""
    others = {cluster: uid for cluster, uid in report.account_uids.items()
              if uid != report.owner_uid}
    return "".join(f", uid {uid} at {cluster}" for cluster, uid in sorted(others.items()))


def render_report(report: DrillReport) -> str:
    seconds, verdict = _seconds, _verdict
    lines = [
        f"slurm-geo drill {report.run} ({report.logical_job}: {report.home} -> "
        f"{report.target})",
        "",
        f"  detection           {seconds(report.detection_s):>10}   window "
        f"{report.detection_window_s:.0f} s",
        f"  RTO                 {seconds(report.rto_s):>10}   target <= "
        f"{report.rto_target_s:.0f} s (detection window"
        f"{' + failover' if report.leader_lost_at is not None else ''} + "
        f"{RTO_SLACK_S:.0f} s): {verdict(report.rto_met)}",
        f"  steps lost (RPO)    {report.steps_lost!s:>10}   last step home "
        f"{report.last_step_home}, off-site at kill {report.offsite_step_at_kill}, resumed "
        f"at {report.resume_step}; target <= {report.settings['ckpt_every']}: "
        f"{verdict(report.steps_lost_met)}",
        _weights_line(report),
        f"  bytes off-site      {report.replicated_bytes:>10}   by checkpoint-sync, "
        f"{report.replication_seconds:.2f} s of transfers",
        _transfer_line(report),
        *_replication_lines(report),
        *_wan_lines(report),
        *_leader_lines(report),
        f"  off-site at loss    {'kept' if report.offsite_kept else 'LOST':>10}   every "
        f"checkpoint verified off-site before the loss, the newest verified again",
        f"  provider's disks    {'no secret' if not report.provider_secrets else 'SECRETS':>10}"
        f"   remote's etcd member and S3 scanned for the master key and the run key"
        + "".join(f"\n    {found}" for found in report.provider_secrets),
        *_world_lines(report),
        f"  stale incarnation   {report.stale_incarnation}",
        f"  audit chain         {'verifies' if report.audit_ok else 'BROKEN'}",
        f"  ran as              {report.owner:>10}   uid {report.owner_uid} in "
        f"{len(report.ran_as)} incarnations{_accounts(report)}: "
        f"{verdict(report.ran_as_owner)}",
        "",
        "  leg                 elapsed      compute        fee      total",
    ]
    for leg in report.legs:
        lines.append(f"  {leg['cluster'] + ':' + str(leg['job_id']):<18} "
                     f"{leg['elapsed_s']:>7.1f} s {leg['compute_usd']:>10.4f} "
                     f"{leg['fee_usd']:>10.4f} {leg['total_usd']:>10.4f} USD")
        lines += [f"    {flag}" for flag in leg.get("flags", ())]
    lines += ["", f"  timeline: {report.picture}",
              f"  result: {'PASSED' if report.passed else 'FAILED'}"]
    return "\n".join(lines)
