"""Who is who in the federation state: each job's owner, each incarnation's lease secret
and its one-time key token. `FederationState.identities` is one of these, on the state's
own connection and lock (the schema: federation.schema).

The secrets are kept in the clear, for as long as the job is: the daemon must compute the
same HMAC as the job, and a stale incarnation must still be told it is fenced. The state
file is 0600 in a 0700 directory, as for every job's batch script.

An incarnation's secret field holds `IncarnationSecrets`: the bootstrap secret it was
submitted with (which its environment, so slurmdbd's records, keep) and the session
secret the daemon hands it over TLS at its first lease (federation.sessions).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass

from slurm_geo.federation.model import RunOwner, token_digest
from slurm_geo.slurm.models import Owner
from slurm_geo.sqlite_tx import immediate_transaction


@dataclass(frozen=True)
class IncarnationSecrets:
    """The secrets an incarnation may sign with. `bootstrap`: minted at submission, in the
    job's environment. `session`: handed out in the reply to its first lease of Slurm
    restart `restart`; `confirmed` once a request was signed with it, and from then on the
    bootstrap secret speaks only for a later restart (a Slurm requeue starts the job again
    with the environment it was submitted with). Kept as one text in the state's secret
    field: a plain bootstrap secret (64 hex digits, as before sessions) or JSON."""

    bootstrap: str
    session: str = ""
    restart: int = 0
    confirmed: bool = False

    @classmethod
    def parse(cls, text: str) -> IncarnationSecrets:
        if not text.startswith("{"):
            return cls(text)
        record = json.loads(text)
        return cls(str(record["bootstrap"]), str(record["session"]), int(record["restart"]),
                   bool(record["confirmed"]))

    def to_text(self) -> str:
        if not self.session:
            return self.bootstrap
        return json.dumps({"bootstrap": self.bootstrap, "session": self.session,
                           "restart": self.restart, "confirmed": self.confirmed})

    @property
    def signing(self) -> str:
        """The secret the incarnation signs with now: the session one once it has one."""
        return self.session or self.bootstrap


@dataclass(frozen=True)
class TokenOwner:
    logical_job: str
    generation: int
    used_restart: int | None  # the restart of the incarnation it released the key to


class Identities:
    def __init__(self, db: sqlite3.Connection, lock: threading.RLock):
        self._db, self._lock = db, lock

    def put_secret(self, logical_job: str, generation: int, secret: str) -> None:
        """Before the incarnation is submitted: it may ask as soon as it starts."""
        with self._lock, immediate_transaction(self._db) as db:
            db.execute("INSERT OR REPLACE INTO incarnation_secrets VALUES (?,?,?)",
                       (logical_job, generation, secret))

    def secret(self, logical_job: str, generation: int) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT secret FROM incarnation_secrets WHERE "
                                   "logical_job = ? AND generation = ?",
                                   (logical_job, generation)).fetchone()
        return None if row is None else str(row[0])

    def token_owner(self, token: str) -> TokenOwner | None:
        with self._lock:
            row = self._db.execute("SELECT logical_job, generation, used_restart FROM tokens "
                                   "WHERE token_sha256 = ?", (token_digest(token),)).fetchone()
        return None if row is None else TokenOwner(row[0], row[1], row[2])

    def use_token(self, token: str, restart: int) -> bool:
        """Mark the token used by `restart` of its incarnation; False if that restart (or a
        later one) used it already. A requeued incarnation (same job, next restart) may
        fetch its key once more, after it got the lease."""
        with self._lock, immediate_transaction(self._db) as db:
            changed = db.execute("UPDATE tokens SET used_restart = ? WHERE token_sha256 = ? "
                                 "AND (used_restart IS NULL OR used_restart < ?)",
                                 (restart, token_digest(token), restart))
            return changed.rowcount == 1

    def claim_owner(self, logical_job: str, owner: Owner, environment: dict[str, str]
                    ) -> None:
        """A job registered before owners were recorded (schema 2) gets the owner Slurm's
        record names and their allow-listed environment, once; an owner already recorded
        is never replaced."""
        with self._lock, immediate_transaction(self._db) as db:
            db.execute("UPDATE jobs SET owner_user = ?, owner_uid = ?, owner_gid = ?, "
                       "owner_env = ? WHERE logical_job = ? AND owner_uid IS NULL",
                       (owner.user, owner.uid, owner.gid, json.dumps(environment),
                        logical_job))


    def run_owner(self, run: str) -> RunOwner | None:
        """The owner an admin gave `run` to (federation.runowners); None if none."""
        with self._lock:
            row = self._db.execute("SELECT run, owner_user, owner_uid, owner_gid, "
                                   "assigned_by, assigned_at FROM run_owners WHERE run = ?",
                                   (run,)).fetchone()
        return None if row is None else RunOwner(row[0], Owner(row[1], row[2], row[3]),
                                                 row[4], row[5])

    def assign_run(self, assignment: RunOwner) -> None:
        """Give a run to an owner (replacing an earlier assignment): an admin's act."""
        o = assignment.owner
        with self._lock, immediate_transaction(self._db) as db:
            db.execute("INSERT OR REPLACE INTO run_owners VALUES (?,?,?,?,?,?)",
                       (assignment.run, o.user, o.uid, o.gid, assignment.assigned_by,
                        assignment.assigned_at))

    def learn_environment(self, logical_job: str, environment: dict[str, str]) -> None:
        """The owner's environment, for a job registered before slurmdbd had it (it
        records a job seconds after submission); one already known is never replaced."""
        with self._lock, immediate_transaction(self._db) as db:
            db.execute("UPDATE jobs SET owner_env = ? WHERE logical_job = ? AND "
                       "owner_env = '{}'", (json.dumps(environment), logical_job))


def put_token(db: sqlite3.Connection, token_sha256: str, logical_job: str,
              generation: int) -> None:
    db.execute("INSERT OR REPLACE INTO tokens VALUES (?,?,?,NULL)",
               (token_sha256, logical_job, generation))


def forget_incarnation(db: sqlite3.Connection, logical_job: str, generation: int) -> None:
    """An ended incarnation can fetch no key. Its secret stays: should it still run (a
    cancel that did not reach it), its requests are answered, and refused, as fenced."""
    db.execute("DELETE FROM tokens WHERE logical_job = ? AND generation = ?",
               (logical_job, generation))
