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


def test_a_link_in_the_temporary_files_place_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    path = tmp_path / "file"
    (tmp_path / f".file.{os.getpid()}.tmp").symlink_to(victim)
    with pytest.raises(OSError):
        write_atomic(path, b"new")
    assert victim.read_text() == "keep" and not path.exists()


@pytest.mark.parametrize("before, written", [(None, True), (b"same", False), (b"other", True)])
def test_a_file_is_written_only_when_it_changes(tmp_path, before, written):
    path = tmp_path / "sub" / "file"
    if before is not None:
        path.parent.mkdir()
        path.write_bytes(before)
        path.chmod(0o600)
    assert write_if_changed(path, b"same", 0o640) is written
    assert path.read_bytes() == b"same" and stat.S_IMODE(path.stat().st_mode) == 0o640
