"""Checkpoint storage: content-addressed, compressed, encrypted chunks and manifests.

The byte format is specified in docs/format.md; this package is its reference
implementation. It never imports torch: tensors arrive as (path, dtype, shape, bytes).
"""

from slurm_geo.ckpt.errors import (
    CkptError,
    CorruptObject,
    KeyFileError,
    ObjectMissing,
    StepMismatch,
    StoreUnavailable,
    UnsafeObjectName,
    UnsupportedFormat,
    WrongKey,
)
from slurm_geo.ckpt.keys import create_master_key_file, load_master_key
from slurm_geo.ckpt.manifest import Manifest, Metadata
from slurm_geo.ckpt.open_store import open_store
from slurm_geo.ckpt.repository import Checkpoint, Repository, Tensor
from slurm_geo.ckpt.retry import RetryingStore, is_permanent
from slurm_geo.ckpt.store import LocalDirStore, Store
from slurm_geo.ckpt.writer import WriteOptions

__all__ = [
    "Checkpoint", "CkptError", "CorruptObject", "KeyFileError", "LocalDirStore", "Manifest",
    "Metadata", "ObjectMissing", "Repository", "StepMismatch", "Store", "StoreUnavailable",
    "Tensor", "UnsafeObjectName", "UnsupportedFormat", "WriteOptions", "WrongKey",
    "RetryingStore", "create_master_key_file", "is_permanent", "load_master_key", "open_store",
]
