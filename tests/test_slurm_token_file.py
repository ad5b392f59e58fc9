"""The JWT of a REST cluster is a password: its token file is refused when group or others
have any permission bit, in one line naming the file and `chmod 600`, as the master key
file is (docs/install.md)."""

from __future__ import annotations

import pytest

from slurm_geo.slurm.errors import SlurmRejected
from slurm_geo.slurm.rest_backend import RestLogin, read_token


def token_file(tmp_path, mode: int, content: bytes = b"eyJhbGciOi.x.y\n"):
    path = tmp_path / "rented.jwt"
    path.write_bytes(content)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_private_token_file_is_read_fresh_each_time(tmp_path, mode):
    path = token_file(tmp_path, mode)
    login = RestLogin("slurm", path)
    assert read_token("rented", login) == "eyJhbGciOi.x.y"
    path.chmod(0o600)
    path.write_bytes(b"rotated\n")
    assert read_token("rented", login) == "rotated"


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o666, 0o610, 0o601])
def test_a_token_file_others_may_touch_is_refused_in_one_line(tmp_path, mode):
    path = token_file(tmp_path, mode)
    with pytest.raises(SlurmRejected) as info:
        read_token("rented", RestLogin("slurm", path))
    message = str(info.value)
    assert "\n" not in message
    assert f"token problem with {path}" in message
    assert f"mode {mode:04o} lets others in" in message
    assert f"chmod 600 {path}" in message
    assert info.value.exit_code == 13


def test_a_missing_or_binary_token_file_is_one_line_too(tmp_path):
    with pytest.raises(SlurmRejected, match="cannot read it .*No such file"):
        read_token("rented", RestLogin("slurm", tmp_path / "absent.jwt"))
    with pytest.raises(SlurmRejected, match="does not hold a JWT"):
        read_token("rented", RestLogin("slurm", token_file(tmp_path, 0o600, b"\xff\xfe")))
