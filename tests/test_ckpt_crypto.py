"""Known-answer vectors (docs/format.md §10), sealed objects, packs and the master key file.

The vectors are checked twice: against the implementation, and against a few lines of
independent code written from the spec, so the spec and the code cannot drift apart.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
import struct
from pathlib import Path

import blake3
import pytest
import zstandard
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from slurm_geo.ckpt.errors import (
    CkptError,
    CorruptObject,
    KeyFileError,
    LegacyObject,
    UnsupportedFormat,
    WrongKey,
)
from slurm_geo.ckpt.format.codec import decode, delta_base_id, encode
from slurm_geo.ckpt.format.keys import (
    KeyFile,
    LiveKeyFile,
    RunKeys,
    chunk_id,
    create_master_key_file,
    federation_state_key,
    fence_key,
    fingerprint,
    load_master_key,
    promotion_key,
    write_key_file,
)
from slurm_geo.ckpt.format.pack import Entry, PackReader, PackWriter, check_pack_id
from slurm_geo.ckpt.format.seal import Kind, open_legacy, open_sealed, open_with_ring, seal

MASTER = bytes(range(32))
DATA_KEY = bytes(range(32, 64))
SALT = bytes(range(0xA0, 0xB0))

FINGERPRINT_MASTER = "55ade8af0381597a"
FINGERPRINT_DATA = "af5518d68abf18c7"
ID_KEY = "faceef5df6d471442a0b92b15ef19e26c0b194ed0622e688cd17cfe887ff1adb"
HELLO_ID = "2606749848cbc3ce63e1ade2a43cbd42cc17c820b3d29af60152ab6e417a8c62"
HELLO_ID_V1 = "ff7bdaa843e27bb41908be2a371af66f8b2ac4c991dfcb6b6595908d7e0f94eb"
SEALED_KEY = (
    "5347454f5345414c010155ade8af0381597aa0a1a2a3a4a5a6a7a8a9aaabacadaeaf"
    "d98663de9c354511ad969e76a1d5d7bb18472212a01cc2883e7d2aa83c13097346b9965f2beb199cf8a157696bf89a3e"
)
FENCE_KEY = "7a1fc1398d1e831634ee3ddf645daec103f4e72b71845fe7a18c20f98daf3a55"
PROMOTION_KEY = "203ac1ca40b17553d7f3f219f1dd7e59abac7ff17ed9692e8da13ee267a45c93"
FINGERPRINT_FENCE = "969e4390281787e5"
FINGERPRINT_PROMOTION = "51c3ebede1f3553c"
MARKER_NAME = "promoted/r/00000000000000000001"
MARKER_PAYLOAD = b'{"run": "r", "step": 1, "promoted_at": "2026-11-29T12:00:00+00:00"}'
SEALED_MARKER = (
    "5347454f5345414c020451c3ebede1f3553ca0a1a2a3a4a5a6a7a8a9aaabacadaeaf"
    "bcb579050d5e35e7f5bc2b92b7d5809e137c4e8e7983d0b001bc5e74c89fe47b3666d3538321cd21cb83a38c"
    "ae2a603fcf88232bbe16a9b7c9c7bfb8b98544b098650a76dae5794da0113cc51e13af1d7a7cbd"
)
STATE_KEY = "1210d4051945fee62eeb8c8ed2161a5c3cb5db22f44666a9887d7cf0e4fb41e1"
FINGERPRINT_STATE = "050f16e03134dacf"
STATE_NAME = "/slurm-geo/federation/secrets/j/0000000001"
STATE_PAYLOAD = b'{"secret":"ab"}'
SEALED_STATE = (
    "5347454f5345414c0106050f16e03134dacfa0a1a2a3a4a5a6a7a8a9aaabacadaeaf"
    "018cc3c7c082c7fdc02a0b560ee67234d70f96071dc10997c38742890ceffd"
)
HELLO_BLOB = "000500000068656c6c6f"
PACK = (
    "5347454f5041434b03a0a1a2a3a4a5a6a7a8a9aaabacadaeaf"
    "2606749848cbc3ce63e1ade2a43cbd42cc17c820b3d29af60152ab6e417a8c621a000000"
    "bbf75e4de2eaaa0d9f1a1c183b1f10e7ce81c7de6ae3679383fe"
)
PACK_ID = "a42182409367df3bc599a2a046e91224296f575298d49320a3f44bf7a3859e43"
# What writers of format version 1 (pack version 1) wrote: readers still open it.
PACK_V1 = (
    "5347454f5041434b01a0a1a2a3a4a5a6a7a8a9aaabacadaeaf"
    "ff7bdaa843e27bb41908be2a371af66f8b2ac4c991dfcb6b6595908d7e0f94eb1a000000"
    "bbf75e4de2eaaa0d9f1ae771e8980b892655202b1e6c55e0b7b4"
)
PACK_V1_ID = "4e5f6732ce6bf919c82cc7ba980c5f5cb82aa447113f9d1a5fa5349a0141019f"


def test_key_derivations_match_the_vectors():
    keys = RunKeys(DATA_KEY)
    assert fingerprint(MASTER).hex() == FINGERPRINT_MASTER
    assert keys.fingerprint.hex() == FINGERPRINT_DATA
    assert keys.id_key.hex() == ID_KEY
    assert chunk_id(keys.id_key, b"hello", 2).hex() == HELLO_ID
    assert chunk_id(keys.id_key, b"hello", 1).hex() == HELLO_ID_V1
    assert fence_key(MASTER).hex() == FENCE_KEY
    assert promotion_key(MASTER).hex() == PROMOTION_KEY
    assert fingerprint(bytes.fromhex(FENCE_KEY)).hex() == FINGERPRINT_FENCE
    assert fingerprint(bytes.fromhex(PROMOTION_KEY)).hex() == FINGERPRINT_PROMOTION
    assert federation_state_key(MASTER).hex() == STATE_KEY
    assert fingerprint(bytes.fromhex(STATE_KEY)).hex() == FINGERPRINT_STATE


def test_the_promotion_marker_matches_its_vector():
    key = promotion_key(MASTER)
    assert seal(key, Kind.PROMOTED, SALT, MARKER_PAYLOAD, MARKER_NAME).hex() == SEALED_MARKER
    assert open_sealed(key, Kind.PROMOTED, bytes.fromhex(SEALED_MARKER),
                       MARKER_NAME) == MARKER_PAYLOAD


def test_a_federation_state_value_matches_its_vector():
    key = federation_state_key(MASTER)
    assert seal(key, Kind.FEDERATION_STATE, SALT, STATE_PAYLOAD, STATE_NAME).hex() \
        == SEALED_STATE
    assert open_sealed(key, Kind.FEDERATION_STATE, bytes.fromhex(SEALED_STATE),
                       STATE_NAME) == STATE_PAYLOAD
    with pytest.raises(CorruptObject):  # the same value under another etcd key
        open_sealed(key, Kind.FEDERATION_STATE, bytes.fromhex(SEALED_STATE),
                    STATE_NAME.replace("/j/", "/k/"))


def test_sealed_key_and_pack_match_the_vectors():
    assert seal(MASTER, Kind.DATA_KEY, SALT, DATA_KEY, "keys/r").hex() == SEALED_KEY
    assert encode(b"hello").hex() == HELLO_BLOB
    writer = PackWriter(DATA_KEY, SALT)
    assert writer.add(bytes.fromhex(HELLO_ID), bytes.fromhex(HELLO_BLOB)) == Entry(
        bytes.fromhex(HELLO_ID), 25, 62)
    assert writer.finish() == (PACK_ID, bytes.fromhex(PACK))


def test_a_version_1_pack_still_opens():
    pack = bytes.fromhex(PACK_V1)
    check_pack_id("p", PACK_V1_ID, pack)
    entry = Entry(bytes.fromhex(HELLO_ID_V1), 25, 62)
    assert decode(PackReader(DATA_KEY, "p", pack).blob(entry)) == b"hello"


# An independent reader, from docs/format.md alone.

def hkdf(ikm: bytes, salt: bytes | None, info: bytes) -> bytes:
    prk = hmac.digest(salt or bytes(32), ikm, hashlib.sha256)
    return hmac.digest(prk, info + b"\x01", hashlib.sha256)  # one block is 32 bytes


def test_an_independent_reader_opens_the_vectors():
    print_master = hmac.digest(MASTER, b"slurm-geo/v1/fingerprint", "sha256")[:8]
    assert print_master.hex() == FINGERPRINT_MASTER
    id_key = hkdf(DATA_KEY, None, b"slurm-geo/v1/chunk-id")
    assert id_key.hex() == ID_KEY
    sealed = bytes.fromhex(SEALED_KEY)
    header, salt = sealed[:34], sealed[18:34]
    seal_key = hkdf(MASTER, salt, b"slurm-geo/v1/seal")
    assert AESGCM(seal_key).decrypt(bytes(12), sealed[34:], header + b"keys/r") == DATA_KEY

    promotion = hkdf(MASTER, None, b"slurm-geo/v1/promotion")
    assert promotion.hex() == PROMOTION_KEY
    assert hkdf(MASTER, None, b"slurm-geo/v1/fence").hex() == FENCE_KEY
    marker = bytes.fromhex(SEALED_MARKER)
    assert marker[8:10] == bytes([2, 4])
    assert marker[10:18] == hmac.digest(promotion, b"slurm-geo/v1/fingerprint", "sha256")[:8]
    marker_key = hkdf(promotion, marker[18:34], b"slurm-geo/v1/seal")
    assert AESGCM(marker_key).decrypt(bytes(12), marker[34:],
                                      marker[:34] + MARKER_NAME.encode()) == MARKER_PAYLOAD

    state = hkdf(MASTER, None, b"slurm-geo/v1/federation-state")
    assert state.hex() == STATE_KEY
    value = bytes.fromhex(SEALED_STATE)
    assert value[8:10] == bytes([1, 6])
    value_key = hkdf(state, value[18:34], b"slurm-geo/v1/seal")
    assert AESGCM(value_key).decrypt(bytes(12), value[34:],
                                     value[:34] + STATE_NAME.encode()) == STATE_PAYLOAD

    for version, pack_hex, pack_id in ((3, PACK, PACK_ID), (1, PACK_V1, PACK_V1_ID)):
        pack = bytes.fromhex(pack_hex)
        name_hash = blake3.blake3 if version == 3 else hashlib.sha256
        assert name_hash(pack).hexdigest() == pack_id
        assert pack[:9] == b"SGEOPACK" + bytes([version])
        pack_key = hkdf(DATA_KEY, pack[9:25], b"slurm-geo/v1/pack")
        entry_id, length = struct.unpack_from("<32sI", pack, 25)
        blob = AESGCM(pack_key).decrypt((25).to_bytes(12, "big"), pack[61:61 + length], entry_id)
        assert blob == b"\x00" + struct.pack("<I", 5) + b"hello"
        if version == 3:
            assert blake3.blake3(blob[5:], key=id_key).digest() == entry_id
        else:
            assert hmac.digest(id_key, blob[5:], "sha256") == entry_id


def test_sealed_objects_round_trip():
    sealed = seal(DATA_KEY, Kind.MANIFEST, os.urandom(16), b"{}", "manifests/r/1")
    assert open_sealed(DATA_KEY, Kind.MANIFEST, sealed, "manifests/r/1") == b"{}"


@pytest.mark.parametrize(
    "key, kind, name, error",
    [
        (MASTER, Kind.DATA_KEY, "keys/r", None),
        (DATA_KEY, Kind.DATA_KEY, "keys/r", WrongKey),
        (MASTER, Kind.MANIFEST, "keys/r", CorruptObject),
        (MASTER, Kind.DATA_KEY, "keys/other", CorruptObject),  # moved to another name
    ],
    ids=["right", "wrong-key", "wrong-kind", "moved"],
)
def test_opening_a_sealed_object(key, kind, name, error):
    sealed = bytes.fromhex(SEALED_KEY)
    if error is None:
        assert open_sealed(key, kind, sealed, name) == DATA_KEY
    else:
        with pytest.raises(error) as info:
            open_sealed(key, kind, sealed, name)
        assert info.value.name == name


def test_a_sealed_object_from_a_newer_format_is_unsupported():
    sealed = bytearray.fromhex(SEALED_KEY)
    sealed[8] = 2
    with pytest.raises(UnsupportedFormat, match="version 2"):
        open_sealed(MASTER, Kind.DATA_KEY, bytes(sealed), "keys/r")


def version_1_marker() -> bytes:
    """The marker vector's payload as a version 1 writer sealed it: under the data key."""
    header = b"SGEOSEAL" + bytes([1, Kind.PROMOTED]) + fingerprint(DATA_KEY) + SALT
    seal_key = hkdf(DATA_KEY, SALT, b"slurm-geo/v1/seal")
    return header + AESGCM(seal_key).encrypt(bytes(12), MARKER_PAYLOAD,
                                             header + MARKER_NAME.encode())


