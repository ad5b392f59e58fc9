"""Reading chunks back: fetch the pack, open the blob, decode, and check the chunk's id.

A `ChunkReader` may be used from several threads at once: each pack is fetched and
checked once however many threads want it, while hashing, decryption and zstd (which
release the GIL) run side by side. `ordered_map` runs such work on a pool and hands the
results back in order, a bounded number at a time.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, TypeVar

from slurm_geo.ckpt.errors import CkptError, CorruptObject, MalformedData
from slurm_geo.ckpt.format.codec import (
    Buffer,
    Method,
    Writable,
    blob_methods,
    decode,
    decode_into,
    delta_base_id,
)
from slurm_geo.ckpt.format.keys import RunKeys, chunk_id
from slurm_geo.ckpt.format.manifest import ChunkRef, packs_run
from slurm_geo.ckpt.format.names import pack_name
from slurm_geo.ckpt.format.pack import (
    BLAKE3_VERSION,
    HEADER_SIZE,
    PATCH_VERSION,
    Entry,
    PackReader,
    check_pack_id,
)
from slurm_geo.ckpt.stores.store import Bytes, LocalDirStore, Store

# Packs read whole (from S3, or to be checked) kept at once: enough for a checkpoint's
# current pack, the next one (fetched ahead), the packs a delta chain reaches into (3 deep
# by default) and one more for a worker whose chunk starts the pack after; 16 MiB each, a
# checkpoint's last smaller. Measured when local stores were read whole too: at 8, the
# peak RSS of a 4 GiB pull was 280-315 MB; at 6, 246 MB in three runs, and a pull of a
# bf16 series stored as deltas fetched each pack once as before.
CACHED_PACKS = 6
# Packs whose header (salt, hence key) a reader by ranges keeps opened: a few hundred bytes
# each, against one more read per blob.
OPENED_HEADERS = 64
MAX_DEFAULT_WORKERS = 4
# The first pack version that may hold each later blob method (docs/format.md §6).
FIRST_PACK_VERSION = {Method.ZSTD_PATCH: PATCH_VERSION, Method.SPARSE_PLANES: BLAKE3_VERSION}

T = TypeVar("T")
R = TypeVar("R")


def default_workers() -> int:
    """Threads for the chunk pipeline: one per core this process may use (a Slurm job's
    allocation), at most 4: beyond, the stages that hold the GIL (plane split, AES-GCM)
    bound the gain."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_WORKERS, cores))


