"""Opening a store from its URL: the one place where stores and their wrappers are put
together, so callers never build a client or a retry policy themselves."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slurm_geo.ckpt.errors import UnsafeObjectName
from slurm_geo.ckpt.format.names import check_object_name
from slurm_geo.ckpt.stores.breaker import BreakerStore
from slurm_geo.ckpt.stores.pacing import Guard, Moved, PacedStore, TokenBucket, Unguarded
from slurm_geo.ckpt.stores.retry import RetryingStore
from slurm_geo.ckpt.stores.store import LocalDirStore, Store
from slurm_geo.ckpt.stores.transfer_plan import DEFAULT_PLAN, TransferPlan
from slurm_geo.errors import ConfigError

ACCEPTED_FORMS = "file:///absolute/path or s3://bucket[/prefix]"


@dataclass(frozen=True)
class Patience:
    """How long a caller waits out a failing store: attempts of each S3 operation
    (RetryingStore), the S3 client's timeouts, and for how long after a failure every call
    fails at once instead (BreakerStore; 0: never)."""

    attempts: int = 5
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    skip_after_failure_s: float = 0.0


PATIENT = Patience()  # jobs, checkpoint-sync, commands: their put is worth the wait
# The federation daemon decides each round and tries again the next: a store behind a cut
# link must cost it a few seconds once (2 attempts x 2 s), then nothing for three rounds,
# not five 5 s connect timeouts a call. The read timeout bounds a request sent on a kept
# connection into a cut link; 5 s of silence is still far more than an S3 server takes to
# answer a request it has all of (a send blocks only until the socket has room).
DECIDING = Patience(attempts=2, connect_timeout_s=2.0, read_timeout_s=5.0,
                    skip_after_failure_s=3.0)

# S3's rules for bucket names (lowercase, 3-63 characters), minus the rarer exceptions.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def open_store(url: str, endpoint_url: str | None = None, region_name: str | None = None,
               *, plan: TransferPlan = DEFAULT_PLAN, patience: Patience = PATIENT,
               access_key_id: str | None = None, secret_access_key: str | None = None,
               ca_file: Path | None = None) -> Store:
    """The store `url` names, ready to use.

    `file:///path` is a `LocalDirStore` on that directory (the path is taken literally, not
    percent-decoded). `s3://bucket/prefix` is an `S3Store` wrapped in a `RetryingStore`;
    `endpoint_url` and `region_name` (an AWS region, not a slurm-geo region), when empty,
    come from boto3's resolution: AWS_ENDPOINT_URL, AWS_DEFAULT_REGION, and so on, as do
    the credentials unless `access_key_id` and `secret_access_key` are given (a process
    that holds keys for several stores passes them here, never through its environment);
    `plan` (slurm_geo.ckpt.stores.transfer_plan) sizes its multipart uploads to the link, and
    `patience` says how long a failing one is waited for; an https endpoint is verified
    against `ca_file` when given (a store's [stores.NAME] ca_file), else against
    AWS_CA_BUNDLE or certifi's CAs. A URL of any other form raises
    `ConfigError` naming it.
    """
    scheme, separator, rest = url.partition("://")
    store: Store
    if scheme == "file" and separator:
        if not rest.startswith("/"):
            raise _bad_url(url, "names no absolute path (a file URL has three slashes)")
        store = LocalDirStore(Path(rest))
    elif scheme == "s3" and separator:
        bucket, prefix = _parse_s3(url, rest)
        store = _open_s3(url, bucket, prefix, endpoint_url or None, region_name or None, plan,
                         patience, access_key_id, secret_access_key, ca_file)
    else:
        raise _bad_url(url, "has an unknown scheme")
    if patience.skip_after_failure_s:
        return BreakerStore(store, url, patience.skip_after_failure_s)
    return store


def open_store_or_named(spec: str, config_path: Path | None = None) -> Store:
    """The store `spec` names: a URL, or the name of a store in the site config (`config_path`,
    else the default one)."""
    if "://" in spec:
        return open_store(spec)
    from slurm_geo.config import load_config

    site = load_config(config_path)
    if spec not in site.stores:
        known = ", ".join(sorted(site.stores)) or "none"
        raise ConfigError(f"store '{spec}' is neither a URL (file:///PATH, "
                          f"s3://BUCKET/PREFIX) nor in {site.source} (stores: {known})")
    config = site.stores[spec]
    return open_store(config.url, endpoint_url=config.endpoint_url or None,
                      ca_file=config.ca_file)


def paced(store: Store, side: str, bucket: TokenBucket | None = None, *,
          guard: Guard | None = None, on_put: Moved | None = None,
          clock: Callable[[], float] = time.time) -> PacedStore:
    """`store` behind the bandwidth cap `bucket` (shared by every store of the process
    that sends through it) and `guard`'s stop check before each object."""
    return PacedStore(store, guard or Unguarded(), side, bucket, on_put=on_put, clock=clock)


def _open_s3(url: str, bucket: str, prefix: str, endpoint_url: str | None,
             region_name: str | None, plan: TransferPlan, patience: Patience,
             access_key_id: str | None, secret_access_key: str | None,
             ca_file: Path | None) -> Store:
    # Imported here: botocore adds ~0.15 s (boto3 ~0.3 s) to the start of every command.
    try:
        from slurm_geo.ckpt.stores.s3store import S3Store, make_s3_client

        client = make_s3_client(endpoint_url, region_name, access_key_id=access_key_id,
                                secret_access_key=secret_access_key,
                                connect_timeout_s=patience.connect_timeout_s,
                                read_timeout_s=patience.read_timeout_s, ca_file=ca_file)
    except ImportError as exc:
        raise ConfigError(f"store URL {url!r} needs boto3 ({exc}); install it with: "
                          "pip install boto3") from None
    except ValueError as exc:  # botocore's word for a malformed endpoint URL or region
        raise ConfigError(f"store URL {url!r}: {exc}; check the endpoint URL "
                          f"({endpoint_url!r}) and the AWS region ({region_name!r})") from None
    return RetryingStore(S3Store(bucket, prefix, client, plan=plan),
                         attempts=patience.attempts)


def _parse_s3(url: str, rest: str) -> tuple[str, str]:
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise _bad_url(url, f"names no valid bucket ({bucket!r}: 3-63 lowercase letters, "
                            "digits, '.' or '-')")
    prefix = prefix.strip("/")
    try:
        if prefix:
            check_object_name(prefix)
    except UnsafeObjectName as exc:
        raise _bad_url(url, f"has an unusable prefix ({exc})") from None
    return bucket, prefix


def _bad_url(url: str, reason: str) -> ConfigError:
    return ConfigError(f"store URL {url!r} {reason}; use {ACCEPTED_FORMS}")
