"""Encoded blobs (docs/format.md §6.1): the transform applied to a chunk before encryption.

Pure functions over bytes. Float tensors compress poorly as a whole because mantissa bytes
are noise; split into byte planes, the exponent planes compress well and the rest is kept
raw. Anything that does not get smaller is stored raw.

Speed matters here (every byte of every checkpoint passes through): planes are cut and
merged, and deltas xored, by numpy (vectorised and off the GIL, so worker threads run side
by side; strided slicing of bytes holds the GIL and ran at half the speed); a large plane
is first probed with a sample spread over it, which decides whether zstd runs at all and
with which parameters (`encode_plane`); blobs come out in parts that are encrypted into
the pack without being joined; decoding merges planes straight into the caller's buffer
(`decode_into`). Decoders accept any zstd frame,
so these choices change what a writer produces, never what a reader accepts.

Deltas come in two kinds, chosen by how much of a chunk changed (`changed_fraction`).
Sparse changes (a few values of a fine-tuned model) are best a zstd *patch* (method 4): one
zstd frame that uses the base chunk's plaintext as its dictionary, so unchanged stretches
become matches into the base. Dense small changes (every value nudged by an optimizer
step) leave no stretch unchanged, but the *xor* of the two versions (method 3) has zero
sign, exponent and high mantissa bits, which its byte planes compress: measured on a dense
fp32 model with AdamW, 0.74x the chunk's own encoding, where a patch is 1.1x.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from enum import IntEnum

import numpy as np
import zstandard

from slurm_geo.ckpt.errors import MalformedData

DEFAULT_LEVEL = 1
PLANE_ELEMENT_SIZES = (2, 4)
ID_SIZE = 32

Buffer = bytes | bytearray | memoryview
# Where a chunk is decoded: a buffer of its own, or a writable view of memory another
# object owns (a tensor's, so a load copies nothing after decoding).
Writable = bytearray | memoryview

# A plane of at least SAMPLE_MIN bytes is first probed: SAMPLE_PIECES slices of
# SAMPLE_PIECE bytes spread over it are compressed as one; if that saves under 5 %
# (SAMPLE_MAX_RATIO), the plane is stored raw (mantissa bytes: noise). Data the plane
# parameters shrink below STRUCTURED_RATIO is also tried with plain zstd. Smaller planes
# are compressed whole, both ways where that applies.
SAMPLE_MIN = 256 * 1024
SAMPLE_PIECES = 8
SAMPLE_PIECE = 8 * 1024
SAMPLE_MAX_RATIO = 0.95
STRUCTURED_RATIO = 1 / 3

# From this fraction of zero elements on, a chunk is stored as a mask of its nonzero
# elements and their byte planes (method 5). Zeros come in numbers from units that never
# activate (dead ReLUs) or tokens never seen: their optimizer moments stay exactly zero.
# Byte planes alone keep the zero bytes of the mantissa planes, which are otherwise noise
# and stored raw; the mask costs at most a bit per element and compresses when the zeros
# have a pattern. Measured on the AdamW moments of a ReLU MLP with 14 % zeros: 0.95x the
# size of byte planes alone.
SPARSE_AT_LEAST = 0.05

_HEAD = struct.Struct("<BI")  # method, decoded size; also the head of one plane
_LENGTH = struct.Struct("<I")
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}  # by element size
# Planes are cut and merged as whole words shifted by 8 bits a plane, not as a transposed
# byte matrix: numpy's strided copy of single bytes ran at 1.0 ms a 4 MiB fp32 chunk each
# way, the shifts at 0.55-0.65 ms (one thread; two threads splitting at once, 0.6 ms a chunk
# against 3.0). Little-endian words whatever the host: plane j is byte j in memory.
_LITTLE_ENDIAN: dict[int, np.dtype[np.unsignedinteger]] = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


class Method(IntEnum):
    RAW = 0
    ZSTD = 1
    PLANES = 2
    XOR_DELTA = 3
    ZSTD_PATCH = 4
    SPARSE_PLANES = 5


DELTA_METHODS = (Method.XOR_DELTA, Method.ZSTD_PATCH)
# The largest zstd window a reader accepts (RFC 8878's decoders' default limit). A patch
# frame reaches back into its base, so it needs a window of twice the chunk: 2 x 64 MiB.
MAX_WINDOW_LOG = 27


def plane_parameters(level: int) -> zstandard.ZstdCompressionParameters:
    """zstd parameters for byte planes at `level`.

    An exponent plane is usually a skewed but unstructured byte stream: nearly all the
    gain is entropy coding, and short matches cost time and gain nothing. Measured on
    float32 and bfloat16 gaussian weights and Adam moments, a minimum match of 7 and a
    64-entry hash table at level 1 compress 2-3x faster than plain level 1 and 6-11 %
    smaller. Slower levels (4 and up) are left as they are.
    """
    if level > 3:
        return zstandard.ZstdCompressionParameters(compression_level=level)
    return zstandard.ZstdCompressionParameters(compression_level=level, min_match=7,
                                               hash_log=6)


class Compressors:
    """The zstd contexts of one thread (a context must not be used by two at once)."""

    def __init__(self, level: int = DEFAULT_LEVEL):
        self.level = level
        self.whole = zstandard.ZstdCompressor(level=level)
        self.plane = zstandard.ZstdCompressor(compression_params=plane_parameters(level))


def split_planes(data: Buffer, element_size: int) -> list[memoryview]:
    """Plane j holds byte j of every element (`element_size` 2 or 4)."""
    elements = np.frombuffer(data, _LITTLE_ENDIAN[element_size])
    planes = np.empty((element_size, len(elements)), np.uint8)
    shifted = np.empty_like(elements)
    for j, plane in enumerate(planes):
        np.right_shift(elements, 8 * j, out=shifted)
        np.copyto(plane, shifted, casting="unsafe")  # keeps the low byte
    return [plane.data for plane in planes]


def merge_planes(planes: Sequence[Buffer]) -> bytearray:
    """The inverse of `split_planes`: element i is byte i of each plane."""
    out = bytearray(len(planes[0]) * len(planes))
    merge_planes_into(planes, out, 0)
    return out


def merge_planes_into(planes: Sequence[Buffer], out: Writable, offset: int) -> None:
    """Merge into `out` from `offset`, without an intermediate buffer."""
    element_size, count = len(planes), len(planes[0])
    elements = np.frombuffer(out, _LITTLE_ENDIAN[element_size], count, offset)
    np.copyto(elements, np.frombuffer(planes[-1], np.uint8))
    for plane in reversed(planes[:-1]):
        np.left_shift(elements, 8, out=elements)
        np.bitwise_or(elements, np.frombuffer(plane, np.uint8), out=elements)


def xor_bytes(a: Buffer, b: Buffer) -> bytes:
    if len(a) != len(b):
        raise MalformedData(f"xor of {len(a)} bytes with {len(b)} bytes")
    return np.bitwise_xor(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)).tobytes()


def changed_fraction(xored: Buffer, element_size: int) -> float:
    """The fraction of elements that differ, given the xor of two versions of a chunk."""
    if not xored:
        return 0.0
    if element_size not in _UNSIGNED or len(xored) % element_size:
        element_size = 1
    elements = np.frombuffer(xored, _UNSIGNED[element_size])
    return np.count_nonzero(elements) / len(elements)


def encode(data: Buffer, *, element_size: int = 1, level: int = DEFAULT_LEVEL,
           compressors: Compressors | None = None) -> bytes:
    """Byte planes when `element_size` is 2 or 4 and divides the data, else zstd; raw if larger.

    `compressors` (one thread's contexts) saves creating them; its level then applies.
    """
    return b"".join(encode_parts(data, element_size=element_size, level=level,
                                 compressors=compressors))


def encode_parts(data: Buffer, *, element_size: int = 1, level: int = DEFAULT_LEVEL,
                 compressors: Compressors | None = None, sparse: bool = True) -> list[Buffer]:
    """`encode` as pieces to be concatenated, sparing a copy of the chunk when encrypting.
    `sparse=False` for a pack older than version 3, which holds no sparse planes."""
    zstd = compressors or Compressors(level)
    if element_size in PLANE_ELEMENT_SIZES and data and len(data) % element_size == 0:
        elements = np.frombuffer(data, _UNSIGNED[element_size])
        nonzero = np.count_nonzero(elements)
        if sparse and nonzero <= (1 - SPARSE_AT_LEAST) * len(elements):
            parts = _sparse_planes_parts(elements, element_size, zstd)
        else:
            parts = _planes_parts(data, element_size, zstd)
    else:
        parts = [_HEAD.pack(Method.ZSTD, len(data)), zstd.whole.compress(data)]
    return _raw_if_larger(data, parts)


def _raw_if_larger(data: Buffer, parts: list[Buffer]) -> list[Buffer]:
    if sum(map(len, parts)) - _HEAD.size >= len(data):
        return [_HEAD.pack(Method.RAW, len(data)), data]
    return parts


def _planes_parts(data: Buffer, element_size: int, zstd: Compressors) -> list[Buffer]:
    parts: list[Buffer] = [_HEAD.pack(Method.PLANES, len(data)), bytes([element_size])]
    for plane in split_planes(data, element_size):
        parts += encode_plane(plane, zstd)
    return parts


def _sparse_planes_parts(elements: np.ndarray, element_size: int,
                         zstd: Compressors) -> list[Buffer]:
    """Method 5: a bit mask of the nonzero elements, then those elements as byte planes."""
    is_nonzero = elements != 0
    mask = np.packbits(is_nonzero).data
    mask_parts = _raw_if_larger(mask, [_HEAD.pack(Method.ZSTD, len(mask)),
                                       zstd.whole.compress(mask)])
    values = memoryview(elements[is_nonzero]).cast("B")
    value_parts = (_raw_if_larger(values, _planes_parts(values, element_size, zstd))
                   if values else [_HEAD.pack(Method.RAW, 0)])
    return [_HEAD.pack(Method.SPARSE_PLANES, elements.nbytes), bytes([element_size]),
            _LENGTH.pack(sum(map(len, mask_parts))), *mask_parts, *value_parts]


def encode_delta(
    data: Buffer, base: Buffer, base_id: bytes, *, element_size: int = 1,
    level: int = DEFAULT_LEVEL, compressors: Compressors | None = None,
) -> bytes:
    """`data` as xor against `base`: unchanged values become zero bytes, which compress away."""
    return b"".join(encode_delta_parts(data, base, base_id, element_size=element_size,
                                       level=level, compressors=compressors))


def encode_delta_parts(
    data: Buffer, base: Buffer, base_id: bytes, *, element_size: int = 1,
    level: int = DEFAULT_LEVEL, compressors: Compressors | None = None,
) -> list[Buffer]:
    """`encode_delta` as pieces to be concatenated."""
    return encode_xored_parts(xor_bytes(data, base), base_id, element_size=element_size,
                              level=level, compressors=compressors)


def encode_xored_parts(
    xored: Buffer, base_id: bytes, *, element_size: int = 1, level: int = DEFAULT_LEVEL,
    compressors: Compressors | None = None,
) -> list[Buffer]:
    """`encode_delta_parts` given the xor of the chunk and its base, already computed."""
    if len(base_id) != ID_SIZE:
        raise ValueError(f"a chunk id is {ID_SIZE} bytes")
    inner = encode_parts(xored, element_size=element_size, level=level,
                         compressors=compressors)
    return [_HEAD.pack(Method.XOR_DELTA, len(xored)), bytes(base_id), *inner]


def patch_parameters(size: int, level: int) -> zstandard.ZstdCompressionParameters:
    """zstd parameters for a patch of a `size`-byte chunk against a base of the same size.

    The window covers base and chunk, so a match can reach the same position in the base.
    At the fast levels, the hash table needs about one slot per 16 bytes of base to keep
    finding the base after a changed value (measured on bf16 and fp32 chunks of 4 MiB:
    with one per 32, patches of sparse changes grew 30-fold).
    """
    window_log = min(MAX_WINDOW_LOG, max(10, (2 * size - 1).bit_length()))
    if level > 3:
        return zstandard.ZstdCompressionParameters.from_level(level, window_log=window_log)
    return zstandard.ZstdCompressionParameters(
        compression_level=level, window_log=window_log,
        hash_log=min(window_log - 3, max(6, size.bit_length() - 4)))


def encode_patch(data: Buffer, base: Buffer, base_id: bytes, *,
                 level: int = DEFAULT_LEVEL) -> bytes:
    """`data` as a zstd patch of `base` (same size): what it shares with it costs ~nothing."""
    return b"".join(encode_patch_parts(data, base, base_id, level=level))


def encode_patch_parts(data: Buffer, base: Buffer, base_id: bytes, *,
                       level: int = DEFAULT_LEVEL) -> list[Buffer]:
    """`encode_patch` as pieces to be concatenated."""
    if len(base_id) != ID_SIZE:
        raise ValueError(f"a chunk id is {ID_SIZE} bytes")
    if len(data) != len(base) or not data:
        raise ValueError(f"a patch of {len(data)} bytes against {len(base)} bytes")
    dictionary = zstandard.ZstdCompressionDict(base, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
    compressor = zstandard.ZstdCompressor(dict_data=dictionary,
                                          compression_params=patch_parameters(len(data), level))
    return [_HEAD.pack(Method.ZSTD_PATCH, len(data)), bytes(base_id), compressor.compress(data)]


def blob_methods(blob: Buffer) -> tuple[Method, ...]:
    """The blob's method, and for an xor delta also its inner blob's."""
    method, _size = _unpack_head(blob)
    if method != Method.XOR_DELTA or len(blob) < 2 * _HEAD.size + ID_SIZE:
        return (method,)
    return method, _unpack_head(memoryview(blob)[_HEAD.size + ID_SIZE:])[0]


def delta_base_id(blob: Buffer) -> bytes | None:
    """The id of the chunk `blob` is a delta against, or None if it stands alone."""
    method, _size = _unpack_head(blob)
    if method not in DELTA_METHODS:
        return None
    if len(blob) < _HEAD.size + ID_SIZE:
        raise MalformedData("delta blob shorter than its header")
    return bytes(blob[_HEAD.size:_HEAD.size + ID_SIZE])


def decode(blob: Buffer, base: Buffer | None = None) -> bytes | bytearray:
    """The chunk `blob` encodes; `base` is the plaintext of its delta base, if it has one."""
    view = memoryview(blob)  # slices below are views, not copies
    method, size = _unpack_head(view)
    if method not in DELTA_METHODS:
        return _decode_standalone(view)
    if base is None:
        raise MalformedData("delta blob decoded without its base chunk")
    if len(base) != size:
        raise MalformedData(f"delta of {size} bytes against a base of {len(base)} bytes")
    if len(view) < _HEAD.size + ID_SIZE:
        raise MalformedData("delta blob shorter than its header")
    inner = view[_HEAD.size + ID_SIZE:]
    if method == Method.ZSTD_PATCH:
        return _unpatch(inner, base, size)
    if _unpack_head(inner)[0] in DELTA_METHODS:
        raise MalformedData("delta blob nests another delta")
    return xor_bytes(_decode_standalone(inner, size), base)


def decode_into(blob: Buffer, out: Writable, offset: int, size: int,
                base: Buffer | None = None) -> None:
    """Decode a chunk of `size` bytes into `out[offset:offset + size]`; as `decode` else.

    Byte planes are merged and patches decompressed in place (no intermediate buffer); a
    blob that declares another size is refused before anything is written.
    """
    view = memoryview(blob)
    method, declared = _unpack_head(view)
    if declared != size:
        raise MalformedData(f"blob decodes to {declared} bytes, expected {size}")
    if offset < 0 or offset + size > len(out):
        raise ValueError(f"{size} bytes at {offset} do not fit in {len(out)}")
    if method == Method.PLANES:
        merge_planes_into(_planes(view[_HEAD.size:], size), out, offset)
    elif method == Method.SPARSE_PLANES:
        _sparse_planes_into(view[_HEAD.size:], size, out, offset)
    elif method in DELTA_METHODS and base is not None and len(base) == size:
        if len(view) < _HEAD.size + ID_SIZE:
            raise MalformedData("delta blob shorter than its header")
        inner = view[_HEAD.size + ID_SIZE:]
        if method == Method.ZSTD_PATCH:
            with memoryview(out)[offset:offset + size] as target:
                _unpatch_into(inner, base, target)
        else:
            if _unpack_head(inner)[0] in DELTA_METHODS:
                raise MalformedData("delta blob nests another delta")
            decode_into(inner, out, offset, size)
            xored = np.frombuffer(out, np.uint8, size, offset)
            np.bitwise_xor(xored, np.frombuffer(base, np.uint8), out=xored)
    else:
        out[offset:offset + size] = decode(view, base)


def encode_plane(plane: Buffer, compressors: Compressors) -> list[Buffer]:
    """A plane's header and body: zstd if that makes it smaller, else raw.

    The plane parameters suit noise-like planes. Where they shrink data below a third
    there is structure (runs of zeros: never-updated rows of an optimizer state,
    padding), and plain zstd at the same level, which finds longer matches, may do
    better; so both are tried. A large plane is decided on a sample spread over it, then
    compressed once: stored raw without running zstd over it at all if the sample did
    not shrink by 5 % (mantissa bytes are noise).
    """
    packed: Buffer
    if len(plane) < SAMPLE_MIN:
        packed = _smallest(plane, compressors)[1]
    else:
        compressor = _smallest(_sample(plane), compressors)[0]
        packed = plane if compressor is None else compressor.compress(plane)
    if len(packed) < len(plane):
        return [_HEAD.pack(Method.ZSTD, len(packed)), packed]
    return [_HEAD.pack(Method.RAW, len(plane)), plane]


def _sample(plane: Buffer) -> bytes:
    step = len(plane) // SAMPLE_PIECES
    return b"".join(plane[i * step:i * step + SAMPLE_PIECE] for i in range(SAMPLE_PIECES))


def _smallest(data: Buffer, compressors: Compressors
              ) -> tuple[zstandard.ZstdCompressor | None, bytes]:
    """The context that compresses `data` best and its output; None if not by 5 %."""
    best, packed = compressors.plane, compressors.plane.compress(data)
    if len(packed) < STRUCTURED_RATIO * len(data):
        alternative = compressors.whole.compress(data)
        if len(alternative) < len(packed):
            best, packed = compressors.whole, alternative
    if len(packed) > SAMPLE_MAX_RATIO * len(data):
        return None, packed
    return best, packed


def _unpack_head(blob: Buffer) -> tuple[Method, int]:
    if len(blob) < _HEAD.size:
        raise MalformedData(f"blob of {len(blob)} bytes is shorter than its header")
    method, size = _HEAD.unpack_from(blob)
    try:
        return Method(method), size
    except ValueError:
        raise MalformedData(f"unknown blob method {method}") from None


def _decode_standalone(blob: memoryview, expected_size: int | None = None) -> bytes | bytearray:
    method, size = _unpack_head(blob)
    if expected_size is not None and size != expected_size:
        raise MalformedData(f"inner blob decodes to {size} bytes, not {expected_size}")
    body = blob[_HEAD.size:]
    data: bytes | bytearray
    if method == Method.RAW:
        data = body.tobytes()
    elif method == Method.ZSTD:
        data = _unzstd(body, size)
    elif method == Method.PLANES:
        data = merge_planes(_planes(body, size))
    elif method == Method.SPARSE_PLANES:
        data = bytearray(size)
        _sparse_planes_into(body, size, data, 0)
    else:
        raise MalformedData(f"blob method {method.name} is not allowed here")
    if len(data) != size:
        raise MalformedData(f"blob decodes to {len(data)} bytes, its header says {size}")
    return data


def _sparse_planes_into(body: memoryview, size: int, out: Writable, offset: int) -> None:
    """Decode a method-5 body: zeros everywhere, the stored values where the mask says."""
    head = 1 + _LENGTH.size
    if len(body) < head or body[0] not in PLANE_ELEMENT_SIZES or size % body[0]:
        raise MalformedData("sparse byte-plane blob with a bad head or element size")
    element_size, (mask_length,) = body[0], _LENGTH.unpack_from(body, 1)
    if len(body) < head + mask_length:
        raise MalformedData("sparse byte-plane blob truncated in its mask")
    count = size // element_size
    mask = _decode_inner(body[head:head + mask_length], (count + 7) // 8,
                         (Method.RAW, Method.ZSTD))
    is_nonzero = np.unpackbits(np.frombuffer(mask, np.uint8), count=count).view(bool)
    values = _decode_inner(body[head + mask_length:],
                           int(np.count_nonzero(is_nonzero)) * element_size,
                           (Method.RAW, Method.ZSTD, Method.PLANES))
    target = np.frombuffer(out, _UNSIGNED[element_size], count, offset)
    target[:] = 0
    target[is_nonzero] = np.frombuffer(values, _UNSIGNED[element_size])


def _decode_inner(blob: memoryview, size: int, allowed: tuple[Method, ...]) -> Buffer:
    """A blob nested in another, of one of the `allowed` methods, decoding to `size` bytes."""
    if _unpack_head(blob)[0] not in allowed:
        raise MalformedData(f"blob method {_unpack_head(blob)[0].name} is not allowed here")
    return _decode_standalone(blob, size)


def _planes(body: memoryview, size: int) -> list[Buffer]:
    """The planes of a byte-plane body, decompressed and checked, ready to merge."""
    if not body or body[0] not in PLANE_ELEMENT_SIZES or size % body[0]:
        raise MalformedData("byte-plane blob with a bad element size")
    element_size, plane_size = body[0], size // body[0]
    planes: list[Buffer] = []
    pos = 1
    for _ in range(element_size):
        if len(body) < pos + _HEAD.size:
            raise MalformedData("byte-plane blob truncated in a plane header")
        method, length = _HEAD.unpack_from(body, pos)
        pos += _HEAD.size
        plane: Buffer = body[pos:pos + length]
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
    return planes


def _unpatch(frame: Buffer, base: Buffer, size: int) -> bytes:
    """A patch frame applied to its base: a zstd frame decoded with the base as dictionary."""
    try:
        declared = zstandard.frame_content_size(frame)
        if declared != size:
            raise MalformedData(f"zstd frame declares {declared} bytes, expected {size}")
        dictionary = zstandard.ZstdCompressionDict(base, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
        return zstandard.ZstdDecompressor(dict_data=dictionary).decompress(frame)
    except zstandard.ZstdError as exc:
        raise MalformedData(f"zstd patch: {exc}") from None


def _unpatch_into(frame: Buffer, base: Buffer, target: memoryview) -> None:
    """`_unpatch` straight into `target`, which it fills exactly."""
    try:
        declared = zstandard.frame_content_size(frame)
        if declared != len(target):
            raise MalformedData(f"zstd frame declares {declared} bytes, expected {len(target)}")
        dictionary = zstandard.ZstdCompressionDict(base, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
        decompressor = zstandard.ZstdDecompressor(dict_data=dictionary)
        with decompressor.stream_reader(frame, read_size=len(frame)) as reader:
            filled = 0
            while filled < len(target):
                got = reader.readinto(target[filled:])
                if not got:
                    raise MalformedData(f"zstd patch ends after {filled} of {len(target)} bytes")
                filled += got
            if reader.read(1):
                raise MalformedData("zstd patch decodes to more than its declared size")
    except zstandard.ZstdError as exc:
        raise MalformedData(f"zstd patch: {exc}") from None


def _unzstd(frame: Buffer, size: int) -> bytes:
    # Check the declared size first: the decompressor trusts it when allocating.
    try:
        declared = zstandard.frame_content_size(frame)
        if declared != size:
            raise MalformedData(f"zstd frame declares {declared} bytes, expected {size}")
        return zstandard.ZstdDecompressor().decompress(frame)
    except zstandard.ZstdError as exc:
        raise MalformedData(f"zstd: {exc}") from None
