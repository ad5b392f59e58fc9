"""Pure tests of blob encoding (byte planes, sparse planes, zstd, raw fallback, deltas) and
chunking."""

from __future__ import annotations

import random
import struct

import pytest
import zstandard

from slurm_geo.ckpt.errors import MalformedData
from slurm_geo.ckpt.format.chunking import GEAR, CdcParams, content_defined_chunks, fixed_chunks
from slurm_geo.ckpt.format.codec import (
    SAMPLE_MIN,
    SPARSE_AT_LEAST,
    Compressors,
    Method,
    blob_methods,
    changed_fraction,
    decode,
    decode_into,
    delta_base_id,
    encode,
    encode_delta,
    encode_patch,
    encode_plane,
    merge_planes,
    merge_planes_into,
    split_planes,
    xor_bytes,
)


def float32_bytes(count: int, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    return struct.pack(f"<{count}f", *(rng.gauss(0, 0.02) for _ in range(count)))


def bfloat16_bytes(count: int, seed: int = 0) -> bytes:
    """bfloat16 is the high half of a float32."""
    full = float32_bytes(count, seed)
    return b"".join(full[i + 2:i + 4] for i in range(0, len(full), 4))


def random_bytes(count: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(count)


def method_of(blob: bytes) -> Method:
    return Method(blob[0])


@pytest.mark.parametrize(
    "data, element_size, method",
    [
        (b"", 1, Method.RAW),
        (b"hello", 1, Method.RAW),
        (bytes(4096), 1, Method.ZSTD),
        (random_bytes(4096), 1, Method.RAW),
        (random_bytes(4096), 4, Method.RAW),
        (float32_bytes(2048), 4, Method.PLANES),
        (bfloat16_bytes(2048), 2, Method.PLANES),
        (float32_bytes(2048) + b"x", 4, Method.ZSTD),  # not whole elements: no planes
        (bytes(4096), 8, Method.ZSTD),  # planes are for element sizes 2 and 4 only
        (b"ab" * 3000, 2, Method.PLANES),
    ],
    ids=["empty", "tiny", "zeros", "random", "random-f32", "f32", "bf16", "ragged", "f64",
         "pattern"],
)
def test_encode_round_trips_with_the_expected_method(data, element_size, method):
    blob = encode(data, element_size=element_size)
    assert method_of(blob) == method
    assert decode(blob) == data
    assert len(blob) <= len(data) + 5


def test_incompressible_data_is_stored_raw_with_a_five_byte_header():
    data = random_bytes(10_000)
    assert encode(data, element_size=4) == b"\x00" + struct.pack("<I", len(data)) + data


def test_float_planes_compress_exponents_and_keep_mantissa_noise_raw():
    blob = encode(float32_bytes(4096), element_size=4)
    assert blob[5] == 4  # element size
    plane_methods, pos = [], 6
    for _ in range(4):
        method, length = struct.unpack_from("<BI", blob, pos)
        plane_methods.append(Method(method))
        pos += 5 + length
    assert plane_methods[0] == Method.RAW  # lowest mantissa byte: noise
    assert plane_methods[3] == Method.ZSTD  # sign and exponent
    assert len(blob) < len(encode(float32_bytes(4096), element_size=1))


@pytest.mark.parametrize(
    "data, element_size, planes",
    [
        (bytes(range(8)), 4, [b"\x00\x04", b"\x01\x05", b"\x02\x06", b"\x03\x07"]),
        (bytes(range(6)), 2, [b"\x00\x02\x04", b"\x01\x03\x05"]),
    ],
)
def test_byte_planes_split_and_merge(data, element_size, planes):
    assert split_planes(data, element_size) == planes
    assert merge_planes(planes) == data


@pytest.mark.parametrize(
    "a, b, result",
    [(b"", b"", b""), (b"\x0f\xf0", b"\xff\xff", b"\xf0\x0f"), (b"abc", b"abc", bytes(3))],
)
def test_xor_bytes(a, b, result):
    assert xor_bytes(a, b) == result


def test_xor_of_unequal_lengths_is_refused():
    with pytest.raises(MalformedData):
        xor_bytes(b"ab", b"a")


def test_delta_of_a_lightly_changed_chunk_is_small_and_round_trips():
    base = float32_bytes(4096)
    changed = bytearray(base)
    changed[100:104] = struct.pack("<f", 1.5)
    base_id = bytes(range(32))
    blob = encode_delta(bytes(changed), base, base_id, element_size=4)
    assert method_of(blob) == Method.XOR_DELTA
    assert delta_base_id(blob) == base_id
    assert len(blob) < 200 < len(encode(bytes(changed), element_size=4))
    assert decode(blob, base) == bytes(changed)


@pytest.mark.parametrize("element_size", [2, 4])
def test_a_patch_of_sparse_changes_is_small_and_round_trips(element_size):
    base = bfloat16_bytes(8192) if element_size == 2 else float32_bytes(8192)
    changed = bytearray(base)
    for position in range(100, len(base), 997 * element_size):  # ~0.1 % of the values
        changed[position:position + element_size] = bytes(element_size)
    base_id = bytes(range(32))
    blob = encode_patch(bytes(changed), base, base_id)
    assert method_of(blob) == Method.ZSTD_PATCH and delta_base_id(blob) == base_id
    assert len(blob) < len(base) // 20
    assert decode(blob, base) == bytes(changed)
    out = bytearray(len(base) + 8)
    decode_into(blob, out, 4, len(base), base)
    assert out[4:-4] == changed and out[:4] == out[-4:] == bytes(4)
    # Against another base it decodes to other bytes, which the chunk id check catches.
    assert decode(blob, bytes(len(base))) != bytes(changed)
    for damaged in (blob[:-5], blob[:40], blob + b"!"):
        with pytest.raises(MalformedData):
            decode_into(damaged, bytearray(len(base)), 0, len(base), base)


def test_standalone_blob_has_no_delta_base():
    assert delta_base_id(encode(b"hello")) is None


def _zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


def _head(method: int, size: int) -> bytes:
    return struct.pack("<BI", method, size)


DELTA_OF_5 = _head(3, 5) + bytes(32) + _head(0, 5) + b"\x00" * 5


@pytest.mark.parametrize(
    "blob, base",
    [
        (b"\x00\x01", None),  # shorter than the header
        (_head(9, 1) + b"x", None),  # unknown method
        (_head(0, 6) + b"hello", None),  # raw body shorter than declared
        (_head(1, 6) + _zstd(b"hello"), None),  # frame declares another size
        (_head(1, 5) + b"not a frame", None),
        (_head(2, 4) + b"\x03" + b"abcd", None),  # element size 3
        (_head(2, 4) + b"\x02" + _head(0, 2) + b"ab", None),  # one of two planes
        (_head(2, 4) + b"\x02" + (_head(0, 2) + b"ab") * 2 + b"!", None),  # trailing byte
        (DELTA_OF_5, None),  # delta without its base
        (DELTA_OF_5, b"abcd"),  # base of another size
        (_head(3, 5) + bytes(32) + DELTA_OF_5[:5] + bytes(37), b"hello"),  # nested delta
        (_head(4, 5) + bytes(32) + _zstd(b"hello"), None),  # patch without its base
        (_head(4, 5) + bytes(32) + _zstd(b"hello"), b"hello!"),  # base of another size
        (_head(4, 6) + bytes(32) + _zstd(b"hello"), b"hello!"),  # frame of another size
        (_head(4, 5) + bytes(10), b"hello"),  # shorter than its base id
        (_head(4, 5) + bytes(32) + b"not a frame", b"hello"),
    ],
    ids=["short", "method", "raw-short", "zstd-size", "zstd-garbage", "plane-size",
         "plane-missing", "plane-trailing", "no-base", "base-size", "nested-delta",
         "patch-no-base", "patch-base-size", "patch-frame-size", "patch-short",
         "patch-garbage"],
)
def test_malformed_blobs_are_refused(blob, base):
    with pytest.raises(MalformedData):
        decode(blob, base)


@pytest.mark.parametrize(
    "length, chunk_size, sizes",
    [(0, 16, []), (16, 16, [16]), (40, 16, [16, 16, 8]), (5, 16, [5])],
)
def test_fixed_chunks_cut_at_multiples_of_the_chunk_size(length, chunk_size, sizes):
    chunks = list(fixed_chunks(memoryview(bytes(range(length))), chunk_size))
    assert [len(c) for c in chunks] == sizes
    assert b"".join(chunks) == bytes(range(length))


SMALL_CDC = CdcParams(min_size=256, mask_bits=8, max_size=2048)


def reference_cuts(data: bytes, params: CdcParams) -> list[int]:
    """The gear chunker as docs/format.md §7.2 words it: hash from each cut, byte by byte."""
    cuts, start = [], 0
    while start < len(data):
        h, end = 0, min(len(data), start + params.max_size)
        for i in range(start, end):
            h = ((h << 1) + GEAR[data[i]]) & (2**64 - 1)
            if i + 1 - start >= params.min_size and h >> (64 - params.mask_bits) == 0:
                end = i + 1
                break
        cuts.append(end)
        start = end
    return cuts


def cdc_cuts(data: bytes, params: CdcParams = SMALL_CDC) -> list[int]:
    cuts, end = [], 0
    for chunk in content_defined_chunks(memoryview(data), params):
        end += len(chunk)
        cuts.append(end)
    return cuts


@pytest.mark.parametrize("length", [0, 100, 256, 5000, 40_000])
def test_content_defined_chunks_match_the_specified_algorithm(length):
    data = random_bytes(length, seed=length)
    cuts = cdc_cuts(data)
    assert cuts == reference_cuts(data, SMALL_CDC)
    sizes = [b - a for a, b in zip([0] + cuts, cuts, strict=False)]
    assert all(s <= SMALL_CDC.max_size for s in sizes)
    assert all(s >= SMALL_CDC.min_size for s in sizes[:-1])


def test_content_defined_cuts_survive_an_insertion_at_the_front():
    data = random_bytes(60_000, seed=7)
    shifted = b"inserted!" + data
    later = {c + 9 for c in cdc_cuts(data)[3:]}
    assert later <= set(cdc_cuts(shifted))


def test_cdc_parameters_are_checked():
    with pytest.raises(ValueError):
        CdcParams(min_size=10, mask_bits=8, max_size=100)


@pytest.mark.parametrize(
    "data, element_size",
    [(b"hello", 1), (bytes(4096), 1), (float32_bytes(2048), 4), (bfloat16_bytes(2048), 2),
     (random_bytes(4096), 4)],
    ids=["raw", "zstd", "f32-planes", "bf16-planes", "raw-f32"],
)
def test_decode_into_writes_the_chunk_in_place_and_nothing_else(data, element_size):
    blob = encode(data, element_size=element_size)
    out = bytearray(b"\xee" * (len(data) + 20))
    decode_into(blob, out, 7, len(data))
    assert out[7:7 + len(data)] == data
    assert out[:7] == b"\xee" * 7 and out[7 + len(data):] == b"\xee" * 13


def test_decode_into_refuses_a_blob_of_another_size_before_writing():
    out = bytearray(16)
    with pytest.raises(MalformedData, match="expected 4"):
        decode_into(encode(b"hello"), out, 0, 4)
    assert out == bytearray(16)


def test_decode_into_applies_a_delta():
    base = float32_bytes(1024)
    changed = bytearray(base)
    changed[8:12] = struct.pack("<f", 2.0)
    blob = encode_delta(bytes(changed), base, bytes(32), element_size=4)
    out = bytearray(len(base))
    decode_into(blob, out, 0, len(base), base)
    assert out == changed


def plane_methods(blob: bytes) -> list[Method]:
    methods, pos = [], 6
    for _ in range(blob[5]):
        method, length = struct.unpack_from("<BI", blob, pos)
        methods.append(Method(method))
        pos += 5 + length
    return methods


def test_large_planes_whose_sample_does_not_compress_are_stored_raw():
    data = float32_bytes(SAMPLE_MIN)  # four planes of SAMPLE_MIN bytes
    blob = encode(data, element_size=4)
    assert plane_methods(blob) == [Method.RAW, Method.RAW, Method.RAW, Method.ZSTD]
    assert decode(blob) == data


def test_the_sample_is_spread_over_the_plane():
    """Noise first, a constant after: a sample of the start alone would store it raw."""
    half = SAMPLE_MIN
    data = random_bytes(half * 2) + b"\x01" * (half * 2)  # two planes, each half noise
    blob = encode(data, element_size=2)
    assert plane_methods(blob) == [Method.ZSTD, Method.ZSTD]
    assert decode(blob) == data


def test_merge_planes_into_fills_only_its_range():
    out = bytearray(b"." * 10)
    merge_planes_into([b"ac", b"bd"], out, 3)
    assert out == bytearray(b"...abcd...")


@pytest.mark.parametrize("level", [-1, 1, 3, 9])
def test_every_level_round_trips(level):
    data = float32_bytes(4096) + bytes(4096)
    for element_size in (1, 4):
        assert decode(encode(data, element_size=element_size, level=level)) == data


def structured_plane(size: int) -> bytes:
    """An optimizer-state exponent plane: zero rows (never updated) and rows that repeat
    (low-rank gradients make rows alike): long-range structure."""
    rng = random.Random(3)
    row = 2048
    rows = [bytes(rng.choice(b"\x3c\x3d\x3e\xbc\xbd\xbe") for _ in range(row))
            for _ in range(4)]
    return b"".join(bytes(row) if rng.random() < 0.5 else rng.choice(rows)
                    for _ in range(size // row))


@pytest.mark.parametrize("size", [64 * 1024, SAMPLE_MIN])
def test_a_plane_is_compressed_by_whichever_context_suits_it(size):
    """Plane parameters for noise-like exponents; plain zstd where zero runs dominate."""
    compressors = Compressors()
    exponents = float32_bytes(size)[3::4] + float32_bytes(size, seed=1)[3::4]
    for plane, context in ((exponents, compressors.plane),
                           (structured_plane(size), compressors.whole)):
        head, body = encode_plane(plane, compressors)
        assert Method(head[0]) == Method.ZSTD
        assert body == context.compress(plane)
        assert len(body) <= len(compressors.plane.compress(plane))


def with_zeros(data: bytes, element_size: int, every: int) -> bytes:
    """`data` with every `every`-th element zeroed, as units that never activate leave
    their optimizer moments."""
    out = bytearray(data)
    for start in range(0, len(out), every * element_size):
        out[start:start + element_size] = bytes(element_size)
    return bytes(out)


@pytest.mark.parametrize("element_size", [2, 4])
@pytest.mark.parametrize("every", [2, 10, 19])  # 50 %, 10 %, 5.3 % zeros
def test_a_chunk_with_many_zero_elements_is_stored_as_sparse_planes(element_size, every):
    dense = float32_bytes(8192) if element_size == 4 else bfloat16_bytes(8192)
    data = with_zeros(dense, element_size, every)
    blob = encode(data, element_size=element_size)
    assert method_of(blob) == Method.SPARSE_PLANES
    assert decode(blob) == data
    out = bytearray(b"\xee" * (len(data) + 9))
    decode_into(blob, out, 4, len(data))
    assert out[4:4 + len(data)] == data and out[:4] + out[-5:] == b"\xee" * 9
    # The zeros cost about a bit each (the mask), not their share of mantissa planes.
    planes_alone = encode(data, element_size=element_size, level=1)
    assert len(blob) < len(encode(dense, element_size=element_size)) * (1 - 0.5 / every)
    assert len(blob) <= len(planes_alone)


@pytest.mark.parametrize(
    "data, element_size, method",
    [
        (bytes(4096), 4, Method.SPARSE_PLANES),  # all zero: a mask and no values
        (with_zeros(float32_bytes(2048), 4, 25), 4, Method.PLANES),  # 4 % zeros
        (with_zeros(random_bytes(8192), 4, 2), 4, Method.SPARSE_PLANES),  # noise values
        (bytes(4096), 1, Method.ZSTD),  # not a float dtype: no planes of any kind
    ],
    ids=["all-zero", "few-zeros", "noise", "bytes"],
)
def test_sparse_planes_are_used_from_the_threshold_on(data, element_size, method):
    zero_share = 1 - changed_fraction(data, element_size)
    assert (method == Method.SPARSE_PLANES) == (element_size > 1 and zero_share >= SPARSE_AT_LEAST)
    blob = encode(data, element_size=element_size)
    assert method_of(blob) == method
    assert decode(blob) == data


def sparse_blob(size: int, element_size: int, mask: bytes, values: bytes) -> bytes:
    return (_head(5, size) + bytes([element_size]) + struct.pack("<I", len(mask)) + mask
            + values)


@pytest.mark.parametrize(
    "blob",
    [
        sparse_blob(8, 3, _head(0, 1) + b"\x80", _head(0, 3) + b"abc"),  # element size 3
        sparse_blob(8, 4, _head(0, 1) + b"\xc0", _head(0, 4) + b"abcd"),  # 2 set, 1 value
        sparse_blob(8, 4, _head(0, 2) + b"\x80\x00", _head(0, 4) + b"abcd"),  # mask size
        sparse_blob(8, 4, _head(0, 1), b""),  # truncated in its mask
        sparse_blob(8, 4, _head(0, 1) + b"\x80", b""),  # no values blob
        sparse_blob(8, 4, _head(2, 1) + b"\x80", _head(0, 4) + b"abcd"),  # mask as planes
        sparse_blob(8, 4, _head(0, 1) + b"\x80", _head(5, 4) + b"abcd"),  # nested sparse
        _head(5, 8) + b"\x04\x01",  # shorter than its head
    ],
    ids=["element-size", "value-count", "mask-size", "mask-truncated", "no-values",
         "mask-method", "nested", "short-head"],
)
def test_malformed_sparse_planes_are_refused(blob):
    with pytest.raises(MalformedData):
        decode(blob)
    with pytest.raises(MalformedData):
        decode_into(blob, bytearray(8), 0, 8)


def test_the_sparse_planes_vector_of_the_spec_decodes():
    """docs/format.md §10. Mask bits are most significant first: 0x40 sets element 1 of 2."""
    vector = bytes.fromhex("05 08000000 04 06000000 00 01000000 40 00 04000000 61626364")
    assert vector == sparse_blob(8, 4, _head(0, 1) + b"\x40", _head(0, 4) + b"abcd")
    assert decode(vector) == bytes(4) + b"abcd"


@pytest.mark.parametrize(
    "xored, element_size, fraction",
    [
        (b"", 4, 0.0),
        (bytes(8), 4, 0.0),
        (b"\x00\x00\x00\x01" + bytes(4), 4, 0.5),  # one of two float32s changed
        (b"\x01\x00\x00\x01", 2, 1.0),
        (b"\x01\x00\x00\x00", 1, 0.25),
        (b"\x01\x00\x00", 2, 1 / 3),  # not whole elements: bytes are counted
    ],
)
def test_changed_fraction_counts_elements_that_differ(xored, element_size, fraction):
    assert changed_fraction(xored, element_size) == pytest.approx(fraction)


def test_blob_methods_name_the_inner_blob_of_an_xor_delta():
    base = float32_bytes(1024)
    changed = with_zeros(base, 4, 2)
    assert blob_methods(encode(base, element_size=4)) == (Method.PLANES,)
    assert blob_methods(encode_delta(changed, base, bytes(32), element_size=4)) == (
        Method.XOR_DELTA, Method.SPARSE_PLANES)  # half the values unchanged: zeros in the xor
