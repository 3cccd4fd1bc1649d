"""A small emulator of the PTX integer instructions that the TurboQuant lookups' inline assembly uses
(``cuda_ext/tq_codes.py``: mov, shl, shr, and, or, mul.lo, lop3, prmt), on numpy uint32 arrays, so the
bit logic of each asm block is checked exactly on a machine without a GPU.  Semantics from the PTX ISA:
``prmt.b32 d, a, b, c`` (default mode) picks output byte i from the eight bytes {b, a} (0-3: a, 4-7: b) by
nibble i of c's low 16 bits, and a selector nibble with bit 3 set replicates the picked byte's top bit;
``lop3.b32 d, a, b, c, imm`` sets each bit to bit (a << 2 | b << 1 | c) of imm (a = 0xF0, b = 0xCC, c = 0xAA).
"""

from __future__ import annotations

import re

import numpy as np

M32 = np.uint64(0xFFFFFFFF)


def _prmt(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    src = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    out = np.zeros_like(a, dtype=np.uint64)
    for i in range(4):
        sel = (c.astype(np.uint64) >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (src >> ((sel & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        rep = np.where((byte >> np.uint64(7)) != 0, np.uint64(0xFF), np.uint64(0))
        byte = np.where((sel & np.uint64(8)) != 0, rep, byte)
        out |= byte << np.uint64(8 * i)
    return out.astype(np.uint32)


def _lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, imm: int) -> np.ndarray:
    out = np.zeros_like(a, dtype=np.uint32)
    for k in range(8):
        if imm >> k & 1:
            ma = a if k & 4 else ~a
            mb = b if k & 2 else ~b
            mc = c if k & 1 else ~c
            out |= ma & mb & mc
    return out


def run(asm: str, inputs: dict[int, np.ndarray], n_out: int) -> list[np.ndarray]:
    """Execute ``asm`` (the string given to ``tl.inline_asm_elementwise``) with operand $k = inputs[k]
    (uint32 arrays, one lane per element); returns the outputs $0 .. $n_out-1 as uint32 arrays (16-bit
    outputs, written by ``mov.b32 {$i, $j}, r``, hold their half in the low bits)."""
    shape = next(iter(inputs.values())).shape
    regs: dict[str, np.ndarray] = {f"${k}": v.astype(np.uint32) for k, v in inputs.items()}

    def val(tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"0x[0-9A-Fa-f]+|\d+", tok):
            return np.full(shape, int(tok, 0) & 0xFFFFFFFF, dtype=np.uint32)
        raise KeyError(f"register {tok} read before it is written")

    body = asm.strip()
    assert body.startswith("{") and body.endswith("}"), "expected one { ... } block"
    for stmt in body[1:-1].split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, _, rest = stmt.partition(" ")
        m = re.fullmatch(r"\{\s*(\$\d+)\s*,\s*(\$\d+)\s*\}\s*,\s*(\S+)", rest.strip())
        if op == "mov.b32" and m:  # unpack a 32-bit register into two 16-bit outputs
            x = val(m.group(3))
            regs[m.group(1)], regs[m.group(2)] = x & np.uint32(0xFFFF), x >> np.uint32(16)
            continue
        args = [t.strip() for t in rest.split(",")]
        d, src = args[0], args[1:]
        if op == "mov.b32":
            r = val(src[0]).copy()
        elif op == "shl.b32":
            r = ((val(src[0]).astype(np.uint64) << np.uint64(int(src[1], 0))) & M32).astype(np.uint32)
        elif op == "shr.b32":  # .b32: a logical shift
            r = val(src[0]) >> np.uint32(int(src[1], 0))
        elif op == "and.b32":
            r = val(src[0]) & val(src[1])
        elif op == "or.b32":
            r = val(src[0]) | val(src[1])
        elif op == "mul.lo.u32":
            r = ((val(src[0]).astype(np.uint64) * val(src[1]).astype(np.uint64)) & M32).astype(np.uint32)
        elif op == "lop3.b32":
            r = _lop3(val(src[0]), val(src[1]), val(src[2]), int(src[3], 0))
        elif op == "prmt.b32":
            r = _prmt(val(src[0]), val(src[1]), val(src[2]))
        else:
            raise NotImplementedError(op)
        regs[d] = r
    return [regs[f"${i}"] for i in range(n_out)]
