"""Checkpoint objects in an S3 bucket (or an S3-compatible store) under a key prefix.

Every object is one key, `<prefix>/<name>`. Small objects (packs among them) go up in one
PUT, which S3 makes visible all at once; large ones by multipart upload, its parts sent a
few at once (the store's TransferPlan), which also appears all at once on completion, and
which a later put() of the same object resumes after a crash (docs/stores.md). The client
is passed in and never retries by itself: retrying is `RetryingStore`'s job, so that one
policy covers every store. boto3 clients are thread-safe, so the parts share it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    FlexibleChecksumError,
    HTTPClientError,
    IncompleteReadError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from slurm_geo.ckpt.errors import CkptError, ObjectMissing, StoreUnavailable
from slurm_geo.ckpt.format.names import check_object_name
from slurm_geo.ckpt.stores.parallel import run_all
from slurm_geo.ckpt.stores.store import Bytes
from slurm_geo.ckpt.stores.sums import composite_b64, sha256_b64
from slurm_geo.ckpt.stores.transfer_plan import DEFAULT_PLAN, MAX_STREAMS, TransferPlan

# (size, MD5 hex or ETag, base64 SHA-256) of one part of a multipart upload
_Part = tuple[int, str, str | None]

_MISSING_CODES = {"NoSuchKey", "NotFound", "404"}
# Worth another try: throttling, server trouble, a corrupted transfer, an upload that a
# concurrent put() aborted (the next attempt starts a new one).
_TRANSIENT_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
    "RequestTimeout", "InternalError", "ServiceUnavailable", "BadDigest", "NoSuchUpload",
    "InvalidPart",
}
_CREDENTIALS_FIX = ("check the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                    "AWS_PROFILE) and that the bucket policy grants this identity access")
_PERMANENT_FIXES = {
    "NoSuchBucket": "the bucket does not exist: create it, or fix the bucket in the store URL",
    "AccessDenied": _CREDENTIALS_FIX,
    "403": _CREDENTIALS_FIX,
    "InvalidAccessKeyId": _CREDENTIALS_FIX + "; check AWS_ENDPOINT_URL names the right service",
    "SignatureDoesNotMatch": _CREDENTIALS_FIX,
    "ExpiredToken": "the session token has expired: refresh the credentials",
    "RequestTimeTooSkewed": "this host's clock is wrong: synchronise it (NTP)",
    "PermanentRedirect": "the bucket is in another region: set AWS_DEFAULT_REGION to it",
    "AuthorizationHeaderMalformed": "the bucket is in another region: set AWS_DEFAULT_REGION",
}


class S3Unavailable(StoreUnavailable):
    """The bucket could not serve a request. `permanent` failures (bad credentials, no such
    bucket) need an admin, so `RetryingStore` gives up on them at once."""

    def __init__(self, name: str, bucket: str, detail: str, fix: str, permanent: bool):
        self.bucket = bucket
        self.detail = detail
        self.permanent = permanent
        self.side = None
        # Skips StoreUnavailable's message, whose advice (a path, a mount) is for directories.
        CkptError.__init__(self, name, f"S3 bucket '{bucket}' cannot access '{name}' "
                                       f"({detail}); {fix}")


def make_s3_client(endpoint_url: str | None = None, region_name: str | None = None, *,
                   access_key_id: str | None = None, secret_access_key: str | None = None,
                   connect_timeout_s: float = 5.0, read_timeout_s: float = 60.0,
                   max_connections: int = 2 * MAX_STREAMS,
                   ca_file: str | os.PathLike[str] | None = None) -> Any:
    """A boto3 S3 client that fails fast and lets `RetryingStore` retry.

    Arguments left None come from boto3's own resolution: AWS_ENDPOINT_URL(_S3),
    AWS_DEFAULT_REGION/AWS_REGION, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE and
    ~/.aws, then instance roles. `max_connections` bounds the connections kept open for
    reuse: a copy's packs and a multipart upload's parts go up at once, each on its own.
    An https endpoint is verified against `ca_file` (PEM) when given, else against
    AWS_CA_BUNDLE or certifi's CAs.
    """
    import boto3  # only S3 users pay for importing it

    options: dict[str, Any] = {
        "connect_timeout": connect_timeout_s, "read_timeout": read_timeout_s,
        "retries": {"total_max_attempts": 1},  # one attempt: no retries under our own
        "max_pool_connections": max_connections,
    }
    # Since botocore 1.36 clients add CRC checksums that many S3-compatible stores reject;
    # we send SHA-256 ourselves (S3Store.put: the server refuses a body that does not match
    # and keeps it for `digest`; parts also carry Content-MD5, which resumption matches), and
    # the checkpoint format verifies all bytes read.
    for option in ("request_checksum_calculation", "response_checksum_validation"):
        if option in Config.OPTION_DEFAULTS:
            options[option] = "when_required"
    client = boto3.session.Session().client(
        "s3", endpoint_url=endpoint_url, region_name=region_name,
        aws_access_key_id=access_key_id, aws_secret_access_key=secret_access_key,
        config=Config(**options), verify=None if ca_file is None else os.fspath(ca_file),
    )
    client.meta.events.register_last("before-call.s3", _no_continue_for_empty_bodies)
    return client


def _no_continue_for_empty_bodies(params: dict[str, Any], **_kwargs: Any) -> None:
    """botocore makes every PUT wait for "100 Continue"; with an empty body SeaweedFS's
    answer leaves bytes on the connection that the next request on it reads as a timeout
    (what botocore's BOTO_EXPERIMENTAL__NO_EMPTY_CONTINUE does, for this client only)."""
    from botocore.utils import determine_content_length

    body = params.get("body")
    if "Expect" in params["headers"] and body is not None \
            and determine_content_length(body) == 0:
        del params["headers"]["Expect"]


class S3Store:
    """The Store interface over one bucket and key prefix; see docs/stores.md."""

    def __init__(self, bucket: str, prefix: str, client: Any, *,
                 plan: TransferPlan = DEFAULT_PLAN, list_page_size: int = 1000):
        prefix = prefix.strip("/")
        self.bucket = bucket
        self.prefix = check_object_name(prefix) + "/" if prefix else ""
        self.plan = plan
        self._client = client
        self._page_size = list_page_size
        # Parts in flight, whichever put they belong to: several copies' multipart puts at
        # once still send at most `streams` parts together.
        self._part_slots = threading.BoundedSemaphore(plan.streams)

    def __repr__(self) -> str:
        return f"S3Store({self.bucket!r}, {self.prefix!r})"

    def put(self, name: str, data: Bytes) -> None:
        key = self._key(name)
        view = memoryview(data).cast("B")
        with self._errors_for(name):
            # S3 has no zero-part uploads
            if len(view) < self.plan.multipart_threshold or not view:
                body = bytes(view)  # boto3 takes bytes or files, not memoryviews
                # The server refuses a body that does not match its SHA-256 (BadDigest)
                self._client.put_object(Bucket=self.bucket, Key=key, Body=body,
                                        ChecksumAlgorithm="SHA256",
                                        ChecksumSHA256=sha256_b64(body))
            else:
                self._put_multipart(key, view)

    def get(self, name: str) -> bytes:
        key = self._key(name)
        with self._errors_for(name):
            response = self._client.get_object(Bucket=self.bucket, Key=key)
            return response["Body"].read()  # a cut stream raises inside this block

    def list(self, prefix: str) -> list[str]:
        return sorted(self.sizes(prefix))

    def sizes(self, prefix: str) -> dict[str, int]:
        directory = prefix.rpartition("/")[0]
        if directory:
            check_object_name(directory)  # as LocalDirStore: no '..' or absolute prefixes
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix,
            PaginationConfig={"PageSize": self._page_size})
        found: dict[str, int] = {}
        with self._errors_for(prefix):
            for page in pages:
                found.update((o["Key"][len(self.prefix):], int(o["Size"]))
                             for o in page.get("Contents", ()))
        # Keys written by other tools may not be object names; get() would refuse them.
        return {n: size for n, size in sorted(found.items()) if _is_object_name(n)}

    def delete(self, name: str) -> None:
        key = self._key(name)
        with self._errors_for(name):
            self._client.delete_object(Bucket=self.bucket, Key=key)  # S3: missing is fine

    def exists(self, name: str) -> bool:
        key = self._key(name)
        try:
            with self._errors_for(name):
                self._client.head_object(Bucket=self.bucket, Key=key)
        except ObjectMissing:
            return False
        return True

    def digest(self, name: str) -> str | None:
        """The SHA-256 the bucket keeps of the object (x-amz-checksum-sha256, from one HEAD:
        the bytes stay where they are); None for an object put without one (by an older
        slurm-geo, or a store that keeps none)."""
        key = self._key(name)
        with self._errors_for(name):
            found = self._client.head_object(Bucket=self.bucket, Key=key,
                                             ChecksumMode="ENABLED")
        return found.get("ChecksumSHA256") or None

    def digest_of(self, data: Bytes) -> str:
        """What `digest` says of an object of `data` put by this store: the SHA-256 of a
        single put, the composite of a multipart one (its parts as `put` cuts them)."""
        view = memoryview(data).cast("B")
        if len(view) < self.plan.multipart_threshold or not view:
            return sha256_b64(view)
        size = self.plan.part_size_for(len(view))
        return composite_b64([view[start:start + size] for start in range(0, len(view), size)])

    def _key(self, name: str) -> str:
        return self.prefix + check_object_name(name)

    def _put_multipart(self, key: str, view: memoryview) -> None:
        """Upload the parts the store lacks, into an earlier unfinished upload if one fits,
        `plan.streams` at once; the first part that fails stops the rest and is raised."""
        size = self.plan.part_size_for(len(view))
        parts = {n: view[start:start + size]
                 for n, start in enumerate(range(0, len(view), size), start=1)}
        wanted: dict[int, _Part] = {
            n: (len(p), hashlib.md5(p, usedforsecurity=False).hexdigest(), sha256_b64(p))
            for n, p in parts.items()}
        upload_id, stored = self._resumable_upload(key, wanted)
        missing = [n for n in parts if n not in stored]
        sent = run_all(lambda n: self._upload_part(key, upload_id, n, parts[n], wanted[n][2]),
                       missing, self.plan.streams)
        etags = {**stored, **dict(zip(missing, sent, strict=True))}
        self._client.complete_multipart_upload(
            Bucket=self.bucket, Key=key, UploadId=upload_id,
            MultipartUpload={"Parts": [{"PartNumber": n, "ETag": etags[n],
                                        "ChecksumSHA256": wanted[n][2]} for n in parts]})

    def _upload_part(self, key: str, upload_id: str, number: int, part: memoryview,
                     sha256: str | None) -> str:
        with self._part_slots:
            body = bytes(part)  # boto3 takes bytes or files, not memoryviews
            return self._client.upload_part(
                Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number,
                Body=body, ContentMD5=_content_md5(body), ChecksumAlgorithm="SHA256",
                ChecksumSHA256=sha256 or sha256_b64(body))["ETag"]

    def _resumable_upload(self, key: str, wanted: dict[int, _Part]) -> tuple[str, dict[int, str]]:
        """The unfinished upload of `key` holding most of the `wanted` parts, and the ETags
        of those; or a new, empty upload if none holds any. Every other unfinished upload
        of `key` is a leftover of a crashed put() (one writer per run) and is aborted."""
        uploads = {u: self._stored_parts(key, u) for u in self._unfinished_uploads(key)}
        reusable = {u: {n: part[1] for n, part in stored.items()
                        if _same_part(part, wanted.get(n))}
                    for u, stored in uploads.items()}
        best = max(reusable, key=lambda u: len(reusable[u]), default=None)
        for upload_id in uploads:
            if upload_id != best or not reusable[upload_id]:
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=key,
                                                    UploadId=upload_id)
        if best is not None and reusable[best]:
            return best, reusable[best]
        created = self._client.create_multipart_upload(Bucket=self.bucket, Key=key,
                                                       ChecksumAlgorithm="SHA256")
        return created["UploadId"], {}

    def _unfinished_uploads(self, key: str) -> set[str]:
        """The uploads of `key` to resume; none when this key may not list uploads (a run's
        own key on SeaweedFS, which counts that listing as a write to the whole bucket):
        the put then starts afresh."""
        pages = self._client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=key)
        try:
            return {u["UploadId"] for page in pages for u in page.get("Uploads", ())
                    if u["Key"] == key}  # Prefix also matches longer keys
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "AccessDenied":
                return set()
            raise

    def _stored_parts(self, key: str, upload_id: str) -> dict[int, _Part]:
        """Part number -> (size, ETag, SHA-256); for non-KMS S3 the ETag is the part's MD5,
        quoted; the SHA-256 where the service lists it (SeaweedFS does not)."""
        pages = self._client.get_paginator("list_parts").paginate(
            Bucket=self.bucket, Key=key, UploadId=upload_id)
        return {p["PartNumber"]: (p["Size"], p["ETag"], p.get("ChecksumSHA256"))
                for page in pages for p in page.get("Parts", ())}

    @contextmanager
    def _errors_for(self, name: str) -> Iterator[None]:
        try:
            yield
        except (ClientError, BotoCoreError) as exc:
            raise classify_s3_error(exc, self.bucket, name) from None


