"""Point libmlx's BLAS imports at another library after libmlx has loaded.

``blas.py`` normally binds an optimized BLAS before ``mlx.core`` loads, so the
dynamic linker resolves libmlx's ``cblas_sgemm`` to it. A program that
imported ``mlx.core`` first has libmlx bound to the wheel's reference BLAS
already (Python loads extensions with ``RTLD_NOW``). Each such import is one
pointer in libmlx's global offset table (GOT), found through the relocations
the ELF file lists (``JUMP_SLOT``/``GLOB_DAT`` entries naming the symbol):
``rebind`` overwrites those pointers, lifting the page's read-only
protection (RELRO) for the write and restoring it after. The effect is the
early binding's: every later call from libmlx goes to the new function.

Linux only (ELF, x86-64 and aarch64); anything unexpected raises
``GotError`` and leaves the table as it was.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct

# Relocation types that fill a GOT slot with a symbol's address.
SLOT_RELOCATIONS = {
    62: (7, 6),  # EM_X86_64: R_X86_64_JUMP_SLOT, R_X86_64_GLOB_DAT
    183: (1026, 1025),  # EM_AARCH64: R_AARCH64_JUMP_SLOT, R_AARCH64_GLOB_DAT
}
SHT_RELA, SHT_DYNSYM = 4, 11
PROT_READ, PROT_WRITE = 1, 2


class GotError(Exception):
    """The GOT could not be read or written; nothing was changed."""


def slots(path: str, names: set[str]) -> dict[str, list[int]]:
    """The GOT offsets (from the load base) of each named import of the ELF
    shared object at ``path``."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise GotError(f"{path} is not a 64-bit little-endian ELF file")
    machine = struct.unpack_from("<H", data, 18)[0]
    if machine not in SLOT_RELOCATIONS:
        raise GotError(f"{path}: machine {machine} is not x86-64 or aarch64")
    kinds = SLOT_RELOCATIONS[machine]
    shoff, = struct.unpack_from("<Q", data, 40)
    shentsize, shnum = struct.unpack_from("<HH", data, 58)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    found: dict[str, list[int]] = {}
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != SHT_RELA or sections[link][1] != SHT_DYNSYM:
            continue
        symtab = sections[link]
        strtab = sections[symtab[6]]
        for at in range(offset, offset + size, entsize or 24):
            r_offset, r_info = struct.unpack_from("<QQ", data, at)
            if r_info & 0xFFFFFFFF not in kinds:
                continue
            st_name, = struct.unpack_from("<I", data, symtab[4] + (r_info >> 32) * (symtab[9] or 24))
            end = data.index(b"\0", strtab[4] + st_name)
            name = data[strtab[4] + st_name:end].decode()
            if name in names:
                found.setdefault(name, []).append(r_offset)
    return found


def load_base(path: str) -> int:
    """Where the shared object at ``path`` is mapped in this process (its
    first segment, file offset 0; a shared object's first segment starts at
    address 0 of its image)."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[2] == "00000000" and os.path.realpath(fields[5]) == real:
                return int(fields[0].split("-")[0], 16)
    raise GotError(f"{path} is not loaded in this process")


def rebind(path: str, addresses: dict[str, int]) -> int:
    """Point every GOT slot of the loaded ``path`` that imports one of
    ``addresses``' names at that address; returns how many were written."""
    offsets = slots(path, set(addresses))
    base = load_base(path)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = mmap.PAGESIZE
    written = 0
    for name, where in offsets.items():
        for offset in where:
            slot = base + offset
            start = slot & ~(page - 1)
            before = _protection(start)
            if libc.mprotect(start, page, PROT_READ | PROT_WRITE) != 0:
                raise GotError(f"mprotect failed: {os.strerror(ctypes.get_errno())}")
            try:
                ctypes.c_void_p.from_address(slot).value = addresses[name]
            finally:
                libc.mprotect(start, page, before)  # read-only again after RELRO, writable without
            written += 1
    return written


def _protection(address: int) -> int:
    """The mprotect flags of the mapping that holds ``address``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return (PROT_READ if fields[1][0] == "r" else 0) | (PROT_WRITE if fields[1][1] == "w" else 0)
    raise GotError(f"address {address:#x} is not mapped")


def bound_to(path: str, name: str) -> list[int]:
    """The addresses the loaded ``path``'s GOT slots for ``name`` hold."""
    base = load_base(path)
    return [ctypes.c_void_p.from_address(base + o).value or 0 for o in slots(path, {name}).get(name, [])]
