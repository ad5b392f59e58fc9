"""Verification records (docs/format.md §8.7): what a daemon that verified a checkpoint as
written (slurm_geo.ckpt.ops.replicate) leaves next to it, so that any daemon of the federation,
at any site, can later resume from it without reading it back.

`verified/<run>/<step>` is sealed under the promotion key, which no job and no provider
holds: a provider can delete a record (the checkpoint is then read in full before a
resume, or an older one is chosen) but not forge or alter one. It names the checkpoint's
objects (the run's key, its packs, its manifest) with their sizes, and the manifest's
digest. `present` is the move's presence check: one listing per directory and, where the
store keeps digests, one HEAD for the manifest: no object is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from slurm_geo.ckpt.errors import CorruptObject, ObjectMissing
from slurm_geo.ckpt.format.names import manifest_name, verified_name
from slurm_geo.ckpt.format.seal import Kind
from slurm_geo.ckpt.ops.replicate import CopyReport, sizes_of
from slurm_geo.ckpt.repo.repository import Repository
from slurm_geo.ckpt.stores.digests import stored_digest


@dataclass(frozen=True)
class VerifiedRecord:
    run: str
    step: int
    manifest_digest: str
    objects: dict[str, int] = field(default_factory=dict)
    verified_at: float = 0.0
    by: str = ""  # "checkpoint-sync" or "federation"

    def to_payload(self) -> bytes:
        return json.dumps({"run": self.run, "step": self.step,
                           "manifest_digest": self.manifest_digest,
                           "objects": dict(sorted(self.objects.items())),
                           "verified_at": self.verified_at, "by": self.by},
                          sort_keys=True).encode()

    @classmethod
    def from_payload(cls, payload: bytes, name: str) -> VerifiedRecord:
        try:
            fields = json.loads(payload)
            objects = {str(k): int(v) for k, v in fields["objects"].items()}
            return cls(str(fields["run"]), int(fields["step"]),
                       str(fields["manifest_digest"]), objects,
                       float(fields.get("verified_at", 0.0)), str(fields.get("by", "")))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptObject(name, f"verification record does not parse: {exc}") from None


def record_of(report: CopyReport, verified_at: float, by: str) -> VerifiedRecord:
    """The record of a checkpoint a copy has just verified as written."""
    return VerifiedRecord(report.run, report.step, report.manifest_digest, report.objects,
                          verified_at, by)


def write_record(repository: Repository, record: VerifiedRecord) -> None:
    repository.put_daemon_record(Kind.VERIFIED, verified_name(record.run, record.step),
                                 record.to_payload())


def read_record(repository: Repository, run: str, step: int) -> VerifiedRecord | None:
    """The checkpoint's record in the repository's store; None when it has none. One that
    does not open, or names another checkpoint, raises CorruptObject (or WrongKey)."""
    name = verified_name(run, step)
    payload = repository.daemon_record(Kind.VERIFIED, name)
    if payload is None:
        return None
    record = VerifiedRecord.from_payload(payload, name)
    if (record.run, record.step) != (run, step):
        raise CorruptObject(name, f"verification record names {record.run}@{record.step}, "
                            f"not {run}@{step}")
    return record


def absent(repository: Repository, record: VerifiedRecord) -> list[str]:
    """What the store lacks of the recorded checkpoint, one line each ([] when every object
    is there at its recorded size and the manifest has its recorded digest): no object is
    read. StoreUnavailable passes through."""
    store = repository.store
    found = sizes_of(store, record.objects)
    faults = [f"{name} is missing" if name not in found
              else f"{name} holds {found[name]} bytes, not {size}"
              for name, size in sorted(record.objects.items()) if found.get(name) != size]
    if faults:
        return faults
    name = manifest_name(record.run, record.step)
    try:
        digest = stored_digest(store, name)
    except ObjectMissing:
        return [f"{name} is missing"]
    if digest is not None and digest != record.manifest_digest:
        return [f"{name} has digest {digest}, not the verified {record.manifest_digest}"]
    return []
