"""The layout of a multi-rank checkpoint (docs/format.md §7.5): which stored tensor holds
which shard of which state-dict item, as PyTorch Distributed Checkpoint saved them.

Pure and torch-free: slurm_geo.torch.distributed turns DCP's Metadata into a `Layout`
and back. A manifest of format 3 carries one; its `tensors` are the stored shards, each
named by `shard_path`, so everything that walks a manifest's chunks (verify, replicate,
gc, prune, billing) treats a multi-rank checkpoint like any other.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from slurm_geo.ckpt.errors import MalformedData

BYTES_DTYPE = "uint8"  # a bytes item (pickled non-tensor state) is stored as a uint8 vector


@dataclass(frozen=True)
class Shard:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: str  # the path of the manifest tensor holding it


@dataclass(frozen=True)
class Item:
    """One state-dict entry: a tensor cut into shards, or one opaque bytes object."""

    fqn: str
    kind: str  # "tensor" or "bytes"
    dtype: str | None = None
    size: tuple[int, ...] = ()
    requires_grad: bool = False
    shards: tuple[Shard, ...] = ()
    tensor: str | None = None  # bytes items: the manifest tensor holding them


@dataclass(frozen=True)
class Layout:
    items: tuple[Item, ...]
    planner_data: dict[str, list[str | int]] | None
    dcp_version: str | None
    ranks: int

    def stored(self) -> Iterable[str]:
        """Every manifest tensor path the layout refers to."""
        for item in self.items:
            if item.tensor is not None:
                yield item.tensor
            yield from (shard.tensor for shard in item.shards)


def shard_path(fqn: str, offsets: Sequence[int] | None) -> str:
    """The manifest path of a stored shard: unique per (item, offsets), readable in ls."""
    if offsets is None:
        return fqn
    return f"{fqn}@{','.join(map(str, offsets))}"


def layout_to_json(layout: Layout) -> dict[str, Any]:
    return {
        "dcp_version": layout.dcp_version,
        "ranks": layout.ranks,
        "planner_data": layout.planner_data,
        "items": [_item_to_json(item) for item in layout.items],
    }


def _item_to_json(item: Item) -> dict[str, Any]:
    if item.kind == "bytes":
        return {"fqn": item.fqn, "kind": "bytes", "tensor": item.tensor}
    return {"fqn": item.fqn, "kind": "tensor", "dtype": item.dtype, "size": list(item.size),
            "requires_grad": item.requires_grad,
            "shards": [{"offsets": list(s.offsets), "sizes": list(s.sizes), "tensor": s.tensor}
                       for s in item.shards]}


def parse_layout(raw: Any, stored: dict[str, tuple[str, tuple[int, ...]]]) -> Layout:
    """The layout in a manifest's "sharded" object; `stored` maps each of the manifest's
    tensor paths to its (dtype, shape), which every shard must match exactly once."""
    if not isinstance(raw, dict):
        raise MalformedData("sharded: not an object")
    ranks = raw.get("ranks")
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise MalformedData("sharded: 'ranks' is not a whole number ≥ 1")
    version = raw.get("dcp_version")
    if version is not None and not isinstance(version, str):
        raise MalformedData("sharded: 'dcp_version' is not a string")
    raw_items = raw.get("items")
    if not isinstance(raw_items, list):
        raise MalformedData("sharded: 'items' is not a list")
    items = tuple(_parse_item(r, stored) for r in raw_items)
    shared = [fqn for fqn, n in Counter(item.fqn for item in items).items() if n > 1]
    if shared:
        raise MalformedData(f"sharded: two items are named {shared[0]!r}")
    layout = Layout(items, _parse_planner_data(raw.get("planner_data")), version, ranks)
    _check_each_stored_once(layout, stored)
    return layout


def _check_each_stored_once(layout: Layout, stored: Iterable[str]) -> None:
    """Each stored tensor holds exactly one shard or bytes item (every shard names a
    stored tensor: `_parse_item` checked that)."""
    named = Counter(layout.stored())
    twice = [path for path, n in named.items() if n > 1]
    if twice:
        raise MalformedData(f"sharded: tensor {twice[0]!r} is named by two shards or items")
    unnamed = [path for path in stored if path not in named]
    if unnamed:
        raise MalformedData(f"sharded: tensor {unnamed[0]!r} is no shard or bytes item")


def _parse_item(raw: Any, stored: dict[str, tuple[str, tuple[int, ...]]]) -> Item:
    if not isinstance(raw, dict) or not isinstance(raw.get("fqn"), str):
        raise MalformedData("sharded: an item is not an object with a 'fqn'")
    fqn, kind = raw["fqn"], raw.get("kind")
    if kind == "bytes":
        tensor = raw.get("tensor")
        if not isinstance(tensor, str) or tensor not in stored or \
                stored[tensor][0] != BYTES_DTYPE or len(stored[tensor][1]) != 1:
            raise MalformedData(f"sharded: bytes item {fqn!r} names no uint8 vector")
        return Item(fqn, "bytes", tensor=tensor)
    if kind != "tensor":
        raise MalformedData(f"sharded: item {fqn!r} is of unknown kind {kind!r}")
    dtype, size = raw.get("dtype"), _sizes(raw.get("size"), fqn)
    requires_grad = raw.get("requires_grad")
    if not isinstance(requires_grad, bool) or not isinstance(raw.get("shards"), list):
        raise MalformedData(f"sharded: item {fqn!r} lacks 'requires_grad' or 'shards'")
    if not raw["shards"]:
        raise MalformedData(f"sharded: tensor item {fqn!r} has no shards")
    shards = []
    for shard in raw["shards"]:
        if not isinstance(shard, dict):
            raise MalformedData(f"sharded: a shard of {fqn!r} is not an object")
        offsets, sizes = _sizes(shard.get("offsets"), fqn), _sizes(shard.get("sizes"), fqn)
        tensor = shard.get("tensor")
        if not isinstance(tensor, str) or stored.get(tensor) != (dtype, sizes):
            raise MalformedData(f"sharded: a shard of {fqn!r} names no {dtype}{list(sizes)} "
                                "tensor")
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o + s > whole for o, s, whole in zip(offsets, sizes, size, strict=True)):
            raise MalformedData(f"sharded: shard {tensor!r} lies outside {fqn}{list(size)}")
        shards.append(Shard(offsets, sizes, tensor))
    # Shards lie inside the item; if their elements add up to the item's too, none is
    # missing (DCP's planner checks on save that they do not overlap).
    if sum(math.prod(s.sizes) for s in shards) != math.prod(size):
        raise MalformedData(f"sharded: the shards of {fqn!r} do not cover {fqn}{list(size)}")
    return Item(fqn, "tensor", dtype, size, requires_grad, tuple(shards))


def _sizes(raw: Any, fqn: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw):
        raise MalformedData(f"sharded: item {fqn!r} has a malformed size or offset")
    return tuple(raw)


def _parse_planner_data(raw: Any) -> dict[str, list[str | int]] | None:
    """DefaultSavePlanner's flattening map: each flat name's path in the nested state dict."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not all(
            isinstance(path, list) and path and all(
                isinstance(p, str | int) and not isinstance(p, bool) for p in path)
            for path in raw.values()):
        raise MalformedData("sharded: 'planner_data' is not a map of key paths")
    return raw
