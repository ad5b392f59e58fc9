"""checkpoint-sync reads a job's checkpoint directory as its owner could read it
(slurm_geo.sync.ownedfiles): never through a symbolic link, only regular files of the
directory's owner. The decision table, the store on its own, and the daemon replicating
alice's directory (her real sandbox account, her links made as her) with links to a
root-only file in it: that file is never read nor uploaded."""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_geo.ckpt.errors import ObjectMissing, StoreUnavailable, UnsafeObjectName
from slurm_geo.registry import Registry
from slurm_geo.sync.daemon import Daemon
from slurm_geo.sync.ownedfiles import OwnedDirStore, SkippedFiles, refusal
from slurm_geo.sync.runtime import load_runtime
from tests.kit.sync import Trainer, master_key, site_config, statuses

SECRET = b"ROOT-ONLY-SECRET-" + os.urandom(16).hex().encode()

as_root = pytest.mark.root(reason="the daemon reads users' directories as root")


def _stat(mode: int, uid: int) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 1, uid, uid, 10, 0, 0, 0))


@pytest.mark.parametrize("mode, uid, expected", [
    (stat.S_IFREG | 0o600, 2001, None),
    (stat.S_IFREG | 0o644, 2001, None),
    (stat.S_IFLNK | 0o777, 2001, "a symbolic link, never followed"),
    (stat.S_IFREG | 0o600, 0, "owned by uid 0, not by the directory's owner 2001"),
    (stat.S_IFIFO | 0o600, 2001, "not a regular file"),
    (stat.S_IFCHR | 0o600, 2001, "not a regular file"),
    (stat.S_IFDIR | 0o700, 2001, "not a regular file"),
])
def test_which_files_are_read(mode: int, uid: int, expected: str | None) -> None:
    assert refusal(_stat(mode, uid), 2001) == expected


# --- the store on its own ------------------------------------------------------------------

