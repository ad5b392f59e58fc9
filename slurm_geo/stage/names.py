"""Object names of staged trees in a checkpoint store (docs/format.md §11), and tree ids.

    tree-keys/<domain>             the domain's key ring, sealed under the master key (kind 1)
    tree-packs/<domain>/<pack id>  packs of the domain's trees (format.md §6)
    trees/<tree>/<snapshot>        a snapshot's tree manifest (kind 2), 20-digit number
    tree-latest/<tree>             the tree's newest snapshot (kind 3)

None of these prefixes is a checkpoint's (§2): gc, prune and `ckpt check` of runs neither
see nor delete them, and no run name can collide with them.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from slurm_geo.ckpt.errors import UnsafeObjectName
from slurm_geo.ckpt.format.keys import derive_key
from slurm_geo.ckpt.format.names import STEP_DIGITS, is_hex_id

TREE_KEYS = "tree-keys"
TREE_PACKS = "tree-packs"
TREES = "trees"
TREE_LATEST = "tree-latest"
PREFIXES = tuple(f"{p}/" for p in (TREE_KEYS, TREE_PACKS, TREES, TREE_LATEST))

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
INFO_TREE_ID = b"slurm-geo/v1/tree-id"
TREE_ID_BYTES = 16  # 32 hex digits


def check_tree_id(tree: str, what: str = "tree") -> str:
    """A tree or domain id: the grammar of a run id (1-128 letters, digits, '.', '_', '-')."""
    if not isinstance(tree, str) or not _ID.fullmatch(tree):
        raise UnsafeObjectName(repr(tree), f"a {what} id is 1-128 letters, digits, '.', '_' "
                               "or '-', starting with a letter or digit")
    return tree


def tree_naming_key(master_key: bytes) -> bytes:
    """`T = HKDF(M, absent, "slurm-geo/v1/tree-id")`: names trees without showing their path."""
    return derive_key(master_key, None, INFO_TREE_ID)


def tree_id(naming_key: bytes, label: str) -> str:
    """The id of the tree staged from `label` (e.g. "home:/home/alice/data"): the first 16
    bytes of HMAC-SHA256(T, label) in hex. Equal labels, equal ids; the store cannot tell a
    label from its id without `T`."""
    digest = hmac.digest(naming_key, label.encode("utf-8", "surrogateescape"), hashlib.sha256)
    return digest[:TREE_ID_BYTES].hex()


def tree_key_name(domain: str) -> str:
    return f"{TREE_KEYS}/{check_tree_id(domain, 'domain')}"


def tree_packs_prefix(domain: str) -> str:
    return f"{TREE_PACKS}/{check_tree_id(domain, 'domain')}/"


def tree_pack_name(domain: str, pack_id: str) -> str:
    if not is_hex_id(pack_id):
        raise UnsafeObjectName(str(pack_id), "a pack id is 64 lowercase hex digits")
    return f"{tree_packs_prefix(domain)}{pack_id}"


def snapshot_prefix(tree: str) -> str:
    return f"{TREES}/{check_tree_id(tree)}/"


def snapshot_name(tree: str, snapshot: int) -> str:
    if isinstance(snapshot, bool) or not isinstance(snapshot, int) \
            or not 1 <= snapshot < 10**STEP_DIGITS:
        raise UnsafeObjectName(repr(snapshot), "a snapshot is numbered from 1")
    return f"{snapshot_prefix(tree)}{snapshot:0{STEP_DIGITS}d}"


def snapshot_of_name(tree: str, name: str) -> int | None:
    tail = name.removeprefix(snapshot_prefix(tree))
    if tail == name or len(tail) != STEP_DIGITS or not (tail.isascii() and tail.isdigit()):
        return None
    return int(tail) or None


def tree_latest_name(tree: str) -> str:
    return f"{TREE_LATEST}/{check_tree_id(tree)}"
