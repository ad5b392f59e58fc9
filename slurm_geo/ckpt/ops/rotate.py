"""`slurm-geo keys rotate`: a new site master key, and every object sealed under the old
one or under a key derived from it sealed again under the new (docs/format.md §8.5).

Run data keys do not change, so no pack, manifest or latest pointer is rewritten, and a
job holding its run's key notices nothing. What is sealed again: `keys/<run>` (under the
master key itself), fences (under F) and promotion markers (under P) in every store named,
and whatever else is named as a `Resealable` (the federation state's values in etcd,
under S: slurm_geo.federation.state.etcd.reseal).

The key file carries the rotation; each step is durable before the next begins:

    one key O --(1) first run--> ring: N, then O, and the stores
              --copied to the control site; (2), (3) second run--> N alone

(1) A new key N goes into the file, with O and the stores, and the run stops: N must be
at both trusted sites before a store holds anything sealed under it alone. (2) The next
run passes over every store, sealing again what opens under O, until one pass finds
nothing left: a copy between stores, or a process that read the key file before (1), may
have written under O meanwhile. (3) The file holds N alone. While it holds the ring, every
reader opens objects under either key, and every writer seals under N (the daemons follow
the file: keys.LiveKeyFile). A run cut anywhere leaves each object sealed under O or N,
both in the ring; the next run finds the ring and finishes that rotation.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from pathlib import Path
from typing import Protocol

from slurm_geo.ckpt.errors import CkptError, KeyFileError, ObjectMissing, WrongKey
from slurm_geo.ckpt.format.keys import (
    KEY_SIZE,
    SALT_SIZE,
    KeyFile,
    RandomBytes,
    fence_key,
    fingerprint,
    load_master_key,
    promotion_key,
    residency_key,
    write_key_file,
)
from slurm_geo.ckpt.format.seal import Kind, open_with_ring, seal, sealing_fingerprint
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.exitcodes import ExitCode

# The first pass seals everything again; the next ones find what was sealed under the old
# key meanwhile. Three passes that each find some mean a writer that does not follow the file.
MAX_PASSES = 3
THREADS = 8  # small objects, one request each: on S3 the round trip is the cost
CHANGED_TRIES = 3  # a fence changed under us is read again, this many times at most


def _master(key: bytes) -> bytes:
    return key


# What the master key seals, directly or through a key derived from it (format.md §2, §5);
# `tree-keys/` holds the staged trees' domain key rings (format.md §11.2), `tree-residency/`
# where each domain may reside (§11.10).
SEALED_UNDER_MASTER: tuple[tuple[str, Kind, Callable[[bytes], bytes]], ...] = (
    ("keys/", Kind.DATA_KEY, _master),
    ("tree-keys/", Kind.DATA_KEY, _master),
    ("fences/", Kind.FENCE, fence_key),
    ("promoted/", Kind.PROMOTED, promotion_key),
    ("verified/", Kind.VERIFIED, promotion_key),
    ("tree-residency/", Kind.MANIFEST, residency_key),
)


class RotationRefused(CkptError):
    """A rotation that cannot start or go on as asked; nothing was changed."""

    exit_code = ExitCode.ROTATION_REFUSED

    def __init__(self, key_file: Path, detail: str):
        super().__init__(str(key_file), f"cannot rotate the master key in '{key_file}': "
                         f"{detail}")


class Verdict(Enum):
    CURRENT = "current"    # sealed under the new key already
    RESEAL = "reseal"      # sealed under the previous key: seal it again under the new
    REFUSED = "refused"    # opens under neither: left as it is


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    payload: bytes = field(default=b"", repr=False)
    error: CkptError | None = None


def judge(sealed: bytes, name: str, kind: Kind, new: bytes, previous: bytes) -> Judgement:
    """What a rotation does with the object `name` holding `sealed`, given the sealing keys
    of `kind` the new and the previous master key yield."""
    try:
        payload = open_with_ring((new, previous), kind, sealed, name)
    except CkptError as exc:
        return Judgement(Verdict.REFUSED, error=exc)
    if sealing_fingerprint(sealed) == fingerprint(new):
        return Judgement(Verdict.CURRENT, payload)
    return Judgement(Verdict.RESEAL, payload)


@dataclass
class StorePass:
    """One pass over one store."""

    rewrapped: list[str] = field(default_factory=list)  # sealed again (or would be)
    current: list[str] = field(default_factory=list)
    refused: dict[str, CkptError] = field(default_factory=dict)


def rewrap_store(store: Store, ring: KeyFile, dry_run: bool = False,
                 random_bytes: RandomBytes = os.urandom) -> StorePass:
    """Seal again under `ring.current` every object of `store` that opens under
    `ring.previous`; with `dry_run`, only say which."""
    assert ring.previous is not None, "a ring: the new key and the one it replaces"
    done = StorePass()
    with ThreadPoolExecutor(THREADS, thread_name_prefix="slurm-geo-rotate") as pool:
        for prefix, kind, derive in SEALED_UNDER_MASTER:
            rewrap = partial(_rewrap, store, kind=kind, new=derive(ring.current),
                             previous=derive(ring.previous), dry_run=dry_run,
                             random_bytes=random_bytes)
            names = store.list(prefix)
            for name, judgement in zip(names, pool.map(rewrap, names), strict=True):
                if judgement is None:
                    continue  # deleted while we looked: nothing left to seal
                if judgement.verdict is Verdict.RESEAL:
                    done.rewrapped.append(name)
                elif judgement.verdict is Verdict.CURRENT:
                    done.current.append(name)
                elif judgement.error is not None:
                    done.refused[name] = judgement.error
    return done


def _rewrap(store: Store, name: str, kind: Kind, new: bytes, previous: bytes, dry_run: bool,
            random_bytes: RandomBytes) -> Judgement | None:
    for _ in range(CHANGED_TRIES):
        try:
            sealed = store.get(name)
        except ObjectMissing:
            return None
        judgement = judge(sealed, name, kind, new, previous)
        if judgement.verdict is not Verdict.RESEAL or dry_run:
            return judgement
        again = seal(new, kind, random_bytes(SALT_SIZE), judgement.payload, name)
        # A fence is the one object written again in place (the federation daemon moves a
        # run on): one set since we read it must not be put back to the older generation.
        if kind is Kind.FENCE and store.get(name) != sealed:
            continue
        store.put(name, again)
        return judgement
    return Judgement(Verdict.REFUSED, error=CkptError(
        name, f"'{name}' changed under the rotation {CHANGED_TRIES} times; run it again"))


class Resealable(Protocol):
    """Objects sealed under the master key or a key derived from it: one pass over them
    seals again under `ring.current` what opens under `ring.previous`, or (`dry_run`)
    only says which. A failure to reach them is a CkptError."""

    def reseal(self, ring: KeyFile, dry_run: bool, random_bytes: RandomBytes) -> StorePass:
        ...


@dataclass(frozen=True)
class StoreObjects:
    """A store's wrapped keys, fences and promotion markers, as a rotation reseals them."""

    store: Store

    def reseal(self, ring: KeyFile, dry_run: bool, random_bytes: RandomBytes) -> StorePass:
        return rewrap_store(self.store, ring, dry_run=dry_run, random_bytes=random_bytes)


