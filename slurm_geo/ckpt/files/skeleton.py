"""Training-state skeletons without torch: the JSON `slurm_geo.torch.state` writes.

A state read from a file (a `torch.save` pickle, a safetensors header) is a nesting of
plain values and tensor leaves; `encode_skeleton` pulls the leaves out and writes the rest
through `SkeletonEncoder`, the encoder `flatten_state` builds on, so the paths and the
skeleton are the same byte for byte as an in-process save's, and a
checkpoint pushed from a file and one saved in-process share paths (and chunks), and
either reads back through `unflatten_state`. `walk_skeleton` goes the other way for
writers of files: it hands each node of a skeleton to a visitor, in the order
`unflatten_state` rebuilds them; a numpy array is handed over as a tensor and a numpy
scalar as its plain value, the forms `torch.load(weights_only=True)` accepts.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode

SKELETON_FORMAT = "slurm-geo-torch/1"
T = TypeVar("T")


class TensorFileError(SlurmGeoError):
    """A tensor file (torch.save, safetensors) that cannot be read or written as asked."""

    exit_code = ExitCode.CONFIG


@dataclass(frozen=True, slots=True)
class TorchName:
    """A torch dtype (`float32`) or device (`cpu`) met in a state, by name."""

    kind: str  # "dtype" or "device"
    name: str


class TorchSize(tuple):
    """A `torch.Size` met in a state (a tuple of ints)."""

    __slots__ = ()


def encode_skeleton(state: Any, is_leaf: Callable[[Any], bool]) -> tuple[list[tuple[str, Any]],
                                                                         bytes]:
    """The tensor leaves of `state` with their paths, in order, and the skeleton's bytes."""
    encoder = _Encoder(is_leaf)
    document = {"format": SKELETON_FORMAT, "state": encoder.encode(state, ())}
    return encoder.leaves, json.dumps(document, separators=(",", ":"), allow_nan=False).encode()


def parse_skeleton(extra_state: bytes) -> Any:
    """The skeleton's state node; TensorFileError unless it is one `flatten_state` wrote."""
    try:
        document = json.loads(extra_state)
    except (UnicodeDecodeError, json.JSONDecodeError):
        document = None
    if not isinstance(document, dict) or document.get("format") != SKELETON_FORMAT:
        raise TensorFileError(f"the checkpoint's extra state is not a {SKELETON_FORMAT} "
                              "skeleton (not saved from a state dict): pull it to a directory")
    return document.get("state")


class Visitor(Protocol[T]):
    """What a writer makes of each kind of skeleton node."""

    def tensor(self, path: str) -> T: ...
    def plain(self, value: None | bool | int | float | str) -> T: ...
    def sequence(self, kind: str, items: list[T]) -> T: ...  # "list", "tuple", "size"
    def mapping(self, items: list[tuple[T, T]], metadata: T | None, ordered: bool) -> T: ...
    def named(self, kind: str, value: Any) -> T: ...  # "float", "bytes", "dtype", "device"


def walk_skeleton(node: Any, visitor: Visitor[T]) -> T:
    """The visitor's value of `node`, built bottom-up in `unflatten_state`'s order."""
    if isinstance(node, list):
        return visitor.sequence("list", [walk_skeleton(v, visitor) for v in node])
    if not isinstance(node, dict):
        return visitor.plain(node)
    if "$" not in node:
        return visitor.mapping([(visitor.plain(k), walk_skeleton(v, visitor))
                                for k, v in node.items()], None, ordered=False)
    kind = node["$"]
    try:
        if kind in ("tensor", "ndarray"):
            # A numpy array (numpy's RNG state) is written as a tensor of its dtype and
            # shape, which torch.load(weights_only=True) reads; `.numpy()` gives it back.
            return visitor.tensor(node["path"])
        if kind == "npscalar":
            return walk_skeleton(node["v"], visitor)  # its plain value
        if kind == "dict":
            items = [(walk_skeleton(k, visitor), walk_skeleton(v, visitor))
                     for k, v in node["items"]]
            metadata = walk_skeleton(node["metadata"], visitor) if "metadata" in node else None
            return visitor.mapping(items, metadata, ordered=metadata is not None)
        if kind in ("tuple", "size"):
            return visitor.sequence(kind, [walk_skeleton(v, visitor) for v in node["items"]])
        if kind == "float":
            return visitor.named("float", float(node["v"]))
        if kind == "bytes":
            return visitor.named("bytes", base64.b64decode(node["v"]))
        if kind in ("dtype", "device"):
            return visitor.named(kind, str(node["v"]))
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, SlurmGeoError):
            raise
        raise TensorFileError(f"malformed {kind!r} entry in the checkpoint's skeleton") from None
    raise TensorFileError(f"the checkpoint's state holds a {kind!r:.40} entry, which this file "
                          "format cannot hold: pull it to a directory instead")