class ChunkReader:
    """Reads the chunks of one run; keeps the last few packs it read whole, and remembers bad ones.

    `manifest_format` is the format version of the manifests of `run` whose chunks it
    reads, which says how chunk ids are checked and where the packs are. `hash_packs`:
    check every pack it fetches against its name, as a reader whose subject is the store's
    integrity must (docs/format.md §6); a reader that decodes relies on the entries' tags
    and the chunks' ids (see `_load`).

    Such a reader reads a local directory store by ranges: each blob on its own, after its
    pack's header, as the kernel's page cache makes a small read as cheap as a large one.
    It then holds a chunk's blob, not 16 MiB packs for every chunk in flight and for delta
    bases (measured: a pull of 300 MB held 106 MB of packs at its peak). On any fault the
    pack is read whole, so the error is the one a whole read gives (`_damage`).
    `ranges_from`: the local store under a wrapped `store` (`ckpt check` counts what it
    reads), for the delta bases its packs' chunks need. `pack_object` names the object of
    a pack id where it is not the run's (a staged tree's packs: slurm_geo.stage).
    """

    def __init__(self, store: Store, keys: RunKeys, manifest_format: int, run: str,
                 cached_packs: int = CACHED_PACKS, hash_packs: bool = False,
                 ranges_from: LocalDirStore | None = None,
                 pack_object: Callable[[str], str] | None = None):
        self._store = store
        self._keys = keys
        self._format = manifest_format
        packs = packs_run(run, manifest_format)
        self._pack_object = pack_object or (lambda pack_id: pack_name(pack_id, packs))
        self._cached_packs = cached_packs
        self._hash_packs = hash_packs
        self._lock = threading.Lock()
        self._packs: OrderedDict[str, Future[PackReader]] = OrderedDict()
        self._bad_packs: dict[str, CkptError] = {}
        if ranges_from is None and isinstance(store, LocalDirStore):
            ranges_from = store
        self._by_ranges = None if hash_packs else ranges_from
        self._headers: OrderedDict[str, PackReader] = OrderedDict()

    def _pack_name(self, pack_id: str) -> str:
        return self._pack_object(pack_id)

    def read(self, ref: ChunkRef) -> bytearray:
        """The chunk's plaintext, verified against its keyed id, or a typed error."""
        data = bytearray(ref.size)
        self.read_into(ref, data, 0)
        return data

    def read_into(self, ref: ChunkRef, out: Writable, offset: int) -> None:
        """Decode the chunk into `out[offset:offset + ref.size]` and verify it there.

        On an error that range holds garbage: the caller must drop `out`. Threads may
        fill disjoint ranges of one buffer at once. Delta bases are decoded on the way but
        not checked one by one: the chunk's own id check fails if any of them was wrong,
        and only then are they checked, to name the damaged object.
        """
        self._verify_into(ref, out, offset, None)

    def check_pack(self, pack_id: str, data: Bytes, refs: Iterable[ChunkRef]) -> list[CkptError]:
        """Check a pack read whole, then every chunk of `refs` stored in it (each decrypted,
        decoded and verified against its id); one fault per damaged object. The pack then
        serves the delta bases later chunks need, from the cache, without a second read."""
        name = self._pack_name(pack_id)
        try:
            check_pack_id(name, pack_id, data)
            pack = PackReader(self._keys.data_key, name, data)
        except CkptError as exc:
            with self._lock:
                self._bad_packs[pack_id] = exc
            return [exc]
        if self._by_ranges is None:
            self._hold(pack_id, pack)
        faults: dict[str, CkptError] = {}
        for ref in refs:
            try:
                self._verify_into(ref, bytearray(ref.size), 0, pack)
            except CkptError as exc:
                faults.setdefault(exc.name, exc)
        return list(faults.values())

    def _verify_into(self, ref: ChunkRef, out: Writable, offset: int,
                     pack: PackReader | None) -> None:
        self._decode_into(ref, out, offset, pack)
        with memoryview(out)[offset:offset + ref.size] as data:
            if chunk_id(self._keys.id_key, data, self._format) == bytes.fromhex(ref.id):
                return
        if ref.base is not None:
            self.read(ref.base)  # raises, naming the base's pack, if the base is damaged
        raise CorruptObject(self._pack_name(ref.pack),
                            f"chunk {ref.id} decodes to data with another id")

    def prefetch(self, ref: ChunkRef, pool: Executor) -> None:
        """Start fetching the packs `ref` and its delta bases live in, on `pool` (none to
        fetch when reading by ranges)."""
        chain: ChunkRef | None = None if self._by_ranges else ref
        while chain is not None:
            try:
                loading, first = self._claim(chain.pack)
            except CkptError:
                return  # known bad: reading the chunk will raise it
            if first:
                pool.submit(self._load, chain.pack, loading)
            chain = chain.base

    def _decode_into(self, ref: ChunkRef, out: Writable, offset: int,
                     pack: PackReader | None = None) -> None:
        """Decode the chunk (and its bases) without checking its id."""
        blob = self._blob(ref, pack)
        try:
            decode_into(blob, out, offset, ref.size, self._base_plaintext(ref))
        except MalformedData as exc:
            raise CorruptObject(self._pack_name(ref.pack), f"chunk {ref.id}: {exc}") from None

    def _plaintext(self, ref: ChunkRef) -> Buffer:
        """A delta base's plaintext, decoded (its own bases too) but not checked."""
        blob = self._blob(ref)
        try:
            data = decode(blob, self._base_plaintext(ref))
            if len(data) != ref.size:
                raise MalformedData(f"it decodes to {len(data)} bytes, not {ref.size}")
            return data
        except MalformedData as exc:
            raise CorruptObject(self._pack_name(ref.pack), f"chunk {ref.id}: {exc}") from None

    def _blob(self, ref: ChunkRef, pack: PackReader | None = None) -> bytes:
        """The chunk's encoded blob (from `pack` when given, else the chunk's own pack),
        authenticated, its delta base checked against `ref`."""
        entry = Entry(bytes.fromhex(ref.id), ref.offset, ref.length)
        if pack is None and self._by_ranges is not None:
            pack, blob = self._read_entry(self._by_ranges, ref.pack, entry)
        else:
            pack = pack or self._pack(ref.pack)
            blob = pack.blob(entry)
        try:
            if delta_base_id(blob) != (None if ref.base is None else bytes.fromhex(ref.base.id)):
                raise MalformedData("its delta base differs from the manifest's")
            for method in blob_methods(blob):
                if pack.version < FIRST_PACK_VERSION.get(method, 1):
                    raise MalformedData(f"a {method.name} blob in a version {pack.version} pack")
        except MalformedData as exc:
            raise CorruptObject(self._pack_name(ref.pack), f"chunk {ref.id}: {exc}") from None
        return blob

    def _read_entry(self, store: LocalDirStore, pack_id: str, entry: Entry
                    ) -> tuple[PackReader, bytes]:
        """One blob read on its own, its pack's header opened once; on any fault, the pack
        read whole, whose reader names the damage as well as it can."""
        name = self._pack_name(pack_id)
        try:
            with self._lock:
                header = self._headers.get(pack_id)
            if header is None:
                header = PackReader(self._keys.data_key, name,
                                    store.get_range(name, 0, HEADER_SIZE))
                with self._lock:
                    self._headers[pack_id] = header
                    while len(self._headers) > OPENED_HEADERS:
                        self._headers.popitem(last=False)
            return header, header.open_entry(
                entry, store.get_range(name, entry.offset, entry.length))
        except CkptError:
            pack = self._pack(pack_id)
            return pack, pack.blob(entry)

    def _base_plaintext(self, ref: ChunkRef) -> Buffer | None:
        return None if ref.base is None else self._plaintext(ref.base)

    def _pack(self, pack_id: str) -> PackReader:
        """The pack, fetched and checked by whichever thread asked for it first."""
        loading, first = self._claim(pack_id)
        if first:
            self._load(pack_id, loading)
        return loading.result()

    def _claim(self, pack_id: str) -> tuple[Future[PackReader], bool]:
        """The pack's future, and whether the caller must load it (nobody else is)."""
        with self._lock:
            if pack_id in self._bad_packs:
                raise self._bad_packs[pack_id]
            loading = self._packs.get(pack_id)
            if loading is not None:
                self._packs.move_to_end(pack_id)
                return loading, False
            loading = self._packs[pack_id] = Future()
            self._evict()
            return loading, True

    def _hold(self, pack_id: str, pack: PackReader) -> None:
        """Cache a pack read and checked elsewhere."""
        held: Future[PackReader] = Future()
        held.set_result(pack)
        with self._lock:
            self._packs[pack_id] = held
            self._packs.move_to_end(pack_id)
            self._evict()

    def _evict(self) -> None:
        """Drop the least recently used packs past the cache's size (under the lock)."""
        while len(self._packs) > self._cached_packs:
            self._packs.popitem(last=False)  # threads reading it still hold it

    def _load(self, pack_id: str, loading: Future[PackReader]) -> None:
        """Fetch a pack to decode its entries. Its hash is checked only once something in it
        fails (`PackReader`, docs/format.md §6): every entry read is authenticated by its
        tag and every chunk checked against its id, and hashing every pack cost a pull of
        300 MB 35 ms of CPU for nothing more. With `hash_packs` (verify, scrub) and in
        `check_pack` (ckpt check) every pack is hashed."""
        name = self._pack_name(pack_id)
        try:
            data = self._store.get(name)
            if self._hash_packs:
                check_pack_id(name, pack_id, data)
            loading.set_result(PackReader(self._keys.data_key, name, data, pack_id))
        except BaseException as exc:
            loading.set_exception(exc)
            with self._lock:
                if self._packs.get(pack_id) is loading:
                    del self._packs[pack_id]
                if isinstance(exc, CkptError):
                    self._bad_packs[pack_id] = exc  # damaged or missing: don't fetch again


class InlineExecutor(Executor):
    """Runs each task at once in the caller's thread: the sequential pipeline."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future


def worker_pool(workers: int, name: str) -> Executor:
    """`workers` threads, or the caller's own thread when that is 1."""
    if workers <= 1:
        return InlineExecutor()
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)


def fetch_pool(workers: int) -> Executor:
    """One thread fetching packs ahead of `workers` decoding threads; inline for one."""
    if workers <= 1:
        return InlineExecutor()
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="slurm-geo-fetch")


def prefetched(jobs: Iterable[T], ref_of: Callable[[T], ChunkRef], reader: ChunkReader,
               pool: Executor, ahead: int) -> Iterator[T]:
    """`jobs`, each passed on `ahead` jobs after its packs were asked for on `pool`."""
    queue: deque[T] = deque()
    for job in jobs:
        reader.prefetch(ref_of(job), pool)
        queue.append(job)
        if len(queue) > ahead:
            yield queue.popleft()
    yield from queue


def ordered_map(fn: Callable[[T], R], items: Iterable[T], pool: Executor,
                window: int) -> Generator[R, None, None]:
    """`fn` of each item, run on `pool`, yielded in order; at most `window` in flight."""
    pending: deque[Future[R]] = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
