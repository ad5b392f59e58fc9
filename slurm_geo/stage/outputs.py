"""A moved incarnation's log and outputs, shipped home (docs/format.md §11.9; issue 31
item 6).

The moved job's preamble, as the job's owner and holding the run's key ring, calls `ship`
periodically while the trainer runs and once more at exit: it uploads the job's log and
each `--geo-outputs` directory to the store of the site it runs at, sealed under the run's
key, and checkpoint-sync brings the objects home (slurm_geo.sync.worlds). At home the
owner reads them with the same run key (`slurm-geo logs`, `slurm-geo outputs fetch`).

    outputs/<run>/<incarnation>/parts/<id>     one part of a file: its plaintext id (an
                                               HMAC under the run's id key), zstd, sealed
    outputs/<run>/<incarnation>/index/<n>      what the incarnation had shipped by then:
                                               every file and its parts (the commit point)

A part is at most `PART_SIZE` bytes of a file at a fixed offset. `ship` reads what changed
only: a file whose size and modification time equal the previous index's entry takes its
parts without being read; the log, which only grows, is read from its last part on; a part
the store holds already is not put again. Nothing changed: no index is written. Every
object is sealed with its name, so no part or index can stand for another, another run's
key opens nothing, and a reader checks each part's plaintext against its id.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import zstandard

from slurm_geo.ckpt.errors import CorruptObject, UnsafeObjectName
from slurm_geo.ckpt.format.keys import SALT_SIZE, RandomBytes, RunKeyRing
from slurm_geo.ckpt.format.names import check_object_name, check_run_id
from slurm_geo.ckpt.format.seal import Kind, open_sealed, seal, sealing_fingerprint
from slurm_geo.ckpt.stores.store import Store
from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode

OUTPUTS = "outputs"
INDEX_FORMAT = 1
PART_SIZE = 8 * 1024 * 1024
MAX_INDEX = 64 * 1024 * 1024  # decompressed


class OutputsError(SlurmGeoError):
    """Outputs that cannot be shipped or fetched as asked (a path that is not usable)."""

    exit_code = ExitCode.USAGE


def outputs_prefix(run: str, incarnation: str | None = None) -> str:
    check_run_id(run)
    if incarnation is None:
        return f"{OUTPUTS}/{run}/"
    check_object_name(incarnation)
    if "/" in incarnation:
        raise UnsafeObjectName(incarnation, "an incarnation is one name: CLUSTER-JOBID")
    return f"{OUTPUTS}/{run}/{incarnation}/"


def incarnation_name(cluster: str, job_id: int | str) -> str:
    """`<cluster>-<jobid>`, as the objects of that incarnation are named."""
    name = f"{cluster}-{job_id}"
    check_object_name(name)
    return name


def part_name(run: str, incarnation: str, part_id: str) -> str:
    return f"{outputs_prefix(run, incarnation)}parts/{part_id}"


def index_name(run: str, incarnation: str, number: int) -> str:
    return f"{outputs_prefix(run, incarnation)}index/{number:020d}"


@dataclass(frozen=True)
class ShippedFile:
    """A file (or directory) as shipped: `path` relative to its output root ("." for the
    root), its parts as (id, size), the SHA-256 of its content."""

    path: str
    type: str  # "file" or "dir"
    mode: int
    mtime_ns: int = 0
    size: int = 0
    sha256: str = ""
    parts: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class ShippedOutput:
    home: str  # the absolute path at home the owner expects it at
    entries: tuple[ShippedFile, ...]


@dataclass(frozen=True)
class Index:
    run: str
    incarnation: str
    number: int
    written_at: float
    final: bool
    log: ShippedFile | None
    outputs: tuple[ShippedOutput, ...] = ()

    def to_payload(self) -> bytes:
        return zstandard.ZstdCompressor().compress(json.dumps(asdict(self)).encode())

    @classmethod
    def from_payload(cls, payload: bytes, name: str) -> Index:
        try:
            body = json.loads(zstandard.ZstdDecompressor().decompress(
                payload, max_output_size=MAX_INDEX))
            if body.pop("format", INDEX_FORMAT) != INDEX_FORMAT:
                raise ValueError("unsupported format")
            log = None if body["log"] is None else _file(body["log"])
            outputs = tuple(ShippedOutput(o["home"], tuple(_file(e) for e in o["entries"]))
                            for o in body["outputs"])
            index = cls(body["run"], body["incarnation"], int(body["number"]),
                        float(body["written_at"]), bool(body["final"]), log, outputs)
        except (ValueError, KeyError, TypeError, zstandard.ZstdError) as exc:
            raise CorruptObject(name, f"not an outputs index: {exc}") from None
        for output in index.outputs:
            if not output.home.startswith("/") or any(_unsafe(e.path) for e in output.entries):
                raise CorruptObject(name, f"an output at {output.home!r} names an unsafe path")
        return index


def _file(body: dict[str, Any]) -> ShippedFile:
    parts = tuple((str(p), int(s)) for p, s in body.get("parts", ()))
    return ShippedFile(body["path"], body["type"], int(body["mode"]) & 0o7777,
                       int(body.get("mtime_ns", 0)), int(body.get("size", 0)),
                       str(body.get("sha256", "")), parts)


def _unsafe(path: str) -> bool:
    parts = path.split("/")
    return path != "." and (path.startswith("/") or any(p in ("", ".", "..") or "\0" in p
                                                        for p in parts))


@dataclass(frozen=True)
class ShipReport:
    index: int | None  # the index written, None when nothing had changed
    files_read: int
    parts_sent: int
    bytes_sent: int
    skipped: tuple[str, ...] = ()  # links and special files: never shipped


@dataclass
class _Sending:
    store: Store
    ring: RunKeyRing
    run: str
    incarnation: str
    held: set[str]
    random_bytes: RandomBytes
    files_read: int = 0
    parts_sent: int = 0
    bytes_sent: int = 0
    skipped: list[str] = field(default_factory=list)

    def part(self, data: bytes) -> tuple[str, int]:
        keys = self.ring.current
        part_id = hmac.new(keys.id_key, data, hashlib.sha256).hexdigest()
        name = part_name(self.run, self.incarnation, part_id)
        if name not in self.held:
            sealed = seal(keys.data_key, Kind.MANIFEST, self.random_bytes(SALT_SIZE),
                          zstandard.ZstdCompressor().compress(data), name)
            self.store.put(name, sealed)
            self.held.add(name)
            self.parts_sent += 1
            self.bytes_sent += len(sealed)
        return part_id, len(data)


def ship(store: Store, run_ring: RunKeyRing, run: str, incarnation: str,
         log_path: str | os.PathLike[str] | None, outputs: Mapping[str, str | os.PathLike[str]],
         final: bool = False, random_bytes: RandomBytes = os.urandom,
         clock: Callable[[], float] = time.time) -> ShipReport:
    """Upload what changed since the incarnation's last index: the log at `log_path` and
    each output directory (or file) `outputs[home_path]`, read as the caller (the job's
    owner); then a new index, unless nothing changed and this is not the `final` call.
    An output or log that does not exist yet ships as absent (a job writes them late)."""
    prefix = outputs_prefix(run, incarnation)
    for home in outputs:
        if not str(home).startswith("/"):
            raise OutputsError(f"output {home!r}: the path at home must be absolute")
    numbers = [_number(n) for n in store.list(f"{prefix}index/")]
    latest = max((n for n in numbers if n is not None), default=None)
    before = None if latest is None else read_index(store, run_ring, run, incarnation, latest)
    sending = _Sending(store, run_ring, run, incarnation, set(store.list(f"{prefix}parts/")),
                       random_bytes)
    previous_log = before.log if before else None
    log = None if log_path is None else _ship_log(sending, Path(log_path), previous_log)
    earlier = {o.home: {e.path: e for e in o.entries} for o in (before.outputs if before else ())}
    shipped = tuple(ShippedOutput(str(home), tuple(_ship_tree(sending, Path(local),
                                                              earlier.get(str(home), {}))))
                    for home, local in sorted(outputs.items()))
    number = 1 if latest is None else latest + 1
    index = Index(run, incarnation, number, clock(), final, log, shipped)
    if before is not None and (before.log, before.outputs) == (log, shipped) \
            and (before.final or not final):
        return ShipReport(None, sending.files_read, 0, 0, tuple(sending.skipped))
    name = index_name(run, incarnation, number)
    sealed = seal(run_ring.current.data_key, Kind.MANIFEST, random_bytes(SALT_SIZE),
                  index.to_payload(), name)
    store.put(name, sealed)
    return ShipReport(number, sending.files_read, sending.parts_sent,
                      sending.bytes_sent + len(sealed), tuple(sending.skipped))


def _number(name: str) -> int | None:
    tail = name.rpartition("/")[2]
    return int(tail) if tail.isdigit() and len(tail) == 20 else None


def _ship_log(sending: _Sending, path: Path, before: ShippedFile | None) -> ShippedFile | None:
    """The log, which only grows: the previous index's whole parts are kept, the rest is
    read from there on (a log that shrank is read again whole)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return before
    except OSError as exc:
        raise OutputsError(f"log {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise OutputsError(f"log {path} is not a regular file")
        if before is not None and (before.size, before.mtime_ns) == (info.st_size,
                                                                     info.st_mtime_ns):
            return before
        kept: tuple[tuple[str, int], ...] = ()
        if before is not None and info.st_size >= before.size:
            kept = tuple(p for p in before.parts if p[1] == PART_SIZE)
        handle.seek(len(kept) * PART_SIZE)
        parts, size = list(kept), len(kept) * PART_SIZE
        for data in iter(lambda: handle.read(PART_SIZE), b""):
            parts.append(sending.part(data))
            size += len(data)
        sending.files_read += 1
    return ShippedFile(path.name, "file", info.st_mode & 0o7777, info.st_mtime_ns, size, "",
                       tuple(parts))


def _ship_tree(sending: _Sending, root: Path, before: Mapping[str, ShippedFile]
               ) -> Iterator[ShippedFile]:
    """Each entry under `root` (a directory or one file), never following a link."""
    try:
        info = os.lstat(root)
    except FileNotFoundError:
        return
    if stat.S_ISREG(info.st_mode):
        yield _ship_file(sending, root, ".", before.get("."))
        return
    if not stat.S_ISDIR(info.st_mode):
        sending.skipped.append(str(root))
        return
    yield ShippedFile(".", "dir", info.st_mode & 0o7777)
    for directory, dirs, files in os.walk(root, followlinks=False):
        dirs.sort()
        base = Path(directory)
        for name in sorted(dirs + files):
            path = base / name
            relative = path.relative_to(root).as_posix()
            entry = os.lstat(path)
            if stat.S_ISDIR(entry.st_mode):
                yield ShippedFile(relative, "dir", entry.st_mode & 0o7777)
            elif stat.S_ISREG(entry.st_mode):
                yield _ship_file(sending, path, relative, before.get(relative))
            else:
                sending.skipped.append(str(path))


def _ship_file(sending: _Sending, path: Path, relative: str, before: ShippedFile | None
               ) -> ShippedFile:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if before is not None and before.type == "file" and \
                (before.size, before.mtime_ns) == (info.st_size, info.st_mtime_ns):
            return replace(before, mode=info.st_mode & 0o7777)
        digest, parts, size = hashlib.sha256(), [], 0
        for data in iter(lambda: handle.read(PART_SIZE), b""):
            digest.update(data)
            parts.append(sending.part(data))
            size += len(data)
        sending.files_read += 1
    return ShippedFile(relative, "file", info.st_mode & 0o7777, info.st_mtime_ns, size,
                       digest.hexdigest(), tuple(parts))


# --- reading ---------------------------------------------------------------------------


def read_index(store: Store, ring: RunKeyRing, run: str, incarnation: str,
               number: int) -> Index:
    name = index_name(run, incarnation, number)
    sealed = store.get(name)
    keys = ring.sealed_under(sealing_fingerprint(sealed), name)
    index = Index.from_payload(open_sealed(keys.data_key, Kind.MANIFEST, sealed, name), name)
    if (index.run, index.incarnation, index.number) != (run, incarnation, number):
        raise CorruptObject(name, f"the index names {index.run}/{index.incarnation}/"
                            f"{index.number}, not its own name")
    return index


def incarnations(store: Store, run: str) -> list[str]:
    """The incarnations of `run` that shipped an index to `store`, by name."""
    prefix = outputs_prefix(run)
    return sorted({n[len(prefix):].split("/", 1)[0] for n in store.list(prefix)
                   if "/index/" in n})


def latest_index(store: Store, ring: RunKeyRing, run: str, incarnation: str) -> Index | None:
    numbers = [_number(n) for n in store.list(f"{outputs_prefix(run, incarnation)}index/")]
    latest = max((n for n in numbers if n is not None), default=None)
    return None if latest is None else read_index(store, ring, run, incarnation, latest)


def read_part(store: Store, ring: RunKeyRing, run: str, incarnation: str,
              part: tuple[str, int]) -> bytes:
    """A part's plaintext, checked against its id and size."""
    part_id, size = part
    name = part_name(run, incarnation, part_id)
    sealed = store.get(name)
    keys = ring.sealed_under(sealing_fingerprint(sealed), name)
    try:
        data = zstandard.ZstdDecompressor().decompress(
            open_sealed(keys.data_key, Kind.MANIFEST, sealed, name), max_output_size=PART_SIZE)
    except zstandard.ZstdError as exc:
        raise CorruptObject(name, f"not a part: {exc}") from None
    expected = hmac.new(keys.id_key, data, hashlib.sha256).hexdigest()
    if len(data) != size or not hmac.compare_digest(expected, part_id):
        raise CorruptObject(name, "its content does not match its id")
    return data


def read_file(store: Store, ring: RunKeyRing, run: str, incarnation: str,
              shipped: ShippedFile) -> Iterator[bytes]:
    for part in shipped.parts:
        yield read_part(store, ring, run, incarnation, part)


def read_log(store: Store, ring: RunKeyRing, run: str, incarnation: str) -> bytes | None:
    """The incarnation's log as last shipped; None when it shipped none."""
    index = latest_index(store, ring, run, incarnation)
    if index is None or index.log is None:
        return None
    return b"".join(read_file(store, ring, run, incarnation, index.log))


class PeriodicShipper:
    """`ship` every `every_s` seconds on a thread of its own while the job runs, and once
    more, final, at `stop()`. A failed periodic call (the store unreachable for a while)
    is kept in `last_error` and tried again at the next period: shipping never stops the
    job; the final call's failure is raised to the caller."""

    def __init__(self, store: Store, run_ring: RunKeyRing, run: str, incarnation: str,
                 log_path: str | os.PathLike[str] | None,
                 outputs: Mapping[str, str | os.PathLike[str]], every_s: float = 60.0):
        self._args = (store, run_ring, run, incarnation, log_path, dict(outputs))
        self._every_s = every_s
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one ship at a time: the final one waits its turn
        self._thread = threading.Thread(target=self._loop, name="slurm-geo-ship",
                                        daemon=True)
        self.last_error: Exception | None = None
        self.shipped = 0  # indexes written

    def start(self) -> PeriodicShipper:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self._every_s):
            try:
                self._ship(final=False)
            except Exception as exc:  # kept and retried: shipping never stops the job
                self.last_error = exc

    def _ship(self, final: bool) -> ShipReport:
        with self._lock:
            report = ship(*self._args, final=final)
            if report.index is not None:
                self.shipped += 1
            return report

    def stop(self) -> ShipReport:
        """Stop the periodic calls and ship once more, final."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self._ship(final=True)
