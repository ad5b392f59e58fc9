"""The S3 credentials a job the daemon submits gets for the store it writes to.

With `job_keys = "per-run"` the daemon mints, at each submission, a key of the job's run
alone through the IAM API at the store's endpoint, with its own key (`IamRunKeys`): the
key may read the store but write only its run's manifests, latest pointer, packs and
push locks (`run_policy`), and minting it revokes the keys the run's earlier incarnations
got. Else a store may name an env file of credentials scoped to its bucket
(`job_credentials`), which every run's jobs share. The job never gets the daemon's own,
which may reach every bucket the site uses, unless neither is configured, as a site with a
single trusted bucket may choose. A job that writes to a directory store gets no S3
credentials at all; one whose store names a `ca_file` gets its path in AWS_CA_BUNDLE.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from slurm_geo.ckpt.format.names import check_run_id, run_packs_prefix
from slurm_geo.config.model import StoreConfig
from slurm_geo.errors import ConfigError
from slurm_geo.lease.protocol import ENV_CA_BUNDLE, ENV_STORE_CA

SECRET_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
REQUIRED_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
REGION_NAME = "AWS_DEFAULT_REGION"
CA_BUNDLE_NAME = ENV_CA_BUNDLE  # boto3 verifies https endpoints against this file
STORE_CA_NAME = ENV_STORE_CA
PER_RUN = "per-run"  # [stores.NAME] job_keys
RUN_POLICY_NAME = "slurm-geo-run"
LOCKS = "locks/"  # slurm_geo.ckpt.format.names.lock_name


def parse_credentials(text: str, where: str) -> dict[str, str]:
    """KEY=VALUE lines as in a systemd EnvironmentFile: blank lines and # comments are
    skipped, one pair of surrounding quotes is dropped; only S3 credential names."""
    found: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, equals, value = line.partition("=")
        name, value = name.strip(), value.strip()
        if not equals or not name:
            raise ConfigError(f"{where}, line {number}: expected NAME=VALUE")
        if name not in SECRET_NAMES:
            raise ConfigError(f"{where}, line {number}: {name} is not one of "
                              f"{', '.join(SECRET_NAMES)}")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        found[name] = value
    missing = [name for name in REQUIRED_NAMES if not found.get(name)]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}")
    return found


def read_job_credentials(path: Path) -> dict[str, str]:
    try:
        with open(path) as handle:
            mode = os.fstat(handle.fileno()).st_mode
            text = handle.read()
    except OSError as exc:
        raise ConfigError(f"job_credentials {path}: cannot read it ({exc.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"job_credentials {path}: mode {stat.S_IMODE(mode):04o} lets "
                          "others in; chmod 600 it")
    return parse_credentials(text, f"job_credentials {path}")


class RunKeys(Protocol):
    """Mints the S3 key of one run for a store: env-file names to values."""

    def mint(self, store: StoreConfig, run: str) -> dict[str, str]: ...


def job_environment(store: StoreConfig, daemon_env: Mapping[str, str], run: str = "",
                    run_keys: RunKeys | None = None) -> dict[str, str]:
    """What a job of `run` writing to `store` gets in its environment for it. The
    job_credentials file is read, or the run's key minted, at each submission, so rotated
    credentials need no daemon restart."""
    if not store.url.startswith("s3://"):
        return {}  # a directory store needs no key
    env = {REGION_NAME: daemon_env[REGION_NAME]} if REGION_NAME in daemon_env else {}
    if store.ca_file is not None:
        env[CA_BUNDLE_NAME] = str(store.ca_file)
        # and the bundle itself, for a cluster without home's files (lease.client.
        # store_ca_here): a CA certificate is no secret
        try:
            env[STORE_CA_NAME] = store.ca_file.read_text()
        except (OSError, UnicodeDecodeError):
            pass  # the path alone, as before: the job reports a bundle it cannot read
    if store.job_keys == PER_RUN:
        if not run:
            # A job that never trained has named no run yet: its key is minted when its
            # first lease names one, and travels in the key reply (leaseservice).
            return env
        return {**env, **(run_keys or IamRunKeys(daemon_env)).mint(store, run)}
    if store.job_credentials is not None:
        return {**env, **read_job_credentials(store.job_credentials)}
    return {**env, **{name: daemon_env[name] for name in SECRET_NAMES if name in daemon_env}}


def bucket_and_prefix(url: str) -> tuple[str, str]:
    """`s3://bucket/prefix` -> (bucket, prefix without slashes at its ends)."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return bucket, prefix.strip("/")


