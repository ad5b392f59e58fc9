"""Scrubbing a store where its bytes are, without a key (docs/checkpoint-sync.md,
"Scrubbing"; docs/format.md §2, the scrub report).

A pack's name is the hash of all its bytes (§6: BLAKE3 from version 3, SHA-256 before), so
whoever can read a pack can tell whether it is still what was written, holding no key.
`scrub_store` reads every pack of a store, one at a time, recomputes its hash and names
those that no longer match (flipped bits, truncation). It runs next to the destination
store, as an unprivileged account of that site: the replica's bytes never cross the WAN
for it. It writes what it found into the store as one small object, `scrub/report` (plain
JSON), which checkpoint-sync at home reads (a few KB) instead of the replica.

Sealed objects (keys, manifests, latest pointers, promotion markers, fences, tree
manifests) open only under a key: the report says they were not checked, and
checkpoint-sync, which holds the key, checks each replica's own (they are KB).

The report is not authenticated: a site that lies in it can hide damage (a resume then
fails its own AEAD check and falls back to an older checkpoint) or claim damage that is
not there (a needless repair), nothing else.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from slurm_geo.ckpt.errors import CorruptObject, ObjectMissing
from slurm_geo.ckpt.format.names import PACK_PREFIXES, is_hex_id
from slurm_geo.ckpt.format.pack import pack_id_of
from slurm_geo.ckpt.stores.open_store import paced
from slurm_geo.ckpt.stores.pacing import TokenBucket
from slurm_geo.ckpt.stores.store import Store

REPORT_NAME = "scrub/report"
REPORT_VERSION = 1
# Packs of checkpoints (§2) and of staged trees (§11.4): every object named by its hash.
SCANNED_PREFIXES = (*PACK_PREFIXES, "tree-packs/")
UNCHECKED = ("objects other than packs were not checked: sealed ones (keys/, manifests/, "
             "latest/, promoted/, fences/, tree-keys/, trees/, tree-latest/) open only "
             "under a key; checkpoint-sync checks each replica's itself")
# A report is a few KB; one naming this many damaged packs is cut (and says so), so that
# reading it at home stays cheap whatever a store holds.
MAX_NAMED = 10_000
MAX_REPORT_BYTES = 4 << 20


@dataclass(frozen=True)
class ScrubReport:
    """What one scrub of a store found. Times are Unix seconds of the scrubbing host."""

    started_at: float
    finished_at: float
    store: str
    packs_checked: int
    bytes_read: int
    damaged: list[str] = field(default_factory=list)
    vanished: int = 0          # listed, then gone before read (garbage collection)
    damaged_cut: int = 0       # damaged packs beyond MAX_NAMED, not named
    unchecked: str = UNCHECKED
    version: int = REPORT_VERSION

    @property
    def ok(self) -> bool:
        return not self.damaged and not self.damaged_cut

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)


Progress = Callable[[int, int], None]  # bytes done, bytes in all


def scrub_store(store: Store, url: str, *, rate_bytes_s: float = 0.0,
                on_bytes: Progress = lambda _d, _t: None,
                clock: Callable[[], float] = time.time) -> ScrubReport:
    """Read every pack of `store` (named `url` in the report), one at a time, at most
    `rate_bytes_s` on average (0: no cap), and name those whose bytes no longer hash to
    their name. A store that cannot be reached raises `StoreUnavailable`."""
    started = clock()
    sizes: dict[str, int] = {}
    for prefix in SCANNED_PREFIXES:
        sizes.update(store.sizes(prefix))
    packs = sorted(n for n in sizes if is_hex_id(n.rpartition("/")[2]))
    total = sum(sizes[n] for n in packs)
    reader = paced(store, "store", TokenBucket(rate_bytes_s) if rate_bytes_s > 0 else None)
    damaged: list[str] = []
    checked = vanished = cut = done = 0
    for name in packs:
        try:
            data = reader.get(name)
        except ObjectMissing:
            vanished += 1
            continue
        checked += 1
        if pack_id_of(data) != name.rpartition("/")[2]:
            if len(damaged) < MAX_NAMED:
                damaged.append(name)
            else:
                cut += 1
        done += sizes[name]
        del data  # one pack held at a time
        on_bytes(done, total)
    return ScrubReport(started_at=started, finished_at=clock(), store=url,
                       packs_checked=checked, bytes_read=reader.bytes_read, damaged=damaged,
                       vanished=vanished, damaged_cut=cut)


def write_report(store: Store, report: ScrubReport) -> None:
    store.put(REPORT_NAME, report.to_json().encode())


def read_report(store: Store) -> ScrubReport | None:
    """The store's scrub report; None when there is none. One that is not a report (too
    large, not JSON, fields missing or of the wrong type) raises CorruptObject."""
    try:
        raw = store.get(REPORT_NAME)
    except ObjectMissing:
        return None
    return parse_report(raw)


def parse_report(raw: bytes) -> ScrubReport:
    if len(raw) > MAX_REPORT_BYTES:
        raise CorruptObject(REPORT_NAME, f"{len(raw)} bytes, more than a report holds")
    try:
        fields = json.loads(raw)
        if not isinstance(fields["damaged"], list):
            raise ValueError("damaged is not a list")
        report = ScrubReport(
            started_at=float(fields["started_at"]), finished_at=float(fields["finished_at"]),
            store=str(fields["store"]), packs_checked=int(fields["packs_checked"]),
            bytes_read=int(fields["bytes_read"]),
            damaged=[str(n) for n in fields["damaged"]],
            vanished=int(fields.get("vanished", 0)),
            damaged_cut=int(fields.get("damaged_cut", 0)),
            unchecked=str(fields.get("unchecked", UNCHECKED)),
            version=int(fields.get("version", REPORT_VERSION)))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptObject(REPORT_NAME, f"not a scrub report: {exc}") from None
    return report

