"""PyTorch Distributed Checkpoint (DCP) into a slurm-geo store: `StorageWriter` and
`StorageReader` for `dcp.save`, `dcp.async_save` and `dcp.load` (docs/training.md).

Every rank stores its own items in parallel as chunks of the store's format (byte-plane
zstd, deduplicated against the run's previous checkpoint, AES-GCM under the run's key);
the coordinator then commits one sealed manifest (format 3, docs/format.md §7.5) naming
every rank's chunks and DCP's layout. Until that commit no part of the checkpoint is
listed or resumed from, so a save is all ranks or nothing. Loading serves DCP's read items
(byte ranges of stored shards), so DCP's planners reshard: N ranks' save loads on M ranks.

The coordinator holds a push lock (docs/format.md §8.1) from its global plan, before any
rank writes, to its commit, so garbage collection never takes a rank's packs in flight.

Both classes pickle without their open store (DCP's process-based async save sends the
writer to its checkpoint process): what is pickled is the store's name or URL and the key
source. `before_commit` (FederatedRun.wait_for_lease) needs the thread-based or the
synchronous save: it holds a live lease client.
"""

from __future__ import annotations

import io
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import StorageReader as _DcpReader
from torch.distributed.checkpoint import StorageWriter as _DcpWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from slurm_geo.ckpt import Metadata as CheckpointMetadata
from slurm_geo.ckpt import Repository, Tensor
from slurm_geo.ckpt.files.skeleton import TensorFileError
from slurm_geo.ckpt.files.torchpickle import MAX_ARCHIVE_BYTES
from slurm_geo.ckpt.format.keys import RunKeyRing, load_master_key
from slurm_geo.ckpt.format.layout import BYTES_DTYPE, Item, Layout, Shard, shard_path
from slurm_geo.ckpt.format.manifest import DTYPE_SIZES, Manifest, TensorEntry, tensor_nbytes
from slurm_geo.ckpt.repo.locks import push_lock
from slurm_geo.ckpt.repo.runkey import RunKeyRepository
from slurm_geo.ckpt.repo.sharded import Fill, StoredReader, commit_sharded, write_shards
from slurm_geo.ckpt.repo.writer import DEFAULT_OPTIONS, WriteOptions
from slurm_geo.ckpt.stores.open_store import open_store, open_store_or_named
from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode
from slurm_geo.jobenv import JobEnv
from slurm_geo.torch.state import TORCH_DTYPE_NAMES, TORCH_DTYPES, load_torch_bytes, tensor_bytes

DCP_VERSION = "1.0.0"  # what DCP's own FileSystemWriter records (CURRENT_DCP_VERSION)


class NotSharded(SlurmGeoError):
    exit_code = ExitCode.USAGE

    def __init__(self, run: str, step: int):
        super().__init__(f"checkpoint {run}@{step} was saved by one process "
                         "(slurm_geo.torch.Checkpointer), not through DCP; resume it with "
                         "Checkpointer.resume")


@dataclass(frozen=True)
class _Keys:
    """Where the repository's key comes from: the master key file, or the run's data key
    the federation daemon released to this job (FederatedRun.run_key)."""

    key_file: Path | None
    run_key: bytes | RunKeyRing | None

    def repository(self, store_spec: str, endpoint_url: str | None, run: str,
                   options: WriteOptions) -> Repository:
        store = (open_store(store_spec, endpoint_url=endpoint_url) if endpoint_url
                 else open_store_or_named(store_spec))
        if self.run_key is not None:
            return RunKeyRepository(store, run, self.run_key)
        assert self.key_file is not None
        return Repository(store, load_master_key(self.key_file), options)


def _keys(key_file: str | os.PathLike[str] | None, run_key: bytes | RunKeyRing | None) -> _Keys:
    if (key_file is None) == (run_key is None):
        raise ValueError("give exactly one of key_file= (the site master key file) and "
                         "run_key= (the run's data key the federation daemon released)")
    return _Keys(None if key_file is None else Path(key_file), run_key)


