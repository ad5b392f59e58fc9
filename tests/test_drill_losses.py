"""The drill's scan of the rented provider's disks for secrets (drills.losses): pure but
for reading the files it is given."""

from __future__ import annotations

import base64
import os

import pytest

from slurm_geo.drills.losses import secrets_found

KEY = bytes(range(32))


@pytest.mark.parametrize("form", [
    KEY, KEY.hex().encode(), base64.b64encode(KEY), base64.urlsafe_b64encode(KEY),
    base64.b64encode(KEY).rstrip(b"=")], ids=["raw", "hex", "base64", "urlsafe", "unpadded"])
def test_a_secret_in_any_form_is_found_naming_the_file(tmp_path, form):
    (tmp_path / "deep" / "er").mkdir(parents=True)
    (tmp_path / "deep" / "er" / "volume.dat").write_bytes(os.urandom(3000) + form)
    (tmp_path / "clean.dat").write_bytes(os.urandom(3000))
    assert secrets_found([tmp_path], {"the master key": KEY}) == [
        f"the master key in {tmp_path / 'deep' / 'er' / 'volume.dat'}"]


def test_a_secret_across_two_reads_is_found(tmp_path):
    (tmp_path / "wal").write_bytes(os.urandom(1000 - 10) + KEY + os.urandom(50))
    assert secrets_found([tmp_path], {"k": KEY}, chunk=1000) == [f"k in {tmp_path / 'wal'}"]


def test_a_part_of_a_secret_is_no_finding(tmp_path):
    (tmp_path / "f").write_bytes(KEY[:31] + os.urandom(100) + KEY.hex()[:60].encode())
    assert secrets_found([tmp_path], {"k": KEY}) == []
