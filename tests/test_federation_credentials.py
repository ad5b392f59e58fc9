"""What a job the federation daemon submits gets to reach its store: the store's own
scoped credentials when it names a file, never the daemon's then; one clear message for a
bad file, at the daemon's start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_geo.ckpt.format.keys import create_master_key_file
from slurm_geo.config.model import StoreConfig
from slurm_geo.errors import ConfigError
from slurm_geo.federation.act.credentials import (
    job_environment,
    parse_credentials,
    read_job_credentials,
)
from tests.kit.site import store, write_site

DAEMON_ENV = {"AWS_ACCESS_KEY_ID": "daemon", "AWS_SECRET_ACCESS_KEY": "daemon-secret",
              "AWS_DEFAULT_REGION": "eu-west-1", "HOME": "/root"}
SCOPED = "AWS_ACCESS_KEY_ID=job\nAWS_SECRET_ACCESS_KEY=job-secret\n"


@pytest.mark.parametrize("text, expected", [
    (SCOPED, {"AWS_ACCESS_KEY_ID": "job", "AWS_SECRET_ACCESS_KEY": "job-secret"}),
    ("# scoped to s3://ckpt\n\nAWS_ACCESS_KEY_ID = \"job\"\nAWS_SECRET_ACCESS_KEY='s=1'\n"
     "AWS_SESSION_TOKEN=tok\n",
     {"AWS_ACCESS_KEY_ID": "job", "AWS_SECRET_ACCESS_KEY": "s=1", "AWS_SESSION_TOKEN": "tok"}),
])
def test_env_file_lines_become_credentials(text, expected):
    assert parse_credentials(text, "f") == expected


@pytest.mark.parametrize("text, message", [
    ("AWS_ACCESS_KEY_ID=job\n", "f: missing AWS_SECRET_ACCESS_KEY"),
    ("AWS_ACCESS_KEY_ID=\nAWS_SECRET_ACCESS_KEY=x\n", "f: missing AWS_ACCESS_KEY_ID"),
    (SCOPED + "export X\n", "f, line 3: expected NAME=VALUE"),
    (SCOPED + "PATH=/tmp\n", "f, line 3: PATH is not one of AWS_ACCESS_KEY_ID"),
    ("", "f: missing AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY"),
])
def test_each_bad_line_is_named(text, message):
    with pytest.raises(ConfigError) as caught:
        parse_credentials(text, "f")
    assert message in str(caught.value)


def credentials_file(tmp_path: Path, text: str = SCOPED, mode: int = 0o600) -> Path:
    path = tmp_path / "offsite-job.env"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_store_with_a_credentials_file_gives_jobs_those_not_the_daemons(tmp_path):
    store = StoreConfig("offsite", "s3://ckpt/p", "eu", job_credentials=credentials_file(tmp_path))

    env = job_environment(store, DAEMON_ENV)

    assert env == {"AWS_ACCESS_KEY_ID": "job", "AWS_SECRET_ACCESS_KEY": "job-secret",
                   "AWS_DEFAULT_REGION": "eu-west-1"}


def test_rotated_credentials_reach_the_next_job_without_a_restart(tmp_path):
    path = credentials_file(tmp_path)
    store = StoreConfig("offsite", "s3://ckpt/p", "eu", job_credentials=path)
    job_environment(store, DAEMON_ENV)
    path.write_text("AWS_ACCESS_KEY_ID=rotated\nAWS_SECRET_ACCESS_KEY=new\n")

    assert job_environment(store, DAEMON_ENV)["AWS_ACCESS_KEY_ID"] == "rotated"


def test_without_a_file_jobs_get_the_daemons_own(tmp_path):
    env = job_environment(StoreConfig("offsite", "s3://ckpt/p", "eu"), DAEMON_ENV)

    assert env == {k: v for k, v in DAEMON_ENV.items() if k.startswith("AWS_")}


def test_a_job_writing_to_a_directory_gets_no_s3_key():
    assert job_environment(StoreConfig("pfs", "file:///pfs/ckpt", "home"), DAEMON_ENV) == {}


def test_a_file_others_can_read_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="mode 0644 lets others in; chmod 600 it"):
        read_job_credentials(credentials_file(tmp_path, mode=0o644))


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=f"job_credentials {tmp_path}/nope.env: cannot read"):
        read_job_credentials(tmp_path / "nope.env")




def test_the_daemon_does_not_start_on_a_bad_credentials_file(tmp_path):
    creds = credentials_file(tmp_path, text="AWS_ACCESS_KEY_ID=job\n")
    create_master_key_file(tmp_path / "master.key")
    config = write_site(tmp_path, stores={
        "pfs": store(tmp_path / "pfs"),
        "offsite": {"url": "s3://ckpt/p", "region": "eu", "endpoint_url": "http://127.0.0.1:9",
                    "job_credentials": str(creds)}},
        federation={"state": f"{tmp_path}/fed.db", "audit_path": f"{tmp_path}/audit.db",
                    "key_file": f"{tmp_path}/master.key"})

    result = subprocess.run([sys.executable, "-m", "slurm_geo.federation.daemon.entry", "--config",
                             str(config)], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "NOTIFY_SOCKET": ""})

    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        f"slurm-geo-federation: error: job_credentials {creds}: missing "
        "AWS_SECRET_ACCESS_KEY"]
