"""A federated job of many ranks (srun, torchrun): one lease per logical job, held by
rank 0; every rank trains, stops, saves and resumes in step with it.

Rank 0 alone talks to the federation daemon (slurm_geo.lease.client.FederatedRun): it
acquires the lease and the run's data key and renews the lease; the other ranks learn
what they need from it over the job's process group:

* **the run's key ring** (docs/format.md §4.2), and the run's own store key when the
  daemon sent one with it (an incarnation submitted before its job named a run gets its
  S3 key then: every rank writes its shards with it), never in clear. An incarnation the
  daemon submitted seals them (AES-GCM) under a key derived from the lease secret every
  rank of the job was given in its environment; a home job, which has no secret, hands
  each rank a MUNGE credential of them restricted to the job's uid, which that rank
  decodes with its node's munged. Neither a process of another user nor anyone reading
  the job's network can open them.
* **the resume step**, the one the daemon verified for a new generation, else the newest
  checkpoint; every rank loads that same step (or, when it does not load, the next older).
* **each step's verdict** (`step_verdict`, one small all-reduce per step): go on, stop
  (a rank got SIGUSR1: every rank saves the same final step), release (the daemon asks
  the job to stop at a checkpoint for a move), or fenced (the lease is lost: no rank
  trains another step). A fence or a stop therefore reaches every rank within one step.

Checkpoints go through slurm_geo.torch.distributed: rank 0, the coordinator, re-checks
the lease right before it commits (`before_commit`), so a rank frozen past its lease
commits nothing.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from slurm_geo.ckpt.format.keys import RunKeyRing, derive_key
from slurm_geo.ckpt.repo.runkey import RunKeyRepository
from slurm_geo.ckpt.stores.open_store import open_store
from slurm_geo.errors import SlurmGeoError
from slurm_geo.lease.client import FederatedRun, Fenced, store_ca_here
from slurm_geo.lease.munge import BadCredential, MungeCommands
from slurm_geo.lease.signing import secret_bytes
from slurm_geo.stage.homestart import stage_home_world
from slurm_geo.torch.distributed import StorageReader, StorageWriter

NONCE_SIZE = 12
INFO_RANK_SHARE = b"slurm-geo/v1/rank-key-share"  # HKDF info: the wrap key of the run key


class Verdict(enum.IntEnum):
    """Larger wins: the all-reduce takes the maximum of what ranks say."""

    TRAIN = 0
    STOP = 1      # a rank was asked to stop (SIGUSR1): save, requeue, exit
    RELEASE = 2   # the daemon asks for a checkpoint and the lease back: the job moves
    FENCED = 3    # the lease is lost: not one more step


class RankFailed(SlurmGeoError):
    """What rank 0 failed with, raised on every rank with rank 0's exit code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class _Start:
    """What rank 0 broadcasts once the lease is held."""

    run: str
    shares: list[str]       # rank i's MUNGE credential of the keys; or one sealed copy
    candidates: list[int]   # the steps to try loading, in order; none: from scratch