def test_a_version_1_marker_is_refused_and_read_only_under_the_old_rule():
    old = version_1_marker()
    for key in (promotion_key(MASTER), DATA_KEY):
        with pytest.raises(LegacyObject, match="version 1 promotion marker") as info:
            open_sealed(key, Kind.PROMOTED, old, MARKER_NAME)
        assert isinstance(info.value, UnsupportedFormat) and info.value.exit_code == 22
    assert open_legacy(DATA_KEY, Kind.PROMOTED, old, MARKER_NAME) == MARKER_PAYLOAD
    with pytest.raises(UnsupportedFormat):  # the new form is not read under the old rule
        open_legacy(DATA_KEY, Kind.PROMOTED, bytes.fromhex(SEALED_MARKER), MARKER_NAME)
    with pytest.raises(ValueError):
        open_legacy(MASTER, Kind.DATA_KEY, bytes.fromhex(SEALED_KEY), "keys/r")


def test_every_flipped_bit_in_a_marker_is_caught_and_named():
    for position, damaged in flips(bytes.fromhex(SEALED_MARKER)):
        with pytest.raises(CkptError) as info:
            open_sealed(promotion_key(MASTER), Kind.PROMOTED, damaged, MARKER_NAME)
        assert info.value.name == MARKER_NAME, position


