"""The CLI run in-process as a user runs it, on a small site of its own."""

from __future__ import annotations

import struct
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
from slurm_geo.federation.model import JobStatus
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
