"""The master key sealed at rest (slurm_geo/share/systemd/sealed-master-key.conf): a key
file sealed by systemd-creds holds no form of the key, opens only under the host's secret
it was sealed with, and once opened as systemd opens a credential, the daemons read it as
their key file. Run with a host secret of the test's own (SYSTEMD_CREDENTIAL_SECRET), not the
machine's."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from systemd_units import installed_here, settings

from slurm_geo.ckpt.format.keys import create_master_key_file, load_master_key
from slurm_geo.config.paths import KEY_FILE_ENV, master_key_path
from slurm_geo.drills.losses import secrets_found
from slurm_geo.site import UNITS

ROOT = Path(__file__).resolve().parent.parent
DROP_IN = UNITS / "sealed-master-key.conf"

pytestmark = pytest.mark.skipif(shutil.which("systemd-creds") is None,
                                reason="needs systemd-creds (Debian's systemd)")


def creds(secret: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-creds", *args], capture_output=True, text=True,
                          timeout=30, env={**os.environ, "SYSTEMD_CREDENTIAL_SECRET": str(secret)})


def test_the_drop_in_opens_the_sealed_file_into_the_key_file_the_daemons_read():
    given = settings(DROP_IN)
    assert given["LoadCredentialEncrypted"] == ["master.key:/etc/slurm-geo/master.key.cred"]
    assert given["Environment"] == [f"{KEY_FILE_ENV}=%d/master.key"]
    # %d is the service's credentials directory; with no key_file set, that is the key.
    opened = Path("/run/credentials/slurm-geo-federation.service/master.key")
    assert master_key_path(None, {KEY_FILE_ENV: str(opened)}) == opened


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.parametrize("unit", ["slurm-geo-federation.service",
                                  "slurm-geo-checkpoint-sync.service"])
def test_systemd_analyze_verify_accepts_each_daemon_with_the_drop_in(unit, tmp_path):
    installed = installed_here(UNITS / unit, tmp_path)
    drop_ins = tmp_path / f"{unit}.d"
    drop_ins.mkdir()
    shutil.copy(DROP_IN, drop_ins)
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(installed)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stderr.strip() == "", result.stderr


@pytest.mark.root(reason="opens the credential into a directory of mode 0500, as systemd "
                         "(root) does for a service")
def test_a_sealed_key_file_holds_no_form_of_the_key_and_opens_only_under_its_secret(
        tmp_path):
    plain, sealed = tmp_path / "master.key", tmp_path / "master.key.cred"
    create_master_key_file(plain)
    key = load_master_key(plain).current
    secret = tmp_path / "credential.secret"
    made = creds(secret, "encrypt", "--name=master.key", "--with-key=host", str(plain),
                 str(sealed))
    assert made.returncode == 0, made.stderr
    (tmp_path / "only-sealed").mkdir()
    shutil.copy(sealed, tmp_path / "only-sealed")
    assert secrets_found([tmp_path / "only-sealed"], {"the master key": key}) == []

    # Opened as systemd opens a credential: a directory only the service enters, the
    # file read-only to it.
    credentials = tmp_path / "credentials"
    credentials.mkdir(mode=0o500)
    opened = credentials / "master.key"
    assert creds(secret, "decrypt", "--name=master.key", str(sealed), str(opened)
                 ).returncode == 0
    opened.chmod(0o400)
    assert load_master_key(opened).current == key

    other = creds(tmp_path / "another.secret", "decrypt", "--name=master.key", str(sealed),
                  str(tmp_path / "nothing"))
    assert other.returncode != 0 and not (tmp_path / "nothing").exists()
