"""The drill's DR report as text, for people (`--json` gives the same for scripts)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slurm_geo.federation.drill import DrillReport


def render_report(report: DrillReport) -> str:
    def seconds(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1f} s"

    def verdict(ok: bool) -> str:
        return "ok" if ok else "MISSED"

    lines = [
        f"slurm-geo drill {report.run} ({report.logical_job}: {report.home} -> "
        f"{report.target})",
        "",
        f"  detection           {seconds(report.detection_s):>10}   window "
        f"{report.detection_window_s:.0f} s",
        f"  RTO                 {seconds(report.rto_s):>10}   target <= "
        f"{report.rto_target_s:.0f} s: {verdict(report.rto_met)}",
        f"  steps lost (RPO)    {report.steps_lost!s:>10}   last step home "
        f"{report.last_step_home}, off-site at kill {report.offsite_step_at_kill}, resumed "
        f"at {report.resume_step}; target <= {report.settings['ckpt_every']}: "
        f"{verdict(report.steps_lost_met)}",
        f"  final weights       {'identical' if report.bit_identical else 'DIFFERENT':>10}"
        f"   step {report.final_step}, sha256 {str(report.final_weights)[:16]}...",
        f"  bytes off-site      {report.replicated_bytes:>10}   by checkpoint-sync, "
        f"{report.replication_seconds:.2f} s of transfers",
        f"  transfer of resume  predicted {seconds(report.predicted_transfer_s)}, actual "
        f"{seconds(report.actual_transfer_s)}",
        f"  stale incarnation   {report.stale_incarnation}",
        f"  audit chain         {'verifies' if report.audit_ok else 'BROKEN'}",
        "",
        "  leg                 elapsed      compute        fee      total",
    ]
    for leg in report.legs:
        lines.append(f"  {leg['cluster'] + ':' + str(leg['job_id']):<18} "
                     f"{leg['elapsed_s']:>7.1f} s {leg['compute_usd']:>10.4f} "
                     f"{leg['fee_usd']:>10.4f} {leg['total_usd']:>10.4f} USD")
    lines += ["", f"  timeline: {report.picture}",
              f"  result: {'PASSED' if report.passed else 'FAILED'}"]
    return "\n".join(lines)
