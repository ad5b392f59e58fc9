"""The CLI run in-process as a user runs it, on a small site of its own."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from pathlib import Path

from slurm_geo.ckpt import (
    LocalDirStore,
    Metadata,
    Repository,
    Tensor,
    create_master_key_file,
    load_master_key,
)
from slurm_geo.cli import PROG, main
from slurm_geo.federation.model import JobStatus, LogicalJob
from slurm_geo.federation.state.sqlite import FederationState
from slurm_geo.sync.state import StateDB
from tests.kit.builders import logical_job
from tests.kit.site import cluster, store, write_site


def cli_site(root: Path) -> dict[str, Path]:
    """Under `root`: a config with clusters onprem and rented, stores pfs and off
    (file://), a SQLite federation state holding onprem-9 (completed), a master key, run r
    at step 10 in pfs, an empty sync state and an empty sandbox directory."""
    for name in ("pfs", "off", "sandbox"):
        (root / name).mkdir()
    key = root / "master.key"
    create_master_key_file(key)
    config = write_site(
        root,
        clusters={"onprem": cluster("home", "pfs", name="onprem"),
                  "rented": cluster("cloud", "off", name="rented")},
        stores={"pfs": store(root / "pfs", "home"), "off": store(root / "off", "cloud")},
        federation={"state": f"{root}/fed.db", "audit_path": f"{root}/audit.db",
                    "key_file": str(key)},
        billing={"database": f"{root}/billing.db"})
    Repository(LocalDirStore(root / "pfs"), load_master_key(key)).write_checkpoint(
        "r", [Tensor("w", "float32", (2,), struct.pack("<2f", 1, 2))], b"{}",
        Metadata(10, 10, 1, 0.123456789, "2026-11-29T12:00:00Z", "", ""))
    now = time.time()
    state = FederationState(root / "fed.db")
    state.add_job(logical_job(logical_job="onprem-9", run="run-9", script="#!/bin/bash\n",
                              spec={}, directives={}, job_id=9, status=JobStatus.COMPLETED,
                              created_at=now, updated_at=now))
    state.close()
    StateDB(root / "sync.db").close()
    return {"root": root, "key": key, "config": config}


def run_cli(argv: list[str], monkeypatch, capsys, site) -> tuple[int, str, str]:
    """`slurm-geo ARGV` through the real entry point (its error handling included); an
    exception escaping it is the traceback a user would see, and fails the test."""
    monkeypatch.setenv("SLURM_GEO_CONFIG", str(site["config"]))
    monkeypatch.delenv("SLURM_GEO_KEY_FILE", raising=False)
    monkeypatch.setattr(sys, "argv", [PROG, *argv])
    try:
        main()
        code: object = 0
    except SystemExit as exited:
        code = exited.code
    said = capsys.readouterr()
    return (code if isinstance(code, int) else 0 if code is None else 1), said.out, said.err




def slurm_geo(*args: str, config) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurm_geo", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "SLURM_GEO_CONFIG":
                                                      str(config)})


def on_call_site(tmp_path):
    """A config with a master key, and a state: onprem-7 recovered onto rented:3 from step
    40; onprem-8 waiting for a move to be approved while onprem is out; onprem-9
    completed; onprem-3 sharing Slurm id 3 with rented:3."""
    from dataclasses import fields

    from slurm_geo.federation.act.resubmit import ScriptOptions
    from slurm_geo.federation.model import ClusterStatus, Health

    (tmp_path / "pfs").mkdir()
    key = tmp_path / "master.key"
    key.write_bytes(bytes(range(32)))
    key.chmod(0o600)
    config = write_site(tmp_path, federation={"state": f"{tmp_path}/fed.db",
                                              "audit_path": f"{tmp_path}/audit.db",
                                              "key_file": str(key)})
    state = FederationState(tmp_path / "fed.db")
    now = time.time()
    output = ScriptOptions(output=f"{tmp_path}/out-%j.txt").to_json()
    for number, status in ((7, JobStatus.RUNNING), (8, JobStatus.RUNNING),
                           (9, JobStatus.COMPLETED), (3, JobStatus.RUNNING)):
        state.add_job(LogicalJob(logical_job=f"onprem-{number}", run=f"run-{number}", home="onprem",
                                 script="#!/bin/bash\n", spec=output, directives={}, generation=0,
                                 cluster="onprem", job_id=number, resume_step=None, status=status,
                                 created_at=now, updated_at=now))
    state.begin_generation("onprem-7", 0, "rented", 40, now, recovery=True)
    state.submitted("onprem-7", 1, 3, "digest", now)
    state.await_approval("onprem-8", "rented", now)
    state.put_health(Health("onprem", ClusterStatus.OUT, 3, now, None, "ping timed out"))
    state.close()
    return config, {f.name for f in fields(LogicalJob)}
