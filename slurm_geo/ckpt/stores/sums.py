"""The digests stores keep of their objects, in the form S3 reports them (base64 SHA-256).

An object put in one request has the SHA-256 of its bytes; one put in parts has S3's
"composite" checksum: the SHA-256 of its parts' SHA-256 digests, then `-<parts>`
(what SeaweedFS and AWS return for a multipart upload made with ChecksumAlgorithm=SHA256).
Pure functions over bytes or a readable file.
"""

from __future__ import annotations

import base64
import hashlib
from typing import BinaryIO

Bytes = bytes | bytearray | memoryview
_BLOCK = 1 << 20


def sha256_b64(data: Bytes | BinaryIO) -> str:
    """Base64 SHA-256 of `data`, or of everything left to read in a binary file."""
    digest = hashlib.sha256()
    if isinstance(data, bytes | bytearray | memoryview):
        digest.update(data)
    else:
        while block := data.read(_BLOCK):
            digest.update(block)
    return base64.b64encode(digest.digest()).decode()


def composite_b64(parts: list[Bytes]) -> str:
    """S3's composite SHA-256 of an object uploaded as `parts`, in order."""
    inner = b"".join(hashlib.sha256(part).digest() for part in parts)
    return f"{base64.b64encode(hashlib.sha256(inner).digest()).decode()}-{len(parts)}"