@pytest.fixture
def owner() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("needs root, to give files to another account")
    try:
        return pwd.getpwnam("alice")
    except KeyError:
        return pwd.getpwnam("nobody")


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A file only root may read (as the master key), in a directory only root enters."""
    directory = tmp_path / "etc"
    directory.mkdir(mode=0o700)
    path = directory / "master.key"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return path


def _give(path: Path, who: pwd.struct_passwd) -> None:
    for p in [path, *path.rglob("*")]:
        os.lchown(p, who.pw_uid, who.pw_gid)


@as_root
def test_the_owners_files_are_read_and_links_and_others_files_are_not(
        tmp_path: Path, owner: pwd.struct_passwd, secret: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "ckpt"
    (root / "packs" / "ab").mkdir(parents=True)
    (root / "packs" / "ab" / "good").write_bytes(b"mine")
    (root / "packs" / "ab" / "link").symlink_to(secret)
    (root / "packs" / "zz").symlink_to(secret.parent, target_is_directory=True)
    os.link(secret, root / "packs" / "ab" / "hard")  # root's file under another name
    os.mkfifo(root / "packs" / "ab" / "fifo")
    _give(root, owner)
    os.chown(root / "packs" / "ab" / "hard", 0, 0)
    skipped = SkippedFiles()
    store = OwnedDirStore(root, frozenset({owner.pw_uid}), skipped)

    with caplog.at_level(logging.WARNING, logger="slurm_geo.sync"):
        assert store.list("packs/") == ["packs/ab/good"]
        assert store.get("packs/ab/good") == b"mine"
        for name in ("packs/ab/link", "packs/zz/master.key", "packs/ab/hard",
                     "packs/ab/fifo"):
            with pytest.raises(UnsafeObjectName):
                store.get(name)
            assert not store.exists(name)
        with pytest.raises(ObjectMissing):
            store.get("packs/ab/absent")
    lines = [r.getMessage() for r in caplog.records if "unsafe_file_skipped" in r.getMessage()]
    told = [line.split()[1].removeprefix(f"path={root}/") for line in lines]
    assert sorted(told) == ["packs/ab/fifo", "packs/ab/hard", "packs/ab/link", "packs/zz",
                            "packs/zz/master.key"]  # one line per path
    assert skipped.count > len(told)  # every skip counted
    assert all(SECRET.decode() not in line for line in lines)
    with pytest.raises(StoreUnavailable, match="never writes"):
        store.put("packs/ab/new", b"x")


@as_root
def test_a_link_in_place_of_the_directory_or_another_owner_is_refused(
        tmp_path: Path, owner: pwd.struct_passwd, secret: Path) -> None:
    link = tmp_path / "ckpt"
    link.symlink_to(secret.parent, target_is_directory=True)
    with pytest.raises(UnsafeObjectName):
        OwnedDirStore(link, frozenset({owner.pw_uid}), SkippedFiles()).get("master.key")
    with pytest.raises(StoreUnavailable, match="belongs to uid 0"):
        OwnedDirStore(secret.parent, frozenset({owner.pw_uid}), SkippedFiles()).get(
            "master.key")


# --- the daemon, alice's directory ---------------------------------------------------------

ALICE = "alice"


def _as_alice(*command: str) -> None:
    subprocess.run(["runuser", "-u", ALICE, "--", *command], check=True, timeout=30)


def _packs(directory: Path) -> set[Path]:
    return {p for top in ("packs", "run-packs") for p in (directory / top).rglob("*")
            if p.is_file() or p.is_symlink()}


def _attack(kind: str, pack: Path, secret: Path, scratch: Path) -> None:
    """Make `pack` (of alice's newest checkpoint) lead to the root-only `secret`, as alice
    could (or, for the hard link, as a filesystem without protected_hardlinks lets her)."""
    if kind == "file link":
        _as_alice("rm", "-f", str(pack))
        _as_alice("ln", "-s", str(secret), str(pack))
    elif kind == "directory link":
        twin = scratch / pack.name  # the pack's name, the secret's bytes, root's only
        twin.write_bytes(SECRET)
        twin.chmod(0o600)
        _as_alice("mv", str(pack.parent), str(pack.parent) + ".old")
        _as_alice("ln", "-s", str(scratch), str(pack.parent))
    else:
        pack.unlink()
        os.link(secret, pack)


@pytest.fixture
def alices_dir(request: pytest.FixtureRequest) -> Iterator[Path]:
    """An empty directory in alice's project directory on the sandbox's shared filesystem
    (her real account; the sandbox need only have been up once, not be up now)."""
    from slurm_geo.sandbox import Sandbox, root_from_env
    from slurm_geo.sandbox.users import ALICE as ALICE_USER
    from tests.kit.sandbox import user_dir

    box = Sandbox(root_from_env(None))
    if os.geteuid() != 0 or not box.layout.project_dir(ALICE).is_dir():
        pytest.skip("needs root and the sandbox's alice (slurm-geo sandbox up)")
    path = user_dir(box, ALICE_USER, request.node.name)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@as_root
@pytest.mark.parametrize("kind", ["file link", "directory link", "hard link"])
def test_alices_link_to_a_root_only_file_is_never_read_nor_uploaded(
        alices_dir: Path, tmp_path: Path, secret: Path, kind: str,
        caplog: pytest.LogCaptureFixture) -> None:
    alice = pwd.getpwnam(ALICE)
    job_dir = alices_dir
    scratch = tmp_path / "root-only"
    scratch.mkdir(mode=0o700)
    offsite, pfs = tmp_path / "offsite", tmp_path / "pfs"
    offsite.mkdir()
    pfs.mkdir()
    key_file, key = master_key(tmp_path)
    registry, state = tmp_path / "registry.db", tmp_path / "state.db"
    config = site_config(tmp_path / "site.toml", {"pfs": pfs}, f"file://{offsite}",
                         key_file=key_file, state=state, registry=registry, max_attempts=1)
    trainer = Trainer(job_dir, key, "r", shape=(32, 32))
    trainer.train(3)
    first = trainer.save()
    before = _packs(job_dir)
    trainer.train(3)
    second = trainer.save()
    _give(job_dir, alice)
    [pack] = sorted(_packs(job_dir) - before)[:1]
    _attack(kind, pack, secret, scratch)
    with Registry(registry) as jobs:
        jobs.job_started("onprem", 41, 0, name="train", user=ALICE, nodes="n1",
                         directives={"geo-ckpt-dir": str(job_dir)}, now=time.time())

    runtime = load_runtime(config)
    with caplog.at_level(logging.WARNING, logger="slurm_geo.sync"):
        Daemon(runtime, lambda: runtime, state, handle_signals=False,
               set_priority=False).run(once=True)

    found = statuses(state)
    if kind != "directory link":  # that one takes the run's pack directory, first's too
        assert found[("r", first)] == "verified"  # alice's own files go on being replicated
    assert found[("r", second)] != "verified"  # the one that names the link does not
    uploaded = b"".join(p.read_bytes() for p in offsite.rglob("*") if p.is_file())
    assert SECRET not in uploaded
    assert runtime.skipped.count >= 1
    assert any("unsafe_file_skipped" in r.getMessage() and pack.name in r.getMessage()
               for r in caplog.records)


@as_root
def test_a_configured_root_reads_any_accounts_files_but_never_through_a_link(
        tmp_path: Path, owner: pwd.struct_passwd, secret: Path) -> None:
    root = tmp_path / "pfs"
    (root / "packs").mkdir(parents=True)
    (root / "packs" / "bobs").write_bytes(b"bob")
    (root / "packs" / "link").symlink_to(secret)
    _give(root, owner)
    os.chown(root / "packs" / "bobs", 65534, 65534)
    store = OwnedDirStore(root, None, SkippedFiles())
    assert store.list("packs/") == ["packs/bobs"] and store.get("packs/bobs") == b"bob"
    with pytest.raises(UnsafeObjectName):
        store.get("packs/link")
    with pytest.raises(StoreUnavailable, match="not a directory"):
        OwnedDirStore(tmp_path / "unmounted", None, SkippedFiles()).list("manifests/")
