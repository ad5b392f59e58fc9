"""Who owns what, read from the other daemons' records for `billing ingest`. Thin I/O:
each database through its owner's read API (`RegistryReader`, `FederationState` and
`AuditLog` opened read-only, or the replicas' state in etcd through
federation.state.open, `SyncStateReader`); what follows from them is `billing.lineage`'s.

A record that does not exist yet (no geo job started, no federation daemon run) is no
records; one that exists and cannot be read stops ingest with its own error, rather than
bill without lineage: `RegistryUnreadable` (exit 42), `FederationStateError` (43),
`AuditError` (55), `SyncStateUnreadable` (40).
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from slurm_geo.billing import lineage
from slurm_geo.billing.attribution import RegistryJob
from slurm_geo.billing.outages import Outage, outages_of
from slurm_geo.federation.model import FederationStateError
from slurm_geo.federation.state.audit import AuditError, AuditLog, Entry
from slurm_geo.federation.state.sqlite import FederationState
from slurm_geo.registry import RegistryReader
from slurm_geo.sync.reader import SyncStateReader

if TYPE_CHECKING:
    from slurm_geo.config.daemons import FederationConfig
    from slurm_geo.federation.state.open import OpenedState


class Ownership(NamedTuple):
    owners: lineage.Owners   # which logical job each Slurm job and run belongs to
    outages: list[Outage]    # the clusters the federation daemon lost, for lost legs


def read_ownership(registry: Path | None, federation_state: Path | None,
                   federation_audit: Path | None,
                   federation_etcd: FederationConfig | None = None) -> Ownership:
    """Every record of which logical job each Slurm job and run belongs to, and the
    outages that cut legs short: one read of the audit log for both. With
    `federation_etcd` (replicas of the daemon), the state and the log are in etcd."""
    entries = audit_entries(federation_audit, (*lineage.LEG_KINDS, lineage.TRAINED,
                                               "transfer", "outage"), federation_etcd)
    federated = lineage.merge(federated_from_state(federation_state, federation_etcd),
                              lineage.from_audit(entries))
    links, jobs = read_registry(registry)
    return Ownership(lineage.Owners(federated, jobs, links), outages_of(entries))


def read_registry(path: Path | None) -> tuple[dict[tuple[str, int], str], list[RegistryJob]]:
    """Lineage and geo jobs from the controller's registry: none when no registry is
    configured or no geo job has started yet (no file)."""
    if path is None:
        return {}, []
    registry = RegistryReader(path, missing_ok=True)
    links = {(link.cluster, link.job_id): link.logical_id for link in registry.lineage()}
    jobs = [RegistryJob(job.cluster, job.job_id, job.logical_id, job.user,
                        job.directives.get("geo-cost-center", ""),
                        job.directives.get("geo-ckpt-dir", ""), job.first_seen)
            for job in registry.jobs()]
    return links, jobs


def federated_from_state(path: Path | None, etcd: FederationConfig | None = None
                         ) -> list[lineage.FederatedJob]:
    """The daemon's logical jobs and their incarnations, as its state holds them."""
    if etcd is not None:
        with replicated_records(etcd) as opened:
            jobs = opened.state.jobs()
            incarnations = {job.logical_job: opened.state.incarnations(job.logical_job)
                            for job in jobs}
        return lineage.from_state(jobs, incarnations)
    if path is None or not path.exists():
        return []
    try:
        state = FederationState(path, readonly=True)
    except sqlite3.Error as exc:
        raise FederationStateError(f"cannot read the federation state {path}: {exc}") from None
    try:
        jobs = state.jobs()
        incarnations = {job.logical_job: state.incarnations(job.logical_job) for job in jobs}
    except (sqlite3.Error, ValueError) as exc:  # ValueError: a row this version cannot parse
        raise FederationStateError(f"cannot read the federation state {path}: {exc}") from None
    finally:
        state.close()
    return lineage.from_state(jobs, incarnations)


def audit_entries(path: Path | None, kinds: Sequence[str],
                  etcd: FederationConfig | None = None) -> list[Entry]:
    """The audit log's entries of these kinds, oldest first; none before the daemon's first
    start (no file). With `etcd`, the replicas' log there."""
    if etcd is not None:
        with replicated_records(etcd) as opened:
            found = [entry for kind in kinds for entry in opened.audit.entries(kind=kind)]
        return sorted(found, key=lambda entry: entry.seq)
    if path is None or not path.exists():
        return []
    with AuditLog(path, readonly=True) as audit:
        try:
            found = [entry for kind in kinds for entry in audit.entries(kind=kind)]
        except sqlite3.Error as exc:
            raise AuditError(f"cannot read audit log {path}: {exc}") from None
    return sorted(found, key=lambda entry: entry.seq)


@contextmanager
def replicated_records(config: FederationConfig) -> Iterator[OpenedState]:
    """The replicas' state and audit log in etcd, read as a person's command reads them:
    with the master key (they are sealed under it), leading nothing. etcd not answering
    is `StateUnavailable` (a FederationStateError): ingest fails, it does not bill blind.
    Opened by federation.state.open, as the commands open it: never the daemon's code."""
    from slurm_geo.federation.state.open import open_replicas_to_read

    opened = open_replicas_to_read(config, os.environ)
    try:
        yield opened
    finally:
        opened.audit.close()


def job_directories(sync_state: Path | None) -> dict[str, tuple[str, ...]]:
    """checkpoint-sync's job roots -> the jobs that named them, when [sync] is configured
    (its state must then be readable, as for its transfers)."""
    if sync_state is None:
        return {}
    return SyncStateReader(sync_state).job_directories()
