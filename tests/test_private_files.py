"""Every file a daemon creates is private to it whatever the umask (slurm_geo.private):
the helpers themselves, table-driven, and each database opener that uses them."""

from __future__ import annotations

import os
import sqlite3
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from helpers import as_uid

from slurm_geo.private import (
    UnsafeStatePath,
    private_database,
    private_dir,
    private_file,
    shared_directory,
    wanted_mode,
)
from tests.kit.files import check_tree

NOBODY = 65534  # the account the attacker runs as here: no file of its own


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.parametrize("current, wanted, directory, expected", [
    (0o644, 0o600, False, 0o600),
    (0o755, 0o700, True, 0o700),
    (0o2775, 0o750, True, 0o2750),   # setgid names a group-readable directory's group
    (0o2664, 0o640, False, 0o640),   # never on a file
    (0o400, 0o600, False, 0o600),    # the owner must write it
    (0o777, 0o640, False, 0o640),
    (0o600, 0o640, False, 0o600),    # tighter than a group-readable one: left so
    (0o700, 0o750, True, 0o700),
    (0o2700, 0o750, True, 0o2700),
])
def test_wanted_mode(current: int, wanted: int, directory: bool, expected: int) -> None:
    assert wanted_mode(current, wanted, directory=directory) == expected


@pytest.mark.parametrize("mask", [0o022, 0o000, 0o077])
@pytest.mark.parametrize("group, file_bits, dir_bits", [(False, 0o600, 0o700),
                                                        (True, 0o640, 0o750)])
def test_a_new_file_and_its_new_directories_are_private_whatever_the_umask(
        tmp_path: Path, mask: int, group: bool, file_bits: int, dir_bits: int) -> None:
    path = tmp_path / "a" / "b" / "state.json"
    with umask(mask):
        private_file(path, group)
    assert (mode(path), mode(path.parent), mode(path.parent.parent)) == \
        (file_bits, dir_bits, dir_bits)


def test_an_existing_too_open_file_and_directory_are_tightened(tmp_path: Path) -> None:
    directory = tmp_path / "state"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    path = directory / "checkpoint-sync.db"
    path.write_text("")
    path.chmod(0o644)
    wal = directory / "checkpoint-sync.db-wal"
    wal.write_text("")
    wal.chmod(0o666)
    with umask(0o022):
        private_database(path, timeout_s=1).close()
    assert (mode(directory), mode(path), mode(wal)) == (0o700, 0o600, 0o600)


@pytest.mark.parametrize("kind", ["file", "companion"])
def test_a_link_in_place_of_a_state_file_is_refused_and_not_followed(
        tmp_path: Path, kind: str) -> None:
    secret = tmp_path / "master.key"
    secret.write_text("k")
    secret.chmod(0o644)
    state = tmp_path / "state"
    state.mkdir()
    path = state / "audit.db"
    if kind == "file":
        path.symlink_to(secret)
    else:
        (state / "audit.db-wal").symlink_to(secret)
    with pytest.raises(UnsafeStatePath, match="symbolic link"):
        private_database(path, timeout_s=1)
    assert mode(secret) == 0o644 and secret.read_text() == "k"


