"""Just enough ELF64 reading for the image builder.

Two questions need answering without external tools (the host may lack ``kmod`` and
``binutils``): is a binary statically linked (no ``PT_INTERP``), and what does a kernel
module's ``.modinfo`` section say (its ``depends=`` line)?
"""

from __future__ import annotations

import struct

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_PHDR = struct.Struct("<IIQQQQQQ")
_PT_INTERP = 3


class ElfError(ValueError):
    """The bytes are not a little-endian ELF64 file this module can read."""


def _header(data: bytes) -> tuple[int, ...]:
    if len(data) < _EHDR.size or data[:4] != b"\x7fELF":
        raise ElfError("not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise ElfError("not a little-endian 64-bit ELF file")
    return _EHDR.unpack_from(data, 0)


def is_static(data: bytes) -> bool:
    """True when the executable has no program interpreter (static or static-pie)."""
    hdr = _header(data)
    phoff, phentsize, phnum = hdr[5], hdr[9], hdr[10]
    for i in range(phnum):
        p_type = _PHDR.unpack_from(data, phoff + i * phentsize)[0]
        if p_type == _PT_INTERP:
            return False
    return True


def section(data: bytes, name: str) -> bytes | None:
    """Contents of the section called ``name``, or None when there is none."""
    hdr = _header(data)
    shoff, shentsize, shnum, shstrndx = hdr[6], hdr[11], hdr[12], hdr[13]
    if shoff == 0 or shnum == 0:
        return None
    headers = [_SHDR.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
    strtab = headers[shstrndx]
    names = data[strtab[4]: strtab[4] + strtab[5]]
    wanted = name.encode()
    for sh in headers:
        start = sh[0]
        end = names.find(b"\0", start)
        if names[start:end] == wanted:
            return data[sh[4]: sh[4] + sh[5]]
    return None


def modinfo(data: bytes) -> dict[str, list[str]]:
    """The ``key=value`` pairs of a kernel module's ``.modinfo`` section (keys repeat)."""
    raw = section(data, ".modinfo")
    info: dict[str, list[str]] = {}
    if raw is None:
        return info
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            info.setdefault(key.decode(errors="replace"), []).append(
                value.decode(errors="replace"))
    return info
