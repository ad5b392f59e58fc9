"""slurm_geo.atomic: the one write-temp-fsync-rename of the package."""

from __future__ import annotations

import os
import stat

import pytest

from slurm_geo.atomic import write_atomic, write_if_changed


@pytest.mark.parametrize("content, mode, umask, expected_mode", [
    ("text\n", None, 0o022, 0o644),
    (b"bytes", None, 0o077, 0o600),
    (b"bytes", 0o600, 0o022, 0o600),
    ("script", 0o755, 0o077, 0o755),
])
def test_a_file_is_replaced_whole_with_its_mode(tmp_path, content, mode, umask,
                                                expected_mode):
    path = tmp_path / "file"
    path.write_text("old")
    old_umask = os.umask(umask)
    try:
        write_atomic(path, content, mode)
    finally:
        os.umask(old_umask)
    data = content.encode() if isinstance(content, str) else content
    assert path.read_bytes() == data
    assert stat.S_IMODE(path.stat().st_mode) == expected_mode
    assert os.listdir(tmp_path) == ["file"]  # no temporary file left


def test_what_another_user_plants_beside_the_file_is_neither_followed_nor_in_the_way(
        tmp_path):
    """The temporary name is random: a link, a FIFO or a hard link planted at a name it
    could have had (the old one was `.NAME.PID.tmp`) is left alone, and the write happens."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    path = tmp_path / "file"
    (tmp_path / f".file.{os.getpid()}.tmp").symlink_to(victim)
    os.mkfifo(tmp_path / ".file.fifo.tmp")
    os.link(victim, tmp_path / ".file.hard.tmp")
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new" and victim.read_text() == "keep"
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["file", "victim", f".file.{os.getpid()}.tmp", ".file.fifo.tmp", ".file.hard.tmp"])


def test_a_name_taken_by_anything_is_never_opened(tmp_path, monkeypatch):
    """Should the random name be there already (O_EXCL), the write fails, nothing through it."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    monkeypatch.setattr("slurm_geo.atomic.secrets.token_hex", lambda n: "guessed")
    (tmp_path / ".file.guessed.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        write_atomic(tmp_path / "file", b"new")
    assert victim.read_text() == "keep" and not (tmp_path / "file").exists()


def test_the_owner_is_given_before_the_file_has_its_name(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr("slurm_geo.atomic.os.fchown", lambda fd, uid, gid: calls.append(
        (uid, gid, sorted(os.listdir(tmp_path)))))
    write_atomic(tmp_path / "file", b"x", 0o600, owner=(1234, 1234))
    assert len(calls) == 1 and calls[0][:2] == (1234, 1234) and "file" not in calls[0][2]


@pytest.mark.parametrize("before, written", [(None, True), (b"same", False), (b"other", True)])
def test_a_file_is_written_only_when_it_changes(tmp_path, before, written):
    path = tmp_path / "sub" / "file"
    if before is not None:
        path.parent.mkdir()
        path.write_bytes(before)
        path.chmod(0o600)
    assert write_if_changed(path, b"same", 0o640) is written
    assert path.read_bytes() == b"same" and stat.S_IMODE(path.stat().st_mode) == 0o640