@dataclass
class StoreReport:
    store: str
    rewrapped: list[str] = field(default_factory=list)
    current: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)   # name -> why it was left
    unfinished: str | None = None  # why a pass over this store stopped

    def add(self, one_pass: StorePass) -> None:
        """The outcome so far: what any pass sealed again, what the last found current
        (and no pass sealed), what the last refused."""
        self.rewrapped = sorted({*self.rewrapped, *one_pass.rewrapped})
        self.current = sorted(set(one_pass.current) - set(self.rewrapped))
        self.refused = {name: str(error) for name, error in sorted(one_pass.refused.items())}


class Outcome(Enum):
    """What a run of `keys rotate` leaves the key file holding."""

    DRY_RUN = "dry-run"            # as it was: nothing written anywhere
    RING_WRITTEN = "ring-written"  # the new key and the old; nothing sealed again yet
    COMPLETE = "complete"          # every store under the new key; the file holds it alone
    UNFINISHED = "unfinished"      # still the ring: run again to finish


@dataclass
class RotationReport:
    outcome: Outcome
    key: str | None  # fingerprint of the new key; None for a dry run before a rotation
    previous: str
    stores: list[StoreReport]  # before a pass (dry run, ring written): what it would do
    unfinished: str | None = None  # why the key file still holds the previous key

    @property
    def refused(self) -> int:
        return sum(len(s.refused) for s in self.stores)


