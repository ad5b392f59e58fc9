"""The Slurm version a SPANK plugin was built against, read from its ELF file, never loaded.

Slurm's SPANK_PLUGIN() macro defines `const unsigned int plugin_version =
SLURM_VERSION_NUMBER` (spank.h), and Slurm refuses a plugin whose major.minor is not its own.
The doctor reads that symbol's value from the file's .dynsym and the section holding it: a
root process never runs code from the plugin just to ask.
"""

from __future__ import annotations

import struct
from pathlib import Path

SYMBOL = b"plugin_version"
SHT_NOBITS = 8
MAX_BYTES = 64 << 20  # a plugin is a few dozen KB; refuse to read a huge file whole


class NotAPlugin(ValueError):
    """The file is no ELF shared object with a plugin_version symbol."""


def plugin_version(path: Path) -> int:
    with open(path, "rb") as handle:
        data = handle.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise NotAPlugin("larger than any SPANK plugin")
    return plugin_version_in(data)


def plugin_version_in(data: bytes) -> int:
    """The plugin_version value in ELF image `data`."""
    if data[:4] != b"\x7fELF" or len(data) < 64:
        raise NotAPlugin("not an ELF file")
    wide, order = data[4] == 2, "<" if data[5] == 1 else ">"
    try:
        sections = _sections(data, wide, order)
        dynsym = next((s for s in sections if s[0] == 11), None)  # SHT_DYNSYM
        if dynsym is None:
            raise NotAPlugin("has no dynamic symbol table")
        strtab = sections[dynsym[5]]
        entry = 24 if wide else 16
        for offset in range(dynsym[3] + entry, dynsym[3] + dynsym[4], entry):
            if wide:
                name, _, _, _, value, size = struct.unpack_from(order + "IBBHQQ", data, offset)
            else:
                name, value, size = struct.unpack_from(order + "III", data, offset)
            if _string(data, strtab[3] + name) == SYMBOL and size == 4:
                return _value_at(data, sections, value, order)
    except (struct.error, IndexError):
        raise NotAPlugin("a truncated or malformed ELF file") from None
    raise NotAPlugin("has no plugin_version symbol: not built with SPANK_PLUGIN()")


def _sections(data: bytes, wide: bool, order: str) -> list[tuple[int, int, int, int, int, int]]:
    """(type, flags, address, offset, size, link) of each section header."""
    if wide:
        shoff, = struct.unpack_from(order + "Q", data, 0x28)
        shentsize, shnum = struct.unpack_from(order + "HH", data, 0x3A)
        layout = order + "IIQQQQI"
    else:
        shoff, = struct.unpack_from(order + "I", data, 0x20)
        shentsize, shnum = struct.unpack_from(order + "HH", data, 0x2E)
        layout = order + "IIIIIII"
    headers = []
    for index in range(shnum):
        _, kind, flags, address, offset, size, link = struct.unpack_from(
            layout, data, shoff + index * shentsize)
        headers.append((kind, flags, address, offset, size, link))
    return headers


def _string(data: bytes, offset: int) -> bytes:
    return data[offset:data.index(b"\0", offset)]


def _value_at(data: bytes, sections: list[tuple[int, int, int, int, int, int]],
              address: int, order: str) -> int:
    for kind, _, start, offset, size, _ in sections:
        if start and start <= address < start + size and kind != SHT_NOBITS:
            value: int = struct.unpack_from(order + "I", data, offset + address - start)[0]
            return value
    raise NotAPlugin("its plugin_version lies in no section of the file")
