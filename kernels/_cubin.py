"""Reading a CUDA cubin (ELF) without a GPU or an arch-aware cuobjdump: shared memory, registers,
stack of its kernel. Shared by the lanes whose DSL hands back a cubin (CuTe DSL, cuTile).

Sections used: ``.nv.shared.<kernel>`` (the kernel's static shared memory, what
``cuobjdump --dump-resource-usage`` prints as SHARED), ``.nv.shared.reserved.*`` (shared memory the
compiler reserves beside it), ``.nv.local.*`` (per-thread local memory, cuobjdump's LOCAL) and
``.nv.info`` attribute records (EIATTR_REGCOUNT 0x2f, EIATTR_MIN_STACK_SIZE 0x12: cuobjdump's STACK,
where register spills go). All sizes in bytes.
"""
from __future__ import annotations

import struct

EIATTR_REGCOUNT, EIATTR_MIN_STACK_SIZE = 0x2F, 0x12


def sections(data: bytes) -> list[tuple[str, int, int]]:
    """(name, file offset, size) of every section of a 64-bit little-endian ELF."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = heads[shstrndx][4]
    out = []
    for h in heads:
        start = strtab + h[0]
        out.append((data[start:data.index(b"\0", start)].decode(), h[4], h[5]))
    return out


def nv_info(buf: bytes) -> dict[int, bytes]:
    """Attributes of a .nv.info section: 4-byte headers (format, attribute, size), EIFMT_SVAL payloads."""
    out, i = {}, 0
    while i + 4 <= len(buf):
        fmt, attr, size = struct.unpack_from("<BBH", buf, i)
        if fmt == 1:        # EIFMT_NVAL: no value
            i += 2
        elif fmt in (2, 3):  # EIFMT_BVAL / EIFMT_HVAL: value in the header
            out[attr] = struct.pack("<H", size)
            i += 4
        elif fmt == 4:      # EIFMT_SVAL: `size` bytes follow
            out[attr] = buf[i + 4:i + 4 + size]
            i += 4 + size
        else:
            break
    return out


def resources(cubin: bytes) -> dict:
    """Static and reserved shared memory, registers per thread, stack, local memory and name of the cubin's
    kernel."""
    static = reserved = local = 0
    regs = stack = None
    kernel = ""
    for name, off, size in sections(cubin):
        if name.startswith(".text."):
            kernel = name[len(".text."):]
        elif name.startswith(".nv.shared.reserved"):
            reserved += size
        elif name.startswith(".nv.shared."):
            static += size
        elif name.startswith(".nv.local."):
            local += size
        elif name == ".nv.info" or name.startswith(".nv.info."):
            attrs = nv_info(cubin[off:off + size])
            if EIATTR_REGCOUNT in attrs:
                regs = struct.unpack_from("<I", attrs[EIATTR_REGCOUNT], 4)[0]
            if EIATTR_MIN_STACK_SIZE in attrs:
                stack = struct.unpack_from("<I", attrs[EIATTR_MIN_STACK_SIZE], 4)[0]
    return {"static": static, "reserved": reserved, "registers": regs, "stack": stack, "local": local,
            "kernel": kernel}
