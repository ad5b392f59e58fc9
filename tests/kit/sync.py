"""Shared pieces of the checkpoint-sync tests: a training-like writer of
checkpoints, site configs with a [sync] table, the daemon as a subprocess, a TCP proxy
that can take the S3 endpoint away, and reading the state database."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from slurm_geo.ckpt import LocalDirStore, Metadata, Repository, Tensor, WriteOptions
from slurm_geo.ckpt.format.keys import create_master_key_file
from slurm_geo.ckpt.stores.pacing import TokenBucket
from slurm_geo.sandbox.layout import S3_BUCKET
from slurm_geo.sync.state import (
    Replica,
    StateDB,
    Status,
)
from slurm_geo.sync.worker import Attempt, Guard, Limits, Route
from tests.kit.fence import KEY

ROOT = Path(__file__).resolve().parents[2]  # the repository
MIB = 1024 * 1024


def master_key(directory: Path) -> tuple[Path, bytes]:
    path = directory / "master.key"
    if not path.exists():
        create_master_key_file(path)
    return path, path.read_bytes()


class Trainer:
    """A small training loop (linear regression by SGD, in numpy) that checkpoints into a
    root store the way a training job does: whole state, one checkpoint per save."""

    def __init__(self, root: Path, key: bytes, run: str, shape: tuple[int, int] = (64, 64),
                 pack_size: int = 16 * MIB, seed: int = 0):
        self.repository = Repository(LocalDirStore(root), key, WriteOptions(pack_size=pack_size))
        self.run = run
        self.rng = np.random.default_rng(seed)
        self.weights = self.rng.standard_normal(shape, dtype=np.float32)
        self.bias = np.zeros(shape[1], dtype=np.float32)
        self.step = 0
        self.last_saved: int | None = None

    def train(self, steps: int) -> None:
        for _ in range(steps):
            x = self.rng.standard_normal((8, self.weights.shape[0]), dtype=np.float32)
            grad = x.T @ (x @ self.weights + self.bias) / len(x)
            self.weights -= np.float32(1e-3) * grad
            self.bias -= np.float32(1e-3) * grad.mean(axis=0)
            self.step += 1

    def tensors(self) -> list[Tensor]:
        return [Tensor("model.weight", "float32", self.weights.shape, self.weights.tobytes()),
                Tensor("model.bias", "float32", self.bias.shape, self.bias.tobytes())]

    def save(self) -> int:
        metadata = Metadata(global_step=self.step, optimizer_step=self.step, epoch=0,
                            loss=None, created_at=datetime.now(UTC).isoformat(), cluster="",
                            job_id="")
        self.repository.write_checkpoint(self.run, self.tensors(), json.dumps(
            {"step": self.step}).encode(), metadata, parent=self.last_saved)
        self.last_saved = self.step
        return self.step


def site_config(path: Path, roots: dict[str, Path], destination_url: str, *,
                endpoint_url: str = "", key_file: Path, state: Path,
                registry: Path | None = None, extra: str = "", **sync: Any) -> Path:
    """A site config with file:// roots, one `offsite` destination, a [sync] table, the
    job registry (default: registry.db beside the config) and `extra` TOML."""
    registry = registry or path.parent / "registry.db"
    lines = [extra, "[registry]", f"path = {json.dumps(str(registry))}", ""]
    for name, directory in roots.items():
        lines += [f"[stores.{name}]", f"url = {json.dumps(f'file://{directory}')}",
                  'region = "home"', ""]
    lines += ["[stores.offsite]", f"url = {json.dumps(destination_url)}", 'region = "remote"']
    if endpoint_url:
        lines.append(f"endpoint_url = {json.dumps(endpoint_url)}")
    settings = {"roots": list(sync.pop("roots", roots)), "destination": "offsite",
                "state": str(state), "key_file": str(key_file), "metrics_port": 0,
                "poll_interval_s": 0.2, "retry_base_s": 0.5, "retry_max_s": 2, "nice": 0,
                "cpu_policy": "normal", "io_class": "none", **sync}
    lines += ["", "[sync]"] + [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def start_daemon(config: Path, *args: str, log: Path, env: dict[str, str] | None = None,
                 ) -> subprocess.Popen:
    """The daemon as systemd runs it (its entry point), logging to `log`; `env` adds to
    this process's environment (an S3 destination's key, the `s3_env` fixture)."""
    environment = {**os.environ, **(env or {})}
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "slurm_geo.sync.entry", "--config",
             str(config), *args], stdout=out, stderr=subprocess.STDOUT, env=environment)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(timeout)


def statuses(state: Path) -> dict[tuple[str, int], str]:
    """(run, step) -> status, or {} before the daemon has created its database."""
    if not state.exists():
        return {}
    conn = sqlite3.connect(f"file:{state}?mode=ro", uri=True, timeout=10)
    try:
        return {(run, step): status for run, step, status
                in conn.execute("SELECT run, step, status FROM replicas")}
    except sqlite3.OperationalError:  # the schema is not there yet
        return {}
    finally:
        conn.close()


def rows(state: Path, sql: str, params: tuple = ()) -> list[dict[str, Any]]:
    conn = sqlite3.connect(f"file:{state}?mode=ro", uri=True, timeout=10)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(sql, params)]
    finally:
        conn.close()


def wait_for(check: Callable[[], Any], timeout_s: float, what: str,
             interval_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout_s} s")
        time.sleep(interval_s)


def all_verified(state: Path, expected: set[tuple[str, int]]) -> bool:
    found = statuses(state)
    return expected <= set(found) and all(found[k] == "verified" for k in expected)


def delete_prefix(s3_client, prefix: str) -> None:
    pages = s3_client.get_paginator("list_objects_v2").paginate(Bucket=S3_BUCKET,
                                                                Prefix=prefix + "/")
    for page in pages:
        for item in page.get("Contents", ()):
            s3_client.delete_object(Bucket=S3_BUCKET, Key=item["Key"])
    uploads = s3_client.list_multipart_uploads(Bucket=S3_BUCKET, Prefix=prefix + "/")
    for upload in uploads.get("Uploads", ()):
        s3_client.abort_multipart_upload(Bucket=S3_BUCKET, Key=upload["Key"],
                                         UploadId=upload["UploadId"])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TcpProxy:
    """127.0.0.1:port -> target host and port. `down()` refuses new connections and cuts open ones
    (an unreachable store); `up()` serves again on the same port."""

    def __init__(self, target_port: int, port: int | None = None,
                 target_host: str = "127.0.0.1"):
        self.target_port = target_port
        self.target_host = target_host
        self.port = port or free_port()
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            if listener is not None:
                listener.close()
            for sock in self._open:
                _quietly(lambda s=sock: s.shutdown(socket.SHUT_RDWR))
                _quietly(sock.close)
            self._open.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by down()
            try:
                upstream = socket.create_connection((self.target_host, self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:  # accepted just before down(): cut it
                    client.close()
                    upstream.close()
                    return
                self._open.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            _quietly(lambda: sink.shutdown(socket.SHUT_WR))


def _quietly(action: Callable[[], Any]) -> None:
    try:
        action()
    except OSError:
        pass


S = Status


def replica(step, status=S.PENDING, *, id=None, run="r", root="pfs", sequence=None,
            next_attempt_at=0.0, discovered_at=0.0):
    return Replica(
        id=id if id is not None else step, root=root, run=run, step=step,
        destination="offsite", sequence=step // 100 - 1 if sequence is None else sequence,
        status=status, promoted=False, manifest_sha256=None, bytes=0, attempts=0, failures=0,
        charged=0, outages=0, corruptions=0, created_at=None, discovered_at=discovered_at,
        started_at=None, replicated_at=None, verified_at=None,
        next_attempt_at=next_attempt_at, lag_s=None, last_error=None)


def attempt_on(tmp_path, home_store, away_store):
    state = StateDB(tmp_path / "sync.db")
    (replica_id,) = state.add([{"root": "pfs", "run": "run", "step": 10,
                                "destination": "offsite", "sequence": 0,
                                "status": Status.PENDING.value}], now=0.0)
    state.move(replica_id, Status.PENDING, Status.UPLOADING, 0.0)
    route = Route("pfs", home_store, "home", "offsite", away_store, "eu")
    attempt = Attempt(state, KEY, route, Guard(threading.Event(), float("inf")),
                      TokenBucket(0), Limits(max_attempts=3))
    return attempt, state.replica(replica_id)
