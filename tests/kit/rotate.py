"""A master key rotated all the way, as the rotation and verified-as-written tests do it;
its key file (the fixture `key_file`, imported as `key_file_fixture`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_geo.ckpt.ops.rotate import (
    Outcome,
    RotationReport,
    rotate_master_key,
)
from tests.kit.fence import KEY


def key_file_of(tmp_path: Path, key: bytes = KEY) -> Path:
    path = tmp_path / "master.key"
    path.write_bytes(key)
    path.chmod(0o600)
    return path


def rotate_fully(stores, key_file: Path) -> RotationReport:
    """Both runs, as an operator makes them with the copy to the control site between."""
    assert rotate_master_key(stores, key_file).outcome is Outcome.RING_WRITTEN
    return rotate_master_key(stores, key_file)


@pytest.fixture(name="key_file")
def key_file_fixture(tmp_path) -> Path:
    return key_file_of(tmp_path)