def run_policy(bucket: str, store_prefix: str, run: str) -> dict[str, Any]:
    """What a run's own key may do in the store `s3://bucket/store_prefix`: read and list
    it; put the run's manifests, latest pointer and packs (`run-packs/<run>/`, where
    format 4 and 5 place them), push locks, and what a moved incarnation ships home
    (`outputs/<run>/`, docs/format.md §11.9); delete push locks. Not another run's
    manifests, pointer, packs, key, promotion or fence; not the packs every run shared
    before format 4; nothing but a push lock deleted; no bucket settings; no other
    bucket."""
    check_run_id(run)
    base = f"arn:aws:s3:::{bucket}"
    prefix = store_prefix.strip("/")
    under = f"{base}/{prefix}/" if prefix else f"{base}/"
    return {"Version": "2012-10-17", "Statement": [
        {"Sid": "ReadTheStore", "Effect": "Allow",
         "Action": ["s3:GetObject", "s3:ListBucket"],
         "Resource": [base, f"{under}*"]},
        {"Sid": "WriteTheRunsObjects", "Effect": "Allow",
         "Action": ["s3:PutObject", "s3:AbortMultipartUpload"],
         "Resource": [f"{under}manifests/{run}/*", f"{under}latest/{run}",
                      f"{under}{run_packs_prefix(run)}*", f"{under}{LOCKS}*",
                      f"{under}outputs/{run}/*"]},
        {"Sid": "DeleteOnlyPushLocks", "Effect": "Allow", "Action": ["s3:DeleteObject"],
         "Resource": [f"{under}{LOCKS}*"]},
    ]}


def run_user_name(store: StoreConfig, run: str) -> str:
    """The IAM user holding `run`'s key to `store`: at most 64 characters of IAM's set,
    the run's name readable in it, a digest keeping runs and stores apart."""
    digest = hashlib.sha256(f"{store.url}\0{check_run_id(run)}".encode()).hexdigest()[:16]
    return f"sg-{run[:40]}-{digest}"


class IamRunKeys:
    """Mints a run's key through the IAM API at the store's endpoint (SeaweedFS serves it
    on its S3 port; AWS at iam.amazonaws.com), with the daemon's own S3 key: the run's
    user, its policy, and a fresh key in place of any it had."""

    def __init__(self, daemon_env: Mapping[str, str]):
        self._env = daemon_env

    def mint(self, store: StoreConfig, run: str) -> dict[str, str]:
        from botocore.exceptions import BotoCoreError, ClientError

        user = run_user_name(store, run)
        try:
            iam = self._client(store)
            _ensure_user(iam, user)
            for old in iam.list_access_keys(UserName=user).get("AccessKeyMetadata", []):
                iam.delete_access_key(UserName=user, AccessKeyId=old["AccessKeyId"])
            iam.put_user_policy(UserName=user, PolicyName=RUN_POLICY_NAME, PolicyDocument=
                                json.dumps(run_policy(*bucket_and_prefix(store.url), run)))
            key = iam.create_access_key(UserName=user)["AccessKey"]
        except (BotoCoreError, ClientError) as exc:
            raise ConfigError(
                f"store '{store.name}': cannot mint run {run}'s key through the IAM API at "
                f"{store.endpoint_url or 'AWS'} ({exc}); give the daemons' key IAM rights "
                "(SeaweedFS: weed s3 -s3.iam.readOnly=false), or use job_credentials") from None
        return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"],
                "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}

    def _client(self, store: StoreConfig) -> Any:
        import boto3

        return boto3.session.Session().client(
            "iam", endpoint_url=store.endpoint_url or None,
            region_name=self._env.get(REGION_NAME) or "us-east-1",
            aws_access_key_id=self._env.get("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key=self._env.get("AWS_SECRET_ACCESS_KEY"),
            aws_session_token=self._env.get("AWS_SESSION_TOKEN"),
            verify=str(store.ca_file) if store.ca_file is not None else None)


def _ensure_user(iam: Any, user: str) -> None:
    from botocore.exceptions import ClientError

    try:
        iam.create_user(UserName=user)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") != "EntityAlreadyExists":
            raise