def tensor_paths(node: Any) -> list[str]:
    """The paths of the tensors a skeleton names, in order."""
    paths: list[str] = []

    class Collect:
        def tensor(self, path: str) -> None:
            paths.append(path)

        def plain(self, value: Any) -> None:
            return None

        def sequence(self, kind: str, items: list[None]) -> None:
            return None

        def mapping(self, items: list[tuple[None, None]], metadata: None, ordered: bool) -> None:
            return None

        def named(self, kind: str, value: Any) -> None:
            return None

    walk_skeleton(node, Collect())
    return paths


class SkeletonEncoder:
    """A state's skeleton node by node, and its tensor leaves' paths; `flatten_state`
    (torch values) and `encode_skeleton` (values read from a file) each say, in
    `encode_leaf`, which values are tensors and which name torch types, so both write the
    same skeleton and paths for the same state."""

    def __init__(self) -> None:
        self.paths: set[str] = set()

    def encode_leaf(self, value: Any, where: tuple[str, ...]) -> Any:
        """The node of a tensor, array or torch type; None for any other value."""
        return None

    def is_size(self, value: Any) -> bool:
        return type(value) is TorchSize

    def refusal(self, value: Any, where: tuple[str, ...]) -> Exception:
        return TensorFileError(
            f"state at {'.'.join(where) or '<root>'!r} is a {type(value).__qualname__}, which "
            "a checkpoint cannot hold: use tensors, numbers, strings, bytes, lists, tuples "
            "and dicts")

    def encode(self, value: Any, where: tuple[str, ...]) -> Any:
        if value is None or type(value) in (bool, int, str):
            return value
        leaf = self.encode_leaf(value, where)
        if leaf is not None:
            return leaf
        if type(value) is float:
            return value if math.isfinite(value) else {"$": "float", "v": repr(value)}
        if isinstance(value, dict):
            return self.encode_dict(value, where)
        if type(value) is list:
            return [self.encode(v, (*where, str(i))) for i, v in enumerate(value)]
        if type(value) is tuple or self.is_size(value):
            items = [self.encode(v, (*where, str(i))) for i, v in enumerate(value)]
            return {"$": "size" if self.is_size(value) else "tuple", "items": items}
        if isinstance(value, bytes):
            return {"$": "bytes", "v": base64.b64encode(value).decode()}
        raise self.refusal(value, where)

    def encode_dict(self, value: dict[Any, Any], where: tuple[str, ...]) -> Any:
        metadata = getattr(value, "_metadata", None)  # nn.Module.state_dict's versions
        if metadata is None and "$" not in value and all(type(k) is str for k in value):
            return {k: self.encode(v, (*where, k)) for k, v in value.items()}
        items = [[self.encode(k, (*where, "key")), self.encode(v, (*where, str(k)))]
                 for k, v in value.items()]
        tagged: dict[str, Any] = {"$": "dict", "items": items}
        if metadata is not None:
            tagged["metadata"] = self.encode(metadata, (*where, "_metadata"))
        return tagged

    def unique_path(self, where: tuple[str, ...]) -> str:
        """The dotted path, made unique by a `~n` suffix (`{"a.b": x, "a": {"b": y}}`)."""
        base = ".".join(where) or "state"
        path, n = base, 1
        while path in self.paths:
            path, n = f"{base}~{n}", n + 1
        self.paths.add(path)
        return path


class _Encoder(SkeletonEncoder):
    """Values read from a file: the caller's leaves, `TorchName`s and `TorchSize`s."""

    def __init__(self, is_leaf: Callable[[Any], bool]):
        super().__init__()
        self.is_leaf = is_leaf
        self.leaves: list[tuple[str, Any]] = []

    def encode_leaf(self, value: Any, where: tuple[str, ...]) -> Any:
        if self.is_leaf(value):
            path = self.unique_path(where)
            self.leaves.append((path, value))
            return {"$": "tensor", "path": path}
        if isinstance(value, TorchName):
            return {"$": value.kind, "v": value.name}
        return None