def rotate_master_key(stores: Mapping[str, Store], key_file: Path, dry_run: bool = False,
                      random_bytes: RandomBytes = os.urandom, *,
                      also: Mapping[str, Resealable] | None = None) -> RotationReport:
    """The next step of rotating the master key of `key_file` over `stores` (named as the
    operator named them) and what `also` names: start a rotation by writing the ring, or
    finish the one the file holds."""
    targets: dict[str, Resealable] = {name: StoreObjects(store)
                                      for name, store in stores.items()}
    targets.update(also or {})
    with _rotation_lock(key_file):
        held = load_master_key(key_file)
        ring = _ring_for(held, targets, key_file, random_bytes)
        surveyed = {name: target.reseal(ring, True, random_bytes)
                    for name, target in targets.items()}
        _check_key_file_opens(surveyed, key_file)
        planned = [_report_of(name, one) for name, one in surveyed.items()]
        new, previous = _fingerprint_hex(ring.current), _fingerprint_hex(ring.previous)
        if dry_run:
            return RotationReport(Outcome.DRY_RUN, None if held.previous is None else new,
                                  previous, planned)
        if held.previous is None:
            # (1), and no more: the new key must be at the other trusted site before a
            # store holds anything sealed under it only, or losing this site loses both.
            write_key_file(key_file, ring)
            return RotationReport(Outcome.RING_WRITTEN, new, previous, planned)
        if ring != held:
            write_key_file(key_file, ring)  # stores added to the rotation in progress
        reports, unfinished = _rewrap_until_done(targets, ring, random_bytes)
        if unfinished is not None:
            return RotationReport(Outcome.UNFINISHED, new, previous, reports, unfinished)
        write_key_file(key_file, KeyFile(ring.current))  # (3)
        return RotationReport(Outcome.COMPLETE, new, previous, reports)


def _ring_for(held: KeyFile, stores: Mapping[str, Resealable], key_file: Path,
              random_bytes: RandomBytes) -> KeyFile:
    """The ring this run works with: a new one, or the one in progress (with any further
    stores named added, so that a later run must name them too)."""
    if held.previous is None:
        return KeyFile(random_bytes(KEY_SIZE), held.current, tuple(stores))
    missing = [s for s in held.rotating if s not in stores]
    if missing:
        raise RotationRefused(key_file, "the rotation in progress re-seals "
                              f"{', '.join(held.rotating)}; finish it naming every one of "
                              f"them (missing: {', '.join(missing)})")
    more = tuple(s for s in stores if s not in held.rotating)
    return KeyFile(held.current, held.previous, held.rotating + more)


def _rewrap_until_done(stores: Mapping[str, Resealable], ring: KeyFile,
                       random_bytes: RandomBytes) -> tuple[list[StoreReport], str | None]:
    reports = {name: StoreReport(name) for name in stores}
    for _ in range(MAX_PASSES):
        rewrapped = False
        for name, store in stores.items():
            try:
                one_pass = store.reseal(ring, False, random_bytes)
            except CkptError as exc:
                reports[name].unfinished = str(exc)
                continue
            reports[name].unfinished = None
            reports[name].add(one_pass)
            rewrapped = rewrapped or bool(one_pass.rewrapped)
        stopped = [r for r in reports.values() if r.unfinished is not None]
        if stopped:
            return list(reports.values()), f"store {stopped[0].store}: {stopped[0].unfinished}"
        if not rewrapped:
            return list(reports.values()), None
    return list(reports.values()), (
        f"objects were still being sealed under the previous key after {MAX_PASSES} passes: "
        "a process that read the key file before the rotation and does not follow it "
        "(docs/runbook.md) writes with it; restart it")


def _check_key_file_opens(surveyed: Mapping[str, StorePass], key_file: Path) -> None:
    """A store where something is sealed under the master key and nothing opens was
    written under another key file: the wrong file, or the wrong store."""
    for name, one in surveyed.items():
        wrong = [n for n, e in one.refused.items() if isinstance(e, WrongKey)]
        if wrong and not one.rewrapped and not one.current:
            raise KeyFileError(str(key_file), f"opens none of the {len(one.refused)} "
                               f"objects of store '{name}' sealed under the master key "
                               f"(such as {wrong[0]}): they were sealed under another key")


def _report_of(name: str, one_pass: StorePass) -> StoreReport:
    report = StoreReport(name)
    report.add(one_pass)
    return report


def _fingerprint_hex(key: bytes | None) -> str:
    assert key is not None, "a ring holds two keys"
    return fingerprint(key).hex()


@contextmanager
def _rotation_lock(key_file: Path) -> Iterator[None]:
    """One rotation of a key file at a time: two would each seal under a new key of their
    own, and the file would keep only one of them. The lock is on the file's directory,
    since the file itself is replaced."""
    try:
        fd = os.open(key_file.resolve().parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise KeyFileError(str(key_file), f"cannot open its directory ({exc.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RotationRefused(key_file, "another `slurm-geo keys rotate` is running on "
                                  "it; let it finish") from None
        yield
    finally:
        os.close(fd)
