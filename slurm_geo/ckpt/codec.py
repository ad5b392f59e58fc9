"""Encoded blobs (docs/format.md §6.1): the transform applied to a chunk before encryption.

Pure functions over bytes. Float tensors compress poorly as a whole because mantissa bytes
are noise; split into byte planes, the exponent planes compress well and the rest is kept
raw. Anything that does not get smaller is stored raw.
"""

from __future__ import annotations

import struct
from enum import IntEnum

import zstandard

from slurm_geo.ckpt.errors import MalformedData

DEFAULT_LEVEL = 3
PLANE_ELEMENT_SIZES = (2, 4)
ID_SIZE = 32

_HEAD = struct.Struct("<BI")  # method, decoded size; also the head of one plane


class Method(IntEnum):
    RAW = 0
    ZSTD = 1
    PLANES = 2
    XOR_DELTA = 3


def split_planes(data: bytes, element_size: int) -> list[bytes]:
    """Plane j holds byte j of every element."""
    return [data[j::element_size] for j in range(element_size)]


def merge_planes(planes: list[bytes]) -> bytes:
    element_size = len(planes)
    out = bytearray(len(planes[0]) * element_size)
    for j, plane in enumerate(planes):
        out[j::element_size] = plane
    return bytes(out)


def xor_bytes(a: bytes, b: bytes) -> bytes:
    if len(a) != len(b):
        raise MalformedData(f"xor of {len(a)} bytes with {len(b)} bytes")
    # Python integers do the whole buffer in C, far faster than a byte loop.
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(len(a), "little")


def encode(data: bytes | memoryview, *, element_size: int = 1, level: int = DEFAULT_LEVEL) -> bytes:
    """Byte planes when `element_size` is 2 or 4 and divides the data, else zstd; raw if larger."""
    data = bytes(data)
    compressor = zstandard.ZstdCompressor(level=level)
    if element_size in PLANE_ELEMENT_SIZES and data and len(data) % element_size == 0:
        method = Method.PLANES
        planes = split_planes(data, element_size)
        body = bytes([element_size]) + b"".join(_encode_plane(p, compressor) for p in planes)
    else:
        method = Method.ZSTD
        body = compressor.compress(data)
    if len(body) >= len(data):
        return _HEAD.pack(Method.RAW, len(data)) + data
    return _HEAD.pack(method, len(data)) + body


def encode_delta(
    data: bytes | memoryview, base: bytes, base_id: bytes, *,
    element_size: int = 1, level: int = DEFAULT_LEVEL,
) -> bytes:
    """`data` as xor against `base`: unchanged values become zero bytes, which compress away."""
    if len(base_id) != ID_SIZE:
        raise ValueError(f"a chunk id is {ID_SIZE} bytes")
    inner = encode(xor_bytes(bytes(data), base), element_size=element_size, level=level)
    return _HEAD.pack(Method.XOR_DELTA, len(data)) + base_id + inner


def delta_base_id(blob: bytes) -> bytes | None:
    """The id of the chunk `blob` is a delta against, or None if it stands alone."""
    method, _size = _unpack_head(blob)
    if method != Method.XOR_DELTA:
        return None
    if len(blob) < _HEAD.size + ID_SIZE:
        raise MalformedData("delta blob shorter than its header")
    return blob[_HEAD.size:_HEAD.size + ID_SIZE]


def decode(blob: bytes, base: bytes | None = None) -> bytes:
    """The chunk `blob` encodes; `base` is the plaintext of its delta base, if it has one."""
    method, size = _unpack_head(blob)
    if method != Method.XOR_DELTA:
        return _decode_standalone(blob)
    if base is None:
        raise MalformedData("delta blob decoded without its base chunk")
    if len(base) != size:
        raise MalformedData(f"delta of {size} bytes against a base of {len(base)} bytes")
    inner = blob[_HEAD.size + ID_SIZE:]
    if _unpack_head(inner)[0] == Method.XOR_DELTA:
        raise MalformedData("delta blob nests another delta")
    return xor_bytes(_decode_standalone(inner, size), base)


def _encode_plane(plane: bytes, compressor: zstandard.ZstdCompressor) -> bytes:
    packed = compressor.compress(plane)
    if len(packed) < len(plane):
        return _HEAD.pack(Method.ZSTD, len(packed)) + packed
    return _HEAD.pack(Method.RAW, len(plane)) + plane


def _unpack_head(blob: bytes) -> tuple[Method, int]:
    if len(blob) < _HEAD.size:
        raise MalformedData(f"blob of {len(blob)} bytes is shorter than its header")
    method, size = _HEAD.unpack_from(blob)
    try:
        return Method(method), size
    except ValueError:
        raise MalformedData(f"unknown blob method {method}") from None


def _decode_standalone(blob: bytes, expected_size: int | None = None) -> bytes:
    method, size = _unpack_head(blob)
    if expected_size is not None and size != expected_size:
        raise MalformedData(f"inner blob decodes to {size} bytes, not {expected_size}")
    body = blob[_HEAD.size:]
    if method == Method.RAW:
        data = body
    elif method == Method.ZSTD:
        data = _unzstd(body, size)
    elif method == Method.PLANES:
        data = _decode_planes(body, size)
    else:
        raise MalformedData(f"blob method {method.name} is not allowed here")
    if len(data) != size:
        raise MalformedData(f"blob decodes to {len(data)} bytes, its header says {size}")
    return data


def _decode_planes(body: bytes, size: int) -> bytes:
    if not body or body[0] not in PLANE_ELEMENT_SIZES or size % body[0]:
        raise MalformedData("byte-plane blob with a bad element size")
    element_size, plane_size = body[0], size // body[0]
    planes, pos = [], 1
    for _ in range(element_size):
        if len(body) < pos + _HEAD.size:
            raise MalformedData("byte-plane blob truncated in a plane header")
        method, length = _HEAD.unpack_from(body, pos)
        pos += _HEAD.size
        plane = body[pos:pos + length]
        pos += length
        if len(plane) != length:
            raise MalformedData("byte-plane blob truncated in a plane")
        if method == Method.ZSTD:
            plane = _unzstd(plane, plane_size)
        elif method != Method.RAW or len(plane) != plane_size:
            raise MalformedData("byte plane with a bad method or size")
        planes.append(plane)
    if pos != len(body):
        raise MalformedData("byte-plane blob has trailing bytes")
    return merge_planes(planes)


def _unzstd(frame: bytes, size: int) -> bytes:
    # Check the declared size first: the decompressor trusts it when allocating.
    try:
        declared = zstandard.frame_content_size(frame)
        if declared != size:
            raise MalformedData(f"zstd frame declares {declared} bytes, expected {size}")
        return zstandard.ZstdDecompressor().decompress(frame)
    except zstandard.ZstdError as exc:
        raise MalformedData(f"zstd: {exc}") from None