def flips(data: bytes):
    """`data` with one bit flipped, for each byte; the flipped bit varies with position."""
    for position in range(len(data)):
        damaged = bytearray(data)
        damaged[position] ^= 1 << (position % 8)
        yield position, bytes(damaged)


def test_every_flipped_bit_in_a_sealed_object_is_caught_and_named():
    for position, damaged in flips(bytes.fromhex(SEALED_KEY)):
        with pytest.raises(CkptError) as info:
            open_sealed(MASTER, Kind.DATA_KEY, damaged, "keys/r")
        assert info.value.name == "keys/r", position


@pytest.mark.parametrize("length", [0, 10, 49, 60, len(SEALED_KEY) // 2 - 1])
def test_a_truncated_sealed_object_is_corrupt(length):
    with pytest.raises(CorruptObject):
        open_sealed(MASTER, Kind.DATA_KEY, bytes.fromhex(SEALED_KEY)[:length], "keys/r")


def pack_of(blobs: list[bytes]) -> tuple[str, bytes, list[Entry]]:
    writer = PackWriter(DATA_KEY, SALT)
    entries = [writer.add(hashlib.sha256(b).digest(), b) for b in blobs]
    return *writer.finish(), entries


def test_pack_round_trip():
    blobs = [b"one", b"", b"three" * 1000]
    pack_id, data, entries = pack_of(blobs)
    check_pack_id("p", pack_id, data)
    reader = PackReader(DATA_KEY, "p", data)
    assert [reader.blob(e) for e in entries] == blobs
    assert [e.offset for e in entries] == [25, 25 + 36 + 19, 25 + 2 * 36 + 19 + 16]


def test_every_flipped_bit_in_a_pack_is_caught_even_without_the_hash():
    """Except in the version byte: versions 1-3 share one layout, so a pack whose 3 became
    1 or 2 still opens, with the same blobs; its name's hash catches that."""
    pack_id, data, entries = pack_of([b"alpha", b"beta"])
    for position, damaged in flips(data):
        with pytest.raises(CkptError) as info:
            if damaged[8] in (1, 2):
                check_pack_id("packs/x", pack_id, damaged)
            reader = PackReader(DATA_KEY, "packs/x", damaged)
            for entry in entries:
                reader.blob(entry)
        assert info.value.name == "packs/x", position


def test_a_truncated_pack_is_corrupt_and_fails_its_hash():
    pack_id, data, entries = pack_of([b"alpha", b"beta"])
    with pytest.raises(CorruptObject, match="outside the pack"):
        PackReader(DATA_KEY, "p", data[:-1]).blob(entries[1])
    with pytest.raises(CorruptObject, match="does not match its name"):
        check_pack_id("p", pack_id, data[:-1])


def test_a_pack_of_a_newer_format_is_unsupported():
    data = bytearray(pack_of([b"x"])[1])
    data[8] = 4
    with pytest.raises(UnsupportedFormat, match="reads version 1 or 2 or 3"):
        PackReader(DATA_KEY, "p", bytes(data))


def test_a_pack_altered_to_claim_an_older_version_no_longer_matches_its_name():
    """The version byte picks the name's hash (BLAKE3 from 3, SHA-256 before), and it is
    hashed too: a downgraded pack matches its name under neither."""
    pack_id, data, _entries = pack_of([b"x"])
    assert data[8] == 3 and blake3.blake3(data).hexdigest() == pack_id
    downgraded = bytearray(data)
    downgraded[8] = 2
    with pytest.raises(CorruptObject, match="does not match its name"):
        check_pack_id("p", pack_id, bytes(downgraded))


def test_an_entry_moved_within_its_pack_does_not_open():
    _pack_id, data, entries = pack_of([b"alpha", b"gamma"])
    first, second = entries
    swapped = data[:first.offset] + data[second.offset:] + data[first.offset:second.offset]
    moved = Entry(second.chunk_id, first.offset, second.length)
    with pytest.raises(CorruptObject, match="failed authentication"):
        PackReader(DATA_KEY, "p", swapped).blob(moved)


def test_master_key_file_is_created_private_and_loads(tmp_path):
    path = tmp_path / "master.key"
    key = create_master_key_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_master_key(path).keys() == (key,) and len(key) == 32
    with pytest.raises(KeyFileError, match="already exists"):
        create_master_key_file(path)
    assert load_master_key(path).keys() == (key,)


@pytest.mark.parametrize(
    "content, mode, message",
    [
        (bytes(32), 0o644, "chmod 600"),
        (bytes(32), 0o640, "chmod 600"),
        (bytes(31), 0o600, "holds 31 bytes"),
        (bytes(64), 0o600, "holds 64 bytes"),
        (None, None, "cannot read"),
    ],
)
def test_bad_master_key_files_are_refused(tmp_path, content, mode, message):
    path = tmp_path / "master.key"
    if content is not None:
        path.write_bytes(content)
        path.chmod(mode)
    with pytest.raises(KeyFileError, match=message) as info:
        load_master_key(path)
    assert info.value.name == str(path)


# A rotation from M to the new key N = bytes 32 to 63 over two stores (format.md §4.1, §10).
KEY_RING = (
    b'{"version": 2, "keys": ["202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f",'
    b' "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"],'
    b' "rotating": ["home", "s3://ckpt/runs"]}\n'
)
FENCE_KEY_OF_N = "fa77ce7a7451c9f555db053d3f673517ffcfe51a585168689e3b6e52236209b3"
FINGERPRINT_FENCE_OF_N = "3faa3bbfaa907eb4"


def test_the_key_ring_vector_reads_by_the_spec_and_by_the_implementation(tmp_path):
    ring = json.loads(KEY_RING)  # the spec: a JSON object, the sealing key first
    new, old = (bytes.fromhex(k) for k in ring["keys"])
    assert (ring["version"], old, new, ring["rotating"]) == (
        2, MASTER, DATA_KEY, ["home", "s3://ckpt/runs"])
    assert fingerprint(new).hex() == FINGERPRINT_DATA  # N is the D of the vectors above
    assert fence_key(new).hex() == FENCE_KEY_OF_N
    assert fingerprint(fence_key(new)).hex() == FINGERPRINT_FENCE_OF_N
    path = tmp_path / "master.key"
    path.write_bytes(KEY_RING)
    path.chmod(0o600)
    loaded = load_master_key(path)
    assert loaded == KeyFile(DATA_KEY, MASTER, ("home", "s3://ckpt/runs"))
    assert loaded.keys() == (DATA_KEY, MASTER) and loaded.to_bytes() == KEY_RING
    format_md = Path(__file__).resolve().parent.parent / "docs" / "format.md"
    assert KEY_RING.decode().rstrip("\n") in format_md.read_text()  # as §10 shows it


def test_a_key_file_is_written_private_and_atomically_in_its_oldest_readable_form(tmp_path):
    path = tmp_path / "master.key"
    write_key_file(path, KeyFile(DATA_KEY, MASTER, ("home",)))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_master_key(path).keys() == (DATA_KEY, MASTER)
    write_key_file(path, KeyFile(DATA_KEY))
    assert path.read_bytes() == DATA_KEY  # version 1: every release reads it
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["master.key"]


def test_a_key_file_rewritten_keeps_its_owner_and_its_symbolic_link(tmp_path):
    real = tmp_path / "secure" / "master.key"
    real.parent.mkdir()
    real.write_bytes(MASTER)
    real.chmod(0o600)
    link = tmp_path / "master.key"
    link.symlink_to(real)
    owner = (os.getuid(), os.getgid()) if os.geteuid() else (12345, 23456)
    os.chown(real, *owner)
    write_key_file(link, KeyFile(DATA_KEY, MASTER, ("home",)))
    assert link.is_symlink() and load_master_key(link).current == DATA_KEY
    assert (real.stat().st_uid, real.stat().st_gid) == owner  # the daemons' account reads it


def test_a_followed_key_file_is_read_again_when_replaced_and_checked_again_when_chmodded(
        tmp_path):
    path = tmp_path / "master.key"
    write_key_file(path, KeyFile(MASTER))
    followed = LiveKeyFile(path)
    assert followed.keys() == (MASTER,)
    write_key_file(path, KeyFile(DATA_KEY, MASTER, ("home",)))
    assert followed.keys() == (DATA_KEY, MASTER)
    path.chmod(0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        followed.keys()
    path.unlink()
    with pytest.raises(KeyFileError, match="cannot read"):
        followed.keys()


def test_a_version_1_key_file_still_loads(tmp_path):
    path = tmp_path / "master.key"
    path.write_bytes(MASTER)
    path.chmod(0o400)
    assert load_master_key(path) == KeyFile(MASTER)


def ring(**changes) -> bytes:
    fields = {"version": 2, "keys": [DATA_KEY.hex(), MASTER.hex()], "rotating": ["home"]}
    return json.dumps({**fields, **changes}).encode()


@pytest.mark.parametrize("content, message", [
    (ring(version=3), "key ring of version 3; this slurm-geo reads version 2: upgrade"),
    (ring(keys=[DATA_KEY.hex()]), "not a valid key ring"),
    (ring(keys=[DATA_KEY.hex(), DATA_KEY.hex()]), "replaces a key by another one"),
    (ring(keys=[DATA_KEY.hex(), "zz" * 32]), "not a valid key ring"),
    (ring(keys=[DATA_KEY.hex(), MASTER.hex()[:-2]]), "64 hex digits"),
    (ring(rotating=[]), "names its previous key and its stores"),
    (ring(rotating=[""]), "not a valid key ring"),
    (ring(extra=1), "unknown members"),
    (b"[1, 2, 3]" + bytes(40), "neither a 32-byte master key nor a key ring"),
    (b'"' + b"x" * 40 + b'"', "neither a 32-byte master key nor a key ring"),
    (b"\xff" * 40, "neither a 32-byte master key nor a key ring"),
])
def test_bad_key_rings_are_refused(tmp_path, content, message):
    path = tmp_path / "master.key"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(KeyFileError, match=message):
        load_master_key(path)


def test_a_ring_opens_an_object_under_the_key_its_header_names():
    sealed = seal(MASTER, Kind.DATA_KEY, SALT, DATA_KEY, "keys/r")
    assert open_with_ring((DATA_KEY, MASTER), Kind.DATA_KEY, sealed, "keys/r") == DATA_KEY
    with pytest.raises(WrongKey, match=f"not with the key given \\({FINGERPRINT_DATA}\\)"):
        open_with_ring((DATA_KEY,), Kind.DATA_KEY, sealed, "keys/r")


PATCH_BASE = b"0123456789abcdef" * 4
PATCHED = PATCH_BASE[:20] + b"XY" + PATCH_BASE[22:]
PATCH_BLOB = ("04 40000000 000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
              "28b52ffd20406d000010585903004360009071e81904")


def test_the_zstd_patch_vector_decodes_by_the_spec_and_by_the_implementation():
    blob = bytes.fromhex(PATCH_BLOB)
    assert decode(blob, PATCH_BASE) == PATCHED
    assert delta_base_id(blob) == bytes(range(32))
    # Independently: method, size, base id, then a frame decoded with the base as a
    # raw-content dictionary.
    method, size = struct.unpack_from("<BI", blob)
    assert (method, size, blob[5:37]) == (4, 64, bytes(range(32)))
    dictionary = zstandard.ZstdCompressionDict(PATCH_BASE,
                                               dict_type=zstandard.DICT_TYPE_RAWCONTENT)
    assert zstandard.ZstdDecompressor(dict_data=dictionary).decompress(blob[37:]) == PATCHED