class _Stored:
    """The store, opened on first use in whichever process uses it, never pickled."""

    def __init__(self, store: str, endpoint_url: str | None, run: str, keys: _Keys,
                 options: WriteOptions):
        self.store, self.endpoint_url, self.run = store, endpoint_url, run
        self.keys, self.options = keys, options
        self._repository: Repository | None = None

    @property
    def repository(self) -> Repository:
        if self._repository is None:
            self._repository = self.keys.repository(self.store, self.endpoint_url, self.run,
                                                    self.options)
        return self._repository

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_repository": None}


@dataclass(frozen=True)
class _SavePlanData:
    parent: int | None  # the run's newest checkpoint: each rank deduplicates against it


class StorageWriter(_DcpWriter):
    """Saves a DCP checkpoint of `run` at `step` into `store` (a URL or a configured
    store name; `endpoint_url` for an S3 URL's endpoint). `checkpoint_id`, when DCP is
    given one, is the step."""

    def __init__(self, store: str, *, run: str, step: int | None = None,
                 key_file: str | os.PathLike[str] | None = None,
                 run_key: bytes | RunKeyRing | None = None,
                 endpoint_url: str | None = None, epoch: int = 0, loss: float | None = None,
                 before_commit: Callable[[], None] | None = None,
                 options: WriteOptions = DEFAULT_OPTIONS):
        super().__init__()
        self._stored = _Stored(store, endpoint_url, run, _keys(key_file, run_key), options)
        self.run, self.step, self.epoch, self.loss = run, step, epoch, loss
        self._before_commit = before_commit
        self._is_coordinator = False
        self._lock: ExitStack | None = None
        self._parent: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        if self._before_commit is not None:
            raise TypeError("a StorageWriter with before_commit holds a live lease client "
                            "and cannot go to another process; use async_save's thread "
                            "checkpointer or a synchronous save")
        return {**self.__dict__, "_lock": None}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.step = _step_of(checkpoint_id)
        self._release_lock()  # a save that failed before its commit left it held

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ValueError("slurm-geo commits one manifest for all ranks: save with "
                             "collectives (dcp.save without no_dist on a process group)")
        if self.step is None:
            raise ValueError("StorageWriter needs the step it saves: StorageWriter(..., "
                             "step=N) or dcp.save(..., checkpoint_id=N)")
        self._is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        repository = self._stored.repository
        repository.create_run_key(self.run)
        self._release_lock()
        self._lock = ExitStack()
        self._lock.enter_context(push_lock(repository.store, os.urandom,
                                           lambda: datetime.now(UTC)))
        steps = [s for s in repository.steps(self.run) if s != self.step]
        data = _SavePlanData(steps[-1] if steps else None)
        self._parent = data.parent
        return [replace(plan, storage_data=data) for plan in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        tensors, sizes = [], []
        for item in plan.items:
            data = planner.resolve_data(item)
            offsets = None if item.type == WriteItemType.BYTE_IO else item.index.offset
            path = shard_path(item.index.fqn, offsets)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                raw = data.getbuffer()
                tensors.append(Tensor(path, BYTES_DTYPE, (len(raw),), raw))
            else:
                assert isinstance(data, torch.Tensor)
                tensors.append(Tensor(path, _dtype_name(data.dtype, item.index.fqn),
                                      tuple(data.shape), tensor_bytes(data)))
            sizes.append(len(memoryview(tensors[-1].data).cast("B")))
        storage: _SavePlanData = plan.storage_data
        entries = write_shards(self._stored.repository, self.run, tensors,
                               storage.parent)
        results = [WriteResult(index=item.index, size_in_bytes=size, storage_data=entry)
                   for item, size, entry in zip(plan.items, sizes, entries, strict=True)]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        assert self.step is not None
        entries = {r.index: r.storage_data for rank in results for r in rank}
        layout = _layout_of(metadata, {index: e.path for index, e in entries.items()},
                            ranks=len(results))
        meta = CheckpointMetadata(
            self.step, self.step, self.epoch, self.loss,
            datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            *_job_names())
        try:
            commit_sharded(self._stored.repository, self.run, list(entries.values()), layout,
                           meta, self._parent, self._before_commit or (lambda: None))
        finally:
            self._release_lock()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _is_step(checkpoint_id)

    def _release_lock(self) -> None:
        if self._lock is not None:
            lock, self._lock = self._lock, None
            lock.close()


@dataclass(frozen=True)
class _LoadData:
    step: int
    paths: dict[MetadataIndex, str]  # each stored item's manifest tensor


class StorageReader(_DcpReader):
    """Loads a DCP checkpoint of `run` from `store`: `step`, or the newest when None
    (`checkpoint_id`, when DCP is given one, is the step). Every chunk read is verified;
    a damaged one fails the load naming its object, never a silently wrong tensor."""

    def __init__(self, store: str, *, run: str, step: int | None = None,
                 key_file: str | os.PathLike[str] | None = None,
                 run_key: bytes | RunKeyRing | None = None,
                 endpoint_url: str | None = None):
        super().__init__()
        self._stored = _Stored(store, endpoint_url, run, _keys(key_file, run_key),
                               DEFAULT_OPTIONS)
        self.run, self.step = run, step
        self._manifest: Manifest | None = None
        self._paths: dict[MetadataIndex, str] = {}
        self._decoded: dict[str, tuple[Any]] = {}  # bytes items' values, by stored path

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_manifest": None, "_decoded": {}}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.step = _step_of(checkpoint_id)
        self._manifest = None

    def read_metadata(self, *args: Any) -> Metadata:
        manifest = self._open(self.step)
        assert manifest.sharded is not None
        return _dcp_metadata(manifest.sharded, manifest.step)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        data: _LoadData = metadata.storage_data
        self._paths = data.paths

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Decodes this rank's bytes items before any rank reads a tensor: DCP gathers
        every rank's local plan first, so a refused item fails the load on all ranks with
        their state dicts untouched."""
        assert self._manifest is not None
        paths = sorted({self._paths[i.storage_index] for i in plan.items
                        if i.type == LoadItemType.BYTE_IO})
        stored = {t.path: t for t in self._manifest.tensors}
        self._decoded = {}
        if paths:
            with StoredReader(self._stored.repository, self._manifest) as reader:
                self._decoded = {p: self._decode(reader, stored[p]) for p in paths}
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        # DCP reads the metadata on every rank: with step=None a save committed meanwhile
        # could give ranks different steps, so each rank checks the coordinator's.
        assert self._manifest is not None
        return [replace(plan, storage_data=self._manifest.step) for plan in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Every read item a contiguous run of its stored shard's bytes (a whole shard, or
        rows of one: loads on as many ranks, or resharded along the first dimension) is
        decoded straight into the tensor DCP resolves for it, all of them in one pass over
        the packs; any other item reads its whole stored shard and copies its part."""
        assert self._manifest is not None
        if plan.storage_data != self._manifest.step:
            raise ValueError(f"run '{self.run}': rank 0 loads step {plan.storage_data}, "
                             f"this rank step {self._manifest.step} (a checkpoint was "
                             "committed during the load); load with step=N")
        stored = {t.path: t for t in self._manifest.tensors}
        direct, apart = _sort_reads(plan.items, self._paths, stored, planner)
        with StoredReader(self._stored.repository, self._manifest) as reader:
            reader.fill([fill for fill, _read_item, _target in direct])
            for _fill, read_item, target in direct:
                planner.commit_tensor(read_item, target)
            for path, items in apart.items():
                if items[0][1] is None:  # a bytes item's path holds only bytes items
                    value = self._decoded.get(path)
                    if value is None:
                        value = self._decode(reader, stored[path])
                    for read_item, _target in items:
                        planner.load_bytes(read_item, _saved(value[0]))
                else:
                    _load_from_whole(reader, stored[path], items, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _is_step(checkpoint_id)

    def _decode(self, reader: StoredReader, entry: TensorEntry) -> tuple[Any]:
        """A bytes item's value (in a 1-tuple: the value may be None).

        The item is a `torch.save` blob written by whoever holds the run's key; DCP's
        planners would read it with `torch.load(weights_only=False)`, which runs what the
        pickle names. slurm-geo's restricted, bounded reader decodes it instead; one it
        refuses is a TensorFileError naming the item, before anything in it runs."""
        assert self._manifest is not None
        where = f"run '{self.run}' step {self._manifest.step} item {entry.path!r}"
        size = tensor_nbytes(entry.dtype, entry.shape)
        if size > MAX_ARCHIVE_BYTES:  # its chunks may all be one, stored once
            raise TensorFileError(f"{where}: a non-tensor item of {size} bytes, over the "
                                  f"{MAX_ARCHIVE_BYTES >> 20} MiB one may have")
        return (load_torch_bytes(_read_whole(reader, entry), where),)

    def _open(self, step: int | None) -> Manifest:
        repository = self._stored.repository
        if step is None:
            step = repository.latest(self.run)
            if step is None:
                raise FileNotFoundError(f"run '{self.run}' has no checkpoint in "
                                        f"{self._stored.store}")
        manifest = repository.manifest(self.run, step)
        if manifest.sharded is None:
            raise NotSharded(self.run, step)
        self._manifest = manifest
        return manifest


def _layout_of(metadata: Metadata, paths: dict[MetadataIndex, str], ranks: int) -> Layout:
    """DCP's metadata of a save, as the manifest's layout."""
    items = []
    for fqn, described in metadata.state_dict_metadata.items():
        if isinstance(described, BytesStorageMetadata):
            items.append(Item(fqn, "bytes", tensor=paths[MetadataIndex(fqn)]))
            continue
        shards = tuple(Shard(tuple(c.offsets), tuple(c.sizes),
                             paths[MetadataIndex(fqn, c.offsets)]) for c in described.chunks)
        items.append(Item(fqn, "tensor", _dtype_name(described.properties.dtype, fqn),
                          tuple(described.size), bool(described.properties.requires_grad),
                          shards))
    return Layout(tuple(items), _planner_data(metadata.planner_data),
                  metadata.version or DCP_VERSION, ranks)


def _dcp_metadata(layout: Layout, step: int) -> Metadata:
    """The manifest's layout, as the Metadata DCP's planners plan a load with."""
    described: dict[str, Any] = {}
    paths: dict[MetadataIndex, str] = {}
    for item in layout.items:
        if item.kind == "bytes":
            assert item.tensor is not None
            described[item.fqn] = BytesStorageMetadata()
            paths[MetadataIndex(item.fqn)] = item.tensor
            continue
        assert item.dtype is not None
        properties = TensorProperties(dtype=TORCH_DTYPES[item.dtype],
                                      requires_grad=item.requires_grad)
        chunks = [ChunkStorageMetadata(torch.Size(s.offsets), torch.Size(s.sizes))
                  for s in item.shards]
        described[item.fqn] = TensorStorageMetadata(properties, torch.Size(item.size), chunks)
        paths.update({MetadataIndex(item.fqn, s.offsets): s.tensor for s in item.shards})
    planner_data = (None if layout.planner_data is None
                    else {fqn: tuple(path) for fqn, path in layout.planner_data.items()})
    return Metadata(described, planner_data=planner_data, storage_data=_LoadData(step, paths),
                    version=layout.dcp_version)


_Apart = dict[str, list[tuple[ReadItem, torch.Tensor | None]]]  # stored path -> its items


def _sort_reads(items: list[ReadItem], paths: dict[MetadataIndex, str],
                stored: dict[str, TensorEntry], planner: LoadPlanner
                ) -> tuple[list[tuple[Fill, ReadItem, torch.Tensor]], _Apart]:
    """The read items decoded straight into their resolved tensors, each with its fill,
    and the rest by stored tensor: bytes items (no tensor) and tensors to copy into."""
    direct: list[tuple[Fill, ReadItem, torch.Tensor]] = []
    apart: _Apart = defaultdict(list)
    for read_item in items:
        entry = stored[paths[read_item.storage_index]]
        if read_item.type == LoadItemType.BYTE_IO:
            apart[entry.path].append((read_item, None))
            continue
        target = planner.resolve_tensor(read_item).detach()
        if tuple(target.shape) != tuple(read_item.lengths):
            raise ValueError(f"{entry.path}: the planner resolved a tensor of shape "
                             f"{list(target.shape)} for {list(read_item.lengths)}")
        span = _byte_span(entry.shape, read_item.storage_offsets, read_item.lengths,
                          DTYPE_SIZES[entry.dtype])
        memory = _memory_of(target, entry.dtype)
        if span is None or memory is None:
            apart[entry.path].append((read_item, target))
        else:
            direct.append((Fill(entry.path, span, memory), read_item, target))
    return direct, apart


def _byte_span(shape: tuple[int, ...], offsets: Sequence[int], lengths: Sequence[int],
               element_size: int) -> int | None:
    """Where the box at `offsets` of `lengths` starts in the row-major bytes of a tensor
    of `shape`, when the box is one contiguous run of them (whole trailing dimensions, one
    partial, single indices before it); None when it is not."""
    whole_from = len(shape)
    while whole_from and offsets[whole_from - 1] == 0 and (
            lengths[whole_from - 1] == shape[whole_from - 1]):
        whole_from -= 1
    if any(length != 1 for length in lengths[:max(whole_from - 1, 0)]):
        return None
    start, stride = 0, element_size
    for offset, size in zip(reversed(offsets), reversed(shape), strict=True):
        start += offset * stride
        stride *= size
    return start


def _memory_of(tensor: torch.Tensor, dtype: str) -> memoryview | None:
    """The tensor's own bytes, writable, when a stored shard of `dtype` can be decoded
    into them as they are: a contiguous CPU tensor of that dtype."""
    if (tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.is_conj()
            or tensor.is_neg() or TORCH_DTYPE_NAMES.get(tensor.dtype) != dtype):
        return None
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _load_from_whole(reader: StoredReader, entry: TensorEntry,
                     items: list[tuple[ReadItem, torch.Tensor | None]], planner: LoadPlanner
                     ) -> None:
    """Read items served from their whole stored shard: boxes that are no contiguous run
    of it (a load resharded along another dimension), and targets of another dtype or
    layout, which `copy_` converts."""
    data = _read_whole(reader, entry)
    whole = (torch.frombuffer(data, dtype=torch.uint8) if data
             else torch.empty(0, dtype=torch.uint8))
    for read_item, target in items:
        assert target is not None
        source = whole.view(TORCH_DTYPES[entry.dtype]).reshape(entry.shape)
        target.copy_(narrow_tensor_by_index(source, read_item.storage_offsets,
                                            read_item.lengths))
        planner.commit_tensor(read_item, target)


def _read_whole(reader: StoredReader, entry: TensorEntry) -> bytearray:
    data = bytearray(tensor_nbytes(entry.dtype, entry.shape))
    reader.fill([Fill(entry.path, 0, memoryview(data))])
    return data


def _saved(value: Any) -> io.BytesIO:
    """`value`, a restricted reader's output, as DCP's load planners take a bytes item:
    a torch.save blob, now of our own writing."""
    saved = io.BytesIO()
    torch.save(value, saved)
    saved.seek(0)
    return saved


def _planner_data(raw: Any) -> dict[str, list[str | int]] | None:
    """DefaultSavePlanner's flattening map (fqn -> its key path), which DCP needs to
    rebuild a nested state dict; another planner's private data is refused, not pickled."""
    if raw is None:
        return None
    if isinstance(raw, dict) and all(isinstance(k, str) and isinstance(v, tuple | list)
                                     and all(isinstance(p, str | int) for p in v)
                                     for k, v in raw.items()):
        return {k: list(v) for k, v in raw.items()}
    raise ValueError(f"the save planner's data ({type(raw).__name__}) is not "
                     "DefaultSavePlanner's key-path map; slurm-geo stores no pickled planner "
                     "state: save with DefaultSavePlanner or a subclass that keeps its map")


def _dtype_name(dtype: torch.dtype, fqn: str) -> str:
    if dtype not in TORCH_DTYPE_NAMES:
        raise ValueError(f"{fqn}: dtype {dtype} has no slurm-geo checkpoint form "
                         "(docs/format.md §7.2)")
    return TORCH_DTYPE_NAMES[dtype]


def _is_step(checkpoint_id: Any) -> bool:
    return (isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool)
            and checkpoint_id >= 0) or (isinstance(checkpoint_id, str) and checkpoint_id.isdigit())


def _step_of(checkpoint_id: Any) -> int:
    if not _is_step(checkpoint_id):
        raise ValueError(f"checkpoint_id {checkpoint_id!r} is not a step (a whole number): "
                         "a slurm-geo checkpoint is named by its run and step")
    return int(checkpoint_id)


def _job_names() -> tuple[str, str]:
    """(cluster, job id) of the Slurm job this process runs in; "" outside one."""
    job = JobEnv.from_environ()
    return job.cluster, job.job_id
