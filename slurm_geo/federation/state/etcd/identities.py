"""Who is who in the federation state in etcd: the interface of
federation.identities.Identities (each job's owner, each incarnation's lease secret and
its one-time key token), `EtcdFederationState.identities`.

A key token is stored under its SHA-256 and the secret in a sealed value, so the etcd
member of the rented site holds neither; the daemons of the trusted sites open them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from slurm_geo.federation.model import LogicalJob, RunOwner, StaleJob, token_digest
from slurm_geo.federation.state.etcd import records
from slurm_geo.federation.state.etcd.kv import EtcdKV
from slurm_geo.federation.state.etcd.layout import Layout
from slurm_geo.federation.state.etcd.leadership import WriteGuard
from slurm_geo.federation.state.etcd.transaction import Transaction, write
from slurm_geo.federation.state.identities import TokenOwner
from slurm_geo.slurm.models import Owner


class EtcdIdentities:
    def __init__(self, kv: EtcdKV, layout: Layout, leadership: WriteGuard):
        self.kv, self.layout, self.leadership = kv, layout, leadership

    def put_secret(self, logical_job: str, generation: int, secret: str) -> None:
        """Before the incarnation is submitted: it may ask as soon as it starts."""
        key = self.layout.secret(logical_job, generation)
        write(self.kv, self.leadership, lambda tx: tx.put(key, {"secret": secret}))

    def secret(self, logical_job: str, generation: int) -> str | None:
        found = self.kv.get(self.layout.secret(logical_job, generation))
        return None if found is None else str(records.loads(found.value)["secret"])

    def token_owner(self, token: str) -> TokenOwner | None:
        found = self.kv.get(self.layout.token(token_digest(token)))
        if found is None:
            return None
        record = records.loads(found.value)
        return TokenOwner(record["logical_job"], record["generation"], record["used_restart"])

    def use_token(self, token: str, restart: int) -> bool:
        """Mark the token used by `restart` of its incarnation; False if that restart (or a
        later one) used it already. A requeued incarnation (same job, next restart) may
        fetch its key once more, after it got the lease."""
        key = self.layout.token(token_digest(token))

        def attempt(tx: Transaction) -> bool:
            record = tx.get(key)
            if record is None or (record["used_restart"] is not None
                                  and record["used_restart"] >= restart):
                return False
            tx.put(key, {**record, "used_restart": restart})
            return True
        return write(self.kv, self.leadership, attempt)

    def claim_owner(self, logical_job: str, owner: Owner, environment: dict[str, str]
                    ) -> None:
        """A job registered before owners were recorded (schema 2) gets the owner Slurm's
        record names and their allow-listed environment, once; an owner already recorded
        is never replaced."""
        change_job(self.kv, self.layout, self.leadership, logical_job, lambda job: replace(
            job, owner=owner, owner_env=environment) if job.owner is None else None)

    def run_owner(self, run: str) -> RunOwner | None:
        """The owner an admin gave `run` to (federation.runowners); None if none."""
        found = self.kv.get(self.layout.run_owner(run))
        return None if found is None else RunOwner.from_json(records.loads(found.value))

    def assign_run(self, assignment: RunOwner) -> None:
        """Give a run to an owner (replacing an earlier assignment): an admin's act."""
        key = self.layout.run_owner(assignment.run)
        write(self.kv, self.leadership, lambda tx: tx.put(key, assignment.to_json()))

    def learn_environment(self, logical_job: str, environment: dict[str, str]) -> None:
        """The owner's environment, for a job registered before slurmdbd had it (it
        records a job seconds after submission); one already known is never replaced."""
        change_job(self.kv, self.layout, self.leadership, logical_job, lambda job: replace(
            job, owner_env=environment) if not job.owner_env else None)


def change_job(kv: EtcdKV, layout: Layout, leadership: WriteGuard, logical_job: str,
               change: Callable[[LogicalJob], LogicalJob | None], *,
               stale_unless: str | None = None) -> LogicalJob | None:
    """Write `change(job)` of the job as it is now (None: leave it as it is, as an SQL
    UPDATE whose WHERE matched nothing); what the job is afterwards, None if unknown.
    With `stale_unless`, an unknown job or one left as it is raises StaleJob ("no
    longer <stale_unless>")."""
    key = layout.job(logical_job)

    def attempt(tx: Transaction) -> LogicalJob | None:
        record = tx.get(key)
        job = None if record is None else records.job_from(record)
        changed = None if job is None else change(job)
        if changed is None:
            if stale_unless is not None:
                raise StaleJob(logical_job, stale_unless)
            return job
        tx.put(key, records.job_record(changed))
        return changed
    return write(kv, leadership, attempt)


def forget_tokens(tx: Transaction, layout: Layout, logical_job: str,
                  generation: int | None = None) -> None:
    """Delete the job's key tokens (only `generation`'s, when given): a new generation
    begins, or an incarnation ended and can fetch no key. Its secret stays: should it
    still run, its requests are answered, and refused, as fenced."""
    for key, token in tx.range(layout.tokens):
        if token["logical_job"] == logical_job and generation in (None, token["generation"]):
            tx.delete(key)