@pytest.fixture
def passable_dir() -> Iterator[Path]:
    """A directory nobody may pass through (pytest's own are root's alone)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(dir="/var/tmp"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path)


@pytest.mark.root(reason="needs root, to give the file to another account")
def test_a_too_open_file_of_another_account_is_refused_in_one_line(passable_dir: Path,
                                                                    ) -> None:
    state = passable_dir / "state"
    state.mkdir(mode=0o700)
    os.chown(state, NOBODY, NOBODY)  # the daemon's own directory ...
    path = state / "registry.db"
    path.write_text("")
    path.chmod(0o644)  # ... with a file root left open in it
    said = as_uid(NOBODY, lambda: private_file(path))
    assert said.startswith("UnsafeStatePath: ") and "\n" not in said
    assert "belongs to uid 0" in said and "chown it to the daemon's account" in said
    assert mode(path) == 0o644


def test_a_directory_made_by_another_process_meanwhile_is_fine(tmp_path: Path) -> None:
    path = tmp_path / "dir"
    path.mkdir(mode=0o700)
    assert private_dir(path) == path and mode(path) == 0o700


# --- every opener of a daemon's database ----------------------------------------------------

def _sync(path: Path) -> Any:
    from slurm_geo.sync.state import StateDB
    return StateDB(path)


def _audit(path: Path) -> Any:
    from slurm_geo.federation.state.audit import AuditLog
    log = AuditLog(path)
    log.append("decision", "a", "opened", "a test")
    return log


def _registry(path: Path) -> Any:
    from slurm_geo.registry import Registry
    return Registry(path)


def _billing(path: Path) -> Any:
    from slurm_geo.billing.db import BillingDB
    return BillingDB(path)


def _federation(path: Path) -> Any:
    from slurm_geo.federation.state.sqlite import FederationState
    return FederationState(path)


OPENERS: list[tuple[str, Callable[[Path], Any], int, int]] = [
    ("checkpoint-sync.db", _sync, 0o600, 0o700),
    ("audit.db", _audit, 0o600, 0o700),
    ("federation.db", _federation, 0o600, 0o700),
    ("billing.db", _billing, 0o600, 0o700),
    ("registry.db", _registry, 0o640, 0o750),  # read through its group (security.md)
]


@pytest.mark.parametrize("name, opener, file_bits, dir_bits", OPENERS,
                         ids=[o[0] for o in OPENERS])
def test_each_daemon_database_and_its_companions_are_private_under_umask_022(
        tmp_path: Path, name: str, opener: Callable[[Path], Any], file_bits: int,
        dir_bits: int) -> None:
    path = tmp_path / "var" / "state" / name
    with umask(0o022):
        handle = opener(path)
        try:
            found = sorted(p.name for p in path.parent.iterdir())
            modes = {p.name: mode(p) for p in path.parent.iterdir()}
        finally:
            handle.close()
    assert f"{name}-wal" in found or f"{name}-journal" in found or name in found
    assert modes == {n: file_bits for n in found}, modes
    assert mode(path.parent) == dir_bits


@pytest.mark.parametrize("name, opener, file_bits, dir_bits", OPENERS,
                         ids=[o[0] for o in OPENERS])
def test_each_daemon_database_left_too_open_is_tightened_at_open(
        tmp_path: Path, name: str, opener: Callable[[Path], Any], file_bits: int,
        dir_bits: int) -> None:
    path = tmp_path / "state" / name
    with umask(0o022):
        opener(path).close()
        os.chmod(path.parent, 0o755)
        for p in path.parent.iterdir():
            os.chmod(p, 0o644)
        opener(path).close()
    assert {p.name: mode(p) for p in path.parent.iterdir()} == \
        {p.name: file_bits for p in path.parent.iterdir()}
    assert mode(path.parent) == dir_bits


def test_sqlite_gives_its_companions_the_database_files_mode(tmp_path: Path) -> None:
    """What private_database relies on: a -wal or -shm SQLite creates takes the mode of
    the database file, not the umask's."""
    path = tmp_path / "x.db"
    with umask(0o022):
        db = private_database(path, timeout_s=1, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE t (x)")
        db.execute("INSERT INTO t VALUES (1)")
        reader = sqlite3.connect(path)
        reader.execute("SELECT * FROM t").fetchall()
        modes = {p.name: mode(p) for p in tmp_path.iterdir()}
        reader.close()
        db.close()
    assert {"x.db", "x.db-wal", "x.db-shm"} <= set(modes) and set(modes.values()) == {0o600}


# --- what the daemons leave behind ----------------------------------------------------------


def test_every_file_the_daemons_leave_is_private(tmp_path: Path) -> None:
    """checkpoint-sync as systemd runs it (its entry point, a real process) replicating a
    job directory from the registry, and the federation daemon's, the hooks' and billing's
    databases written through their openers, all under umask 022 in state directories an
    installer made 0755: afterwards every file and directory in them is private."""
    from slurm_geo.billing.db import BillingDB
    from slurm_geo.federation.state.audit import AuditLog
    from slurm_geo.federation.state.sqlite import FederationState
    from slurm_geo.registry import Registry
    from tests.kit.sync import (
        Trainer,
        all_verified,
        master_key,
        site_config,
        start_daemon,
        stop,
        wait_for,
    )

    var = tmp_path / "var"
    dirs = {name: var / name for name in ("sync", "federation", "registry", "billing")}
    for directory in dirs.values():
        directory.mkdir(parents=True, mode=0o755)
        directory.chmod(0o755)  # as `install -d` or a package leaves them
    pfs, offsite, job_dir = (tmp_path / name for name in ("pfs", "offsite", "job"))
    for directory in (pfs, offsite, job_dir):
        directory.mkdir()
    key_file, key = master_key(tmp_path)
    trainer = Trainer(job_dir, key, "r", shape=(16, 16))
    trainer.train(2)
    step = trainer.save()
    registry = dirs["registry"] / "registry.db"
    state = dirs["sync"] / "checkpoint-sync.db"
    config = site_config(tmp_path / "site.toml", {"pfs": pfs}, f"file://{offsite}",
                         key_file=key_file, state=state, registry=registry)
    with umask(0o022):
        user = pwd_name(os.getuid())
        with Registry(registry) as jobs:
            jobs.job_started("onprem", 7, 0, name="train", user=user, nodes="n1",
                             directives={"geo-ckpt-dir": str(job_dir)}, now=time.time())
        proc = start_daemon(config, log=tmp_path / "sync.log")
        try:
            wait_for(lambda: all_verified(state, {("r", step)}), 60, "verified")
        finally:
            assert stop(proc) == 0
        federation = FederationState(dirs["federation"] / "federation.db")
        audit = AuditLog(dirs["federation"] / "audit.db")
        audit.append("decision", None, "ran", "a test")
        billing = BillingDB(dirs["billing"] / "billing.db")
        for handle in (federation, audit, billing):
            handle.close()

    assert {p.name for p in dirs["sync"].iterdir()} >= {"checkpoint-sync.db"}
    wrong = [*check_tree(dirs["sync"], 0o600, 0o700),
             *check_tree(dirs["federation"], 0o600, 0o700),
             *check_tree(dirs["billing"], 0o600, 0o700),
             *check_tree(dirs["registry"], 0o640, 0o750)]  # read through its group
    assert wrong == []


def pwd_name(uid: int) -> str:
    import pwd

    return pwd.getpwuid(uid).pw_name


@pytest.mark.parametrize("path, mode, expected", [
    ("/var/lib/slurm-geo", 0o755, None),
    ("/var/lib/slurm-geo/sync", 0o700, None),
    ("/tmp/x", 0o1777, "others may write to it"),
    ("/srv/x/y", 0o777, "others may write to it"),
    ("/tmp", 0o1777, "others may write to it"),
    ("/var/lib", 0o755, "it is a system-wide directory"),
    ("/home", 0o755, "it is a system-wide directory"),
])
def test_which_directories_are_tightened(path: str, mode: int, expected: str | None) -> None:
    assert shared_directory(Path(path), mode) == expected


def test_a_shared_directory_is_never_tightened_but_refused_in_one_line(
        tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(UnsafeStatePath) as caught:
        private_database(shared / "state.db", timeout_s=1)
    assert mode(shared) == 0o1777 and not (shared / "state.db").exists()
    assert "\n" not in str(caught.value) and "directory of its own" in str(caught.value)


def test_reopening_a_database_keeps_the_locks_of_a_connection_already_open(
        tmp_path: Path) -> None:
    """A thread of a daemon opening its state again (a sync worker, a world pass) must not
    open and close the file itself: closing any descriptor of it drops every POSIX lock
    the process holds there, the other connection's SHARED lock among them, and another
    process could then remove the WAL under it."""
    import subprocess
    import sys

    path = tmp_path / "state" / "s.db"
    held = private_database(path, timeout_s=1)
    held.execute("PRAGMA journal_mode=wal")
    held.execute("CREATE TABLE t (x)")
    held.commit()
    held.execute("SELECT * FROM t").fetchall()
    probe = ("import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDWR)\ntry:\n"
             "    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 510, 0x40000002)\n"
             "    print('granted')\nexcept OSError:\n    print('refused')\n")

    def exclusive() -> str:
        return subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True,
                              text=True, check=True, timeout=30).stdout.strip()

    assert exclusive() == "refused"
    again = private_database(path, timeout_s=1)
    again.close()
    assert exclusive() == "refused"  # the first connection still holds its lock
    held.close()
