"""Checkpoint storage: content-addressed, compressed, encrypted chunks and manifests.

The byte format is specified in docs/format.md; this package is its reference
implementation. It never imports torch: tensors arrive as (path, dtype, shape, bytes).

The names below are imported when first used, not with the package: a command that
pushes a file would otherwise load every module here, numpy among them (measured: 95 ms
of a 0.27 s `ckpt push` of a frozen-base checkpoint). `open_store` is not among them: it
shares its name with its module, which importing the module would put in its place;
import it from `slurm_geo.ckpt.stores.open_store`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slurm_geo.lazy import module_getattr

if TYPE_CHECKING:
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
    from slurm_geo.ckpt.format.keys import create_master_key_file, load_master_key
    from slurm_geo.ckpt.format.manifest import Manifest, Metadata
    from slurm_geo.ckpt.repo.repository import Checkpoint, Repository, Tensor
    from slurm_geo.ckpt.repo.writer import WriteOptions
    from slurm_geo.ckpt.stores.retry import RetryingStore, is_permanent
    from slurm_geo.ckpt.stores.store import LocalDirStore, Store

_HOMES = {
    **dict.fromkeys(["CkptError", "CorruptObject", "KeyFileError", "ObjectMissing",
                     "StepMismatch", "StoreUnavailable", "UnsafeObjectName",
                     "UnsupportedFormat", "WrongKey"], "errors"),
    **dict.fromkeys(["create_master_key_file", "load_master_key"], "format.keys"),
    **dict.fromkeys(["Manifest", "Metadata"], "format.manifest"),
    **dict.fromkeys(["Checkpoint", "Repository", "Tensor"], "repo.repository"),
    **dict.fromkeys(["RetryingStore", "is_permanent"], "stores.retry"),
    **dict.fromkeys(["LocalDirStore", "Store"], "stores.store"),
    "WriteOptions": "repo.writer",
}

__all__ = [
    "Checkpoint", "CkptError", "CorruptObject", "KeyFileError", "LocalDirStore",
    "Manifest", "Metadata", "ObjectMissing", "Repository", "RetryingStore", "StepMismatch",
    "Store", "StoreUnavailable", "Tensor", "UnsafeObjectName", "UnsupportedFormat",
    "WriteOptions", "WrongKey", "create_master_key_file", "is_permanent",
    "load_master_key",
]

__getattr__ = module_getattr(__name__, _HOMES)
