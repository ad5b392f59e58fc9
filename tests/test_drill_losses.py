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


def test_a_daemon_alone_leads_by_a_name_the_drill_can_wait_for(tmp_path):
    """The default sandbox runs one federation daemon, no replicas: the drill's first wait
    ("a federation replica to lead") must see a leader, not "" (issue 29: `make drill`
    timed out there on every fresh machine)."""
    from slurm_geo.config import parse_config
    from slurm_geo.drills.losses import ALONE, FederationView
    from slurm_geo.federation.state.audit import AuditLog

    AuditLog(tmp_path / "audit.db").close()
    site = parse_config({
        "site": {"home_cluster": "onprem"},
        "clusters": {"onprem": {"region": "home", "provider": "onprem", "access": "cli",
                                "slurm_conf": str(tmp_path / "slurm.conf"), "store": "pfs"}},
        "stores": {"pfs": {"url": f"file://{tmp_path}/pfs", "region": "home"}},
        "federation": {"state": str(tmp_path / "federation.db"),
                       "audit_path": str(tmp_path / "audit.db")}})
    assert FederationView(site).leader() == ALONE
