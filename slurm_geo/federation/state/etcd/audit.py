"""The federation daemon's audit log in etcd: the interface and the chain of
federation.audit.AuditLog (the same entries, the same hashes), for the replicated state.

Entry `seq` is the record `<prefix>/audit/<seq>` (the columns of the SQLite table, the
detail as its canonical text) and `<prefix>/audit-head` names the last one. An append is
one transaction (federation.etcd.transaction): it reads the head, writes entry seq + 1
only where there is none and the head with it, and holds only while this replica leads,
so the chain stays linear whichever site's daemon leads. Values are sealed: one altered,
or moved from another key, does not open, and `verify` reports it at its seq; entries
deleted are a gap, as in SQLite; a cut tail or a rewritten history shows only against a
head kept elsewhere (`verify(expected_head=...)`), as there.

A daemon's log names, in each entry's detail, the replica that wrote it (`replica`):
whichever site's daemon led then. The SQLite log of a daemon alone has no such field.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from slurm_geo.closing import Closing
from slurm_geo.federation.state.audit import (
    GENESIS,
    ChainChecker,
    Entry,
    VerifyReport,
    canonical_json,
    entry_from_row,
    entry_hash,
    utc_iso,
)
from slurm_geo.federation.state.etcd.kv import EtcdKV, SealBroken
from slurm_geo.federation.state.etcd.layout import Layout
from slurm_geo.federation.state.etcd.leadership import WriteGuard
from slurm_geo.federation.state.etcd.records import loads
from slurm_geo.federation.state.etcd.transaction import Transaction, write


class EtcdAuditLog(Closing):
    def __init__(self, kv: EtcdKV, layout: Layout, leadership: WriteGuard, *,
                 clock: Callable[[], float] = time.time, replica: str | None = None):
        """`replica`: the name each entry's detail gives its writer (a daemon's own)."""
        self.kv, self.layout, self.leadership = kv, layout, leadership
        self._clock = clock
        self._replica = {} if replica is None else {"replica": replica}

    def close(self) -> None:
        self.kv.close()

    def append(self, kind: str, logical_job: str | None, what: str, why: str,
               **detail: Any) -> Entry:
        """Add one entry at the end of the chain; ValueError / TypeError when `kind` is
        empty or `detail` is not JSON (NaN and infinities included)."""
        if not kind:
            raise ValueError("audit: kind must not be empty")
        detail_text = canonical_json({**self._replica, **detail})
        stored_detail = json.loads(detail_text)

        def attempt(tx: Transaction) -> Entry:
            head = tx.get(self.layout.audit_head)
            seq = 1 if head is None else int(head["seq"]) + 1
            prev_hash = GENESIS if head is None else str(head["hash"])
            when = utc_iso(self._clock())
            digest = entry_hash(seq, when, kind, logical_job, what, why, stored_detail,
                                prev_hash)
            key = self.layout.audit_entry(seq)
            tx.get(key)  # written once: the commit holds only if it is not there
            tx.put(key, {"seq": seq, "time": when, "kind": kind, "logical_job": logical_job,
                         "what": what, "why": why, "detail": detail_text,
                         "prev_hash": prev_hash, "hash": digest})
            tx.put(self.layout.audit_head, {"seq": seq, "hash": digest})
            return Entry(seq, when, kind, logical_job, what, why, stored_detail, prev_hash,
                         digest)
        return write(self.kv, self.leadership, attempt)

    def head(self) -> tuple[int, str]:
        """(seq, hash) of the last entry; (0, 64 zeros) for an empty log."""
        found = self.kv.get(self.layout.audit_head)
        if found is None:
            return 0, GENESIS
        head = loads(found.value)
        return int(head["seq"]), str(head["hash"])

    def entries(self, logical_job: str | None = None, since_seq: int = 0,
                kind: str | None = None) -> list[Entry]:
        """Entries after `since_seq`, oldest first; only `logical_job`'s, or only those of
        `kind`, when given."""
        found = self.kv.range(self.layout.audit_entries,
                              start=self.layout.audit_entry(since_seq + 1))
        entries = [entry_from_row(loads(item.value)) for item in found]
        return [e for e in entries if (logical_job is None or e.logical_job == logical_job)
                and (kind is None or e.kind == kind)]

    def verify(self, expected_head: tuple[int, str] | None = None) -> VerifyReport:
        """Recompute the chain; see the module docstring for what it can and cannot show."""
        checker = ChainChecker(expected_head)
        for item in self.kv.range_sealed(self.layout.audit_entries):
            seq = int(item.key.rsplit("/", 1)[1])
            try:
                row = loads(self.kv.open(item).value)
            except SealBroken:
                checker.unreadable(seq, "does not open under the state key: it was altered, "
                                        "or moved there from another key")
                continue
            checker.feed(row)
        return checker.report()