def classify_s3_error(exc: ClientError | BotoCoreError, bucket: str, name: str) -> CkptError:
    """The store error for a botocore failure concerning object `name`."""
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        detail = f"{code or status}: {error.get('Message') or 'no message'}"
        if code in _MISSING_CODES:
            return ObjectMissing(name)
        if code in _TRANSIENT_CODES or status >= 500 or status == 429:
            return S3Unavailable(name, bucket, detail, "retry later", permanent=False)
        fix = _PERMANENT_FIXES.get(code, "the request was refused; see the detail")
        return S3Unavailable(name, bucket, detail, fix, permanent=True)
    if isinstance(exc, BotoConnectionError | HTTPClientError | IncompleteReadError
                  | FlexibleChecksumError):
        return S3Unavailable(name, bucket, str(exc), "check the endpoint URL and the network",
                             permanent=False)
    # Missing credentials, an invalid endpoint: retrying cannot help.
    return S3Unavailable(name, bucket, str(exc), _CREDENTIALS_FIX + ", and the endpoint URL",
                         permanent=True)


def _same_part(stored: _Part, wanted: _Part | None) -> bool:
    """Whether a part an unfinished upload holds is the one wanted: same size and MD5, and
    the same SHA-256 where the service lists one."""
    if wanted is None:
        return False
    size, etag, sha256 = stored
    return (size, etag.strip('"')) == wanted[:2] and sha256 in (None, wanted[2])


def _content_md5(body: bytes) -> str:
    """Lets S3 refuse a body corrupted on the way (BadDigest) instead of storing it."""
    return base64.b64encode(hashlib.md5(body, usedforsecurity=False).digest()).decode()


def _is_object_name(name: str) -> bool:
    try:
        check_object_name(name)
    except CkptError:
        return False
    return True
