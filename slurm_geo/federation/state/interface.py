"""The one typed interface of the federation state, whichever backend holds it: `State`
(logical jobs, incarnations, leases, health, bandwidth, the daemon's watermarks), its
`IdentityStore` (owners, runs given to owners, incarnation secrets, one-time key tokens)
and the `Audit` log.

SQLite for a daemon alone (federation.state.sqlite, .identities, .audit) and etcd for
replicas (federation.state.etcd.state, .identities, .audit) implement these Protocols
(structurally: federation.state.open, which builds both, has mypy check each backend
against them); everything above (wiring, decide, act, engine, operator, the commands,
billing, the drills) names only these. tests/test_state_conformance.py runs one table of
their behaviours on both backends. Open them from the config with federation.state.open.
"""

from __future__ import annotations

from typing import Any, Protocol

from slurm_geo.federation.model import (
    Health,
    Incarnation,
    IncarnationEnd,
    JobStatus,
    Lease,
    LeftHome,
    LogicalJob,
    RunOwner,
)
from slurm_geo.federation.state.audit import Entry, VerifyReport
from slurm_geo.federation.state.identities import TokenOwner
from slurm_geo.slurm.models import Owner


class IdentityStore(Protocol):
    """Who is who: each job's owner, the runs an admin gave to an owner, each
    incarnation's lease secret and its one-time key token (`State.identities`)."""

    def put_secret(self, logical_job: str, generation: int, secret: str) -> None:
        """Before the incarnation is submitted: it may ask as soon as it starts."""
        ...

    def secret(self, logical_job: str, generation: int) -> str | None: ...

    def token_owner(self, token: str) -> TokenOwner | None:
        """The incarnation a key token (its SHA-256) was minted for; None once it is gone."""
        ...

    def use_token(self, token: str, restart: int) -> bool:
        """Mark the token used by `restart` of its incarnation; False if that restart (or a
        later one) used it already."""
        ...

    def claim_owner(self, logical_job: str, owner: Owner, environment: dict[str, str]
                    ) -> None:
        """The owner Slurm's record names and their environment, for a job that has none;
        an owner already recorded is never replaced."""
        ...

    def run_owner(self, run: str) -> RunOwner | None:
        """The owner an admin gave `run` to; None if none."""
        ...

    def assign_run(self, assignment: RunOwner) -> None:
        """Give a run to an owner (replacing an earlier assignment)."""
        ...

    def learn_environment(self, logical_job: str, environment: dict[str, str]) -> None:
        """The owner's environment for a job that has none yet; never replaced."""
        ...


class State(Protocol):
    """All reads and writes of the federation state. Writes of status and generation are
    compare-and-set: StaleJob (nothing written) when the job is no longer as the writer
    saw it, IllegalTransition for a move the lifecycle forbids, UnknownLogicalJob for a
    name the state does not hold. Thread-safe. A write by a replica that does not lead is
    NotLeader (etcd); a daemon alone on SQLite always leads."""

    @property
    def identities(self) -> IdentityStore: ...

    def close(self) -> None: ...

    def confirm_leading(self) -> None:
        """NotLeader unless this writer leads now (always true for SQLite)."""
        ...

    # --- logical jobs ---------------------------------------------------------------------

    def add_job(self, job: LogicalJob) -> bool:
        """Register `job` (generation 0 at home); False if it is already known. A job is
        registered as first found: its planned move, approval, `left_home` and counts are
        not the caller's to give (SQLite does not store them; later writes set them)."""
        ...

    def job(self, logical_job: str) -> LogicalJob: ...

    def find_job(self, cluster: str, job_id: int) -> LogicalJob | None:
        """The logical job whose incarnation is Slurm job `job_id` on `cluster`."""
        ...

    def find_by_job_id(self, job_id: int) -> list[tuple[str, LogicalJob]]:
        """(cluster, logical job) of each incarnation that is Slurm job `job_id` anywhere,
        by cluster then age."""
        ...

    def find_by_run(self, run: str) -> list[LogicalJob]: ...

    def jobs(self, active_only: bool = False) -> list[LogicalJob]:
        """Every job (only those not final with `active_only`), oldest first."""
        ...

    def name_run(self, logical_job: str, run: str, now: float) -> LogicalJob: ...

    def move_status(self, logical_job: str, expected: JobStatus, wanted: JobStatus,
                    now: float) -> LogicalJob: ...

    def plan_move(self, logical_job: str, generation: int, target: str,
                  after_step: int | None, now: float) -> LogicalJob: ...

    def await_approval(self, logical_job: str, target: str | None, now: float) -> None: ...

    def count_lost_restart(self, logical_job: str, now: float) -> None: ...

    def reset_lost_restarts(self, logical_job: str, now: float) -> None: ...

    def begin_generation(self, logical_job: str, expected_generation: int, cluster: str,
                         resume_step: int | None, now: float, *,
                         left_home: LeftHome | None = None, recovery: bool = False,
                         live_lease_ttl_s: float | None = None) -> LogicalJob: ...

    def submitted(self, logical_job: str, generation: int, job_id: int, token_sha256: str,
                  now: float) -> LogicalJob: ...

    # --- incarnations ---------------------------------------------------------------------

    def incarnations(self, logical_job: str) -> list[Incarnation]:
        """The job's incarnations, by generation."""
        ...

    def end_incarnation(self, logical_job: str, generation: int, reason: IncarnationEnd,
                        now: float) -> None: ...

    # --- leases ---------------------------------------------------------------------------

    def lease(self, logical_job: str) -> Lease | None: ...

    def put_lease(self, lease: Lease, first_for_generation: bool) -> None: ...

    def release_lease(self, logical_job: str) -> None: ...

    def refresh_leases(self, now: float) -> None: ...

    # --- health, bandwidth and the daemon's own watermarks ----------------------------------

    def health(self) -> dict[str, Health]: ...

    def put_health(self, health: Health) -> None: ...

    def bandwidth_snapshot(self) -> list[dict[str, Any]]: ...

    def put_bandwidth_snapshot(self, rows: list[dict[str, Any]]) -> None: ...

    def bandwidth_probe_at(self) -> float: ...

    def put_bandwidth_probe_at(self, when: float) -> None: ...

    def sync_transfer_id(self) -> int: ...

    def put_sync_transfer_id(self, transfer_id: int) -> None: ...


class Audit(Protocol):
    """The hash-chained audit log (federation.state.audit's module docstring)."""

    def close(self) -> None: ...

    def __enter__(self) -> Audit: ...

    def __exit__(self, *exc: object) -> None: ...

    def append(self, kind: str, logical_job: str | None, what: str, why: str,
               **detail: Any) -> Entry:
        """Add one entry at the end of the chain; ValueError / TypeError when `kind` is
        empty or `detail` is not JSON (NaN and infinities included)."""
        ...

    def head(self) -> tuple[int, str]:
        """(seq, hash) of the last entry; (0, 64 zeros) for an empty log."""
        ...

    def entries(self, logical_job: str | None = None, since_seq: int = 0,
                kind: str | None = None) -> list[Entry]:
        """Entries after `since_seq`, oldest first; only `logical_job`'s, or only those of
        `kind`, when given."""
        ...

    def verify(self, expected_head: tuple[int, str] | None = None) -> VerifyReport: ...