class RankedRun:
    """Every rank constructs one (after init_process_group) and calls `acquire`."""

    def __init__(self, federated: FederatedRun, munge: Any = None):
        self.federated = federated
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._munge = munge or MungeCommands(federated.placement.munge_socket)
        self.run = federated.placement.run
        self._key: RunKeyRing | None = None
        self._start: _Start | None = None

    @classmethod
    def from_environment(cls, run: str) -> RankedRun:
        return cls(FederatedRun.from_environment(run, stage_world=stage_home_world))

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def acquire(self) -> None:
        """Rank 0 acquires the lease and the run key; every rank gets its share. Raises
        on every rank what rank 0 failed with (Fenced, FederationUnreachable, ...)."""
        message: list[Any] = [None]
        if self.is_leader:
            try:
                message[0] = self._lead()
            except SlurmGeoError as exc:
                message[0] = (str(exc), exc.exit_code)
        dist.broadcast_object_list(message, src=0)
        if isinstance(message[0], tuple):
            raise RankFailed(*message[0])
        start: _Start = message[0]
        self._start, self.run = start, start.run
        self._key = self._open_share(start.shares[min(self.rank, len(start.shares) - 1)])

    def step_verdict(self, stop_requested: bool) -> Verdict:
        """Every rank, once per step: what all ranks do next. Rank 0 first waits while
        its lease is not current (a partition), as a single-process trainer does."""
        mine = Verdict.STOP if stop_requested else Verdict.TRAIN
        if self.is_leader:
            try:
                self.federated.wait_for_lease()
            except Fenced:
                mine = Verdict.FENCED
            else:
                if self.federated.release_requested:
                    mine = max(mine, Verdict.RELEASE)
        verdict = torch.tensor([int(mine)], dtype=torch.int64)
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        return Verdict(int(verdict.item()))

    def writer(self, step: int, **options: Any) -> StorageWriter:
        placement = self.federated.placement
        guard: Callable[[], None] | None = (self.federated.wait_for_lease if self.is_leader
                                            else None)
        return StorageWriter(placement.store_url, endpoint_url=placement.store_endpoint or None,
                             run=self.run, step=step, run_key=self._run_key(),
                             before_commit=guard, **options)

    def reader(self, step: int) -> StorageReader:
        placement = self.federated.placement
        return StorageReader(placement.store_url, endpoint_url=placement.store_endpoint or None,
                             run=self.run, step=step, run_key=self._run_key())

    def resume(self, state: dict[str, Any]) -> int | None:
        """Load into `state`, on every rank, the step this incarnation starts from: for a
        new generation the step the daemon verified, exactly; else the newest checkpoint
        that loads, the next older one when a load fails on any rank (DCP reports a
        rank's failure to all, so they stay in step). None: from scratch."""
        assert self._start is not None
        candidates = self._start.candidates
        for index, step in enumerate(candidates):
            try:
                dcp.load(state, storage_reader=self.reader(step))
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                if isinstance(exc, KeyboardInterrupt | SystemExit) or index + 1 == len(
                        candidates):
                    raise
                continue
            return step
        return None

    def checkpointed(self, step: int) -> None:
        if self.is_leader:
            self.federated.checkpointed(step)

    def release(self, step: int | None) -> None:
        if self.is_leader:
            self.federated.release(step)

    def _lead(self) -> _Start:
        federated = self.federated
        federated.acquire()
        run, key = federated.run_key()
        self._key = key
        placement = federated.placement
        payload = _share_payload(key, federated.store_env)
        if placement.lease_secret:
            nonce = os.urandom(NONCE_SIZE)
            shares = [(nonce + AESGCM(self._share_key()).encrypt(nonce, payload, run.encode())
                       ).hex()]
        else:
            uid = os.getuid()
            shares = [self._munge.encode(payload.decode(), restrict_uid=uid)
                      for _ in range(self.world)]
        if placement.generation > 0 and placement.restart == 0:  # the daemon placed it
            # The step it verified first (by its record and a presence check: nothing was
            # read, docs/format.md §8.7); should that one not load intact, the older ones.
            chosen = placement.resume_step
            candidates = []
            if chosen is not None:
                store = open_store(placement.store_url,
                                   endpoint_url=placement.store_endpoint or None)
                steps = RunKeyRepository(store, run, key).steps(run)
                candidates = [chosen, *(s for s in reversed(steps) if s < chosen)]
        else:
            store = open_store(placement.store_url, endpoint_url=placement.store_endpoint or None)
            # Its own newest: unless the store rolled the run back (RolledBack, on every rank)
            repository = federated.checked(RunKeyRepository(store, run, key), run)
            candidates = list(reversed(repository.steps(run)))
        return _Start(run, shares, candidates)

    def _share_key(self) -> bytes:
        placement = self.federated.placement
        return derive_key(secret_bytes(placement.lease_secret), None, INFO_RANK_SHARE)

    def _open_share(self, share: str) -> RunKeyRing:
        if self.is_leader and self._key is not None:
            return self._key
        if self.federated.placement.lease_secret:
            sealed = bytes.fromhex(share)
            try:
                return self._take(AESGCM(self._share_key()).decrypt(
                    sealed[:NONCE_SIZE], sealed[NONCE_SIZE:], self.run.encode()))
            except InvalidTag:
                raise RankFailed(f"rank {self.rank} could not open the run key rank 0 sent "
                                 "(sealed under another incarnation's secret)", 34) from None
        credential = share
        try:
            decoded = self._munge.decode(credential)
        except BadCredential as exc:
            raise RankFailed(f"rank {self.rank} could not open the run key rank 0 sent: "
                             f"{exc}", 34) from None
        if decoded.uid != os.getuid():
            raise RankFailed(f"rank {self.rank}: the run key came from uid {decoded.uid}, "
                             f"not this job's uid {os.getuid()}", 34)
        return self._take(decoded.payload.encode())

    def _take(self, payload: bytes) -> RunKeyRing:
        """The key ring of a share rank 0 sent; its store key goes into this rank's
        environment, where the store is opened (slurm_geo.ckpt.stores.open_store)."""
        try:
            body = json.loads(payload)
            ring = RunKeyRing.of([bytes.fromhex(k) for k in body["keys"]])
            store_env = {str(k): str(v) for k, v in body.get("store_env", {}).items()
                         if str(k).startswith("AWS_")}
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise RankFailed(f"rank {self.rank} could not read the run key rank 0 sent: "
                             f"{exc}", 34) from None
        os.environ.update(store_env)
        store_ca_here(os.environ)
        return ring

    def _run_key(self) -> RunKeyRing:
        if self._key is None:
            raise RuntimeError("RankedRun.acquire() first: the run key comes with the lease")
        return self._key


def _share_payload(ring: RunKeyRing, store_env: dict[str, str]) -> bytes:
    """What rank 0 hands every other rank, before sealing: the key ring, newest first, and
    the run's store key when the daemon sent one."""
    return json.dumps({"keys": [k.hex() for k in ring.data_keys],
                       "store_env": store_env}).encode()
