"""Reading chunks back: fetch the pack, open the blob, decode, and check the chunk's id."""

from __future__ import annotations

from collections import OrderedDict

from slurm_geo.ckpt.codec import decode, delta_base_id
from slurm_geo.ckpt.errors import CkptError, CorruptObject, MalformedData
from slurm_geo.ckpt.keys import RunKeys, chunk_id
from slurm_geo.ckpt.manifest import ChunkRef
from slurm_geo.ckpt.names import pack_name
from slurm_geo.ckpt.pack import Entry, PackReader, check_pack_id
from slurm_geo.ckpt.store import Store

# Enough for a checkpoint's current pack plus its delta bases' packs; 4 x 16 MiB.
CACHED_PACKS = 4


class ChunkReader:
    """Reads the chunks of one run; keeps the last few packs, and remembers bad ones."""

    def __init__(self, store: Store, keys: RunKeys):
        self._store = store
        self._keys = keys
        self._packs: OrderedDict[str, PackReader] = OrderedDict()
        self._bad_packs: dict[str, CkptError] = {}

    def read(self, ref: ChunkRef) -> bytes:
        """The chunk's plaintext, verified against its keyed id, or a typed error."""
        name = pack_name(ref.pack)
        wanted = bytes.fromhex(ref.id)
        blob = self._pack(ref.pack).blob(Entry(wanted, ref.offset, ref.length))
        try:
            base_id = delta_base_id(blob)
            if base_id != (None if ref.base is None else bytes.fromhex(ref.base.id)):
                raise MalformedData("its delta base differs from the manifest's")
            data = decode(blob, None if ref.base is None else self.read(ref.base))
        except MalformedData as exc:
            raise CorruptObject(name, f"chunk {ref.id}: {exc}") from None
        if len(data) != ref.size or chunk_id(self._keys.id_key, data) != wanted:
            raise CorruptObject(name, f"chunk {ref.id} decodes to data with another id")
        return data

    def _pack(self, pack_id: str) -> PackReader:
        if pack_id in self._bad_packs:
            raise self._bad_packs[pack_id]
        if pack_id in self._packs:
            self._packs.move_to_end(pack_id)
            return self._packs[pack_id]
        name = pack_name(pack_id)
        try:
            data = self._store.get(name)
            check_pack_id(name, pack_id, data)
            reader = PackReader(self._keys.data_key, name, data)
        except CkptError as exc:
            self._bad_packs[pack_id] = exc
            raise
        self._packs[pack_id] = reader
        if len(self._packs) > CACHED_PACKS:
            self._packs.popitem(last=False)
        return reader
